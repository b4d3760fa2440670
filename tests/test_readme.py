"""The README's "Your own model" examples, run as written (with a shorter run where noted)."""

import os
import re
import subprocess
import sys

import keras
from absl.testing import flagsaver

from tests.conftest import REPO
from tfspeed import train
from tfspeed.config import flags as tfspeed_flags


def _examples() -> dict[str, str]:
    """``<!-- example: NAME -->`` followed by a fenced block -> {NAME: the block's text}."""
    text = (REPO / "README.md").read_text()
    found = re.findall(r"<!-- example: (\S+) -->\n```[a-z]*\n(.*?)```", text, re.S)
    return dict(found)


EXAMPLES = _examples()


def _env():
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": str(REPO)}


def test_the_readme_names_its_examples():
    assert sorted(EXAMPLES) == ["api.py", "command", "my_models.py"]


@flagsaver.flagsaver
def test_own_model_from_the_command_line(digits_dir, tmp_path, monkeypatch):
    """The command, parsed and run as ``python -m tfspeed.train`` would (in this process:
    a TF start saved), from a working directory holding my_models.py."""
    (tmp_path / "my_models.py").write_text(EXAMPLES["my_models.py"])
    command = EXAMPLES["command"].strip()
    assert command.startswith("python -m tfspeed.train --flagfile=pipelines/digits.flags ")
    args = command.split()[3:]
    args[0] = f"--flagfile={REPO / 'pipelines' / 'digits.flags'}"
    # The shared digits conversion, and 1 epoch instead of 30.
    args += [f"--data_dir={digits_dir}", "--prepare_source=", "--epochs=1"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    tfspeed_flags.parse(["tfspeed.train", *args])
    report = train.run(tfspeed_flags.to_config())
    assert report["config"]["model"]["name"] == "my_models:small_cnn"
    assert report["runtime"]["num_replicas"] == 2 and report["optimizer_updates"] > 0
    import my_models  # noqa: F401  (registers Residual)

    loaded = keras.saving.load_model(tmp_path / "runs" / "mine" / "model.keras")
    assert type(loaded.layers[-2]).__name__ == "Residual"


def test_own_model_from_python(tmp_path):
    """api.py as written, in a process of its own (it splits the CPU before TF starts)."""
    (tmp_path / "api.py").write_text(EXAMPLES["api.py"])
    done = subprocess.run([sys.executable, "api.py"], cwd=tmp_path, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = re.fullmatch(r"accuracy (\S+), \d+ examples/s", done.stdout.strip().splitlines()[-1])
    assert float(accuracy[1]) > 0.85  # 10 epochs of a small MLP on the real digits
    epochs = (tmp_path / "runs" / "api-epochs.csv").read_text().strip().splitlines()
    assert len(epochs) == 1 + 10 and epochs[0].startswith("epoch,")
