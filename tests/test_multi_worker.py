"""MultiWorkerMirroredStrategy: 2 real worker processes on 127.0.0.1 via python -m tfspeed.launch."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from absl.testing import flagsaver

from tfspeed import runtime
from tfspeed.config import RuntimeConfig
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training.run import run

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
# Float32 sums of the same gradients in another order (an all-reduce of two halves vs one
# batch): equal to a few ulps of the weights.
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def four_shards(tmp_path_factory) -> str:
    """64 train records in 4 equal shards: 2 workers each read 2 whole shards (sharded by
    file); 9 validation records in 1 shard: sharded by record, worker 0 evaluates 5 records
    (2 batches of 4) and worker 1 only 4 (1 batch)."""
    from tfspeed.convert import convert

    rng = np.random.default_rng(3)
    y = rng.integers(0, 3, size=73)
    x = (rng.normal(size=(73, 6)) + y[:, None]).astype(np.float32)
    root = tmp_path_factory.mktemp("four_shards")
    np.savez(root / "data.npz", x=x, y=y)
    convert(f"npz:{root / 'data.npz'}", str(root / "data"), shards=4,
            validation_fraction=9 / 73)
    return str(root / "data")


def _flags(data_dir: str, model_dir: Path, *extra: str) -> list[str]:
    # A fixed data order (no shuffling): the 2-worker job then sees, at every step, the same
    # global batch as one worker does (deterministic interleave over equal shards).
    return [f"--data_dir={data_dir}", f"--model_dir={model_dir}", "--model=mlp", "--width=8",
            "--batch_size=8", "--shuffle=false", "--cache=none", "--eval_split=",
            "--precision=float32", "--optimizer=sgd", "--learning_rate=0.1", "--log_every=2",
            *extra]


def _launch(flags: list[str], workers: int = 2, *launch_flags: str, timeout: float = 240):
    return subprocess.run(
        [sys.executable, "-m", "tfspeed.launch", f"--workers={workers}", *launch_flags, "--",
         *flags], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


@flagsaver.flagsaver
def _train_here(flags: list[str], *extra: str) -> dict:
    """The driver's command line, run in this process; its report."""
    tfspeed_flags.parse(["tfspeed.train", *flags, *extra])
    return run(tfspeed_flags.to_config())


def _weights(model_dir: Path) -> list[np.ndarray]:
    import keras

    return keras.models.load_model(model_dir / "model.keras", compile=False).get_weights()


@pytest.mark.parametrize("placement", ["host", "device"])
def test_two_workers_match_one_worker(four_shards, tmp_path, placement):
    common = ("--train_steps=4", "--grad_accum_steps=2", "--steps_per_execution=2", "--xla=on",
              "--eval_split=validation", f"--input_placement={placement}")
    job = subprocess.Popen(  # meanwhile, one worker in this process (TF already started)
        [sys.executable, "-m", "tfspeed.launch", "--workers=2", "--",
         *_flags(four_shards, tmp_path / "two", *common)], cwd=REPO, env=ENV,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _train_here(_flags(four_shards, tmp_path / "one", *common), "--strategy=default")
    finally:
        job.stdout = job.communicate(timeout=240)[0]
    assert job.returncode == 0, job.stdout[-3000:]

    report = json.loads((tmp_path / "two" / "report.json").read_text())
    assert report["runtime"]["num_workers"] == 2 and report["runtime"]["num_replicas"] == 2
    assert report["runtime"]["xla"] is True
    assert report["optimizer_updates"] == 4 and report["micro_steps"] == 8
    assert report["input"]["placement"]["where"] == placement
    assert report["input_sharding"].startswith(
        "by file (4 shard files over 2 input pipelines" if placement == "host" else
        "none: every worker holds the split in-graph")
    # Every worker holds the same weights after training ...
    other = re.search(r"\[worker 1\] worker 1 of 2 finished at update 4: weights sha256 (\w+)",
                      job.stdout)
    assert other and other.group(1) == report["weights_sha256"]
    # ... equal to one worker training on the same global batches.
    for a, b in zip(_weights(tmp_path / "one"), _weights(tmp_path / "two"), strict=True):
        np.testing.assert_allclose(a, b, atol=TOLERANCE, rtol=0)
    # Evaluation covered the 9 uneven validation records once, as one process does.
    alone = json.loads((tmp_path / "one" / "report.json").read_text())
    assert report["eval_loss"] == pytest.approx(alone["eval_loss"], abs=TOLERANCE)
    assert report["eval_accuracy"] == pytest.approx(alone["eval_accuracy"], abs=1e-9)
    # Only the chief wrote into the run directory; the other worker's temp dir is gone.
    assert not list((tmp_path / "two").glob(".worker-*"))
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").glob("*.index")) == [
        "ckpt-4.index"]


def test_killed_worker_job_restarts_and_resumes(four_shards, tmp_path):
    model_dir = tmp_path / "run"
    command = [sys.executable, "-m", "tfspeed.launch", "--workers=2", "--max_restarts=1", "--",
               *_flags(four_shards, model_dir, "--train_steps=300", "--steps_per_execution=1",
                       "--checkpoint_every=10")]
    job = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines, pid, saved = [], None, 0
    for line in job.stdout:
        lines.append(line)
        if match := re.match(r"\[launch\] worker 1: pid (\d+)", line):
            pid = int(match.group(1))
        # "update 30/300" is logged before update 30's checkpoint is written: kill only once
        # the chief has recorded a checkpoint of update >= 30 (its files complete) on disk.
        saved = _saved_update(model_dir / "checkpoints")
        if pid is not None and saved >= 30:
            os.kill(pid, signal.SIGKILL)
            break
    lines += job.stdout.readlines()
    assert job.wait(timeout=240) == 0, "".join(lines[-30:])
    output = "".join(lines)
    assert saved >= 30, output[-3000:]
    assert "[launch] worker 1 was killed by SIGKILL; restarting all 2 workers" in output
    report = json.loads((model_dir / "report.json").read_text())
    assert saved <= report["resumed_from_update"] < 300  # resumed, at or after what was saved
    assert report["optimizer_updates"] == 300
    assert not list(model_dir.glob(".worker-*"))  # the killed worker's leftovers too


def _saved_update(directory: Path) -> int:
    """The update of the newest checkpoint recorded in ``directory``'s state file whose
    index is written (what a restart restores from), or 0."""
    import tensorflow as tf

    state = tf.train.get_checkpoint_state(str(directory)) if directory.is_dir() else None
    paths = [p for p in (state.all_model_checkpoint_paths if state else ())
             if os.path.exists(p + ".index")]
    return max((int(p.rsplit("-", 1)[1]) for p in paths), default=0)


def test_a_live_workers_directory_is_refused_and_a_dead_ones_removed(tmp_path):
    """Worker 1 of another job, still running, owns MODEL_DIR/.worker-1-PID: a second job's
    worker 1 stops with one line naming it, instead of deleting its directory. Once that
    process is dead (SIGKILL), its directory is stale and removed."""
    from tfspeed.training.trainer import _worker_dir

    holder = subprocess.Popen(  # the real context, in a light process (no TensorFlow)
        [sys.executable, "-c", "import os, sys, time\nfrom tfspeed.util import locks\n"
         "with locks.own_dir(sys.argv[1], '.worker-1', 'w', 'f') as path:\n"
         "    os.makedirs(path); print(path, flush=True); time.sleep(120)\n", str(tmp_path)],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        theirs = Path(holder.stdout.readline().strip())
        assert theirs == tmp_path / f".worker-1-{holder.pid}" and theirs.is_dir()
        with pytest.raises(UsageError) as caught, _worker_dir(str(tmp_path), 1):
            pass
        assert re.fullmatch(rf"worker 1's directory in --model_dir={re.escape(str(tmp_path))} "
                            rf"is in use by pid {holder.pid} on \S+, running since .*: `.*`; stop "
                            r"that job first, or use another --model_dir", str(caught.value))
        assert theirs.is_dir()
        with _worker_dir(str(tmp_path), 0) as other:  # another index is not theirs
            assert other == str(tmp_path / f".worker-0-{os.getpid()}")
    finally:
        holder.kill()
        holder.communicate()
    with _worker_dir(str(tmp_path), None) as chief:  # the chief writes into model_dir
        assert chief == str(tmp_path)
    with _worker_dir(str(tmp_path), 1) as mine:
        assert not theirs.exists()  # dead: removed
        assert mine == str(tmp_path / f".worker-1-{os.getpid()}")
        os.makedirs(mine)
    assert not list(tmp_path.glob(".worker-1*"))  # our directory and the lock are gone


def test_multi_worker_needs_tf_config():
    with pytest.raises(UsageError, match="--strategy=multi_worker needs a cluster in TF_CONFIG"):
        runtime.resolve(RuntimeConfig(strategy="multi_worker"), runtime.Hardware())


def test_auto_picks_multi_worker_under_a_cluster():
    plan = runtime.resolve(RuntimeConfig(strategy="auto"), runtime.Hardware(cluster_tasks=2))
    assert plan.strategy == "multi_worker"
    assert plan.reasons["strategy"] == "auto: TF_CONFIG describes a cluster of 2 tasks"


@pytest.mark.parametrize("text", ['{"cluster": {}}', "not json", '{"task": {"index": 0}}'])
def test_bad_tf_config_is_a_usage_error(text):
    with pytest.raises(UsageError, match="TF_CONFIG is not a cluster description"):
        runtime.cluster_tasks({"TF_CONFIG": text})


def test_tf_config_of_launch_names_every_worker():
    from tfspeed.launch import tf_config

    config = json.loads(tf_config(["127.0.0.1:1", "127.0.0.1:2"], 1))
    assert config == {"cluster": {"worker": ["127.0.0.1:1", "127.0.0.1:2"]},
                      "task": {"type": "worker", "index": 1}}
    assert runtime.cluster_tasks({"TF_CONFIG": json.dumps(config)}) == 2


def test_input_sharding_is_by_file_when_every_worker_gets_one():
    from tfspeed.data.pipeline import sharding

    assert sharding(16, 1) == "none (one input pipeline)"
    assert sharding(4, 2).startswith("by file (4 shard files over 2 input pipelines")
    assert sharding(1, 2).startswith("by record (1 shard file(s) < 2 input pipelines")


def test_cpu_replicas_with_multi_worker_is_refused():
    with pytest.raises(UsageError, match="drop it with --strategy=multi_worker"):
        runtime.resolve(RuntimeConfig(strategy="multi_worker", cpu_replicas=2),
                        runtime.Hardware(cluster_tasks=2))
