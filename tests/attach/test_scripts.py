"""Users' own training scripts, unchanged, under python -m tfspeed.run and tfspeed.diagnose."""

import json
import os
import subprocess
import sys

import pytest

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
model.fit(x, y, batch_size=64, epochs=2, verbose=0)
print("SCRIPT done")
'''


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("scripts")
    photos = write_photos(root / "photos", classes=2, per_class=16)
    (root / "tutorial.py").write_text(TUTORIAL)
    (root / "arrays.py").write_text(ARRAYS)
    (root / "nofit.py").write_text("print('no training here')\n")
    return root, str(photos)


def tfspeed(command, *args, cwd, cache):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO),
           "TFSPEED_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", f"tfspeed.{command}", *args], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=300)


def test_the_tutorial_script_runs_unchanged_and_replays_its_store_on_the_next_run(scripts):
    root, photos = scripts
    args = ["tutorial.py", f"--data={photos}", f"--out={root / 'model.keras'}"]
    first = tfspeed("run", *args, cwd=root, cache=root / "cache")
    assert first.returncode == 0, first.stderr[-2000:]
    # The script's own figures: history keys, callbacks, evaluate, predict and a stock reload.
    assert "SCRIPT epochs=3 begins=3 predictions=8 reloaded=True" in first.stdout
    assert "fit 1: epoch 1" in first.stdout and "as written while storing" in first.stdout
    second = tfspeed("run", *args, cwd=root, cache=root / "cache")
    assert second.returncode == 0, second.stderr[-2000:]
    assert "SCRIPT epochs=3 begins=3" in second.stdout
    assert "x: replaying the stored" in second.stdout or "kept in RAM" in second.stdout


def test_diagnose_gives_a_verdict_on_the_scripts_first_fit_and_stops_it(scripts):
    root, photos = scripts
    done = tfspeed("diagnose", "tutorial.py", f"--data={photos}", "--out=unused.keras",
                   cwd=root, cache=root / "cache-d")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "tfspeed diagnose: " in done.stdout and "next steps, by expected gain:" in done.stdout
    assert "SCRIPT" not in done.stdout  # the script stopped at its first fit
    result = json.loads((root / "tfspeed_diagnose" / "diagnose.json").read_text())
    assert set(result["ms_per_batch"]) >= {"input_alone", "step_alone", "together"}
    assert result["verdict"].startswith(("input-bound", "compute-bound"))
    assert result["pipeline"]["storable"] is True


def test_arrays_are_diagnosed_and_fed_as_written(scripts):
    root, _ = scripts
    done = tfspeed("diagnose", "arrays.py", cwd=root, cache=root / "cache-a")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step alone" in done.stdout
    ran = tfspeed("run", "arrays.py", cwd=root, cache=root / "cache-a")
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "SCRIPT done" in ran.stdout
    assert "is not a tf.data.Dataset (ndarray): fed by Keras as written" in ran.stdout


@pytest.mark.parametrize("command, script, message", [
    ("diagnose", "nofit.py", "nofit.py ended without calling model.fit"),
    ("run", "train.txt", "train.txt: not a Python script"),
])
def test_a_script_tfspeed_cannot_use_is_one_line(scripts, command, script, message):
    root, _ = scripts
    done = tfspeed(command, script, cwd=root, cache=root / "cache-e")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert message in done.stderr.strip().splitlines()[-1]
