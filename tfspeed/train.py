"""The training driver: ``python -m tfspeed.train --flagfile=pipelines/digits.flags``.

Trains the model on a dataset converted by scripts/to_tfrecord.py and writes checkpoints, the
model and report.json into --model_dir.

A command only: parse the flags into a ``Config``, then one library call,
``tfspeed.training.run.run(config)``.
"""

from __future__ import annotations

import sys

from absl import app

from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.training.run import run
from tfspeed.util.cli import exit_on_help, flags_usage, main_entry

__all__ = ["main", "run", "run_main"]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    config = tfspeed_flags.to_config()
    from tfspeed.training import trainer

    try:
        run(config)
    except trainer.Stopped as e:
        print(e, file=sys.stderr)  # one line; the checkpoint is written
        sys.exit(e.exit_status)


def run_main() -> None:
    """Console entry point: one-line errors with exit status 2 for user mistakes."""
    exit_on_help(lambda: flags_usage(__doc__, tfspeed_flags.help_groups()))
    main_entry(lambda: app.run(main, flags_parser=tfspeed_flags.parse))


if __name__ == "__main__":
    run_main()
