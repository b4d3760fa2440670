"""``python -m tfspeed.run train.py [its arguments]``: your own training script, unchanged,
with every dataset it gives ``Model.fit`` stored and replayed by ``tfspeed.optimize``.

The script runs as ``__main__`` with its own arguments, its callbacks, history, evaluate,
predict and saving as they were. Each ``fit`` prints one line: its first epoch (as written,
while the deterministic part is stored) against its later epochs.
"""

from __future__ import annotations

import sys

from tfspeed.util.cli import main_entry

USAGE = ("usage: python -m tfspeed.run [--cache_dir=DIR] SCRIPT.py [the script's arguments]\n\n"
         + __doc__ + "\n  --cache_dir: where the stores go (default: $TFSPEED_CACHE_DIR, else "
         "~/.cache/tfspeed/datasets)\n")


def main(argv: list[str]) -> None:
    from tfspeed.attach.runner import run_script

    run_script(argv[0], argv[1:])


def run_main() -> None:
    import os

    from tfspeed.attach.store import ENV_DIR

    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "-help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    if args[0].startswith("--cache_dir="):  # tfspeed's own option, before the script
        os.environ[ENV_DIR] = os.path.abspath(args.pop(0).split("=", 1)[1])
    main_entry(lambda: main(args))


if __name__ == "__main__":
    run_main()
