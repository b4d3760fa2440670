"""One job, one engine: every engine a run builds (training, the precision probe, tune and
diagnose) trains on the job's own loss and metrics; what a run leaves behind; the checks
``tfspeed.fit`` shares with the command line."""

import json
import logging
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import flagsaver

import tfspeed
from tests import forked
from tests.conftest import REPO, importable
from tfspeed import diagnose
from tfspeed.config import TrainConfig
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training import trainer
from tfspeed.training.run import run

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def _driver(data_dir, model_dir, *extra):
    tfspeed_flags.parse(["tfspeed.train", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
                         "--model=mlp", "--width=16", "--batch_size=32", "--train_steps=40",
                         "--learning_rate=0.01", "--log_every=10", *extra])
    return run(tfspeed_flags.to_config())


# --precision=measure times float32 against the mixed policy on every machine: the probe
# that --precision=auto runs only where a CPU has native bfloat16.
@flagsaver.flagsaver
@pytest.mark.parametrize("flags, loss, metrics", [
    ((), "mse", ["mae"]),
    (("--loss={m}:halved_mse", "--metrics=mae,{m}:doubled_mae"), "{m}:halved_mse",
     ["mae", "doubled_mae"]),
], ids=["regression-default", "own-loss-and-metrics"])
def test_the_precision_probe_trains_the_jobs_own_loss(regression_dir, user_objectives, tmp_path,
                                                      flags, loss, metrics):
    flags = [f.format(m=user_objectives) for f in flags]
    report = _driver(regression_dir, tmp_path, "--precision=measure", *flags)
    assert report["runtime"]["reasons"]["precision"].startswith("measure: measured")
    assert report["objectives"]["task"] == "regression"
    assert report["objectives"]["loss"] == loss.format(m=user_objectives)
    assert set(report["eval_metrics"]) == {"loss", *metrics}
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["objectives"]["loss"] == report["objectives"]["loss"]
    if "doubled_mae" in metrics:
        assert report["eval_metrics"]["doubled_mae"] == pytest.approx(
            2 * report["eval_metrics"]["mae"], rel=1e-5)
        assert report["eval_metrics"]["loss"] > 0


@flagsaver.flagsaver
def test_the_precision_probe_keeps_a_classifiers_metrics(digits_dir, tmp_path):
    report = _driver(digits_dir, tmp_path, "--precision=measure",
                     "--metrics=accuracy,sparse_top_k_categorical_accuracy")
    assert report["runtime"]["reasons"]["precision"].startswith("measure: measured")
    assert set(report["eval_metrics"]) == {"loss", "accuracy",
                                           "sparse_top_k_categorical_accuracy"}


def test_diagnose_times_the_jobs_own_loss(regression_dir, user_objectives, tmp_path):
    with flagsaver.flagsaver():
        tfspeed_flags.parse(["tfspeed.diagnose", f"--data_dir={regression_dir}",
                             f"--model_dir={tmp_path}", "--model=mlp", "--width=8",
                             "--batch_size=32", f"--loss={user_objectives}:halved_mse",
                             "--precision=measure", "--eval_split="])
        config = tfspeed_flags.to_config()
    diagnose.run(config, diagnose.Options(steps=8, warmup=2, profile_steps=4))
    saved = json.loads((tmp_path / "diagnose" / "diagnose.json").read_text())
    assert saved["settings"]["objectives"]["loss"] == f"{user_objectives}:halved_mse"
    assert saved["settings"]["objectives"]["task"] == "regression"


def test_an_engine_without_objectives_cannot_be_built():
    from tfspeed import runtime
    from tfspeed.config import RuntimeConfig

    rt = runtime.setup(RuntimeConfig(strategy="default", precision="float32", xla="off"))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(TypeError, match="needs the job's resolved objectives"):
        trainer.make_engine(model, None, TrainConfig(), rt, 8, 10)


SUBCLASSED = '''
import keras


class Sub(keras.Model):
    """Most subclassed models in the wild: no get_config."""

    def __init__(self, n, **kw):
        super().__init__(**kw)
        self.f = keras.layers.Flatten()
        self.h = keras.layers.Dense(64, activation="relu")
        self.o = keras.layers.Dense(n, dtype="float32")

    def call(self, x, training=False):
        return self.o(self.h(self.f(x)))


def build_sub(input_shape, num_outputs):
    return Sub(num_outputs)
'''


@pytest.fixture(scope="module")
def sub_module(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("sub"), "tfspeed_sub_models", SUBCLASSED) as folder:
        yield folder


def _eval_loss(model, data_dir) -> float:
    batches = list(tfspeed.data.build(data_dir, "validation", 64, cache="none"))
    logits = np.concatenate([model(x, training=False) for x, _ in batches])
    labels = np.concatenate([y for _, y in batches])
    return float(np.mean(keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                                      from_logits=True)))


def test_a_subclassed_model_without_get_config_ends_with_its_report_and_weights(
        digits_dir, sub_module, tmp_path):
    model_dir = tmp_path / "run"
    proc = forked.run(
        [sys.executable, "-m", "tfspeed.train", "--flagfile=pipelines/digits.flags",
         f"--data_dir={digits_dir}", f"--model_dir={model_dir}", "--prepare_source=",
         "--model=tfspeed_sub_models:build_sub", "--train_steps=20", "--precision=float32"],
        cwd=REPO, env={**ENV, "PYTHONPATH": str(sub_module)}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "eval_accuracy=" in proc.stdout
    warnings = [line for line in proc.stderr.splitlines() if "model.keras not written" in line]
    assert len(warnings) == 1 and "get_config()" in warnings[0]
    report = json.loads((model_dir / "report.json").read_text())
    assert report["saved"]["model"] is None
    assert report["saved"]["weights"] == str(model_dir / "model.weights.h5")
    assert not (model_dir / "model.keras").exists()
    assert list(model_dir.glob("checkpoints/*"))
    # The portable weights load into a model rebuilt from the user's function.
    import tfspeed_sub_models

    fresh = tfspeed_sub_models.build_sub((8, 8, 1), 10)
    fresh(tf.zeros([1, 8, 8, 1]))
    fresh.load_weights(model_dir / "model.weights.h5")
    assert _eval_loss(fresh, digits_dir) == pytest.approx(report["eval_loss"], rel=1e-4)


def test_tfspeed_fit_saves_the_weights_of_a_subclassed_model(digits_dir, sub_module, tmp_path):
    import tfspeed_sub_models

    train = tfspeed.data.build(digits_dir, "train", 32, training=True)
    train = train.take(20)
    val = tfspeed.data.build(digits_dir, "validation", 64, cache="none")
    report = tfspeed.fit(lambda: tfspeed_sub_models.Sub(10), train, val, epochs=1,
                         precision="float32", model_dir=str(tmp_path))
    assert report["saved"]["model"] is None and "get_config()" in report["saved"][
        "model_not_saved"]
    fresh = tfspeed_sub_models.Sub(10)
    fresh(tf.zeros([1, 8, 8, 1]))
    fresh.load_weights(tmp_path / "model.weights.h5")
    assert _eval_loss(fresh, digits_dir) == pytest.approx(report["eval_metrics"]["loss"],
                                                          rel=1e-4)


def _pairs(n=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (np.arange(n) % 3).astype(np.int64)


def test_tfspeed_fit_refuses_a_model_with_too_few_outputs_in_one_line(tmp_path):
    x, y = _pairs()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    two = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with pytest.raises(UsageError, match=r"the model outputs 2 classes, but train's labels "
                                         r"reach 2; end the model with keras.layers.Dense\(3\)"):
        tfspeed.fit(two, train, steps=2, model_dir=str(tmp_path))


def test_tfspeed_fit_refuses_an_unbatched_dataset_in_one_line(tmp_path):
    x, y = _pairs()
    train = tf.data.Dataset.from_tensor_slices((x, y))
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    with pytest.raises(UsageError, match=r"batch it first: train.batch\(N\)"):
        tfspeed.fit(model, train, steps=2, model_dir=str(tmp_path))


def test_tfspeed_fit_on_a_finished_model_dir_says_it_resumed_at_the_end(tmp_path, caplog):
    x, y = _pairs()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)

    def build():
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    first = tfspeed.fit(build, train, steps=4, precision="float32", model_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        again = tfspeed.fit(build, train, steps=4, precision="float32", model_dir=str(tmp_path))
    assert again["resumed_from_update"] == again["optimizer_updates"] == 4
    said = [r.getMessage() for r in caplog.records if "resumed at the end" in r.getMessage()]
    assert len(said) == 1 and str(tmp_path) in said[0]
    np.testing.assert_allclose(first["model"].get_weights()[0], again["model"].get_weights()[0])


@pytest.mark.parametrize("task", ["classification", "lm"])
def test_tfspeed_fit_trains_on_token_batches_with_the_exact_loss(text_dirs, tmp_path, task):
    """Dict batches from tfspeed.data.build on text: fit resolves the per-sequence (or per real
    token) loss, as the driver does, and reports the padding it computed."""
    import tfspeed.data
    from tfspeed.training import transformer

    data_dir = text_dirs[task]
    train = tfspeed.data.build(data_dir, "train", 8, batching="pack", max_length=64,
                               tokens_per_batch=512).take(6)
    schema = tfspeed.data.read_schema(data_dir)
    vocab = schema.text["tokenizer"]["vocab_size"]
    outputs = vocab if task == "lm" else schema.num_classes

    def build():
        return transformer.build_transformer(vocab, outputs, task, width=16, depth=1, heads=2,
                                             max_length=64, max_segments=16)

    report = tfspeed.fit(build, train, task=None if task == "classification" else "lm",
                         precision="float32", model_dir=str(tmp_path))
    per = "per real token" if task == "lm" else "per sequence"
    assert report["objectives"]["loss"].endswith(f"({per})")
    assert report["optimizer_updates"] == 6
    assert 0 <= report["throughput"]["padding_fraction"] < 0.1
    assert np.isfinite(report["train_metrics"]["loss"])
