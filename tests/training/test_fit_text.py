"""``tfspeed.fit`` and the driver on text as a user writes it: ``tfspeed.data.build`` datasets
of every batching, a model written the standard Keras way (``Embedding(mask_zero=True)`` and
pooling), and a loss that turns NaN never ending in exit status 0."""

import json
import math
import sys

import keras
import numpy as np
import pytest

import tfspeed
from tests import forked
from tests.conftest import REPO, importable
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

# The model a Keras user writes for text classification: ids -> masked embedding -> mean of
# the real tokens -> classes, one prediction per row (S = 1, as bucketed batches give).
MASKED_MODEL = '''
import keras


def build(input_shape, num_outputs, vocab=2000):
    tokens = keras.Input((None,), dtype="int32", name="tokens")
    segment_ids = keras.Input((None,), dtype="int32", name="segment_ids")
    positions = keras.Input((None,), dtype="int32", name="positions")
    x = keras.layers.Embedding(vocab, 16, mask_zero=True)(tokens)
    x = keras.layers.GlobalAveragePooling1D()(x)
    x = keras.layers.Dense(num_outputs)(x)
    logits = keras.layers.Reshape((1, num_outputs))(x)
    return keras.Model({"tokens": tokens, "segment_ids": segment_ids, "positions": positions},
                       logits)


class _NanWhenEvaluating(keras.layers.Layer):
    def call(self, x, training=None):
        return x if training else x * float("nan")


def nan_in_eval(input_shape, num_outputs):
    model = build(input_shape, num_outputs)
    return keras.Model(model.inputs, _NanWhenEvaluating()(model.outputs[0]))
'''


@pytest.fixture(scope="module")
def masked(tmp_path_factory):
    folder = tmp_path_factory.mktemp("masked_model")
    with importable(folder, "tfspeed_masked_model", MASKED_MODEL) as where:
        import tfspeed_masked_model

        yield tfspeed_masked_model, str(where)


def _classes(data_dir):
    return schema_lib.read(data_dir).num_classes


@pytest.mark.parametrize("mode", ["bucket", "pad", "pack"])
def test_fit_takes_training_datasets_of_every_batching_with_steps(text_dirs, masked, tmp_path,
                                                                  mode):
    """``build(..., training=True)`` repeats forever: ``steps=`` bounds the run."""
    module, _ = masked
    data = text_dirs["classification"]
    train = tfspeed.data.build(data, "train", 16, training=True, batching=mode)
    validation = tfspeed.data.build(data, "validation", 16, batching=mode)
    classes = _classes(data)
    if mode == "pack":  # a packed row holds several sequences: the transformer keeps them apart
        from tfspeed.config import ModelConfig
        from tfspeed.data import text
        from tfspeed.training import models

        batching = text.resolve(tfspeed.data.DataConfig(data_dir=data, batch_size=16,
                                                        batching="pack"),
                                schema_lib.read(data))
        spec = {"vocab_size": 300, "task": "classification", "max_length": batching.max_length,
                "max_segments": batching.max_segments}

        def make():
            return models.build(ModelConfig(name="transformer", width=16, depth=1, heads=2),
                                text.input_spec(), classes, text=spec)
    else:
        def make():
            return module.build(None, classes)
    report = tfspeed.fit(make, train, validation, steps=5, model_dir=str(tmp_path),
                         precision="float32", learning_rate=0.01)
    assert report["optimizer_updates"] == 5
    assert math.isfinite(report["eval_metrics"]["loss"])
    assert 0 <= report["eval_metrics"]["accuracy"] <= 1
    # The plan's XLA rule, on the batches' shapes: packed rows (one static shape) compile.
    xla = report["plan"]["xla"]
    assert xla["value"] == (mode == "pack") and xla["source"] == "predicted", xla
    assert report["plan"]["precision"] == {"value": "float32", "reason": "--precision=float32",
                                           "source": "given"}


def test_fit_takes_a_finite_bucketed_dataset_as_it_comes(short_texts, masked, tmp_path):
    """Bucketed batches differ in rows and width: one epoch of them, never rebatched."""
    module, _ = masked
    data = short_texts
    train = tfspeed.data.build(data, "train", 16, batching="bucket")  # finite, not shuffled
    batches = list(train)
    assert len({tuple(x["tokens"].shape) for x, _ in batches}) > 1
    report = tfspeed.fit(lambda: module.build(None, _classes(data)), train, epochs=1,
                         model_dir=str(tmp_path), precision="float32")
    assert report["micro_steps"] == len(batches)


def test_a_masked_keras_model_evaluates_to_a_finite_loss(text_dirs, masked, tmp_path):
    """Evaluation fills a last short batch with empty rows (weight 0): every token masked,
    the average pooling divides 0 by 0. Their NaN must not reach the loss."""
    module, _ = masked
    data = text_dirs["classification"]
    train = tfspeed.data.build(data, "train", 16, training=True, batching="bucket")
    validation = tfspeed.data.build(data, "validation", 16, batching="bucket")
    report = tfspeed.fit(lambda: module.build(None, _classes(data)), train, validation,
                         steps=20, model_dir=str(tmp_path), precision="float32",
                         learning_rate=0.01)
    assert math.isfinite(report["eval_metrics"]["loss"])
    # The same model through the driver, its default configuration.
    out = tmp_path / "driver"
    done = _train(data, out, "--model=tfspeed_masked_model:build", module_dir=masked[1])
    assert done.returncode == 0, done.stderr[-2000:]
    assert math.isfinite(json.loads((out / "report.json").read_text())["eval_loss"])


def test_a_nan_evaluation_never_exits_0(text_dirs, masked, tmp_path):
    data = text_dirs["classification"]
    out = tmp_path / "nan"
    done = _train(data, out, "--model=tfspeed_masked_model:nan_in_eval", module_dir=masked[1])
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "the evaluation loss is NaN" in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    # Nothing is lost: the run still leaves its report and weights.
    report = json.loads((out / "report.json").read_text())
    assert report["optimizer_updates"] == 4 and (out / "model.weights.h5").exists()


def test_fit_on_a_dataset_that_is_not_token_batches_still_refuses_forever(text_dirs, masked):
    x = np.zeros((8, 3), np.float32)
    import tensorflow as tf

    endless = tf.data.Dataset.from_tensor_slices((x, np.zeros(8, np.int64))).batch(4).repeat()
    with pytest.raises(UsageError, match="repeats forever: give tfspeed.fit steps="):
        tfspeed.fit(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
                    endless, epochs=1)


def _train(data_dir, model_dir, *flags, module_dir):
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (module_dir, str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return forked.run(
        [sys.executable, "-m", "tfspeed.train", f"--data_dir={data_dir}",
         f"--model_dir={model_dir}", "--train_steps=4", "--batch_size=16", "--log_every=2",
         *flags], env=env, cwd=str(model_dir.parent), timeout=600)
