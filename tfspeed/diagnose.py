"""``python -m tfspeed.diagnose --flagfile=...``: where does the time go, and what to try next.

``python -m tfspeed.diagnose [--diagnose_seconds=S] train.py [its arguments]`` runs your own
script up to its first ``model.fit`` and gives the same kind of verdict on its dataset and
model (see ``tfspeed.attach.verdict``); each of its timings takes about S seconds (default 4)
after its warm-up.

With flags, it takes the same flags as ``python -m tfspeed.train``. It times the input alone, the model's step
alone, both together and a profiler capture, each for --diagnose_steps steps or
--diagnose_seconds, whichever ends first; gives a verdict (input-, compute- or memory-bound)
with next steps ranked by expected gain; writes MODEL_DIR/diagnose/diagnose.json and
diagnose.png.

A command only: flags -> ``tfspeed.diagnosis.run.run(config, options)``; what it measures and
how: ``tfspeed.diagnosis.measure``.
"""

from __future__ import annotations

import sys
import types

from absl import app, flags

from tfspeed.config import flags as tfspeed_flags
from tfspeed.diagnosis.measure import Options
from tfspeed.diagnosis.run import run
from tfspeed.errors import UsageError
from tfspeed.util.cli import exit_on_help, flags_usage, main_entry

__all__ = ["Options", "main", "run", "run_main"]

_STEPS = flags.DEFINE_integer("diagnose_steps", Options.steps, "Steps timed per measurement.")
_WARMUP = flags.DEFINE_integer("diagnose_warmup", Options.warmup, "Untimed steps before each.")
_SECONDS = flags.DEFINE_float(
    "diagnose_seconds", Options.seconds, "Each measurement's warm-up, and its timed steps, "
    "stop after this many seconds even short of their steps (one step at least).")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    config = tfspeed_flags.to_config()
    options = Options(steps=_STEPS.value, warmup=_WARMUP.value,
                      seconds=_SECONDS.value).validate()
    run(config, options)


def _usage() -> str:
    return flags_usage(__doc__, {**tfspeed_flags.help_groups(),
                                 "diagnose": [_STEPS, _WARMUP, _SECONDS]})


def _script(argv: list[str]) -> None:
    """``[--diagnose_seconds=S] SCRIPT.py [its arguments]``: a verdict on the script's first fit."""
    from tfspeed.attach.runner import diagnose_script

    argv, seconds = _script_options(argv)
    diagnose_script(argv[0], argv[1:], seconds=seconds)


def _script_options(argv: list[str]) -> tuple[list[str], float | None]:
    """``(the script and its arguments, --diagnose_seconds)``; raises ``UsageError`` for a
    wrong option or a path that is no Python script (no TensorFlow)."""
    from tfspeed.attach.script import check_script

    argv, seconds = list(argv), None
    while argv[0].startswith("--"):  # tfspeed's own option, before the script
        name, _, value = argv.pop(0).partition("=")
        try:
            seconds = float(value) if name == "--diagnose_seconds" else None
        except ValueError:
            seconds = None
        if seconds is None or seconds <= 0:
            raise UsageError(f"python -m tfspeed.diagnose {name}={value}: before a script, its "
                             "one option is --diagnose_seconds=SECONDS (a number over 0)")
    check_script(argv[0])
    return argv, seconds


def run_main() -> None:
    script = next((i for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--")), None)
    if script is not None and sys.argv[script].endswith(".py"):  # a user's own script
        main_entry(lambda: _script(sys.argv[1:]), check=lambda: _script_options(sys.argv[1:]))
    exit_on_help(_usage)
    main_entry(lambda: app.run(main, flags_parser=tfspeed_flags.parse))


if __name__ == "__main__":
    run_main()


class _CallableModule(types.ModuleType):
    """The command's module is also ``tfspeed.diagnose(dataset, model, **options)``: see
    ``tfspeed.attach.verdict.diagnose``."""

    def __call__(self, dataset, model, **options):
        from tfspeed.attach.verdict import diagnose

        return diagnose(dataset, model, **options)


sys.modules[__name__].__class__ = _CallableModule
