"""Keras 3 on JAX, exactly: the TensorFlow backend's exactness tests on the JAX engine.
Accumulation and data parallelism equal one big batch under SGD, token losses are exact per
real token, and a run killed by SIGKILL resumes to the weights of one never interrupted."""

import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests import forked
from tests.conftest import REPO
from tests.training import jax_runs as jr

DIGITS = ["--model=mlp", "--width=32", "--optimizer=sgd", "--learning_rate=0.05",
          "--precision=float32", "--noshuffle", "--eval_split=", "--steps_per_execution=4",
          "--train_steps=12"]
TEXT = [*jr.TINY_TEXT, "--batching=pack", "--max_length=64", "--optimizer=sgd",
        "--learning_rate=0.1", "--precision=float32", "--noshuffle", "--deterministic",
        "--eval_split=", "--train_steps=6", "--cache=memory"]
KILLED = ["--model=mlp", "--width=16", "--precision=float32", "--noshuffle",
          "--input_placement=host", "--batch_size=32", "--steps_per_execution=1",
          "--train_steps=60", "--checkpoint_every=1", "--log_every=50", "--eval_split="]


@pytest.fixture(scope="module")
def runs(digits_dir, text_dirs, tmp_path_factory):
    """This module's uninterrupted jobs, one after another in one JAX process (each JAX
    process starts in about 25 CPU-s), two CPU devices split first: each test reads its own
    model dirs. Runs of ``python -m tfspeed.train``'s own parse and library call."""
    root = tmp_path_factory.mktemp("jax_runs")
    jobs = [(digits_dir, root / "digits_split", *DIGITS, "--input_placement=device",
             "--batch_size=32", "--grad_accum_steps=2", "--strategy=mirrored",
             "--cpu_replicas=2"),
            (digits_dir, root / "digits_whole", *DIGITS, "--input_placement=host",
             "--batch_size=64"),
            (digits_dir, root / "digits_half", *DIGITS, "--input_placement=host",
             "--batch_size=32"),
            (digits_dir, root / "straight", *KILLED)]
    for task in ("classification", "lm"):
        jobs += [(text_dirs[task], root / f"{task}_split", *TEXT, "--tokens_per_batch=256",
                  "--grad_accum_steps=2", "--strategy=mirrored", "--cpu_replicas=2"),
                 (text_dirs[task], root / f"{task}_whole", *TEXT, "--tokens_per_batch=512")]
    jr.train_together(*jobs)
    return root


def test_accumulation_and_two_devices_equal_one_big_batch_under_sgd(runs):
    """Two CPU devices and two micro-batches an update, on the split held on the devices,
    train as one device on tf.data batches of four times the size (the data in a fixed
    order): the in-step and the host paths alike; a factor-2 control moves elsewhere."""
    split, whole, half = runs / "digits_split", runs / "digits_whole", runs / "digits_half"
    assert jr.report(split)["runtime"]["num_replicas"] == 2
    assert jr.report(whole)["runtime"]["num_replicas"] == 1
    assert jr.report(split)["input"]["placement"]["where"] == "device"
    assert jr.report(whole)["input"]["placement"]["where"] == "host"
    jr.close(split, whole)
    worst = max(float(np.abs(a - b).max()) for a, b in zip(jr.weights(half), jr.weights(whole),
                                                            strict=True))
    assert worst > 1e-3


@pytest.mark.parametrize("task", ["classification", "lm"])
def test_token_losses_are_exact_under_accumulation_and_two_devices(runs, task):
    """Packed rows, SGD: two devices and two micro-batches of 4 rows train as one device on
    8 rows (the packed row stream does not depend on the batch; the loss is per real
    token or sequence however they fall)."""
    split, whole = runs / f"{task}_split", runs / f"{task}_whole"
    assert jr.report(whole)["runtime"]["num_replicas"] == 1
    jr.close(split, whole)
    report = jr.report(split)
    assert report["input"]["batching"]["mode"] == "pack" and report["padding_fraction"] < 0.2


def test_sigkill_then_the_same_command_ends_with_the_sameweights(digits_dir, runs, tmp_path):
    command = [sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}", *KILLED]
    killed_dir, straight_dir = tmp_path / "killed", runs / "straight"
    process = forked.Popen([*command, f"--model_dir={killed_dir}"], cwd=REPO, env=jr.env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    state = killed_dir / "checkpoints" / "checkpoint"
    while not (state.exists() and "ckpt-2" in state.read_text()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    done = forked.run([*command, f"--model_dir={killed_dir}"], cwd=REPO, env=jr.env(),
                      timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    resumed = jr.report(killed_dir)
    assert 0 < resumed["resumed_from_update"] < 60
    assert resumed["optimizer_updates"] == jr.report(straight_dir)["optimizer_updates"] == 60
    jr.close(killed_dir, straight_dir, atol=1e-6)
