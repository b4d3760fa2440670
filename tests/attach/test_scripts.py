"""Users' own training scripts, unchanged, under python -m tfspeed.run and tfspeed.diagnose."""

import json
import os
import sys

import pytest

from tests import forked
from tests.conftest import REPO, write_photos

TUTORIAL = '''
"""The Keras image tutorial, as users write it."""
import argparse
import keras

parser = argparse.ArgumentParser()
parser.add_argument("--data", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--epochs", type=int, default=3)
args = parser.parse_args()
train = keras.utils.image_dataset_from_directory(
    args.data, image_size=(32, 32), batch_size=8, seed=1, validation_split=0.25,
    subset="training", verbose=False)
val = keras.utils.image_dataset_from_directory(
    args.data, image_size=(32, 32), batch_size=8, seed=1, validation_split=0.25,
    subset="validation", verbose=False)
model = keras.Sequential([keras.Input((32, 32, 3)), keras.layers.Rescaling(1 / 255),
                          keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.GlobalAveragePooling2D(),
                          keras.layers.Dense(len(train.class_names))])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])


class Begins(keras.callbacks.Callback):
    begins = 0

    def on_epoch_begin(self, epoch, logs=None):
        Begins.begins += 1


history = model.fit(train, validation_data=val, epochs=args.epochs, callbacks=[Begins()],
                    verbose=0)
loss, accuracy = model.evaluate(val, verbose=0)
predictions = model.predict(val, verbose=0)
model.save(args.out)
again = keras.saving.load_model(args.out)
print(f"SCRIPT epochs={len(history.history['val_accuracy'])} begins={Begins.begins} "
      f"predictions={predictions.shape[0]} reloaded={again.count_params() == model.count_params()}")
'''

ARRAYS = '''
"""NumPy arrays straight to fit: the digits."""
import keras
from sklearn.datasets import load_digits

digits = load_digits()
x, y = digits.images[..., None] / 16.0, digits.target
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                          keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(x, y, batch_size=64, epochs=3, validation_split=0.25, verbose=0)
print("SCRIPT keys", sorted(history.history), len(history.history["val_loss"]))
model.fit(x, y, batch_size=64, epochs=2, class_weight={k: 1.0 for k in range(10)}, verbose=0)
print("SCRIPT done")
'''

DIGITS = '''
"""A small CNN on the digits, as users write it: tf.data, callbacks, evaluate, save, reload."""
import json
import sys

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

digits = load_digits()
x, y = (digits.images[..., None] / 16.0).astype("float32"), digits.target
train = tf.data.Dataset.from_tensor_slices((x[:256], y[:256])).shuffle(256, seed=1).batch(32)
val = tf.data.Dataset.from_tensor_slices((x[256:336], y[256:336])).batch(32)
keras.utils.set_random_seed(1)
model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                          keras.layers.Flatten(), keras.layers.Dense(10, activation="softmax")])
model.compile(keras.optimizers.Adam(1e-2), "sparse_categorical_crossentropy",
              metrics=["accuracy"])
events = []


class Events(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        events.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        events.append(f"begin {epoch}")

    def on_epoch_end(self, epoch, logs=None):
        events.append(f"end {epoch} {sorted(logs)}")

    def on_train_end(self, logs=None):
        events.append("train_end")


class StopAfter(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.stop_training = epoch == 1


history = model.fit(train, validation_data=val, epochs=3, callbacks=[Events()], verbose=0)
stopped = model.fit(train, validation_data=val, epochs=5, callbacks=[StopAfter()], verbose=0)
loss, accuracy = model.evaluate(val, verbose=0)
predicted = model.predict(val, verbose=0)
model.save(sys.argv[1])
again = keras.models.load_model(sys.argv[1])
print("SCRIPT " + json.dumps({
    "keys": sorted(history.history), "epoch": history.epoch, "params": history.params,
    "same_model": history.model is model, "val_accuracy": history.history["val_accuracy"],
    "val_loss": history.history["val_loss"],
    "events": events, "stopped_epochs": stopped.epoch, "evaluate": accuracy,
    "reloaded": bool(np.allclose(again.predict(val, verbose=0), predicted, atol=1e-5)),
    "iterations": int(model.optimizer.iterations)}))
'''

# The digits with a map before their seeded shuffle: tfspeed.optimize stores the map's output.
MAPPED = DIGITS.replace(".shuffle(256, seed=1)", ".map(lambda a, b: (a * 2 - 1, b)).shuffle(256, seed=1)")
# The script looks at a batch and adapts a layer on its training data before fit: its shuffle
# has drawn two orders when fit starts, and the rebuilt one must go on from there.
PEEKED = MAPPED.replace("keras.utils.set_random_seed(1)", """keras.utils.set_random_seed(1)
print("batch", next(iter(train))[0].shape)
keras.layers.Normalization().adapt(train.map(lambda a, b: a))""")

FALLBACKS = '''
"""fit calls the engine does not take: each runs on Keras' fit, with one line."""
import keras
import tensorflow as tf
from sklearn.datasets import load_digits

digits = load_digits()
x, y = (digits.images.reshape(-1, 64) / 16.0).astype("float32"), digits.target % 2
data = tf.data.Dataset.from_tensor_slices((x[:128], y[:128])).batch(32)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1, activation="sigmoid")])
model.compile("adam", "binary_crossentropy", metrics=[keras.metrics.AUC()])
model.fit(data, epochs=2, verbose=0)
model.compile("adam", "binary_crossentropy", metrics=["accuracy"])
model.fit(data, epochs=3, initial_epoch=1, class_weight={0: 1.0, 1: 2.0}, verbose=0)
print("SCRIPT done")
'''

COMPUTE = '''
"""A convolution-heavy model on arrays held in memory: the step, not the input, sets the pace."""
import keras
import numpy as np
import tensorflow as tf

x = np.random.default_rng(0).random((512, 32, 32, 3), dtype="float32")
y = np.arange(512) % 10
train = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
model = keras.Sequential([keras.Input((32, 32, 3)),
                          keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                          keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
                          keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(train, epochs=2, verbose=0)
'''


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripts")
    photos = write_photos(root / "photos", classes=2, per_class=16)
    (root / "tutorial.py").write_text(TUTORIAL)
    (root / "arrays.py").write_text(ARRAYS)
    (root / "digits.py").write_text(DIGITS)
    (root / "fallbacks.py").write_text(FALLBACKS)
    (root / "compute.py").write_text(COMPUTE)
    (root / "nofit.py").write_text("print('no training here')\n")
    return root, str(photos)


def tfspeed(command, *args, cwd, cache, backend="tensorflow"):
    """``python -m tfspeed.COMMAND ARGS`` (``command`` None: ``python ARGS``, as written)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO),
           "TFSPEED_CACHE_DIR": str(cache), "KERAS_BACKEND": backend}
    head = ["-m", f"tfspeed.{command}"] if command else []
    return forked.run([sys.executable, *head, *args], cwd=cwd, env=env, timeout=300)


def script_figures(done) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("SCRIPT "))
    return json.loads(line[len("SCRIPT "):])


def test_the_tutorial_script_runs_unchanged_and_replays_its_store_on_the_next_run(scripts):
    root, photos = scripts
    args = ["tutorial.py", f"--data={photos}", f"--out={root / 'model.keras'}"]
    first = tfspeed("run", "--min_engine_seconds=0", *args, cwd=root, cache=root / "cache")
    assert first.returncode == 0, first.stderr[-2000:]
    # The script's own figures: history keys, callbacks, evaluate, predict and a stock reload.
    assert "SCRIPT epochs=3 begins=3 predictions=8 reloaded=True" in first.stdout
    assert "examples/s on Keras (epoch 1 on Keras' fit (storing the optimised data" in first.stdout
    assert "on tfspeed's engine" in first.stdout and "x: storing the deterministic part" in first.stdout
    second = tfspeed("run", *args, cwd=root, cache=root / "cache")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "SCRIPT epochs=3 begins=3" in second.stdout
    # By default a fit whose later epochs are a few seconds on Keras stays there: the
    # engine's setup and compile would cost more than they save.
    assert "too short to repay the engine's setup and compile" in second.stdout
    assert "x: replaying the stored" in second.stdout or "kept in RAM" in second.stdout


# The tutorial with its photos moved away once epoch 1 has read them: as written, epoch 2
# cannot find them; every epoch that reads what tfspeed.optimize stored does not need them.
MOVED = TUTORIAL.replace("callbacks=[Begins()]", "callbacks=[Begins(), MoveAway()]").replace(
    "history = model.fit(", """import os


class MoveAway(keras.callbacks.Callback):  # and back when fit ends, for evaluate and predict
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            os.rename(args.data, args.data + "-away")

    def on_train_end(self, logs=None):
        os.rename(args.data + "-away", args.data)
        print("MOVED BACK")


history = model.fit(""", 1)


def test_a_short_fit_stays_on_keras_and_every_epoch_reads_the_optimised_data(scripts):
    """The default (no flags): a fit whose later epochs are a few seconds stays on Keras'
    fit, one run of it, and those epochs read the store epoch 1 wrote, not the files."""
    root, _ = scripts
    assert MOVED != TUTORIAL
    (root / "moved.py").write_text(MOVED)
    photos = write_photos(root / "photos-moved", classes=2, per_class=16)
    done = tfspeed("run", "moved.py", f"--data={photos}", f"--out={root / 'moved.keras'}",
                   cwd=root, cache=root / "cache-moved")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "MOVED BACK" in done.stdout and "SCRIPT epochs=3 begins=3 predictions=8" in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("tfspeed.run")]
    assert "epoch 1 on Keras' fit (storing the optimised data as it reads it); epochs 2-3 " \
        "stayed on Keras' fit: the 2 epochs left would take" in line, line


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_the_step_runs_on_tfspeeds_engine_and_the_script_sees_what_keras_gives(
        scripts, backend):
    root, _ = scripts
    written = script_figures(tfspeed(None, "digits.py", str(root / f"w-{backend}.keras"),
                                     cwd=root, cache=root / "cache-w", backend=backend))
    done = tfspeed("run", "--min_engine_seconds=0", "digits.py",
                   str(root / f"t-{backend}.keras"), cwd=root,
                   cache=root / "cache-t", backend=backend)
    through = script_figures(done)
    # Callbacks in Keras' order with val_* per epoch, History's keys, epochs and params, a
    # callback's stop honoured, the optimizer's updates counted on from Keras' epoch 1.
    for key in ("keys", "epoch", "params", "same_model", "events", "stopped_epochs",
                "iterations"):
        assert through[key] == written[key], key
    assert len(through["val_accuracy"]) == 3 and through["reloaded"] is True
    lines = [line for line in done.stdout.splitlines() if line.startswith("tfspeed.run: fit")]
    assert len(lines) == 2 and all("on tfspeed's engine" in line for line in lines), lines
    assert "epoch 3 on tfspeed's engine" in lines[0]
    if backend == "tensorflow":  # the default keeps these short fits on Keras' own fit,
        # on the stored data (a map before the shuffle): the same seeded orders, the same
        # numbers as written, though the script iterated its data before fit (PEEKED)
        assert MAPPED != DIGITS and PEEKED != MAPPED
        (root / "peeked.py").write_text(PEEKED)
        runs = [tfspeed(*head, "peeked.py", str(root / "m.keras"), cwd=root,
                        cache=root / "cache-m") for head in ([None], ["run"])]
        figures = [script_figures(run) for run in runs]
        assert figures[0]["val_loss"] == figures[1]["val_loss"]
        assert figures[0]["evaluate"] == figures[1]["evaluate"]
        first, second = [line for line in runs[1].stdout.splitlines()
                         if line.startswith("tfspeed.run: fit")]
        assert "epoch 1 on Keras' fit (storing the optimised data" in first, first
        assert "epoch 1 on Keras' fit (replaying the store an earlier fit wrote)" in second
        assert "x: the dataset an earlier fit optimised (storing" in second, second


def test_what_the_engine_cannot_take_runs_on_keras_fit_with_one_line(scripts):
    root, _ = scripts
    done = tfspeed("run", "fallbacks.py", cwd=root, cache=root / "cache-f")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "SCRIPT done" in done.stdout and "Traceback" not in done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("tfspeed.run: fit")]
    assert len(lines) == 2, done.stdout
    assert lines[0].endswith("the step ran on Keras' own fit: metric auc (AUC) is not a mean "
                             "of per-example values")
    assert lines[1].endswith("the step ran on Keras' own fit: fit(class_weight=...) is "
                             "Keras' own")
    assert lines[1].startswith("tfspeed.run: fit 2: epoch 2 "), lines[1]  # from initial_epoch


def test_diagnose_gives_a_verdict_on_the_scripts_first_fit_and_stops_it(scripts):
    root, photos = scripts
    done = tfspeed("diagnose", "--diagnose_seconds=2", "tutorial.py", f"--data={photos}",
                   "--out=unused.keras", cwd=root, cache=root / "cache-d")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tfspeed diagnose: " in done.stdout and "next steps, by expected gain:" in done.stdout
    assert "SCRIPT" not in done.stdout  # the script stopped at its first fit
    result = json.loads((root / "tfspeed_diagnose" / "diagnose.json").read_text())
    assert set(result["ms_per_batch"]) >= {"input_alone", "step_alone", "together"}
    assert result["verdict"].startswith(("input-bound", "compute-bound"))
    assert result["pipeline"]["storable"] is True


def test_diagnose_says_a_compute_bound_script_is_not_limited_by_its_input(scripts):
    root, _ = scripts
    done = tfspeed("diagnose", "--diagnose_seconds=2", "compute.py", cwd=root,
                   cache=root / "cache-c")
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((root / "tfspeed_diagnose" / "diagnose.json").read_text())
    assert result["verdict"] == "compute-bound: the input is not your limit", result["why"]
    assert "COMPUTE-BOUND: THE INPUT IS NOT YOUR LIMIT" in done.stdout
    # The step-side figures that would help: XLA, a larger batch and steps per call
    # measured, precision named.
    advice = " ".join(step["advice"] for step in result["next_steps"])
    assert "under XLA" in advice or "XLA measured" in advice
    assert "a batch twice as large" in advice and "steps_per_execution=8" in advice
    assert "mixed precision" in advice
    assert not any("optimize" in step["advice"] for step in result["next_steps"])


def test_arrays_are_diagnosed_and_batched_as_keras_does_for_the_engine(scripts):
    """NumPy arrays with validation_split go to the engine as the batches Keras' own fit
    makes of them (its split, batch size and reshuffling); a fit with class weights stays on
    Keras' fit with the arrays as written."""
    root, _ = scripts
    done = tfspeed("diagnose", "--diagnose_seconds=1", "arrays.py", cwd=root,
                   cache=root / "cache-a")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step alone" in done.stdout
    ran = tfspeed("run", "--min_engine_seconds=0", "arrays.py", cwd=root,
                  cache=root / "cache-a")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "SCRIPT keys ['loss', 'val_loss'] 3" in ran.stdout and "SCRIPT done" in ran.stdout
    first, second = [line for line in ran.stdout.splitlines()
                     if line.startswith("tfspeed.run: fit")]
    assert "on tfspeed's engine" in first, first
    assert ("x: 1347 examples in NumPy arrays as Keras batches them (64 a batch, reshuffled "
            "every epoch); validation_data: 450 examples (the last 25% of them)") in first
    assert "x is NumPy arrays with sample or class weights: fed by Keras as written" in second
    assert second.endswith("the step ran on Keras' own fit: x is a ndarray, not a "
                           "tf.data.Dataset"), second


@pytest.mark.parametrize("command, script, message", [
    ("diagnose", "nofit.py", "nofit.py ended without calling model.fit"),
    ("run", "train.txt", "train.txt: not a Python script"),
    ("run", "--min_engine_seconds=soon", "its options are --cache_dir=DIR, --min_engine"),
])
def test_a_script_tfspeed_cannot_use_is_one_line(scripts, command, script, message):
    root, _ = scripts
    done = tfspeed(command, script, cwd=root, cache=root / "cache-e")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert message in done.stderr.strip().splitlines()[-1]


def test_diagnose_takes_its_seconds_before_the_script_and_says_what_it_takes(scripts):
    root, _ = scripts
    done = tfspeed("diagnose", "--diagnose_seconds=soon", "nofit.py", cwd=root,
                   cache=root / "cache-e")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: python -m tfspeed.diagnose --diagnose_seconds=soon: before a script, its one "
        "option is --diagnose_seconds=SECONDS (a number over 0)")
    # Given well, it is taken: the verdict tests above run with it.
