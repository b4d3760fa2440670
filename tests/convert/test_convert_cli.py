"""The converter's command line: bad input is one ``error:`` line and exit status 2, and a
conversion killed with SIGKILL resumes to the same bytes as an uninterrupted one."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import write_photos

from tests.conftest import REPO as REPO_PATH
from tfspeed.convert import convert, run
from tfspeed.convert import plan as plan_lib

SCRIPT = REPO_PATH / "scripts" / "to_tfrecord.py"


def _run(capsys, *args):
    """Runs the CLI in this process; returns (exit status, stdout, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        run(["to_tfrecord.py", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err.splitlines()


def _script(*args):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.Popen(
        [sys.executable, str(SCRIPT), *args],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _snapshot(out):
    """The shards' bytes and schema.json, but the figures of the measured storage choice."""
    names = [n for n in os.listdir(out) if n.endswith(".tfrecord")]
    snapshot = {n: (out / n).read_bytes() for n in sorted(names)}
    schema = json.loads((out / "schema.json").read_text())
    schema["storage"] = {k: schema["storage"][k] for k in ("image_format", "requested")}
    return {**snapshot, "schema.json": schema}


# ---------------------------------------------------------------- bad input


def _make(tmp_path, case):
    """Builds the input of a bad-input case; returns (flags, text the error must contain)."""
    out = f"--output={tmp_path / 'out'}"
    if case == "missing path":
        return [f"--source=imagefolder:{tmp_path / 'nope'}", out], str(tmp_path / "nope")
    if case == "unknown kind":
        return ["--source=parquet:/data/x", out], "parquet"
    if case == "no class folders":
        (tmp_path / "empty").mkdir()
        return [f"--source=imagefolder:{tmp_path / 'empty'}", out], str(tmp_path / "empty")
    if case == "no files":
        (tmp_path / "src" / "cat").mkdir(parents=True)
        return [f"--source=imagefolder:{tmp_path / 'src'}", out], str(tmp_path / "src")
    if case == "no images":
        (tmp_path / "src" / "cat").mkdir(parents=True)
        (tmp_path / "src" / "cat" / "a.txt").write_text("x")
        return [f"--source=imagefolder:{tmp_path / 'src'}", out], str(tmp_path / "src")
    if case == "all undecodable":
        (tmp_path / "src" / "cat").mkdir(parents=True)
        (tmp_path / "src" / "cat" / "a.jpg").write_text("not a jpeg")
        return [f"--source=imagefolder:{tmp_path / 'src'}", out], "every item was skipped"
    csv = tmp_path / "t.csv"
    if case == "csv without label":
        csv.write_text("a,b\n1,2\n")
        return [f"--source=csv:{csv}", out], f"{csv} has no label column 'label'"
    if case == "csv empty":
        csv.write_text("")
        return [f"--source=csv:{csv}", out], f"CSV {csv} is empty"
    if case == "csv not numeric":
        csv.write_text("a,b,label\n1,2,x\n3,four,y\n")
        return [f"--source=csv:{csv}", out], f"CSV {csv}: column 'b', row 2 (line 3) holds 'four'"
    npz = tmp_path / "d.npz"
    if case == "npz without y":
        np.savez(npz, x=np.zeros((3, 2)))
        return [f"--source=npz:{npz}", out], f"{npz} has no array 'y'"
    if case == "npz lengths differ":
        np.savez(npz, x=np.zeros((3, 2)), y=np.zeros(4, np.int64))
        return [f"--source=npz:{npz}", out], str(npz)
    if case == "tfds not prepared":
        return [
            "--source=tfds:no_such_dataset_xyz",
            f"--tfds_data_dir={tmp_path}",
            out,
        ], "not prepared"
    if case == "raw with varying sizes":
        write_photos(tmp_path / "src", classes=1, per_class=2)
        return [f"--source=imagefolder:{tmp_path / 'src'}", out, "--image_format=raw"], (
            "--image_format=raw needs images of one size"
        )
    if case == "image options without images":
        csv.write_text("a,label\n1,x\n2,y\n")
        return [f"--source=csv:{csv}", out, "--image_size=32"], "--image_size=32: --source=csv"
    if case == "another dataset":
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "train-00000-of-00001.tfrecord").write_bytes(b"theirs")
        return ["--source=digits", out], f"{tmp_path / 'out'} holds another dataset"
    if case == "output is the photo folder":
        src = write_photos(tmp_path / "src", classes=2, per_class=1)
        return [f"--source=imagefolder:{src}", f"--output={src}"], (
            f"--output={src} is the source itself (--source=imagefolder:{src}): the shards would "
            "mix with the source's files; write them to a separate directory, e.g. --output=data/src"
        )
    if case == "output inside the photo folder":
        src = write_photos(tmp_path / "src", classes=2, per_class=1)
        return [f"--source=imagefolder:{src}", f"--output={src / 'tfrecord'}"], (
            f"--output={src / 'tfrecord'} lies inside the source"
        )
    if case == "output holds photos":
        write_photos(tmp_path / "out", classes=1, per_class=1)
        return ["--source=digits", out], (
            f"{out} holds source files ({tmp_path / 'out' / 'class_0' / 'img_000.jpg'})"
        )
    options = {
        "shards < 0": ("--shards=-1", "--shards=-1"),
        "fraction 1": ("--validation_fraction=1", "--validation_fraction=1"),
        "workers 0": ("--workers=0", "--workers=0"),
        "max side < 0": ("--image_max_side=-5", "--image_max_side=-5"),
        "bad format": ("--image_format=gif", "--image_format"),
        "size < 0": ("--image_size=-1", "--image_size=-1"),
        "size and max side": ("--image_size=32 --image_max_side=64", "conflict"),
        "budget < 0": ("--raw_budget_mb=-1", "--raw_budget_mb=-1.0"),
        "unknown flag": ("--shardz=3", "shardz"),
        "wrong type": ("--shards=many", "--shards=many"),
        "extra argument": ("stray", "'stray'"),
    }
    flag, expected = options[case]
    return ["--source=digits", out, *flag.split()], expected


BAD_CASES = [
    "missing path",
    "unknown kind",
    "no class folders",
    "no files",
    "no images",
    "all undecodable",
    "csv without label",
    "csv empty",
    "csv not numeric",
    "npz without y",
    "npz lengths differ",
    "tfds not prepared",
    "another dataset",
    "output is the photo folder",
    "output inside the photo folder",
    "output holds photos",
    "shards < 0",
    "fraction 1",
    "workers 0",
    "max side < 0",
    "bad format",
    "size < 0",
    "size and max side",
    "budget < 0",
    "raw with varying sizes",
    "image options without images",
    "unknown flag",
    "wrong type",
    "extra argument",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_is_one_error_line_and_status_2(tmp_path, capsys, case):
    args, expected = _make(tmp_path, case)
    status, _, err = _run(capsys, *args)
    assert status == 2
    errors = [line for line in err if not line.startswith("W")]  # skip warnings (undecodable)
    assert len(errors) == 1 and errors[0].startswith("error: "), err
    assert expected in errors[0]
    assert "Traceback" not in "\n".join(err)


def test_bad_input_from_a_real_process(tmp_path):
    # Both at once: each process spends seconds importing TensorFlow.
    missing = _script(f"--source=csv:{tmp_path / 'none.csv'}", f"--output={tmp_path / 'o'}")
    unknown = _script("--source=digits", f"--output={tmp_path / 'o'}", "--no_such_flag")
    for process, expected in [(missing, str(tmp_path / "none.csv")), (unknown, "no_such_flag")]:
        out, err = process.communicate(timeout=120)
        assert process.returncode == 2, err
        assert err.splitlines() == [err.strip()] and err.startswith("error: "), err
        assert expected in err and "Traceback" not in err and not out


# ---------------------------------------------------------------- success, help


def test_cli_converts_then_reports_already_converted(tmp_path, capsys):
    args = ["--source=digits", f"--output={tmp_path}", "--shards=2", "--workers=1", "--noprogress"]
    status, out, err = _run(capsys, *args)
    assert status == 0 and not err
    assert out.startswith("converted digits") and "1797 records" in out and "train 1617" in out
    status, out, _ = _run(capsys, *args)
    assert status == 0 and out.startswith("already converted")


def test_help_lists_the_flags(capsys):
    status, out, _ = _run(capsys, "--help")
    assert status == 0 and "--source" in out and "--target_shard_mb" in out

def test_command_line_forks_its_workers_and_writes_what_one_worker_writes(tmp_path):
    """The command line imports no TensorFlow, so its workers are forked (ready at once);
    a process that imported TensorFlow, like this one, spawns them. Either way the bytes
    are those of a single writer."""
    probe = "from tfspeed.convert import pool; print(pool.start_method())"
    methods = {
        imports: subprocess.run([sys.executable, "-c", imports + probe], capture_output=True,
                                text=True, check=True).stdout.strip()
        for imports in ("", "import tensorflow; ")
    }
    assert methods == {"": "fork", "import tensorflow; ": "spawn"}

    forked = _script("--source=digits", f"--output={tmp_path / 'two'}", "--shards=4",
                     "--workers=2", "--noprogress")
    out, err = forked.communicate(timeout=120)
    assert forked.returncode == 0, err
    assert "1797 records" in out
    convert("digits", str(tmp_path / "one"), shards=4, workers=1)
    shards = sorted(p.name for p in (tmp_path / "one").glob("*.tfrecord"))
    assert len(shards) > 4  # train and validation
    for name in shards:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "one" / name).read_bytes()
    schemas = [json.loads((tmp_path / d / "schema.json").read_text()) for d in ("one", "two")]
    assert schemas[0]["fingerprint"] == schemas[1]["fingerprint"]



# ---------------------------------------------------------------- real interruption


def test_a_second_conversion_into_a_busy_output_names_the_first(tmp_path, capsys):
    out = tmp_path / "out"
    args = ("--source=digits", f"--output={out}", "--shards=500", "--workers=1", "--noprogress")
    first = _script(*args)
    try:
        deadline = time.monotonic() + 120
        while not (out / plan_lib.PLAN_FILE).exists():  # written under the lock
            assert first.poll() is None and time.monotonic() < deadline, first.communicate()
            time.sleep(0.002)
        status, _, err = _run(capsys, *args)
        assert first.poll() is None, "the first conversion ended too soon for this test"
    finally:
        first.kill()
        first.communicate()
    assert status == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: --output={out} is in use by pid {first.pid} on "), err
    assert err[0].endswith(f"to_tfrecord.py {' '.join(args)}`; wait for it to finish or stop "
                           "it, or choose another --output"), err
    assert not (out / "schema.json").exists()


@pytest.mark.parametrize("plan_lines", [1, 4, 300], ids=["plan-only", "few-shards", "most-shards"])
def test_sigkill_mid_run_then_rerun_equals_an_uninterrupted_run(tmp_path, plan_lines):
    """SIGKILL at several moments: right after the plan, after a few shards, near the end."""
    out, clean = tmp_path / "out", tmp_path / "clean"
    args = dict(shards=500, validation_fraction=0.1)
    process = _script(
        "--source=digits", f"--output={out}", "--shards=500", "--workers=1", "--noprogress"
    )
    plan = out / plan_lib.PLAN_FILE
    deadline = time.monotonic() + 120
    # Kill once the plan (a header line, then a line per finished shard) is that long.
    while time.monotonic() < deadline and process.poll() is None:
        if plan.exists() and len(plan.read_text().splitlines()) >= plan_lines:
            break
        time.sleep(0.002)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert not (out / "schema.json").exists()  # killed before the end

    resumed = convert("digits", str(out), **args)
    assert plan_lines - 1 <= resumed.summary["resumed_shards"] < 500
    convert("digits", str(clean), **args)
    assert _snapshot(out) == _snapshot(clean)
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def _children(pid):
    """{pid: start time} of the live processes whose parent is ``pid`` (from /proc)."""
    children = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        fields = _stat(entry)
        if fields and fields[1] == str(pid):
            children[int(entry)] = fields[19]
    return children


def _stat(pid):
    """The fields of /proc/PID/stat after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def _alive(pid, start_time):
    fields = _stat(pid)  # the same process (not a reused pid), and not a zombie
    return fields is not None and fields[19] == start_time and fields[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigkill_takes_the_workers_along_and_a_rerun_finishes(tmp_path):
    """kill -9 of the converter: its worker processes end too, not wait on a pipe for ever."""
    out, log = tmp_path / "out", tmp_path / "stderr.txt"
    args = ["--source=digits", f"--output={out}", "--image_size=224", "--image_format=jpeg",
            "--shards=32", "--workers=2", "--noprogress"]
    with open(log, "w") as stderr:  # not a pipe: an orphaned worker would hold it open
        process = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=stderr,
                                   stderr=stderr, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    plan = out / plan_lib.PLAN_FILE
    deadline = time.monotonic() + 120
    workers = {}
    try:  # kill once a shard is finished, the workers started and the rest still to write
        while not (workers and plan.exists() and len(plan.read_text().splitlines()) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            workers = workers or _children(process.pid)
            time.sleep(0.005)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (out / "schema.json").exists(), "the conversion ended too soon for this test"

    deadline = time.monotonic() + 5
    while any(_alive(*w) for w in workers.items()) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid, start in workers.items() if _alive(pid, start)]
    for pid in left:  # not to leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert not left, f"workers {left} outlived the killed converter"

    resumed = convert("digits", str(out), image_size=224, image_format="jpeg", shards=32,
                      workers=2)
    assert resumed.summary["resumed_shards"] >= 1 and resumed.summary["records"] == 1797
    assert (out / "schema.json").exists()
    assert not [n for n in os.listdir(out) if ".tmp-" in n]
