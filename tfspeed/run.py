"""``python -m tfspeed.run train.py [its arguments]``: your own training script, unchanged,
with every dataset it gives ``Model.fit`` stored and replayed by ``tfspeed.optimize`` and the
step on tfspeed's engine.

The script runs as ``__main__`` with its own arguments, its callbacks, history, evaluate,
predict and saving as they were. Each ``fit`` runs its first epoch on Keras' fit as written
(the figure "before") and the rest on tfspeed's engine (steps per call and XLA as the driver
chooses them; the model keeps its own precision), on the datasets ``tfspeed.optimize`` gives
with the model (uint8 images scaled inside a model around the script's, text batched by
length on its layers: the script's model trains). Where the engine's first epoch measures
slower than Keras' epoch 1, the epochs left go back to Keras' fit as written. One line per
fit: examples/s as written against on tfspeed, and each epoch's seconds. NumPy arrays become
the batches Keras' fit makes of them. A fit the engine cannot take (a PyDataset, class or
sample weights, a metric that is not a mean per example, ...) runs on Keras' fit, and its
line says why.
"""

from __future__ import annotations

import os
import sys

from tfspeed.util.cli import main_entry

USAGE = ("usage: python -m tfspeed.run [--cache_dir=DIR] [--min_engine_seconds=S] "
         "[--min_engine_speedup=R] SCRIPT.py [the script's arguments]\n\n" + __doc__
         + "\n  --cache_dir: where the stores go (default: $TFSPEED_CACHE_DIR, else "
         "~/.cache/tfspeed/datasets)\n  --min_engine_seconds: a fit's epochs 2 on move to the "
         "engine only where Keras' fit would take this long for them (default 20)\n"
         "  --min_engine_speedup: the epochs after the engine's first stay there only where "
         "it measured at least this many times Keras' examples/s (default 1)\n")


def main(argv: list[str]) -> None:
    """Runs ``[tfspeed's options] SCRIPT.py [its arguments]``."""
    from tfspeed.attach.runner import run_script

    argv, numbers = options(argv)
    fits = run_script(argv[0], argv[1:], numbers["--min_engine_seconds"],
                      numbers["--min_engine_speedup"])
    if not fits:
        print(f"tfspeed.run: {os.path.basename(argv[0])} called no model.fit: it ran as "
              "written (in a training loop of your own, train = tfspeed.optimize(train) "
              "speeds up its input)", file=sys.stderr)


def options(argv: list[str]) -> tuple[list[str], dict]:
    """``(the script and its arguments, tfspeed's numbers)``; sets ``--cache_dir``. Raises
    ``UsageError`` for a wrong option or a path that is no Python script (no TensorFlow)."""
    from tfspeed.attach.script import check_script
    from tfspeed.attach.store import ENV_DIR
    from tfspeed.errors import UsageError

    argv, numbers = list(argv), {"--min_engine_seconds": None, "--min_engine_speedup": None}
    while argv and argv[0].startswith("--"):  # tfspeed's own options, before the script
        name, _, value = argv.pop(0).partition("=")
        if name == "--cache_dir":
            os.environ[ENV_DIR] = os.path.abspath(value)
        elif name in numbers and value.replace(".", "", 1).isdigit():
            numbers[name] = float(value)
        else:
            raise UsageError(f"python -m tfspeed.run {name}={value}: its options are "
                             "--cache_dir=DIR, --min_engine_seconds=SECONDS and "
                             "--min_engine_speedup=RATIO (numbers), before the script")
    if not argv:
        raise UsageError("python -m tfspeed.run: give the script, e.g. python -m tfspeed.run "
                         "train.py --epochs=3")
    check_script(argv[0])
    return argv, numbers


def run_main() -> None:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help", "-help"):
        print(USAGE)
        sys.exit(0 if args else 2)
    main_entry(lambda: main(args), check=lambda: options(args))


if __name__ == "__main__":
    run_main()
