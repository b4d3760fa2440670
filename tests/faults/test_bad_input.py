"""Bad input everywhere: each case ends with one line naming what and how to fix, exit 2,
and nothing written that a later run would take for finished. (docs/errors.md lists them.)"""

import json
import os
import shutil
import subprocess
import sys

import pytest
from absl.testing import flagsaver
from conftest import REPO

from tests import forked
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training.run import run


def _cli(*args, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return forked.run([sys.executable, "-m", "tfspeed.train", *args], cwd=REPO, env=env,
                      timeout=timeout)


def _one_line_error(proc, *fragments):
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


@flagsaver.flagsaver
def test_flagfile_loop(tmp_path, capsys):
    (tmp_path / "a.flags").write_text(f"--flagfile={tmp_path / 'b.flags'}\n--batch_size=8\n")
    (tmp_path / "b.flags").write_text(f"--flagfile={tmp_path / 'a.flags'}\n")
    with pytest.raises(SystemExit) as exit_info:
        tfspeed_flags.parse(["tfspeed.train", f"--flagfile={tmp_path / 'a.flags'}"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "flagfile loop" in err and "a.flags -> " in err


def _copy(digits_dir, tmp_path, name="data"):
    return shutil.copytree(digits_dir, tmp_path / name)


def _edit_schema(data_dir, edit):
    path = data_dir / "schema.json"
    schema = json.loads(path.read_text())
    edit(schema)
    path.write_text(json.dumps(schema))


def _config(data_dir, model_dir, *extra):
    tfspeed_flags.parse(["tfspeed.train", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
                         "--model=mlp", "--width=8", "--train_steps=3", "--batch_size=16",
                         "--precision=float32", *extra])
    return tfspeed_flags.to_config()


def test_schema_of_another_format_version(digits_dir, tmp_path):
    data = _copy(digits_dir, tmp_path)
    _edit_schema(data, lambda s: s.update(format_version=99))
    proc = _cli(f"--data_dir={data}", f"--model_dir={tmp_path / 'run'}")
    _one_line_error(proc, "schema format 99", "reconvert")
    assert not (tmp_path / "run" / "report.json").exists()


@flagsaver.flagsaver
def test_labels_outside_the_class_range(digits_dir, tmp_path):
    """The schema says 5 classes, the records hold labels up to 9."""
    data = _copy(digits_dir, tmp_path)
    _edit_schema(data, lambda s: s.update(class_names=s["class_names"][:5], num_classes=5))
    with pytest.raises(UsageError, match=r"labels outside the 5 classes of .*\(expected 0..4\)"):
        run(_config(data, tmp_path / "run"))
    assert not (tmp_path / "run" / "report.json").exists()
    assert not (tmp_path / "run" / "model.keras").exists()


@flagsaver.flagsaver
def test_empty_split(digits_dir, tmp_path):
    data = _copy(digits_dir, tmp_path)
    _edit_schema(data, lambda s: s["splits"]["validation"].update(shards=[], num_records=0))
    with pytest.raises(UsageError, match="split 'validation' of .* is empty"):
        run(_config(data, tmp_path / "run"))


@flagsaver.flagsaver
def test_features_that_do_not_fit_the_model(digits_dir, tmp_path):
    with pytest.raises(UsageError, match="--model=resnet50 needs RGB images of at least 32x32"):
        run(_config(digits_dir, tmp_path / "run", "--model=resnet50"))


@flagsaver.flagsaver
def test_on_corrupt_flag_reaches_the_pipeline(digits_dir, tmp_path):
    assert _config(digits_dir, tmp_path, "--on_corrupt=fail").data.on_corrupt == "fail"


def _mount_tmpfs(path, options):
    """Mounts a tmpfs at ``path`` (made here); False where this process may not mount."""
    path.mkdir()
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True).returncode == 0


def _unwritable(tmp_path):
    """A directory nothing can be written into, even by root; returns (it, mounted?).

    A read-only tmpfs where mounting is allowed; else a read-only directory, and where that
    is writable after all (root ignores permissions, as in tests/test_train.py) a path under
    a regular file.
    """
    target = tmp_path / "read_only"
    if _mount_tmpfs(target, "ro,size=40k"):
        return target, True
    target.chmod(0o500)
    if os.access(target, os.W_OK):
        target = tmp_path / "a_file"
        target.write_text("")
    return target, False


@pytest.mark.parametrize("disk", ["full", "unwritable"])
def test_model_dir_where_writes_fail(digits_dir, tmp_path, disk):
    """A real 40 KB tmpfs as --model_dir (the checkpoint cannot be written), and a directory
    that takes no write at all."""
    if disk == "full":
        target, mounted = tmp_path / "tiny", _mount_tmpfs(tmp_path / "tiny", "size=40k")
        if not mounted:
            pytest.skip("mounting a tmpfs needs root or CAP_SYS_ADMIN")
    else:
        target, mounted = _unwritable(tmp_path)
        with pytest.raises(OSError):  # the write really fails, whoever runs this
            (target / "run").mkdir()
    try:
        proc = _cli("--flagfile=pipelines/smoke.flags", f"--data_dir={digits_dir}",
                    f"--model_dir={target / 'run'}", "--checkpoint_every=2")
        if disk == "full":
            _one_line_error(proc, "--model_dir")
            assert "no space left on device" in proc.stderr
            assert not (target / "run" / "report.json").exists()
            assert not (target / "run" / "checkpoints" / "checkpoint").exists()
        else:
            _one_line_error(proc, f"--model_dir={target / 'run'} is not writable")
            assert not (target / "run").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], check=True)


@flagsaver.flagsaver
def test_a_record_with_a_valid_checksum_and_a_bad_payload(digits_dir, tmp_path):
    """It costs that record alone: skipped and counted (or a one-line stop with fail)."""
    import tensorflow as tf

    from tfspeed.data import pipeline

    data = _copy(digits_dir, tmp_path)
    shard = next(data.glob("train-00001-*.tfrecord"))
    records = [r.numpy() for r in tf.data.TFRecordDataset(str(shard))]
    records[7] = b"not a tf.train.Example"
    with tf.io.TFRecordWriter(str(shard)) as writer:
        for record in records:
            writer.write(record)
    with pytest.raises(UsageError, match=rf"shard {shard} ended after {len(records) - 1} of "
                                         rf"{len(records)} records, 1 lost.*--repair"):
        run(_config(data, tmp_path / "fail", "--train_steps=200", "--on_corrupt=fail"))
    pipeline.reset_corruption_report()
    report = run(_config(data, tmp_path / "skip", "--train_steps=200", "--on_corrupt=skip"))
    assert report["optimizer_updates"] == 200
    assert pipeline.corruption_report()[str(shard)] >= 1  # once per epoch read
    assert set(pipeline.corruption_report().values()) == {pipeline.corruption_report()[str(shard)]}
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    repair = forked.run([sys.executable, "-m", "tfspeed.verify", str(data), "--repair"],
                        cwd=REPO, env=env, timeout=120)
    assert "1 lost" in repair.stdout, repair.stdout


@flagsaver.flagsaver
def test_a_memory_cache_that_cannot_fit_is_one_line(digits_dir, tmp_path):
    """At 64x64 the digits' train split takes ~7 MB cached: over a 1 MB budget."""
    with pytest.raises(UsageError, match=r"--cache=memory cannot hold the data: 'train' cached "
                                         r"takes ~7 MB, the budget is 1 MB.*use --cache=disk"):
        run(_config(digits_dir, tmp_path, "--cache=memory", "--ram_budget_mb=1",
                    "--image_size=64"))
    # Two passes over the split (200 steps of 16): auto caches it on disk instead.
    report = run(_config(digits_dir, tmp_path / "auto", "--cache=auto", "--ram_budget_mb=1",
                         "--image_size=64", "--train_steps=200", f"--cache_dir={tmp_path}"))
    assert report["input"]["cache"]["train"]["mode"] == "disk"
    assert report["input"]["cache"]["train"]["reason"].startswith("auto: 'train' cached takes")
    assert report["input"]["cache"]["validation"]["mode"] == "none"  # evaluated once
