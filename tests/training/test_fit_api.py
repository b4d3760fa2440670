"""``tfspeed.fit`` as a Keras user meets it: a model the labels do not fit fails in one line
before any step (the precision probe's included), and ``help(tfspeed.fit)`` shows the real
parameters."""

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
    done = subprocess.run([sys.executable, "-c", FIT_SCRIPT], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("tfspeed.errors.UsageError: the model outputs 2 classes, but "
                           "train's labels reach 2"), done.stderr[-3000:]
    assert "InvalidArgumentError" not in done.stderr
    assert "During handling of the above exception" not in done.stderr


def test_help_shows_the_real_parameters():
    parameters = inspect.signature(tfspeed.fit).parameters
    assert list(parameters)[:3] == ["model", "train", "validation"]
    assert {"epochs", "steps", "callbacks", "precision"} <= set(parameters)
    assert "Args:" in tfspeed.fit.__doc__ and "callbacks:" in tfspeed.fit.__doc__
    assert {"fit", "split_cpu", "__version__"} <= set(tfspeed.__all__)
    for name in tfspeed.__all__:
        assert getattr(tfspeed, name) is not None


def test_import_tfspeed_does_not_start_tensorflow():
    """``import tfspeed`` stays cheap: TensorFlow starts at the first call that needs it."""
    code = "import sys, tfspeed; help(tfspeed.fit); print('tensorflow' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PAGER": "cat"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
    assert "steps_per_execution" in done.stdout and "**kwargs" not in done.stdout
