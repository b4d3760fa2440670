"""``tfspeed.fit`` as a Keras user meets it: a model the labels do not fit fails in one line
before any step (the precision probe's included), Keras callbacks are called as Keras' own
``fit`` calls them, and ``help(tfspeed.fit)`` shows the real parameters."""

import inspect
import logging
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfspeed
from tests import forked
from tests.conftest import REPO
from tfspeed.errors import UsageError

TOO_FEW = r"the model outputs 2 classes, but train's labels reach 2; end the model with " \
          r"keras.layers.Dense\(3\)"


def _three_classes(n=96, batch=16):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return tf.data.Dataset.from_tensor_slices((x, np.arange(n) % 3)).batch(batch)


def _two_outputs():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])


# "measure" runs the precision probe on any host; None (auto) runs it on a host with native
# bfloat16 (this one, where oneDNN is on), and skips it elsewhere.
@pytest.mark.parametrize("precision", ["measure", None])
def test_a_model_function_with_too_few_outputs_fails_in_one_line_before_the_probe(
        tmp_path, precision, caplog):
    caplog.set_level(logging.INFO, logger="absl")
    with pytest.raises(UsageError, match=TOO_FEW) as raised:
        tfspeed.fit(_two_outputs, _three_classes(), steps=2, precision=precision,
                    model_dir=str(tmp_path))
    assert "\n" not in str(raised.value) and raised.value.__cause__ is None
    # The data and the model are checked first: no probe timed a step of the wrong model.
    assert not [r for r in caplog.records if "precision probe: first call" in r.getMessage()]


FIT_SCRIPT = """
import keras, numpy as np, tensorflow as tf, tfspeed
x = np.random.default_rng(0).normal(size=(96, 4)).astype(np.float32)
train = tf.data.Dataset.from_tensor_slices((x, np.arange(96) % 3)).batch(16)
tfspeed.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]), train,
            steps=2, model_dir="run")
"""


def test_what_a_script_with_too_few_outputs_shows(tmp_path):
    """The user's own script, default precision: the UsageError's line, never TensorFlow's
    InvalidArgumentError and its traceback."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO)}
    done = forked.run([sys.executable, "-c", FIT_SCRIPT], cwd=tmp_path, env=env, timeout=180)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfspeed.errors.UsageError: the model outputs 2 classes, but "
                           "train's labels reach 2"), done.stderr[-3000:]
    assert "InvalidArgumentError" not in done.stderr
    assert "During handling of the above exception" not in done.stderr


class Recorder(keras.callbacks.Callback):
    """Every hook Keras' fit calls, in order, with the keys of its logs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def _add(self, hook, index=None, logs=None):
        self.calls.append((hook, index, sorted(logs or {})))

    def on_train_begin(self, logs=None):
        self._add("train_begin", None, logs)

    def on_epoch_begin(self, epoch, logs=None):
        self._add("epoch_begin", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._add("batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._add("batch_end", batch, logs)
        self.batch_logs = logs

    def on_epoch_end(self, epoch, logs=None):
        self._add("epoch_end", epoch, logs)
        self.epoch_logs = logs

    def on_train_end(self, logs=None):
        self._add("train_end", None, logs)


def test_keras_callbacks_hear_every_hook_in_keras_order(tmp_path):
    """2 epochs of 6 batches in calls of up to 3 (steps_per_execution): each call is one
    batch_begin/batch_end pair with the epoch's batch indices, as Keras' fit does; epoch logs
    hold the loss and metrics, and val_* where an evaluation fell (every epoch here)."""
    train, history = _three_classes(), keras.callbacks.History()
    recorder = Recorder()
    report = tfspeed.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
                         train, train.take(2), epochs=2, steps_per_execution=3,
                         eval_every_epochs=1, precision="float32", model_dir=str(tmp_path),
                         callbacks=[recorder, history])
    epoch_keys = ["accuracy", "loss", "val_accuracy", "val_loss"]
    expected = [("train_begin", None, [])]
    # The first call runs one step (it traces the step function), then calls of 3 from there.
    for epoch, calls in enumerate([[(0, 0), (1, 2), (3, 5)], [(0, 2), (3, 5)]]):
        expected.append(("epoch_begin", epoch, []))
        for first, last in calls:
            expected += [("batch_begin", first, []), ("batch_end", last, ["accuracy", "loss"])]
        expected.append(("epoch_end", epoch, epoch_keys))
    assert recorder.calls == [*expected, ("train_end", None, epoch_keys)]
    assert recorder.model is report["model"]
    # The last epoch's val_* is the final evaluation.
    assert recorder.epoch_logs["val_loss"] == pytest.approx(report["eval_metrics"]["loss"])
    assert all(isinstance(v, float) for v in recorder.batch_logs.values())
    # keras.callbacks.History works as under Keras' fit: one value per epoch.
    assert history.epoch == [0, 1] and sorted(history.history) == epoch_keys
    assert all(len(values) == 2 for values in history.history.values())
    assert history.history["val_loss"][-1] == pytest.approx(report["eval_metrics"]["loss"])


class StopAtFirstEpoch(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = True


def test_a_callback_stops_training_as_under_keras(tmp_path):
    """``self.model.stop_training = True`` (what EarlyStopping does) ends the run after that
    epoch: the model is saved and evaluated, and the callbacks hear of the end."""
    recorder = Recorder()
    report = tfspeed.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
                         _three_classes(), epochs=3, steps_per_execution=2,
                         precision="float32", model_dir=str(tmp_path),
                         callbacks=[StopAtFirstEpoch(), recorder])
    assert report["optimizer_updates"] == report["micro_steps"] == 6
    hooks = [(hook, index) for hook, index, _ in recorder.calls]
    assert hooks[-2:] == [("epoch_end", 0), ("train_end", None)]
    assert ("epoch_begin", 1) not in hooks
    assert (tmp_path / "report.json").exists()


def test_help_shows_the_real_parameters():
    parameters = inspect.signature(tfspeed.fit).parameters
    assert list(parameters)[:3] == ["model", "train", "validation"]
    assert {"epochs", "steps", "callbacks", "precision"} <= set(parameters)
    assert "Args:" in tfspeed.fit.__doc__ and "callbacks:" in tfspeed.fit.__doc__
    assert {"fit", "split_cpu", "data", "convert", "__version__"} <= set(tfspeed.__all__)
    for name in tfspeed.__all__:
        assert getattr(tfspeed, name) is not None


def test_import_tfspeed_does_not_start_tensorflow():
    """``import tfspeed`` stays cheap: TensorFlow starts at the first call that needs it."""
    code = ("import sys, tfspeed; help(tfspeed.fit); tfspeed.data, tfspeed.convert.convert; "
            "print('tensorflow' in sys.modules); print(callable(tfspeed.data.build))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PAGER": "cat"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-2:] == ["False", "True"]
    assert "steps_per_execution" in done.stdout and "**kwargs" not in done.stdout


def test_callbacks_pair_their_hooks_while_steps_per_execution_is_tuned(tmp_path):
    """steps_per_execution=auto: the tuner's probe calls are training calls too, each one
    batch_begin/batch_end pair; every epoch begins and ends once, in order."""
    recorder = Recorder()
    report = tfspeed.fit(lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)]),
                         _three_classes(batch=8), epochs=35, precision="float32",
                         model_dir=str(tmp_path), callbacks=[recorder])
    assert report["steps_per_execution"]["probe_steps"] > 1  # the tuner probed
    hooks = [(hook, index) for hook, index, _ in recorder.calls]
    epochs = [(hook, index) for hook, index in hooks if hook.startswith("epoch")]
    assert epochs == [(f"epoch_{edge}", e) for e in range(35) for edge in ("begin", "end")]
    batches = [hook for hook, _ in hooks if hook.startswith("batch")]
    assert batches == ["batch_begin", "batch_end"] * (len(batches) // 2)
    assert hooks[0] == ("train_begin", None) and hooks[-1] == ("train_end", None)


def test_token_batches_with_too_few_outputs_fail_in_one_line(text_dirs, tmp_path):
    """Token batches (labels [batch, T], logits [batch, T, vocabulary]) are checked as plain
    ones: a language model with 16 outputs for a 300-id vocabulary."""
    train = tfspeed.data.build(text_dirs["lm"], "train", 8, batching="bucket").take(4)

    def build():
        tokens = keras.Input((None,), dtype="int32", name="tokens")
        segments = keras.Input((None,), dtype="int32", name="segment_ids")
        positions = keras.Input((None,), dtype="int32", name="positions")
        logits = keras.layers.Dense(16)(keras.layers.Embedding(300, 8)(tokens))
        return keras.Model({"tokens": tokens, "segment_ids": segments, "positions": positions},
                           logits)

    with pytest.raises(UsageError, match=r"the model outputs 16 classes, but train's labels "
                                         r"reach \d+; end the model with keras.layers.Dense"):
        tfspeed.fit(build, train, task="lm", precision="measure", model_dir=str(tmp_path))
