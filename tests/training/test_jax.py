"""Keras 3 on JAX: the same driver, data and ``tfspeed.fit`` with ``KERAS_BACKEND=jax``, each
run in a process of its own (a process has one Keras backend). The exactness tests are the
TensorFlow backend's: accumulation and data parallelism equal one big batch under SGD,
token losses are exact per real token, and a run killed by SIGKILL resumes to the weights
of one never interrupted."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import REPO

TINY_TEXT = ["--model=transformer", "--width=16", "--depth=1", "--heads=2"]


def _env(devices: int = 1) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("XLA_FLAGS", None)
    return env


def _train(data_dir, model_dir, *flags, check=True):
    done = subprocess.run([sys.executable, "-m", "tfspeed.train", "--log_every=5", *flags,
                           f"--data_dir={data_dir}", f"--model_dir={model_dir}"], cwd=REPO,
                          env=_env(), capture_output=True, text=True, timeout=900)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def _report(model_dir) -> dict:
    return json.loads((model_dir / "report.json").read_text())


def _weights(model_dir) -> list[np.ndarray]:
    """The trained weights, read without Keras (h5py: any backend wrote them alike)."""
    import h5py

    found = []
    with h5py.File(model_dir / "model.weights.h5", "r") as f:
        f.visititems(lambda name, item: found.append((name, item[()]))
                     if isinstance(item, h5py.Dataset) else None)
    return [value for _, value in sorted(found, key=lambda pair: pair[0])]


def _close(a_dir, b_dir, atol=2e-5):
    for got, want in zip(_weights(a_dir), _weights(b_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def test_the_digits_job_trains_on_jax_with_its_defaults(digits_dir, tmp_path):
    """pipelines/digits.flags' job as it is (in-step input, steps per call auto, shuffled),
    a few epochs: the accuracy the TensorFlow backend reaches on the same job (within the
    noise of two differently shuffled runs), and a report that names JAX."""
    flags = ["--flagfile=pipelines/digits.flags", "--epochs=4", "--prepare_source="]
    _train(digits_dir, tmp_path / "jax", *flags)
    env = {**_env(), "KERAS_BACKEND": "tensorflow"}
    done = subprocess.run([sys.executable, "-m", "tfspeed.train", *flags,
                           f"--data_dir={digits_dir}", f"--model_dir={tmp_path / 'tf'}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report, reference = _report(tmp_path / "jax"), _report(tmp_path / "tf")
    assert report["runtime"]["backend"] == "jax" and report["runtime"]["xla"]
    assert reference["runtime"]["backend"] == "tensorflow"
    assert report["input"]["placement"]["where"] == "device"
    assert report["optimizer_updates"] == reference["optimizer_updates"] > 0
    assert abs(report["eval_accuracy"] - reference["eval_accuracy"]) < 0.05, (
        report["eval_accuracy"], reference["eval_accuracy"])
    assert report["steps_per_execution"]["auto"]
    assert (tmp_path / "jax" / "model.weights.h5").exists()


@pytest.mark.parametrize("placement", ["device", "host"])
def test_accumulation_and_two_devices_equal_one_big_batch_under_sgd(digits_dir, tmp_path,
                                                                     placement):
    """Two CPU devices and two micro-batches an update train as one device on batches of
    four times the size (the data in a fixed order); a factor-2 control moves elsewhere."""
    common = ["--model=mlp", "--width=32", "--optimizer=sgd", "--learning_rate=0.05",
              "--precision=float32", "--noshuffle", f"--input_placement={placement}",
              "--eval_split=", "--steps_per_execution=4"]
    split, whole, half = tmp_path / "split", tmp_path / "whole", tmp_path / "half"
    _train(digits_dir, split, *common, "--batch_size=32", "--grad_accum_steps=2",
           "--strategy=mirrored", "--cpu_replicas=2", "--train_steps=12")
    _train(digits_dir, whole, *common, "--batch_size=64", "--train_steps=12")
    assert _report(split)["runtime"]["num_replicas"] == 2
    _close(split, whole)
    _train(digits_dir, half, *common, "--batch_size=32", "--train_steps=12")
    worst = max(float(np.abs(a - b).max()) for a, b in zip(_weights(half), _weights(whole),
                                                            strict=True))
    assert worst > 1e-3


@pytest.mark.parametrize("task", ["classification", "lm"])
def test_token_losses_are_exact_under_accumulation_and_two_devices(text_dirs, tmp_path, task):
    """Packed rows, SGD: two devices and two micro-batches of 4 rows train as one device on
    8 rows (the packed row stream does not depend on the batch; the loss is per real
    token or sequence however they fall)."""
    common = [*TINY_TEXT, "--batching=pack", "--max_length=64", "--optimizer=sgd",
              "--learning_rate=0.1", "--precision=float32", "--noshuffle", "--deterministic",
              "--eval_split=", "--train_steps=6", "--cache=memory"]
    split, whole = tmp_path / "split", tmp_path / "whole"
    _train(text_dirs[task], split, *common, "--tokens_per_batch=256", "--grad_accum_steps=2",
           "--strategy=mirrored", "--cpu_replicas=2")
    _train(text_dirs[task], whole, *common, "--tokens_per_batch=512")
    _close(split, whole)
    report = _report(split)
    assert report["input"]["batching"]["mode"] == "pack" and report["padding_fraction"] < 0.2


def test_sigkill_then_the_same_command_ends_with_the_same_weights(digits_dir, tmp_path):
    command = [sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
               "--model=mlp", "--width=16", "--precision=float32", "--noshuffle",
               "--input_placement=host", "--batch_size=32", "--steps_per_execution=1",
               "--train_steps=60", "--checkpoint_every=1", "--log_every=50", "--eval_split="]
    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"
    process = subprocess.Popen([*command, f"--model_dir={killed_dir}"], cwd=REPO, env=_env(),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    state = killed_dir / "checkpoints" / "checkpoint"
    while not (state.exists() and "ckpt-2" in state.read_text()):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    for model_dir in (killed_dir, straight_dir):
        done = subprocess.run([*command, f"--model_dir={model_dir}"], cwd=REPO, env=_env(),
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    resumed = _report(killed_dir)
    assert 0 < resumed["resumed_from_update"] < 60
    assert resumed["optimizer_updates"] == _report(straight_dir)["optimizer_updates"] == 60
    _close(killed_dir, straight_dir, atol=1e-6)


def test_the_text_job_reaches_the_tensorflow_backends_accuracy(short_texts, tmp_path):
    """The same text job (short docstrings, the transformer, batching auto) on both
    backends, run side by side: JAX's accuracy is TensorFlow's within the noise of two
    differently initialised runs."""
    flags = [*TINY_TEXT, "--batch_size=32", "--epochs=3", "--learning_rate=0.003",
             f"--data_dir={short_texts}"]
    runs = {backend: subprocess.Popen(
        [sys.executable, "-m", "tfspeed.train", *flags, f"--model_dir={tmp_path / backend}"],
        cwd=REPO, env={**_env(), "KERAS_BACKEND": backend}, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True) for backend in ("jax", "tensorflow")}
    for proc in runs.values():
        _, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, err[-3000:]
    report, reference = _report(tmp_path / "jax"), _report(tmp_path / "tensorflow")
    assert report["runtime"]["backend"] == "jax"
    assert reference["runtime"]["backend"] == "tensorflow"
    assert report["input"]["batching"]["mode"] == reference["input"]["batching"]["mode"]
    # (Each compile counts against the run on JAX, so auto buckets into fewer widths there:
    # 6 against 16 here, the same 3 epochs in a different number of batches.)
    assert len(report["input"]["batching"]["boundaries"]) < len(
        reference["input"]["batching"]["boundaries"])
    assert report["eval_accuracy"] > 0.5 and report["real_tokens_per_sec"] is not None
    assert abs(report["eval_accuracy"] - reference["eval_accuracy"]) < 0.08, (
        report["eval_accuracy"], reference["eval_accuracy"])


FIT = '''
import json, sys
import keras
import tfspeed, tfspeed.data
data, model_dir = sys.argv[1], sys.argv[2]
train = tfspeed.data.build(data, "train", 16, training=True, batching="bucket")
validation = tfspeed.data.build(data, "validation", 16, batching="bucket")

def build():
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    segments = keras.Input((None,), dtype="int32", name="segment_ids")
    positions = keras.Input((None,), dtype="int32", name="positions")
    x = keras.layers.Embedding(2000, 16, mask_zero=True)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    logits = keras.layers.Reshape((1, 3))(keras.layers.Dense(3)(x))
    return keras.Model({"tokens": tokens, "segment_ids": segments, "positions": positions},
                       logits)

report = tfspeed.fit(build, train, validation, steps=30, model_dir=model_dir,
                     learning_rate=0.01)
print(json.dumps({"backend": report["runtime"]["backend"], "loss": report["eval_metrics"]["loss"],
                  "updates": report["optimizer_updates"]}))
'''


def test_fit_on_jax_trains_a_masked_keras_model_on_bucketed_text(short_texts, tmp_path):
    done = subprocess.run([sys.executable, "-c", FIT, short_texts, str(tmp_path / "fit")],
                          cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax" and result["updates"] == 30
    assert np.isfinite(result["loss"])


def test_a_backend_without_an_engine_is_one_line(digits_dir, tmp_path):
    env = {**_env(), "KERAS_BACKEND": "numpy"}
    done = subprocess.run([sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
                           f"--model_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: KERAS_BACKEND=numpy: tfspeed's engine runs on tensorflow and jax")


def test_tune_on_jax_is_one_line_naming_the_backend_to_use(digits_dir, tmp_path):
    done = subprocess.run([sys.executable, "-m", "tfspeed.tune", f"--data_dir={digits_dir}",
                           f"--model_dir={tmp_path / 'run'}"], cwd=REPO, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: KERAS_BACKEND=jax: tune times its candidates with "
                           "TensorFlow's step") and "KERAS_BACKEND=tensorflow" in last

