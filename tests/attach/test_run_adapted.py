"""python -m tfspeed.run with the rewrites that need the model (uint8 images, text by length),
and the engine kept only where it measures faster than Keras' fit."""

import json
import re

import pytest

from tests.attach.test_scripts import script_figures, tfspeed

UINT8 = '''
"""The digits as uint8 images, scaled to floats in the pipeline's last map, as users write it."""
import json
import re

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

digits = load_digits()
images, labels = (digits.images * 255 / 16).astype("uint8")[..., None], digits.target


def scale(x, y):
    return tf.cast(x, tf.float32) / 255.0, y


train = tf.data.Dataset.from_tensor_slices((images[:256], labels[:256])).batch(32).map(scale)
val = tf.data.Dataset.from_tensor_slices((images[256:352], labels[256:352])).batch(32).map(scale)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
history = model.fit(train, validation_data=val, epochs=4, verbose=0)
loss, accuracy = model.evaluate(val, verbose=0)
print("SCRIPT " + json.dumps({
    "keys": sorted(history.history), "epoch": history.epoch, "evaluate": accuracy,
    "val_accuracy": history.history["val_accuracy"], "same_model": history.model is model,
    "iterations": int(model.optimizer.iterations)}))


class StopAfter(keras.callbacks.Callback):  # on the user's model: the engine's model stops
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = epoch == 2


stopped = model.fit(train, validation_data=val, epochs=6, callbacks=[StopAfter()], verbose=0)
print(f"STOPPED {stopped.epoch}")
again = model.fit(train, validation_data=val, epochs=2, verbose=0)  # after a stopped fit
print(f"AGAIN {again.epoch}")
'''

TEXT = '''
"""The Keras text tutorial's shape: TextVectorization padded to a fixed length, a masked GRU."""
import json
import re

import keras
import numpy as np
import tensorflow as tf
from pydoc_data.topics import topics

lines = [line.strip() for text in topics.values() for line in text.split("\\n") if line.strip()]
texts = np.array(lines[:384])
labels = np.array([len(t.split()) % 2 for t in texts])
vectorize = keras.layers.TextVectorization(max_tokens=2000, output_sequence_length=64)
vectorize.adapt(texts)


def as_ids(t, y):
    return vectorize(t), y


train = tf.data.Dataset.from_tensor_slices((texts[:320], labels[:320])).batch(32).map(as_ids)
val = tf.data.Dataset.from_tensor_slices((texts[320:], labels[320:])).batch(32).map(as_ids)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((64,), dtype="int64"),
                          keras.layers.Embedding(2000, 8, mask_zero=True),
                          keras.layers.GRU(8), keras.layers.Dense(1, activation="sigmoid")])
# SGD: with Adam, an embedding's sparse rows keep the fit on Keras' own (test_scripts).
model.compile(keras.optimizers.SGD(0.1, momentum=0.9), "binary_crossentropy",
              metrics=["accuracy"])
history = model.fit(train, validation_data=val, epochs=3, verbose=0)
loss, accuracy = model.evaluate(val, verbose=0)
print("SCRIPT " + json.dumps({"epoch": history.epoch, "evaluate": accuracy,
                              "val_accuracy": history.history["val_accuracy"]}))
'''


# Its validation data made otherwise: floats from the start, no uint8 to send.
MIXED = UINT8.replace(
    "val = tf.data.Dataset.from_tensor_slices((images[256:352], labels[256:352])).batch(32)"
    ".map(scale)", "val = tf.data.Dataset.from_tensor_slices(((images[256:352] / 255.0)"
    ".astype('float32'), labels[256:352])).batch(32)")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapted")
    (folder / "uint8.py").write_text(UINT8)
    (folder / "mixed.py").write_text(MIXED)
    (folder / "text.py").write_text(TEXT)
    return folder


def fit_lines(done) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("tfspeed.run: fit")]


def test_uint8_images_train_the_users_model_and_its_evaluate_gives_the_reported_accuracy(root):
    done = tfspeed("run", "--min_engine_seconds=0", "--min_engine_speedup=0", "uint8.py",
                   cwd=root, cache=root / "cache-u")
    figures = script_figures(done)
    line = fit_lines(done)[0]
    assert "STOPPED [0, 1, 2]" in done.stdout
    assert "AGAIN [0, 1]" in done.stdout  # the stop of the fit before is not carried over
    assert "uint8 images, scaled inside the returned model" in line, line
    assert "on tfspeed's engine" in line, line
    # The user's own model holds the trained weights: its evaluate on the float pipeline
    # gives the accuracy the last epoch reported (the engine's, on uint8 images).
    assert figures["evaluate"] == pytest.approx(figures["val_accuracy"][-1], abs=1e-6)
    assert figures["epoch"] == [0, 1, 2, 3] and figures["same_model"] is True
    assert figures["iterations"] == 4 * 8
    assert figures["keys"] == ["accuracy", "loss", "val_accuracy", "val_loss"]


def test_validation_data_the_adapted_model_cannot_take_keeps_the_model_as_given(root):
    assert MIXED != UINT8
    done = tfspeed("run", "--min_engine_seconds=0", "--min_engine_speedup=0", "mixed.py",
                   cwd=root, cache=root / "cache-m")
    figures = script_figures(done)
    line = fit_lines(done)[0]
    assert "validation_data is not rewritten as x was" in line, line
    assert "uint8 images, scaled inside" not in line, line
    assert figures["evaluate"] == pytest.approx(figures["val_accuracy"][-1], abs=1e-6)
    assert figures["epoch"] == [0, 1, 2, 3]


def test_a_padded_text_script_is_batched_by_length_or_says_why_not(root):
    done = tfspeed("run", "--min_engine_seconds=0", "--min_engine_speedup=0", "text.py",
                   cwd=root, cache=root / "cache-t")
    figures = script_figures(done)
    (line,) = fit_lines(done)
    assert "text batched by length" in line or "text not batched by length: " in line, line
    assert "give the model" not in line, line
    assert figures["epoch"] == [0, 1, 2]
    assert figures["evaluate"] == pytest.approx(figures["val_accuracy"][-1], abs=1e-6)


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_an_engine_slower_than_keras_hands_the_remaining_epochs_back_to_keras(root, backend):
    done = tfspeed("run", "--min_engine_seconds=0", "--min_engine_speedup=1000", "uint8.py",
                   cwd=root, cache=root / f"cache-s-{backend}", backend=backend)
    figures = script_figures(done)
    line = fit_lines(done)[0]
    assert "STOPPED [0, 1, 2]" in done.stdout  # a script's stop honoured on either side
    # Judged at the engine's first epoch, or its second where the first was all compiles.
    assert re.search(r"on tfspeed's engine, epochs? [34].* back on Keras' fit: "
                     r"the engine's epoch [23] \d+ examples/s", line), line
    # One History over the 4 epochs: 1 on Keras, then the engine, then Keras again, the
    # optimizer's updates counted on, the model's evaluate the last epoch's accuracy.
    assert figures["epoch"] == [0, 1, 2, 3] and len(figures["val_accuracy"]) == 4
    assert figures["iterations"] == 4 * 8
    assert figures["evaluate"] == pytest.approx(figures["val_accuracy"][-1], abs=1e-6)
    assert json.dumps(figures["keys"]) == json.dumps(
        ["accuracy", "loss", "val_accuracy", "val_loss"])
