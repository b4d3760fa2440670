"""The text job in its default configuration, as a user runs it: batching, precision, XLA,
steps per call, the cache and the checkpoint interval all ``auto``, shuffle on. Killed by
SIGKILL mid-run, the same command resumes from the last automatic checkpoint and ends with
the weights of a run never interrupted.

``--deterministic`` is the one setting added: with shuffle on, parallel stages otherwise
hand elements on in the order they finish, so two uninterrupted runs differ already."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
from absl.testing import flagsaver

from tests import forked
from tests.conftest import REPO
from tfspeed.config import flags as tfspeed_flags
from tfspeed.training.run import run

STEPS = 30


def _command(data_dir, model_dir):
    return [sys.executable, "-m", "tfspeed.train", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", "--model=transformer", "--width=16", "--depth=1",
            "--heads=2", "--batch_size=16", f"--train_steps={STEPS}", "--log_every=2",
            "--checkpoint_seconds=0.5", "--deterministic"]


def _restorable(model_dir: Path) -> int:
    """The update of the checkpoint a rerun restores (its state file names it once written)."""
    state = model_dir / "checkpoints" / "checkpoint"
    found = re.search(r'^model_checkpoint_path: "ckpt-(\d+)"', state.read_text(), re.M) \
        if state.exists() else None
    return int(found.group(1)) if found else 0


@flagsaver.flagsaver
def _run_here(command):
    tfspeed_flags.parse(["tfspeed.train", *command[3:]])
    return run(tfspeed_flags.to_config())


def test_the_default_text_job_resumes_exactly_after_sigkill(text_dirs, tmp_path):
    data = text_dirs["classification"]
    killed_dir = tmp_path / "killed"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    process = forked.Popen(_command(data, killed_dir), cwd=REPO, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not 0 < _restorable(killed_dir) < STEPS:
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no automatic checkpoint"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    resumed = forked.run(_command(data, killed_dir), cwd=REPO, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The straight run takes the killed run's measured decisions (precision, batching, steps
    # per call) from the same file a rerun reads: probed anew on a loaded host, it could
    # choose otherwise (float32 against bf16 within noise) and train other weights.
    (tmp_path / "straight" / "checkpoints").mkdir(parents=True)
    shutil.copy(killed_dir / "checkpoints" / "decisions.json",
                tmp_path / "straight" / "checkpoints" / "decisions.json")
    straight = _run_here(_command(data, tmp_path / "straight"))
    straight_report = json.loads((tmp_path / "straight" / "report.json").read_text())
    assert not straight_report["decisions"]["made"], straight_report["decisions"]
    report = json.loads((killed_dir / "report.json").read_text())
    assert 0 < report["resumed_from_update"] < STEPS
    # What the killed run measured (precision on a host with native bfloat16, batching
    # where it timed both modes) the rerun took from its record instead of probing again.
    recorded = json.loads((killed_dir / "checkpoints" / "decisions.json").read_text())
    assert sorted(recorded["decisions"]) == report["decisions"]["reused"]
    assert not report["decisions"]["made"] and not report["probe_compiled_programs"]
    assert "precision probe" not in resumed.stderr and "batching probe" not in resumed.stderr
    if "precision" in recorded["decisions"]:
        assert report["runtime"]["precision"] == recorded["decisions"]["precision"]["value"]
        assert report["runtime"]["reasons"]["precision"].endswith("reused from the first run")
    assert ("precision" in recorded["decisions"]) == _probes_here(), recorded
    # --deterministic: TensorFlow's op determinism, so exact also where oneDNN is on.
    # The same kernels as the killed attempt (oneDNN's where this TensorFlow runs them):
    # bit-exact, and the report says so.
    assert report["resume"]["exact"], report["resume"]
    assert report["weights_sha256"] == straight["weights_sha256"]
    assert report["optimizer_updates"] == straight["optimizer_updates"] == STEPS
    # Every setting was the default's to resolve, and it resolved.
    config = report["config"]
    assert config["data"]["batching"] == "auto" and config["data"]["shuffle"]
    assert config["runtime"]["precision"] == config["runtime"]["xla"] == "auto"
    assert config["train"]["checkpoint_every"] == "auto"
    assert report["input"]["batching"]["mode"] in ("bucket", "pack")
    assert report["runtime"]["xla"] == (report["input"]["batching"]["mode"] == "pack")
    assert report["steps_per_execution"]["auto"]
    for got, want in zip(keras.models.load_model(killed_dir / "model.keras").get_weights(),
                         keras.models.load_model(tmp_path / "straight" / "model.keras")
                         .get_weights(), strict=True):
        np.testing.assert_array_equal(got, want)


def _probes_here() -> bool:
    """Whether precision auto measures on this host (its CPU has native bfloat16)."""
    from tfspeed import runtime
    from tfspeed.runtime import hostmem

    return runtime.Hardware(cpu_flags=frozenset(hostmem.cpu_flags())).cpu_has_bf16
