"""tfspeed.runtime.backends: the one place that names a Keras backend."""

import re

import keras
import pytest

from tests.conftest import REPO
from tfspeed.errors import UsageError
from tfspeed.runtime import backends

# A test of a backend's name: `backend() == "jax"`, `!= "tensorflow"`, `'jax'`, ...
_NAME_TEST = re.compile(r"""[!=]=\s*["'](jax|tensorflow|torch)["']|keras\.backend\.backend\(\)""")


def test_only_runtime_backends_tests_the_backend_name():
    found = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in sorted((REPO / "tfspeed").rglob("*.py"))
             if path != REPO / "tfspeed" / "runtime" / "backends.py"
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if _NAME_TEST.search(line)]
    assert not found, "ask runtime.backends.current() what the backend can do:\n" + "\n".join(
        found)


def test_each_backend_names_an_engine_adapter():
    assert set(backends.BACKENDS) == {"tensorflow", "jax"}
    assert backends.engine_class("tensorflow").__name__ == "TensorFlowEngine"
    assert backends.current() is backends.BACKENDS[keras.backend.backend()]


def test_an_unknown_backend_is_one_line_naming_the_fix():
    with pytest.raises(UsageError, match="KERAS_BACKEND=torch.*set KERAS_BACKEND=tensorflow"):
        backends.get("torch")
