"""``python -m tfspeed.run train.py [its arguments]``: your own training script, unchanged,
with every dataset it gives ``Model.fit`` stored and replayed by ``tfspeed.optimize`` and the
step on tfspeed's engine.

The script runs as ``__main__`` with its own arguments, its callbacks, history, evaluate,
predict and saving as they were. Each ``fit`` runs its first epoch on Keras' fit as written
(the figure "before") and the rest on tfspeed's engine (steps per call and XLA as the driver
chooses them; the model keeps its own precision), then prints one line: examples/s as
written against on tfspeed, and each epoch's seconds. A fit the engine cannot take (arrays, a
PyDataset, class or sample weights, a metric that is not a mean per example, ...) runs on
Keras' fit, and its line says why.
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
