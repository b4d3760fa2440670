"""tfspeed.optimize(ds, model): uint8 images out of the pipeline, scaled inside the model, with
the same numbers; and where that is not exact, one line that says why."""

import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfspeed
from tests.conftest import write_photos
from tfspeed.attach import dtypes
from tfspeed.attach.optimize import optimize
from tfspeed.errors import UsageError

SIZE = 16
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]  # ImageNet's, as tutorials write them
SCALES = {
    "divide": lambda x, y: (tf.cast(x, tf.float32) / 255.0, y),
    "convert_image_dtype": lambda x, y: (tf.image.convert_image_dtype(x, tf.float32), y),
    "rescaling": lambda x, y: (keras.layers.Rescaling(1 / 127.5, offset=-1)(x), y),
    "normalise": lambda x, y: ((tf.cast(x, tf.float32) / 255.0 - MEAN) / STD, y),
}


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    return str(write_photos(tmp_path_factory.mktemp("photos"), classes=2, per_class=6))


def stored_uint8(folder, scale, batch=4):
    """decode -> resize -> cast to uint8, then a map that scales to float32: the target."""
    files = tf.data.Dataset.list_files(os.path.join(folder, "*", "*.jpg"), shuffle=False)

    def load(path):
        image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
        label = tf.strings.to_number(tf.strings.split(
            tf.strings.split(path, os.sep)[-2], "_")[-1], tf.int32)
        return tf.cast(tf.image.resize(image, (SIZE, SIZE)), tf.uint8), label

    ds = files.map(load, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.map(scale, num_parallel_calls=tf.data.AUTOTUNE).batch(batch).prefetch(2)


def small_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SIZE, SIZE, 3))
    x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    outputs = keras.layers.Dense(2)(keras.layers.GlobalAveragePooling2D()(x))
    model = keras.Model(inputs, outputs)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(
        from_logits=True))
    return model


def dtypes_lines(report):
    return [line for line in report.changed + report.unchanged if line.startswith("dtypes:")]


@pytest.mark.parametrize("name", list(SCALES))
def test_uint8_images_and_the_returned_model_give_bit_identical_outputs_and_losses(
        name, photo_folder, tmp_path):
    model = small_model()
    train, adapted = optimize(stored_uint8(photo_folder, SCALES[name]), model,
                              cache_dir=str(tmp_path), quiet=True)
    assert train.element_spec[0].dtype == tf.uint8
    assert train.element_spec[1] == stored_uint8(photo_folder, SCALES[name]).element_spec[1]
    assert adapted is not model and adapted.compiled
    (line,) = dtypes_lines(train.tfspeed_report)
    assert "images leave as uint8" in line and "cast(x, float32)" in line
    # Inside the compiled step (where Grappler would fold x / 255 into x * (1/255)).
    np.testing.assert_array_equal(adapted.predict(train, verbose=0),
                                  model.predict(stored_uint8(photo_folder, SCALES[name]),
                                                verbose=0))
    assert adapted.evaluate(train, verbose=0) == model.evaluate(
        stored_uint8(photo_folder, SCALES[name]), verbose=0)


def test_training_the_returned_model_trains_the_users_model_as_the_float_pipeline_would(
        photo_folder, tmp_path):
    scale = SCALES["normalise"]
    theirs, ours = small_model(), small_model()
    start = [w.copy() for w in ours.get_weights()]
    train, adapted = optimize(stored_uint8(photo_folder, scale), ours,
                              cache_dir=str(tmp_path), quiet=True)
    ran = adapted.fit(train, epochs=2, verbose=0).history["loss"]
    assert ran == theirs.fit(stored_uint8(photo_folder, scale), epochs=2, verbose=0).history["loss"]
    assert any(not np.array_equal(a, b) for a, b in zip(start, ours.get_weights(), strict=True))
    for a, b in zip(theirs.get_weights(), ours.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


def test_without_a_model_the_store_holds_uint8_and_the_floats_come_back_the_same(
        photo_folder, tmp_path):
    scale = SCALES["divide"]
    first = optimize(stored_uint8(photo_folder, scale), cache_dir=str(tmp_path), quiet=True)
    assert first.element_spec == stored_uint8(photo_folder, scale).element_spec
    assert any("store holds uint8" in line for line in dtypes_lines(first.tfspeed_report))
    expected = [tuple(np.asarray(t) for t in e) for e in stored_uint8(photo_folder, scale)]
    for _ in range(2):  # the epoch that writes the store, then one that reads it
        got = [tuple(np.asarray(t) for t in e) for e in first]
        assert all(np.array_equal(a, b) for p, q in zip(got, expected, strict=True)
                   for a, b in zip(p, q, strict=True))
    later = optimize(stored_uint8(photo_folder, scale), cache_dir=str(tmp_path), quiet=True,
                     probe_seconds=0.1)
    assert later.tfspeed_report.state == "complete"
    stored = dtypes.find(stored_uint8(photo_folder, scale)).uint8
    assert stored.element_spec[0].dtype == tf.uint8  # what the store holds
    assert [np.asarray(e[0]).tobytes() for e in later] == [a.tobytes() for a, _ in expected]


def keras_tutorial(folder):
    return keras.utils.image_dataset_from_directory(folder, image_size=(SIZE, SIZE),
                                                    batch_size=4, seed=1, verbose=False)


def resized_then_scaled(folder):
    files = tf.data.Dataset.list_files(os.path.join(folder, "*", "*.jpg"), shuffle=False)
    return files.map(lambda p: (tf.image.resize(tf.io.decode_jpeg(tf.io.read_file(p),
                                                                   channels=3), (SIZE, SIZE))
                                / 255.0, 0)).batch(4)


def made_and_scaled_in_one_map(folder):
    files = tf.data.Dataset.list_files(os.path.join(folder, "*", "*.jpg"), shuffle=False)
    return files.map(lambda p: (tf.cast(tf.cast(tf.image.resize(tf.io.decode_jpeg(
        tf.io.read_file(p), channels=3), (SIZE, SIZE)), tf.uint8), tf.float32) / 255.0,
        0)).batch(4)


@pytest.mark.parametrize("make, words", [
    (keras_tutorial, "leave a resize (ResizeBilinear) as fractional float32, as "
                     "keras.utils.image_dataset_from_directory's do"),
    (lambda f: keras_tutorial(f).map(lambda x, y: (x / 255.0, y)),
     "come from before its last map (e.g. tf.image.resize, which interpolates)"),
    (resized_then_scaled, "leave a resize (ResizeBilinear)"),
    (made_and_scaled_in_one_map, "made uint8 and scaled in the same map"),
    (lambda f: stored_uint8(f, lambda x, y: (tf.cast(x, tf.float32) * np.ones(
        (1, SIZE, SIZE, 3), np.float32), y)), "its scale changes the images' shape"),
    (lambda f: tf.data.Dataset.range(8).map(lambda i: (i, i)).batch(2),
     "no float output leaves its last map"),
])
def test_an_inexact_or_unreadable_scale_keeps_the_users_model_and_says_why(
        make, words, photo_folder, tmp_path):
    model = small_model()
    out, same = optimize(make(photo_folder), model, cache_dir=str(tmp_path), quiet=True)
    assert same is model
    assert out.element_spec == make(photo_folder).element_spec
    (line,) = dtypes_lines(out.tfspeed_report)
    assert line.startswith("dtypes: images leave the pipeline as they did: ") and words in line


def test_a_model_with_its_own_train_step_is_not_wrapped(photo_folder, tmp_path):
    class Custom(keras.Model):
        def train_step(self, data):
            return super().train_step(data)

    inputs = keras.Input((SIZE, SIZE, 3))
    model = Custom(inputs, keras.layers.Dense(2)(keras.layers.Flatten()(inputs)))
    out, same = optimize(stored_uint8(photo_folder, SCALES["divide"]), model,
                         cache_dir=str(tmp_path), quiet=True)
    assert same is model and out.element_spec[0].dtype == tf.float32
    assert any("overrides train_step" in line for line in dtypes_lines(out.tfspeed_report))


def test_anything_but_a_keras_model_is_one_line(photo_folder):
    with pytest.raises(UsageError, match="model must be a keras.Model, got str"):
        optimize(stored_uint8(photo_folder, SCALES["divide"]), "model.keras")


def test_help_says_a_model_gives_a_tuple_back():
    assert "tuple ``(dataset, model)``" in tfspeed.optimize.__doc__
    assert "train, model = tfspeed.optimize(train, model)" in tfspeed.optimize.__doc__


def test_the_returned_model_saves_and_reloads_with_the_same_numbers(photo_folder, tmp_path):
    scale = SCALES["normalise"]
    train, adapted = optimize(stored_uint8(photo_folder, scale), small_model(),
                              cache_dir=str(tmp_path), quiet=True)
    adapted.save(tmp_path / "adapted.keras")
    again = keras.models.load_model(tmp_path / "adapted.keras")
    batch = next(iter(train))[0]
    np.testing.assert_array_equal(again.predict(batch, verbose=0),
                                  adapted.predict(batch, verbose=0))


ON_JAX = """
import os, sys
import keras, numpy as np, tensorflow as tf
from tests.attach.test_dtypes import SCALES, small_model, stored_uint8
from tfspeed.attach.optimize import optimize
assert keras.backend.backend() == "jax"
folder, cache = sys.argv[1:]
theirs, ours = small_model(), small_model()
train, adapted = optimize(stored_uint8(folder, SCALES["normalise"]), ours, cache_dir=cache,
                          quiet=True)
assert np.array_equal(adapted.predict(train, verbose=0),
                      theirs.predict(stored_uint8(folder, SCALES["normalise"]), verbose=0))
assert adapted.fit(train, verbose=0).history == theirs.fit(
    stored_uint8(folder, SCALES["normalise"]), verbose=0).history
print("same numbers")
"""


def test_on_jax_the_returned_model_gives_the_same_numbers(photo_folder, tmp_path):
    """XLA turns a division by a broadcast scalar into a multiplication by its reciprocal
    (126 of the 256 values of x / 255 differ): the model looks the values up instead."""
    import sys

    from tests import forked
    from tests.conftest import REPO

    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": str(REPO)}
    done = forked.run([sys.executable, "-c", ON_JAX, photo_folder, str(tmp_path)], env=env,
                      timeout=300, cwd=str(REPO))
    assert done.stdout.strip().endswith("same numbers"), done.stderr[-2000:]
