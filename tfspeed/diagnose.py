"""``python -m tfspeed.diagnose --flagfile=...``: where does the time go, and what to try next.

A command only: flags -> ``tfspeed.diagnosis.run.run(config, options)``.

Same flags as ``tfspeed.train``; what it measures and how: ``tfspeed.diagnosis.measure``.
Writes ``MODEL_DIR/diagnose/diagnose.json`` and ``diagnose.png``.
"""

from __future__ import annotations

from absl import app, logging

from tfspeed.config import flags as tfspeed_flags
from tfspeed.diagnosis.measure import Options
from tfspeed.diagnosis.run import run
from tfspeed.errors import UsageError
from tfspeed.util.cli import main_entry

__all__ = ["Options", "main", "run", "run_main"]


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    config = tfspeed_flags.to_config()
    steps, warmup = tfspeed_flags.diagnose_options()
    run(config, Options(steps=steps, warmup=warmup))

def run_main() -> None:
    main_entry(lambda: app.run(main, flags_parser=tfspeed_flags.parse))

if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    run_main()
