"""Your own Keras model on the engine: --model=module:function, --loss/--metrics, the Python
API, regression and named inputs. The user's model files are written by the tests."""

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
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training.run import run

USER_MODELS = '''
import keras


@keras.saving.register_keras_serializable(package="usermodels")
class Scale(keras.layers.Layer):
    """A custom layer: multiplies by a learned scalar."""

    def build(self, input_shape):
        self.factor = self.add_weight(shape=(), initializer="ones", name="factor")

    def call(self, x):
        return x * self.factor


def functional(input_shape, num_outputs):
    inputs = keras.Input(input_shape)
    x = Scale()(keras.layers.Flatten()(inputs))
    x = keras.layers.Dense(32, activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(x))


@keras.saving.register_keras_serializable(package="usermodels")
class Subclassed(keras.Model):
    def __init__(self, num_outputs=10, **kwargs):
        super().__init__(**kwargs)
        self.num_outputs = num_outputs
        self.flatten = keras.layers.Flatten()
        self.hidden = keras.layers.Dense(32, activation="relu")
        self.out = keras.layers.Dense(num_outputs, activation="softmax")

    def call(self, x):
        return self.out(self.hidden(self.flatten(x)))

    def get_config(self):
        return {**super().get_config(), "num_outputs": self.num_outputs}


def subclassed(input_shape, num_outputs):
    return Subclassed(num_outputs)


def too_few_outputs(input_shape, num_outputs):
    return keras.Sequential([keras.Input(input_shape), keras.layers.Flatten(),
                             keras.layers.Dense(num_outputs + 1)])


def named(input_shapes, num_outputs):
    inputs = {name: keras.Input(shape, name=name) for name, shape in input_shapes.items()}
    x = keras.layers.Concatenate()(list(inputs.values()))
    return keras.Model(inputs, keras.layers.Dense(num_outputs)(keras.layers.Dense(16)(x)))


def halved_mae(labels, outputs):
    return keras.ops.mean(keras.ops.abs(labels - outputs), axis=-1) / 2

not_a_function = 3
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    with importable(tmp_path_factory.mktemp("user"), "usermodels", USER_MODELS) as folder:
        yield folder


# Each model kind runs under the default strategy and under mirrored with accumulation and
# several steps per call.
EVERY_STRATEGY = pytest.mark.parametrize("where", [
    ("--strategy=default",),
    ("--strategy=mirrored", "--cpu_replicas=2", "--grad_accum_steps=2",
     "--steps_per_execution=3"),
], ids=["default", "mirrored-accum2-spe3"])


def _run(data_dir, model_dir, *extra):
    tfspeed_flags.parse(["tfspeed.train", f"--data_dir={data_dir}", f"--model_dir={model_dir}",
                         "--batch_size=16", "--train_steps=6", "--precision=float32",
                         "--learning_rate=0.01", "--log_every=2", *extra])
    return run(tfspeed_flags.to_config())


@flagsaver.flagsaver
@pytest.mark.parametrize("model", ["usermodels:functional", "usermodels:subclassed"])
@EVERY_STRATEGY
def test_own_models_train_and_reload(digits_dir, user_dir, tmp_path, model, where):
    report = _run(digits_dir, tmp_path, f"--model={model}", *where)
    k = 2 if "--grad_accum_steps=2" in where else 1
    assert report["optimizer_updates"] == 6 and report["micro_steps"] == 6 * k
    assert report["objectives"]["outputs"] == ("probabilities" if "subclassed" in model
                                               else "logits")
    assert 0 <= report["eval_accuracy"] <= 1 and np.isfinite(report["eval_loss"])
    import usermodels  # noqa: F401 -- registers the custom objects, as a user's code does

    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    batch = next(iter(tfspeed.data.build(digits_dir, "validation", 8)))[0]
    assert reloaded(batch).shape == (8, 10)


@flagsaver.flagsaver
def test_loss_and_metrics_by_name_and_by_function(digits_dir, user_dir, tmp_path):
    report = _run(digits_dir, tmp_path, "--model=mlp", "--width=8",
                  "--metrics=accuracy,sparse_top_k_categorical_accuracy")
    assert set(report["eval_metrics"]) == {"loss", "accuracy",
                                           "sparse_top_k_categorical_accuracy"}
    assert report["eval_metrics"]["sparse_top_k_categorical_accuracy"] >= report["eval_accuracy"]


@flagsaver.flagsaver
@pytest.mark.parametrize("flag, message", [
    ("--model=nosuchmodule:build", "module 'nosuchmodule' is not importable from the working "
                                   "directory or PYTHONPATH"),
    ("--model=usermodels:not_a_function", "usermodels has int (not callable) 'not_a_function'"),
    ("--model=usermodels:missing", "usermodels has no attribute 'missing'"),
    ("--model=usermodels:too_few_outputs", "outputs shape (None, 11), the task needs (None, 10)"),
    ("--loss=no_such_loss", "--loss=no_such_loss is not a Keras loss nor package.module"),
    ("--metrics=auc", "--metrics=auc is not a mean of per-example values (AUC)"),
    ("--model=usermodels", "--model='usermodels' is not one of: mlp, cnn, resnet50, "
                           "mobilenetv2, transformer, nor your own as package.module:function"),
])
def test_mistakes_with_your_own_model_are_one_line(digits_dir, user_dir, tmp_path, flag,
                                                   message):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _run(digits_dir, tmp_path, "--model=mlp", flag)


def test_a_missing_module_on_the_command_line_is_one_line(digits_dir, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    proc = forked.run([sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
                       f"--model_dir={tmp_path}", "--model=my_models:build"], cwd=REPO,
                      env=env, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "module 'my_models' is not importable" in errors[0]


def _arrays(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64)  # a learnable rule
    return x, y


def test_python_api_with_any_dataset_mirrored_accumulated(tmp_path):
    x, y = _arrays()
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    validation = tf.data.Dataset.from_tensor_slices((x[:40], y[:40])).batch(16)  # uneven

    def make():
        keras.utils.set_random_seed(5)
        return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(2)])

    seen = []

    class Epochs(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((epoch, sorted(logs)))

    # Calls of 4 micro-steps, epochs of 6: evaluating after every epoch cuts the calls there.
    settings = dict(epochs=4, strategy="mirrored", cpu_replicas=2, grad_accum_steps=2,
                    steps_per_execution=4, precision="float32", learning_rate=0.05, log_every=3)
    report = tfspeed.fit(make, train, validation, **settings, model_dir=str(tmp_path),
                         callbacks=[Epochs()], eval_every_epochs=1)
    assert report["optimizer_updates"] == 4 * 6 // 2 and report["micro_steps"] == 24
    assert report["runtime"]["num_replicas"] == 2
    assert [epoch for epoch, _ in seen] == [0, 1, 2, 3]
    assert seen[0][1] == ["accuracy", "loss", "val_accuracy", "val_loss"]
    # The last epoch's evaluation is the final one, in its logs as Keras' fit puts it.
    assert seen[3][1] == ["accuracy", "loss", "val_accuracy", "val_loss"]
    assert report["history"] and report["history"][-1]["micro_step"] == 24
    evals = report["eval_history"]
    assert [(e["epoch"], e["update"], e["micro_step"]) for e in evals] == [
        (1, 3, 6), (2, 6, 12), (3, 9, 18), (4, 12, 24)]
    assert evals[-1]["accuracy"] == report["eval_metrics"]["accuracy"]
    seconds = [e["train_seconds"] for e in evals]
    assert 0 < seconds[0] < seconds[1] < seconds[2] < seconds[3]
    assert report["seconds"]["evaluate"] == pytest.approx(sum(e["seconds"] for e in evals))
    with pytest.raises(UsageError, match="evaluates on validation=, which was not given"):
        tfspeed.fit(make, train, **settings, model_dir=str(tmp_path / "none"),
                    eval_every_epochs=1)
    # Evaluating along the way changes nothing in training: the same weights without it.
    plain = tfspeed.fit(make, train, **settings, model_dir=str(tmp_path / "plain"))
    assert plain["eval_history"] == []
    for a, b in zip(report["model"].weights, plain["model"].weights, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    # Evaluation on the 40 uneven records equals evaluating the returned model directly.
    model = report["model"]
    logits = model(x[:40]).numpy()
    assert report["eval_metrics"]["accuracy"] == pytest.approx(
        np.mean(logits.argmax(1) == y[:40]))
    # TensorBoard-compatible logs were written.
    assert list((tmp_path / "logs" / "train").glob("events.out.tfevents.*"))
    # A rerun resumes and trains nothing more.
    again = tfspeed.fit(make, train, epochs=4, strategy="mirrored", cpu_replicas=2,
                        grad_accum_steps=2, precision="float32", model_dir=str(tmp_path))
    assert again["resumed_from_update"] == again["optimizer_updates"] == 12


def test_uint8_images_with_the_scaling_layer_train_as_float32_ones(digits_dir, tmp_path):
    """tfspeed.data.build(..., image_dtype="uint8") with tfspeed.data.scaling_layer() first in
    the model trains to the weights of float32 batches (4x the bytes) without it; only the
    float32 run is told so."""
    f32 = tfspeed.data.build(digits_dir, "train", 32, training=False)
    u8 = tfspeed.data.build(digits_dir, "train", 32, training=False, image_dtype="uint8")
    (xf, _), (xu, _) = next(iter(f32)), next(iter(u8))
    assert xf.dtype == tf.float32 and xu.dtype == tf.uint8
    np.testing.assert_allclose(tfspeed.data.scaling_layer()(xu), xf, rtol=1e-6, atol=1e-7)

    def make(scaled):
        def build():
            keras.utils.set_random_seed(3)
            inputs = keras.Input(xf.shape[1:], dtype="uint8" if scaled else "float32")
            x = tfspeed.data.scaling_layer()(inputs) if scaled else inputs
            x = keras.layers.Dense(32, activation="relu")(keras.layers.Flatten()(x))
            return keras.Model(inputs, keras.layers.Dense(10)(x))
        return build

    runs = {name: tfspeed.fit(make(name == "uint8"), data, steps=12, optimizer="sgd",
                              learning_rate=0.1, precision="float32", xla="off",
                              model_dir=str(tmp_path / name))
            for name, data in (("float32", f32), ("uint8", u8))}
    for a, b in zip(runs["float32"]["model"].weights, runs["uint8"]["model"].weights,
                    strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)
    assert runs["uint8"]["input"] == {"image_dtype": "uint8"}
    told = runs["float32"]["input"]
    assert told["image_dtype"] == "float32" and "4x the bytes of uint8" in told["advice"]
    assert "tfspeed.data.scaling_layer()" in told["advice"]


def test_python_api_regression_with_a_built_model_and_function_metric(tmp_path):
    x, _ = _arrays(seed=1)
    y = (2 * x[:, 0] - x[:, 2]).astype(np.float32)
    train = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])

    def doubled_abs(labels, outputs):
        return 2 * tf.reduce_mean(tf.abs(labels - outputs), axis=-1)

    report = tfspeed.fit(model, train, train, steps=60, learning_rate=0.05,
                         metrics=["mae", doubled_abs], model_dir=str(tmp_path))
    assert report["objectives"]["task"] == "regression" and report["objectives"]["loss"] == "mse"
    metrics = report["eval_metrics"]
    assert metrics["doubled_abs"] == pytest.approx(2 * metrics["mae"], rel=1e-5)
    assert metrics["loss"] < 0.5 * float(np.var(y))  # it learned the linear target
    with pytest.raises(UsageError, match="give tfspeed.fit epochs= or steps=, not both"):
        tfspeed.fit(model, train, epochs=1, steps=3)
    with pytest.raises(UsageError, match="strategy='mirrored' needs the model built in its"):
        tfspeed.fit(model, train, steps=1, strategy="mirrored")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """Real tables: scikit-learn's diabetes (regression) and iris (named inputs), as CSV."""
    from sklearn.datasets import load_diabetes, load_iris

    from tfspeed.convert import convert

    root = tmp_path_factory.mktemp("tables")
    dirs = {}
    for name, data, options in (
        ("diabetes", load_diabetes(), {"task": "regression"}),
        ("iris", load_iris(), {"named_columns": True}),
    ):
        columns = [c.replace(" (cm)", "").replace(" ", "_") for c in data.feature_names]
        table = np.column_stack([data.data, data.target])
        path = root / f"{name}.csv"
        np.savetxt(path, table, delimiter=",", header=",".join([*columns, "target"]),
                   comments="", fmt="%.6g")
        dirs[name] = str(root / name)
        convert(f"csv:{path}", dirs[name], label_column="target", shards=4, **options)
    return dirs


@flagsaver.flagsaver
@EVERY_STRATEGY
def test_regression_with_mse_on_a_csv(tables, tmp_path, where):
    schema = tfspeed.data.read_schema(tables["diabetes"])
    assert schema.task == "regression" and schema.num_outputs == 1
    report = _run(tables["diabetes"], tmp_path, "--model=mlp", "--width=32", "--train_steps=300",
                  "--learning_rate=0.05", "--batch_size=32", *where)
    assert report["objectives"] == {"task": "regression", "loss": "mse", "metrics": ["mae"],
                                    "outputs": "logits", "output_dtype": "float32"}
    targets = np.concatenate([y for _, y in tfspeed.data.build(tables["diabetes"],
                                                              "validation", 64)])
    # Far better than always predicting the mean target (the variance of the targets).
    assert report["eval_loss"] < 0.7 * float(np.var(targets))
    assert report["eval_metrics"]["mae"] < float(np.mean(np.abs(targets - targets.mean())))


@flagsaver.flagsaver
@EVERY_STRATEGY
def test_several_named_inputs_from_a_csv(tables, user_dir, tmp_path, where):
    schema = tfspeed.data.read_schema(tables["iris"])
    assert schema.input_names == ("sepal_length", "sepal_width", "petal_length", "petal_width")
    x, _ = next(iter(tfspeed.data.build(tables["iris"], "train", 8)))
    assert sorted(x) == sorted(schema.input_names) and x["petal_width"].shape == (8, 1)
    report = _run(tables["iris"], tmp_path, "--model=usermodels:named", "--train_steps=60",
                  "--learning_rate=0.05", *where)
    assert report["eval_accuracy"] > 0.8  # iris is easy
    import usermodels  # noqa: F401

    reloaded = keras.saving.load_model(tmp_path / "model.keras")
    assert reloaded(x).shape == (8, 3)


def test_task_and_named_columns_need_a_table(tmp_path):
    from tfspeed.convert import convert

    with pytest.raises(UsageError, match="--task=regression needs numeric targets: a csv: or "
                                         "npz: source, not --source=digits"):
        convert("digits", str(tmp_path / "d"), task="regression")
    with pytest.raises(UsageError, match="--named_columns makes each CSV column a named input"):
        convert("digits", str(tmp_path / "d"), named_columns=True)


@flagsaver.flagsaver
def test_regression_with_several_targets_from_an_npz(tmp_path):
    """scikit-learn's linnerud: 3 exercise inputs, 3 physiological targets per person."""
    from sklearn.datasets import load_linnerud

    from tfspeed.convert import convert

    data = load_linnerud()
    np.savez(tmp_path / "linnerud.npz", x=data.data.astype(np.float32), y=data.target)
    convert(f"npz:{tmp_path / 'linnerud.npz'}", str(tmp_path / "data"), task="regression",
            validation_fraction=0.2, shards=2)
    schema = tfspeed.data.read_schema(str(tmp_path / "data"))
    assert (schema.task, schema.num_outputs) == ("regression", 3)
    _, y = next(iter(tfspeed.data.build(str(tmp_path / "data"), "train", 4)))
    assert y.dtype == tf.float32 and y.shape == (4, 3)
    report = _run(tmp_path / "data", tmp_path / "run", "--model=mlp", "--width=8",
                  "--batch_size=4")
    assert report["objectives"]["loss"] == "mse" and report["eval_metrics"]["mae"] > 0
    assert keras.saving.load_model(tmp_path / "run" / "model.keras").output_shape == (None, 3)
