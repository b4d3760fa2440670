"""Runs of the driver on Keras' JAX backend, each in a process of its own (a process has one
Keras backend), and what they leave: the tests of test_jax*.py share them."""

import json
import os
import sys
from pathlib import Path

import numpy as np

from tests import forked
from tests.conftest import REPO, XLA_FLAGS

TINY_TEXT = ["--model=transformer", "--width=16", "--depth=1", "--heads=2"]


def env(devices: int = 1) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    env["XLA_FLAGS"] = XLA_FLAGS
    return env


def train(data_dir, model_dir, *flags, check=True):
    done = forked.run([sys.executable, "-m", "tfspeed.train", "--log_every=5", *flags,
                       f"--data_dir={data_dir}", f"--model_dir={model_dir}"], cwd=REPO,
                      env=env(), timeout=900)
    if check:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


# The driver's jobs one after another in one process: each parsed from its flags and run as
# ``python -m tfspeed.train`` runs it, in a fresh Keras session (its layers named as in a
# process of its own).
_TOGETHER = """
import json, sys
import keras
from absl import flags
from tfspeed.config import flags as tfspeed_flags
from tfspeed.training.run import run
for argv in json.loads(sys.argv[1]):
    flags.FLAGS.unparse_flags()
    tfspeed_flags.parse(["tfspeed.train", *argv])
    keras.backend.clear_session()
    run(tfspeed_flags.to_config())
"""


def train_together(*runs):
    """``train`` for each ``(data_dir, model_dir, *flags)`` of ``runs``, in order, in one JAX
    process (a JAX process takes about 25 CPU-s to start). Its CPU devices are the first
    job's ``--cpu_replicas``: list a job that splits the CPU first."""
    argvs = [["--log_every=5", *flags, f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
             for data_dir, model_dir, *flags in runs]
    done = forked.run([sys.executable, "-c", _TOGETHER, json.dumps(argvs)], cwd=REPO,
                      env=env(), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def report(model_dir) -> dict:
    return json.loads((model_dir / "report.json").read_text())


def weights(model_dir) -> list[np.ndarray]:
    """The trained weights, read without Keras (h5py: any backend wrote them alike)."""
    import h5py

    found = []
    with h5py.File(model_dir / "model.weights.h5", "r") as f:
        f.visititems(lambda name, item: found.append((name, item[()]))
                     if isinstance(item, h5py.Dataset) else None)
    return [value for _, value in sorted(found, key=lambda pair: pair[0])]


def close(a_dir, b_dir, atol=2e-5):
    for got, want in zip(weights(a_dir), weights(b_dir), strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=atol)


def accuracies_agree(a: float, b: float, data_dir) -> None:
    """Two runs' accuracies (differently initialised or shuffled, each scored on the same
    validation split of ``data_dir``) differ by less than three standard errors of a
    difference of two proportions: chance, not a backend that learns less. (A fixed gap
    failed in CI: 0.085 on 130 texts, 0.056 on 180 digits.)"""
    schema = json.loads((Path(data_dir) / "schema.json").read_text())
    n = schema["splits"]["validation"]["num_records"]
    assert abs(a - b) < 3 * np.sqrt((a * (1 - a) + b * (1 - b)) / n), (a, b, n)
