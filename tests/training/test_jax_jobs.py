"""Keras 3 on JAX: the same jobs, ``tfspeed.fit`` and commands with ``KERAS_BACKEND=jax``
(each run a process of its own): the digits and text jobs reach the TensorFlow backend's
accuracy, and what JAX does not run is one line."""

import json
import subprocess
import sys

import numpy as np

from tests import forked
from tests.conftest import REPO
from tests.training import jax_runs as jr


def test_the_digits_job_trains_on_jax_with_its_defaults(digits_dir, tmp_path):
    """pipelines/digits.flags' job as it is (in-step input, steps per call auto, shuffled),
    a few epochs: the accuracy the TensorFlow backend reaches on the same job (within the
    noise of two differently shuffled runs), and a report that names JAX."""
    flags = ["--flagfile=pipelines/digits.flags", "--epochs=4", "--prepare_source="]
    jr.train(digits_dir, tmp_path / "jax", *flags)
    env = {**jr.env(), "KERAS_BACKEND": "tensorflow"}
    done = forked.run([sys.executable, "-m", "tfspeed.train", *flags,
                       f"--data_dir={digits_dir}", f"--model_dir={tmp_path / 'tf'}"],
                      cwd=REPO, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report, reference = jr.report(tmp_path / "jax"), jr.report(tmp_path / "tf")
    assert report["runtime"]["backend"] == "jax" and report["runtime"]["xla"]
    assert reference["runtime"]["backend"] == "tensorflow"
    assert report["input"]["placement"]["where"] == "device"
    assert report["optimizer_updates"] == reference["optimizer_updates"] > 0
    assert report["eval_accuracy"] > 0.8, report["eval_accuracy"]  # ten classes: chance is 0.1
    jr.accuracies_agree(report["eval_accuracy"], reference["eval_accuracy"], digits_dir)
    assert report["steps_per_execution"]["auto"]
    assert (tmp_path / "jax" / "model.weights.h5").exists()


def test_the_text_job_reaches_the_tensorflow_backends_accuracy(short_texts, tmp_path):
    """The same text job (short docstrings, the transformer, batching auto) on both
    backends, run side by side: JAX's accuracy is TensorFlow's within the noise of two
    differently initialised runs."""
    flags = [*jr.TINY_TEXT, "--batch_size=8", "--epochs=2", "--learning_rate=0.003",
             "--eval_every_epochs=1", f"--data_dir={short_texts}"]
    runs = {backend: forked.Popen(
        [sys.executable, "-m", "tfspeed.train", *flags, f"--model_dir={tmp_path / backend}"],
        cwd=REPO, env={**jr.env(), "KERAS_BACKEND": backend, "JAX_LOG_COMPILES": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for backend in ("jax", "tensorflow")}
    errors = {}
    for backend, proc in runs.items():
        _, errors[backend] = proc.communicate(timeout=900)
        assert proc.returncode == 0, errors[backend][-3000:]
    report, reference = jr.report(tmp_path / "jax"), jr.report(tmp_path / "tensorflow")
    # XLA compiled the training step once per program the report counts (one a bucket),
    # not again when a call's running sums came from the device instead of the host; and
    # the probes' engines (precision on a host with native bfloat16) are counted apart.
    compiles = errors["jax"].count("Finished XLA compilation of jit(_run_steps)")
    probes = sum(report["probe_compiled_programs"].values())
    assert compiles == report["compiled_programs"] + probes, (compiles, report)
    assert report["compiled_programs"] <= len(report["input"]["batching"]["boundaries"]) + 1
    assert report["runtime"]["backend"] == "jax"
    assert reference["runtime"]["backend"] == "tensorflow"
    assert report["input"]["batching"]["mode"] == reference["input"]["batching"]["mode"]
    # (Each compile counts against the run on JAX, so auto buckets into fewer widths there:
    # 6 against 24 here, the same epochs in a different number of batches.)
    assert len(report["input"]["batching"]["boundaries"]) < len(
        reference["input"]["batching"]["boundaries"])
    assert report["eval_accuracy"] > 0.5 and report["real_tokens_per_sec"] is not None
    jr.accuracies_agree(report["eval_accuracy"], reference["eval_accuracy"], short_texts)
    # An evaluation after the first pass too, on both backends (the call is cut there).
    for run in (report, reference):
        history = run["eval_history"]
        assert [entry["epoch"] for entry in history] == [1, 2], history
        assert history[-1]["accuracy"] == run["eval_accuracy"]
        assert 0 < history[0]["train_seconds"] < history[1]["train_seconds"]


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

history, batches = keras.callbacks.History(), []
seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: batches.append(logs))
report = tfspeed.fit(build, train, validation, steps=12, model_dir=model_dir,
                     learning_rate=0.01, callbacks=[history, seen])
print(json.dumps({"backend": report["runtime"]["backend"], "loss": report["eval_metrics"]["loss"],
                  "updates": report["optimizer_updates"], "epochs": history.epoch,
                  "val_loss": history.history["val_loss"], "batch_logs": batches}))
'''


def test_fit_on_jax_trains_a_masked_keras_model_on_bucketed_text(short_texts, tmp_path):
    done = forked.run([sys.executable, "-c", FIT, short_texts, str(tmp_path / "fit")],
                      cwd=REPO, env=jr.env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["backend"] == "jax" and result["updates"] == 12
    assert np.isfinite(result["loss"])
    # Keras callbacks on JAX: one epoch (12 steps of an endless dataset), its val_loss the
    # final evaluation, and a LambdaCallback's batch ends hold the loss and accuracy.
    assert result["epochs"] == [0] and result["val_loss"] == [result["loss"]]
    logs = result["batch_logs"]
    assert logs and all(sorted(b) == ["accuracy", "loss"] and np.isfinite(b["loss"]) for b in logs)


def test_a_backend_without_an_engine_is_one_line(digits_dir, tmp_path):
    env = {**jr.env(), "KERAS_BACKEND": "numpy"}
    done = subprocess.run([sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
                           f"--model_dir={tmp_path / 'run'}"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: KERAS_BACKEND=numpy: tfspeed's engine runs on tensorflow and jax")


def test_tune_on_jax_is_one_line_naming_the_backend_to_use(digits_dir, tmp_path):
    done = forked.run([sys.executable, "-m", "tfspeed.tune", f"--data_dir={digits_dir}",
                       f"--model_dir={tmp_path / 'run'}"], cwd=REPO, env=jr.env(), timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: KERAS_BACKEND=jax: tune times its candidates with "
                           "TensorFlow's step") and "KERAS_BACKEND=tensorflow" in last
