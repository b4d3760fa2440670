"""``--help`` on every command: its own flags, with their help and defaults, exit status 0,
and no TensorFlow start before printing them."""

import functools
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import REPO

# Runs a command as ``python -m`` (or as a script) would, then says whether TensorFlow was
# imported: help is printed before the seconds of TensorFlow's start.
_RUN = """\
import runpy, sys
target = sys.argv.pop(1)
try:
    if target.endswith(".py"):
        runpy.run_path(target, run_name="__main__")
    else:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
finally:
    print("tensorflow imported:", "tensorflow" in sys.modules)
"""

# command -> flags of its own that its help must list, and flags it must not list.
COMMANDS = {
    "tfspeed.train": (["--batching", "--batch_size", "--model_dir", "--[no]shuffle"],
                      ["--budget_s", "--diagnose_steps"]),
    "tfspeed.diagnose": (["--batching", "--diagnose_steps", "--diagnose_seconds", "train.py"],
                         ["--budget_s"]),
    "tfspeed.tune": (["--batching", "--budget_s", "--tune_dir"], ["--diagnose_steps"]),
    "tfspeed.verify": (["--repair", "data_dir"], []),
    "tfspeed.launch": (["--workers", "--max_restarts"], ["--batching"]),
    "tfspeed.data_service": (["--dispatcher", "--work_dir", "--port"], ["--batching"]),
    "scripts/to_tfrecord.py": (["--source", "--output", "--tokenizer"], ["--batching"]),
    "tfspeed.bench": (["compare", "--threshold"], ["--batching"]),
    "tfspeed.run": (["SCRIPT.py", "tfspeed.optimize"], ["--batching"]),
}

# Flags the docs name that belong to other tools: Apache Beam's inside --beam_options,
# TensorBoard's --logdir and pip's --no-deps.
OTHER_TOOLS_FLAGS = {"direct_num_workers", "direct_running_mode", "logdir", "no-deps"}
# Pages whose flags are tfspeed's; docs/benchmarks.md also names the benchmark scripts' own.
DOCS = [REPO / "README.md",
        *(page for page in sorted((REPO / "docs").glob("*.md")) if page.name != "benchmarks.md")]


@functools.cache
def _help(command: str) -> subprocess.CompletedProcess:
    """``command --help``, run once per test session (each run starts a Python process)."""
    target = str(REPO / command) if command.endswith(".py") else command
    return subprocess.run([sys.executable, "-c", _RUN, target, "--help"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_help_lists_the_commands_own_flags_and_exits_0(command):
    run = _help(command)
    assert run.returncode == 0, (run.stdout[-2000:], run.stderr[-2000:])
    listed, unlisted = COMMANDS[command]
    help_text = run.stdout
    for flag in listed:
        assert flag in help_text, (flag, help_text)
    for flag in unlisted:
        assert flag not in help_text, (flag, help_text)
    assert "default" in help_text  # each flag's default is shown
    assert help_text.rstrip().endswith("tensorflow imported: False"), help_text[-500:]


def test_bench_compare_help_exits_0():
    """``compare --help`` gives compare's own help, not "compare needs two records"."""
    run = subprocess.run([sys.executable, "-m", "tfspeed.bench", "compare", "--help"],
                         cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--threshold" in run.stdout and "OLD.json" in run.stdout, run.stdout


def test_every_flag_the_docs_name_is_a_commands_flag():
    """A renamed or removed flag leaves no stale mention in README.md or docs/."""
    known = set(OTHER_TOOLS_FLAGS) | {"help", "helpfull", "flagfile"}
    for command in COMMANDS:
        for negatable, name in re.findall(r"--(\[no\])?([a-z][a-z0-9_]*)", _help(command).stdout):
            known |= {name, f"no{name}"} if negatable else {name}
    unknown = {}
    for page in DOCS:
        for name in re.findall(r"(?<![\w-])--([a-z][\w-]*)", page.read_text()):
            if name not in known:
                unknown.setdefault(page.name, set()).add(f"--{name}")
    assert not unknown, unknown


@pytest.mark.parametrize("command, args, message", [
    ("tfspeed.run", ["train.txt"], "error: train.txt: not a Python script"),
    ("tfspeed.run", ["--min_engine_seconds=soon", "train.py"],
     "error: python -m tfspeed.run --min_engine_seconds=soon: its options are"),
    ("tfspeed.diagnose", ["--diagnose_seconds=0", "missing.py"],
     "error: python -m tfspeed.diagnose --diagnose_seconds=0: before a script"),
    ("tfspeed.diagnose", ["missing.py"], "error: missing.py: not a Python script"),
])
def test_a_mistake_in_the_scripts_options_is_one_line_before_tensorflow_starts(
        tmp_path, command, args, message):
    """`tfspeed.run` and `diagnose` on a script checked its options only after TensorFlow's
    import: ~5 s for a typo. The mistake is now one line, status 2, before it."""
    run = subprocess.run([sys.executable, "-c", _RUN, command, *args], cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=120)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith(message), lines
    assert run.stdout.strip() == "tensorflow imported: False", run.stdout
