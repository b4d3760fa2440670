"""Packaging promises: a missing TensorFlow is named in one line with the extra to install."""

import re
import subprocess
import sys

from conftest import REPO


def test_import_without_tensorflow_names_the_extra():
    # -I -S: no site-packages, so TensorFlow cannot be found; the repo is put on the path.
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import tfspeed"
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: tfspeed needs TensorFlow")
    assert "pip install 'tfspeed[cpu]'" in last and "'tfspeed[gpu]'" in last


def test_package_declares_the_tensorflow_extras():
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(dep.startswith("tensorflow-cpu") for dep in extras["cpu"])
    assert any(dep.startswith("tensorflow[and-cuda]") for dep in extras["gpu"])
    names = {re.split(r"[<>=\[ ;]", dep)[0] for dep in project["dependencies"]}
    assert not names & {"tensorflow", "tensorflow-cpu"}, "TensorFlow is chosen by an extra"
    assert "tensorboard>=2.18" in project["dependencies"]  # tensorflow-cpu 2.21 no longer pulls it
