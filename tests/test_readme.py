"""The README and docs/: their examples run as written (with a shorter run where noted), the
Quick start stays what CI runs, every relative link and path resolves, docs/flags.md matches
the config's help texts, and the README stays short enough to read."""

import os
import re
import sys

import keras
import pytest
from absl.testing import flagsaver

from tests import forked
from tests.conftest import REPO
from tfspeed import train
from tfspeed.config import flags as tfspeed_flags
from tfspeed.config import reference

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def _examples() -> dict[str, str]:
    """``<!-- example: NAME -->`` followed by a fenced block -> {NAME: the block's text}."""
    text = README.read_text()
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
    """api.py as written, in a process of its own (as a user's script runs)."""
    (tmp_path / "api.py").write_text(EXAMPLES["api.py"])
    done = forked.run([sys.executable, "api.py"], cwd=tmp_path, env=_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    accuracy = re.fullmatch(r"accuracy (\S+), \d+ examples/s", done.stdout.strip().splitlines()[-1])
    assert float(accuracy[1]) > 0.85  # 10 epochs of a small MLP on the real digits
    epochs = (tmp_path / "runs" / "api-epochs.csv").read_text().strip().splitlines()
    assert len(epochs) == 1 + 10 and epochs[0].startswith("epoch,")


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move details to docs/"


def _quick_start_commands() -> list[str]:
    """The Quick start's first code block, read as .ci/run reads it (comments and blank lines
    left out)."""
    section = README.read_text().split("\n## Quick start\n", 1)[1]
    block = re.search(r"```[a-z]*\n(.*?)```", section, re.S)[1]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_quick_start_block_is_the_main_job_then_the_tests():
    """.ci/run executes the block's second line: it must stay the test command."""
    main_job, tests = _quick_start_commands()
    assert main_job.endswith("python -m tfspeed.train --flagfile=pipelines/digits.flags")
    assert tests.endswith("python -m pytest") and '".[cpu,test]"' in tests
    assert "eval_accuracy=" in README.read_text()  # the main job's example output


def _links(page) -> list[str]:
    """A page's Markdown link and image targets, web addresses left out."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text())
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def _anchors(page) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to -."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md"
                                 and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_repository_path_named_exists(page):
    """Paths in backquotes (`tests/...py`, `pipelines/x.flags`) name files that exist; a
    placeholder (NAME, <split>, *) is not a path."""
    named = re.findall(r"`((?:tests|tfspeed|scripts|pipelines|benchmarks|docs)/[\w./-]+)`",
                       page.read_text())
    missing = [path for path in named
               if not re.search(r"[A-Z*<]", path) and not (REPO / path).exists()]
    assert not missing, f"{page.name}: {missing}"


def test_flags_doc_matches_the_config_help_texts():
    assert (REPO / "docs" / "flags.md").read_text() == reference.render(), (
        f"docs/flags.md is stale: run {reference.REGENERATE}")
