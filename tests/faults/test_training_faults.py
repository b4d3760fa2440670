"""Training survives faults: SIGKILL (resume from the last checkpoint, input position
included), SIGTERM (final checkpoint, status 143) and a diverging loss (one line, nothing
bad checkpointed). Real processes and real signals; a tiny MLP on the digits demo."""

import gc
import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import flagsaver

from tests import forked
from tests.conftest import REPO
from tfspeed import diagnose
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training.run import run
from tfspeed.training.trainer import LossDiverged

NOT_CHECKPOINTED = "the input position is not checkpointed"


def _command(data_dir, model_dir, steps, every=1, placement="host"):
    # tf.data in a fixed order (its iterator is checkpointed); in-graph input shuffled (its
    # position and permutation follow from the step alone).
    order = "--noshuffle" if placement == "host" else "--shuffle"
    return [sys.executable, "-m", "tfspeed.train", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", "--model=mlp", "--width=16", "--precision=float32",
            "--strategy=default", order, f"--input_placement={placement}", "--batch_size=32",
            "--steps_per_execution=1", f"--train_steps={steps}", f"--checkpoint_every={every}",
            "--log_every=50", "--eval_split="]


def _start(command, popen=forked.Popen):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                 text=True)


def _finish(process, timeout=60):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@flagsaver.flagsaver
def _run_here(command: list[str]) -> dict:
    """``python -m tfspeed.train ARGS`` run in this process."""
    assert command[1:3] == ["-m", "tfspeed.train"]
    tfspeed_flags.parse(["tfspeed.train", *command[3:]])
    return run(tfspeed_flags.to_config())


def _checkpoint_numbers(model_dir: Path) -> list[int]:
    return sorted(int(p.name[5:-6]) for p in (model_dir / "checkpoints").glob("ckpt-*.index"))


def _wait_for_checkpoint(process, model_dir: Path, at_least: int, timeout=60) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        numbers = _checkpoint_numbers(model_dir) if (model_dir / "checkpoints").exists() else []
        if numbers and numbers[-1] >= at_least:
            return numbers[-1]
        assert process.poll() is None, f"the run ended before ckpt-{at_least}: {_finish(process)}"
        time.sleep(0.005)
    raise AssertionError(f"no ckpt-{at_least} after {timeout} s")


def _wait_until(process, condition, timeout=60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended: {_finish(process)}"
        assert time.monotonic() < deadline, f"still waiting after {timeout} s"
        time.sleep(0.005)


def _weights(model_dir: Path) -> list[np.ndarray]:
    return keras.models.load_model(model_dir / "model.keras").get_weights()


def _report(model_dir: Path) -> dict:
    return json.loads((model_dir / "report.json").read_text())


@pytest.mark.parametrize("placement", ["host", "device"])
def test_sigkill_then_the_same_command_ends_with_the_same_weights(digits_dir, tmp_path,
                                                                    placement):
    """Model, optimizer, step and input position come back: no batch repeated or skipped."""
    steps = 60
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    killed = _start(_command(digits_dir, killed_dir, steps, placement=placement))
    kill_after = random.Random(7).randint(10, 40)
    reached = _wait_for_checkpoint(killed, killed_dir, kill_after)
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(timeout=30) == -signal.SIGKILL
    resumed = _start(_command(digits_dir, killed_dir, steps, placement=placement))
    # Meanwhile the same command uninterrupted, in this process (TensorFlow started already).
    _run_here(_command(digits_dir, reference_dir, steps, every=steps, placement=placement))
    status, _, err = _finish(resumed)
    assert status == 0, err
    assert NOT_CHECKPOINTED not in err, "the input pipeline could not be checkpointed: " + err

    resumed, uninterrupted = _report(killed_dir), _report(reference_dir)
    # The checkpoint state file names ckpt-N only after ckpt-N is written: a kill in between
    # resumes from the one before.
    assert resumed["resumed_from_update"] >= reached - 1 >= kill_after - 1
    assert resumed["optimizer_updates"] == uninterrupted["optimizer_updates"] == steps
    assert resumed["micro_steps"] == uninterrupted["micro_steps"] == steps
    for got, want in zip(_weights(killed_dir), _weights(reference_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # float32, fixed order


def test_sigterm_saves_a_final_checkpoint_and_the_rerun_finishes(digits_dir, tmp_path):
    steps = 400
    command = _command(digits_dir, tmp_path, steps, every=50)
    process = _start(command)
    # Wait until training runs (the first checkpoint after 50 updates), then stop it.
    _wait_for_checkpoint(process, tmp_path, 50)
    process.send_signal(signal.SIGTERM)
    status, _, err = _finish(process)
    assert status == 128 + signal.SIGTERM, err
    stopped = re.findall(r"stopped by SIGTERM at update (\d+); rerun the same command to "
                         r"resume", err)
    assert len(stopped) == 1, err
    update = int(stopped[0])
    assert 50 <= update < steps
    assert _checkpoint_numbers(tmp_path)[-1] == update  # saved at the update reached
    assert not (tmp_path / "report.json").exists()

    status, _, err = _finish(_start(command))
    assert status == 0, err
    report = _report(tmp_path)
    assert report["resumed_from_update"] == update
    assert report["optimizer_updates"] == report["micro_steps"] == steps


def test_a_second_run_on_a_busy_model_dir_stops_and_a_dead_owner_never_blocks(digits_dir,
                                                                              tmp_path):
    """A scheduler restarts a job whose old process still runs: the new run (or a diagnosis)
    on the same --model_dir stops at once, naming the old one. Once the old one is SIGKILLed
    its lock is gone, and the directory resumes as before."""
    # Runs until killed; started afresh: the lock names the command line it was started with.
    first = _start(_command(digits_dir, tmp_path, 10**6, every=50), subprocess.Popen)
    second = None
    try:
        _wait_until(first, lambda: (tmp_path / ".tfspeed-lock").exists()
                    or (tmp_path / "checkpoints").exists())  # the old code has no lock file
        second = _start(_command(digits_dir, tmp_path, 10**6, every=50))
        # The state file lists a checkpoint once one is complete: the rerun has one to resume.
        _wait_until(first, lambda: (tmp_path / "checkpoints" / "checkpoint").exists())
        first.send_signal(signal.SIGSTOP)  # a hung process holds its lock too; frees the CPU
        with pytest.raises(UsageError) as caught:  # meanwhile, here: a diagnosis of that run
            diagnose.run(_config(digits_dir, tmp_path, steps=10),
                         diagnose.Options(steps=2, warmup=1))
        status, _, err = _finish(second)
    finally:
        for process in (first, second):
            if process and process.poll() is None:
                process.send_signal(signal.SIGKILL)
                process.communicate(timeout=30)
    assert first.returncode == -signal.SIGKILL
    busy = (rf"error: --model_dir={re.escape(str(tmp_path))} is in use by pid {first.pid} on "
            r"\S+, running since [-\d]+ [:\d]+: `python\S* -m tfspeed.train --data_dir=.*`; "
            r"wait for it to finish or stop it, or use another --model_dir")
    assert status == 2 and re.fullmatch(busy, err.strip()), err
    assert re.fullmatch(busy[len("error: "):], str(caught.value)), caught.value

    reached = _checkpoint_numbers(tmp_path)[-1]
    report = run(_config(digits_dir, tmp_path, steps=reached + 10))  # a rerun, after SIGKILL
    assert 0 < report["resumed_from_update"] <= reached
    assert report["optimizer_updates"] == reached + 10
    assert not (tmp_path / ".tfspeed-lock").exists()  # released at the end


def _config(data_dir, model_dir, *, steps, strategy="default", replicas=0, placement="host",
            **train):
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=32, shuffle=False, cache="memory",
                        eval_split="", input_placement=placement),
        model=ModelConfig(name="mlp", width=16),
        runtime=RuntimeConfig(strategy=strategy, cpu_replicas=replicas, precision="float32",
                              xla="off"),
        train=TrainConfig(**{"train_steps": steps, "steps_per_execution": 1,
                             "checkpoint_every": 1, "keep_checkpoints": 50, "log_every": 4,
                             **train}),
        model_dir=str(model_dir),
    ).validate()


def test_a_diverging_loss_stops_the_run_before_it_is_checkpointed(digits_dir, tmp_path):
    config = _config(digits_dir, tmp_path, steps=30, optimizer="sgd", learning_rate=1e30)
    with pytest.raises(LossDiverged) as caught:
        run(config)
    message = str(caught.value)
    assert re.fullmatch(r"loss became (NaN|Inf) at update (\d+) \(micro-step \2\); "
                        r"(the last good checkpoint is ckpt-\d+|no checkpoint was written) "
                        r"— lower --learning_rate or check the data", message), message
    checkpoints = sorted((tmp_path / "checkpoints").glob("ckpt-*.index"))
    if "ckpt-" in message:
        assert checkpoints[-1].name == message.split(" is ")[1].split(" ")[0] + ".index"
    for index in checkpoints:
        reader = tf.train.load_checkpoint(str(index)[: -len(".index")])
        for name, dtype in reader.get_variable_to_dtype_map().items():
            if dtype.is_floating:
                assert np.isfinite(reader.get_tensor(name)).all(), (index.name, name)
    assert not (tmp_path / "model.keras").exists()


def test_mirrored_resume_skips_to_the_same_step_of_the_epoch(digits_dir, tmp_path, caplog):
    """tf.distribute iterators over 2 replicas cannot be checkpointed in TF 2.21: the resumed
    run fast-forwards a fresh stream instead, which in a fixed data order gives the same
    weights as an uninterrupted run."""
    with caplog.at_level(logging.WARNING):
        run(_config(digits_dir, tmp_path / "resumed", steps=3, strategy="mirrored", replicas=2))
        caplog.clear()
        report = run(_config(digits_dir, tmp_path / "resumed", steps=5, strategy="mirrored",
                             replicas=2))
    assert report["resumed_from_update"] == 3 and report["optimizer_updates"] == 5
    warnings = [r.getMessage() for r in caplog.records if NOT_CHECKPOINTED in r.getMessage()]
    assert len(warnings) == 1, warnings
    run(_config(digits_dir, tmp_path / "straight", steps=5, strategy="mirrored", replicas=2))
    resumed = keras.models.load_model(tmp_path / "resumed" / "model.keras").get_weights()
    straight = keras.models.load_model(tmp_path / "straight" / "model.keras").get_weights()
    for a, b in zip(resumed, straight, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)


def test_a_checkpoint_without_input_position_still_resumes(digits_dir, tmp_path, caplog):
    """Written under MirroredStrategy (no iterator), resumed on one device (which saves one)."""
    run(_config(digits_dir, tmp_path, steps=3, strategy="mirrored", replicas=2))
    with caplog.at_level(logging.WARNING):
        report = run(_config(digits_dir, tmp_path, steps=5))
    assert report["resumed_from_update"] == 3 and report["optimizer_updates"] == 5
    assert any("ckpt-3 holds no input position" in r.getMessage() for r in caplog.records)


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(data)


def test_a_damaged_newest_checkpoint_costs_only_itself(digits_dir, tmp_path, caplog):
    """A flipped byte in the newest checkpoint: it is set aside with one warning, the run
    resumes from the one before and ends with the weights of an uninterrupted run; the
    manager keeps keep_checkpoints good ones. If none restores: one error, nothing moved."""
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    run(_config(digits_dir, run_dir, steps=10, checkpoint_every=2, keep_checkpoints=3))
    assert _checkpoint_numbers(run_dir) == [6, 8, 10]
    _flip_middle_byte(checkpoints / "ckpt-10.data-00000-of-00001")
    with caplog.at_level(logging.WARNING):
        report = run(_config(digits_dir, run_dir, steps=12, checkpoint_every=3,
                             keep_checkpoints=3))
    warnings = [r.getMessage() for r in caplog.records if "does not restore" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(
        f"checkpoint {checkpoints / 'ckpt-10'} does not restore ("), warnings
    assert warnings[0].endswith(f"moved it to {checkpoints / 'damaged'} and resumed from ckpt-8")
    assert report["resumed_from_update"] == 8 and report["optimizer_updates"] == 12
    assert sorted(p.name for p in (checkpoints / "damaged").iterdir()) == [
        "ckpt-10.data-00000-of-00001", "ckpt-10.index"]
    # Saved at 9 and 12; the damaged one counted, ckpt-10 would be listed in place of ckpt-8.
    assert _checkpoint_numbers(run_dir) == [8, 9, 12]
    state = tf.train.get_checkpoint_state(str(checkpoints))
    assert [Path(p).name for p in state.all_model_checkpoint_paths] == ["ckpt-8", "ckpt-9",
                                                                        "ckpt-12"]
    run(_config(digits_dir, tmp_path / "straight", steps=12))
    for got, want in zip(_weights(run_dir), _weights(tmp_path / "straight"), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)  # nothing of ckpt-10 leaked

    for number in (8, 9, 12):
        _flip_middle_byte(checkpoints / f"ckpt-{number}.data-00000-of-00001")
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(UsageError) as caught:
        run(_config(digits_dir, run_dir, steps=14))
    message = str(caught.value)
    del caught  # its frames hold the failed restores' status objects, which TF checks ...
    gc.collect()  # ... when they go: the error must be the one line, no warnings after it
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
    assert re.fullmatch(rf"no checkpoint in {re.escape(str(checkpoints))} restores: all 3 are "
                        r"damaged \(newest ckpt-12: .+\); move that directory away to train "
                        r"from scratch, or use another --model_dir", message)
    assert _checkpoint_numbers(run_dir) == [8, 9, 12]  # left in place: a rerun says it again
