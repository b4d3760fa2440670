"""tfspeed.run and diagnose on scripts with more than one fit, no fit, their own errors, and
models the engine would train otherwise than Keras' fit: each run as written and through
tfspeed, in subprocesses. (Apart from test_scripts.py so that the two spread over workers.)"""

import pytest

from tests.attach.test_scripts import MAPPED, script_figures, tfspeed

# TF's text generation tutorial, small: characters of Python's own pydoc topics, an Embedding
# trained by Adam, whose gradients are sparse rows with repeated ids.
CHARS = '''
import json
import keras
import tensorflow as tf
from pydoc_data import topics

keras.utils.set_random_seed(0)
text = "\\n".join(v for _, v in sorted(topics.topics.items()))[:40_000]
ids = keras.layers.StringLookup(vocabulary=sorted(set(text)), mask_token=None)
chars = tf.data.Dataset.from_tensor_slices(ids(tf.strings.unicode_split(text, "UTF-8")))
data = chars.batch(65, drop_remainder=True).map(lambda s: (s[:-1], s[1:]))
data = data.shuffle(1000, seed=1).batch(32, drop_remainder=True)
model = keras.Sequential([keras.Input((None,), dtype="int64"),
                          keras.layers.Embedding(ids.vocabulary_size(), 32),
                          keras.layers.Dense(ids.vocabulary_size())])
model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
history = model.fit(data, epochs=3, verbose=0)
print("SCRIPT " + json.dumps({"loss": history.history["loss"]}))
'''
# Fine-tuning's second fit, as the transfer learning tutorial writes it: from the epoch the
# first ended (initial_epoch), its shuffle going on from the first's; the script's callback
# sees the epochs numbered from there.
FINETUNE = MAPPED.replace("epochs=5, callbacks=[StopAfter()]",
                          "epochs=4, initial_epoch=2, callbacks=[Events()]")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fits")
    (folder / "nofit.py").write_text("print('no training here')\n")
    (folder / "boom.py").write_text("def load():\n    raise ValueError('no such column: age')\n"
                                    "\n\nload()\n")
    (folder / "chars.py").write_text(CHARS)
    (folder / "finetune.py").write_text(FINETUNE)
    return folder


@pytest.fixture(scope="module")
def finetune_written(root) -> dict:
    return script_figures(tfspeed(None, "finetune.py", str(root / "w.keras"), cwd=root,
                                  cache=root / "cache-w"))


def _fit_lines(done) -> list[str]:
    return [line for line in done.stdout.splitlines() if line.startswith("tfspeed.run: fit")]


def test_a_fine_tuning_fit_reads_the_first_fits_optimised_dataset(root, finetune_written):
    # Once, Keras ran the second fit itself (initial_epoch) on a rewrite of its own, whose
    # shuffle drew its orders from the first again, and the model's numbers differed from
    # the script's as written (0.4625 against 0.475).
    done = tfspeed("run", "finetune.py", str(root / "f.keras"), cwd=root,
                   cache=root / "cache-ft")
    through = script_figures(done)
    assert finetune_written["stopped_epochs"] == through["stopped_epochs"] == [2, 3]
    assert finetune_written["evaluate"] == through["evaluate"]
    assert finetune_written["events"] == through["events"]
    second = _fit_lines(done)[1]
    assert "x: the dataset an earlier fit optimised (storing" in second, second
    # By default its one epoch after the first is too short for the engine: numbered as the
    # script numbers them, from initial_epoch=2 (epochs 3 and 4 of 4).
    assert "epoch 3 on Keras' fit (replaying the store an earlier fit wrote); epoch 4 stayed " \
        "on Keras' fit: the 1 epoch left would take" in second, second


def test_a_fit_from_initial_epoch_runs_its_later_epochs_on_the_engine(root, finetune_written):
    """Before, any ``initial_epoch`` kept a fit on Keras' fit. On the engine the script sees
    what Keras gives: History's epochs from initial_epoch, its callbacks' epoch numbers and
    logs, and the optimizer's updates counted on."""
    done = tfspeed("run", "--min_engine_seconds=0", "finetune.py", str(root / "e.keras"),
                   cwd=root, cache=root / "cache-fe")
    through = script_figures(done)
    for key in ("stopped_epochs", "events", "iterations", "keys", "epoch"):
        assert through[key] == finetune_written[key], key
    second = _fit_lines(done)[1]
    assert "epoch 3 on Keras' fit" in second and "on tfspeed's engine" in second, second
    assert "stayed on Keras' fit" not in second and "back on Keras' fit" not in second, second


def test_a_fit_with_the_model_reads_a_dataset_an_earlier_fit_optimised_without_it(tmp_path):
    # The other way round (class weights first, then a fit the engine could take): the same
    # rewrite, not a second one that would restart its shuffle.
    import keras
    import tensorflow as tf

    from tfspeed.attach import runner
    from tfspeed.attach.store import ENV_DIR

    data = tf.data.Dataset.range(64).map(lambda i: (tf.cast(i, tf.float32)[None], i % 2))
    data = data.shuffle(64, seed=1).batch(8)
    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
    with pytest.MonkeyPatch.context() as env:
        env.setenv(ENV_DIR, str(tmp_path))
        runner._DONE.clear()
        first = runner._once(data)
        again, given = runner._once(data, model)
        assert again is first and given is model
        runner._DONE.clear()
        with_model, _ = runner._once(data, model)
        assert runner._once(data) is with_model
        runner._DONE.clear()


def test_a_script_without_fit_runs_as_written_and_run_says_it_changed_nothing(root):
    # A loop of the user's own (GradientTape): tfspeed.run used to end in silence.
    done = tfspeed("run", "nofit.py", cwd=root, cache=root / "cache-f")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == "no training here\n"
    assert done.stderr.strip().splitlines()[-1] == (
        "tfspeed.run: nofit.py called no model.fit: it ran as written (in a training loop "
        "of your own, train = tfspeed.optimize(train) speeds up its input)")


def test_the_scripts_own_error_is_its_traceback_as_python_prints_it(root):
    # It came with tfspeed's and runpy's frames on top, as if tfspeed had failed.
    written = tfspeed(None, "boom.py", cwd=root, cache=root / "cache-b")
    for command in ("run", "diagnose"):
        done = tfspeed(command, "boom.py", cwd=root, cache=root / "cache-b")
        assert done.returncode == written.returncode == 1
        assert done.stderr.strip().splitlines() == written.stderr.strip().splitlines()
        assert "tfspeed" not in done.stderr and "runpy" not in done.stderr
