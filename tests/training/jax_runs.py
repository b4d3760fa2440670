"""Runs of the driver on Keras' JAX backend, each in a process of its own (a process has one
Keras backend), and what they leave: the tests of test_jax*.py share them."""

import json
import os
import subprocess
import sys

import numpy as np

from tests.conftest import REPO

TINY_TEXT = ["--model=transformer", "--width=16", "--depth=1", "--heads=2"]


def env(devices: int = 1) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "3",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH"))
                                         if p)}
    env.pop("XLA_FLAGS", None)
    return env


def train(data_dir, model_dir, *flags, check=True):
    done = subprocess.run([sys.executable, "-m", "tfspeed.train", "--log_every=5", *flags,
                           f"--data_dir={data_dir}", f"--model_dir={model_dir}"], cwd=REPO,
                          env=env(), capture_output=True, text=True, timeout=900)
    if check:
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
