"""The converter's Beam runner: an Apache Beam pipeline (the DirectRunner) writes the same
shards and schema.json as the local runner, resumes the same way, and bad ``--beam_options``
end with one ``error:`` line and exit status 2. Real Beam, real files in tmp_path."""

import dataclasses
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from tfspeed.convert import convert, run
from tfspeed.convert import plan as plan_lib
from tfspeed.data import schema as schema_lib

TWO_PROCESSES = "--direct_num_workers=2 --direct_running_mode=multi_processing"


def _shard_records(path, schema):
    """The records of one shard, parsed with the schema's spec: feature -> numpy array."""
    batches = [
        tf.io.parse_example(b, schema.parse_spec())
        for b in tf.data.TFRecordDataset(str(path)).batch(100_000)
    ]
    return {name: np.concatenate([b[name].numpy() for b in batches]) for name in schema.features}


def _assert_same_dataset(beam_dir, local_dir):
    """Same shard files, counts, records (shard by shard), schema.json and bytes."""
    beam, local = schema_lib.read(str(beam_dir)), schema_lib.read(str(local_dir))
    # Every field: the schema records neither the runner nor a time (only the figures of a
    # measured storage choice differ from run to run).
    assert _unmeasured(beam) == _unmeasured(local)
    for split in local.splits.values():
        assert [s.file for s in split.shards] == [s.file for s in beam.splits[split.name].shards]
        for shard in split.shards:
            ours = _shard_records(Path(beam_dir) / shard.file, beam)
            theirs = _shard_records(Path(local_dir) / shard.file, local)
            assert len(ours[local.label]) == shard.num_records > 0
            for name in local.features:
                np.testing.assert_array_equal(ours[name], theirs[name], err_msg=shard.file)
    assert _snapshot(beam_dir) == _snapshot(local_dir)


def _unmeasured(schema):
    choice = {k: schema.storage[k] for k in ("image_format", "requested") if k in schema.storage}
    return dataclasses.replace(schema, storage=choice)


def _snapshot(out):
    """The shards' bytes and schema.json, but the figures of the measured storage choice."""
    out = Path(out)
    names = [n for n in os.listdir(out) if n.endswith(".tfrecord")]
    snapshot = {n: (out / n).read_bytes() for n in sorted(names)}
    schema = _unmeasured(schema_lib.read(str(out))).to_json()
    return {**snapshot, "schema.json": schema}


# ---------------------------------------------------------------- same output as local


def test_beam_image_folder_equals_the_local_conversion(photos_dir, tmp_path):
    source = f"imagefolder:{Path(photos_dir).parent / 'src'}"  # how conftest converted it
    result = convert(
        source, str(tmp_path), shards=3, validation_fraction=0.25, runner="beam", progress=True
    )
    assert result.summary["records"] == 36 and result.summary["resumed_shards"] == 0
    _assert_same_dataset(tmp_path, photos_dir)


def test_beam_npz_in_two_worker_processes_equals_the_local_conversion(tabular_dir, tmp_path):
    # Two Beam worker processes write shards and append them to the plan, which the driver
    # then reads back: a lost or torn line would have failed the conversion.
    source = f"npz:{Path(tabular_dir).parent / 'data.npz'}"
    result = convert(source, str(tmp_path), shards=2, runner="beam", beam_options=TWO_PROCESSES)
    assert result.summary["shards"] == {"train": 2, "validation": 1}
    _assert_same_dataset(tmp_path, tabular_dir)


# ---------------------------------------------------------------- resume


def test_beam_resumes_a_killed_run_keeping_its_recorded_shards(tmp_path):
    clean, out = tmp_path / "clean", tmp_path / "out"
    convert("digits", str(clean), shards=4)  # the local runner
    first = convert("digits", str(out), shards=4, runner="beam")
    files = [s.file for s in first.schema.splits["train"].shards]
    # As if killed mid-way: no schema.json yet, train shards 2 and 3 neither written nor recorded.
    (out / "schema.json").unlink()
    plan = out / plan_lib.PLAN_FILE
    header, *lines = plan.read_text().splitlines()
    lines = [ln for ln in lines if not any(f in ln for f in files[2:])]
    plan.write_text("\n".join([header, *lines]) + "\n")
    for name in files[2:]:
        (out / name).unlink()
    kept = os.stat(out / files[0])

    resumed = convert("digits", str(out), shards=4, runner="beam")
    assert resumed.summary["resumed_shards"] == 3  # train 0, 1 and the validation shard
    again = os.stat(out / files[0])
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # not rewritten
    assert _snapshot(out) == _snapshot(clean)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
    # The runner is not part of the dataset: the local runner finds it finished.
    assert convert("digits", str(out), shards=4).already_converted


# ---------------------------------------------------------------- command line


def _run(capsys, *args):
    """Runs the CLI in this process; returns (exit status, stdout, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        run(["to_tfrecord.py", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err.splitlines()


def test_cli_converts_with_beam_in_one_quiet_line(tmp_path, capsys):
    status, out, err = _run(
        capsys, "--source=digits", f"--output={tmp_path}", "--shards=2", "--runner=beam"
    )
    assert status == 0 and err == []
    assert out.startswith(f"converted digits into {tmp_path}: 1797 records"), out


BAD_OPTIONS = {
    "bad value": (["--beam_options=--direct_num_workers=two"], "invalid int value: 'two'"),
    "bad choice": (["--beam_options=--direct_running_mode=fast"], "invalid choice: 'fast'"),
    "unknown runner": (["--beam_options=--runner=NoSuchRunner"], "NoSuchRunner"),
    "typo": (["--beam_options=--direct_num_worker=2"], "'--direct_num_worker=2' is not a Beam"),
    "stray word": (["--beam_options=--direct_num_workers=2 two"], "'two' is not a Beam option"),
    "quotes": (["--beam_options='--runner"], "No closing quotation"),
    "workers": (["--workers=4"], "--workers is for --runner=local"),
}


@pytest.mark.parametrize("case", list(BAD_OPTIONS))
def test_bad_beam_options_are_one_error_line_and_status_2(tmp_path, capsys, case):
    flags, expected = BAD_OPTIONS[case]
    status, _, err = _run(
        capsys, "--source=digits", f"--output={tmp_path / 'out'}", "--runner=beam", *flags
    )
    assert status == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_beam_options_without_the_beam_runner_are_refused(tmp_path, capsys):
    status, _, err = _run(
        capsys, "--source=digits", f"--output={tmp_path}", "--beam_options=--direct_num_workers=2"
    )
    assert status == 2 and len(err) == 1 and "needs --runner=beam" in err[0], err


def test_without_beam_installed_the_error_names_the_extra(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "apache_beam", None)  # `import apache_beam` now fails
    status, _, err = _run(capsys, "--source=digits", f"--output={tmp_path}", "--runner=beam")
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith("error: --runner=beam needs Apache Beam: pip install 'tfspeed[beam]'")
