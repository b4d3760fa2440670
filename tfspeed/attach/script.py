"""Running a user's training script unchanged, with tfspeed between it and ``Model.fit``.

As ``python -m cProfile script.py`` does, the script runs as ``__main__`` with its own
arguments. ``keras.Model.fit`` is wrapped for the run: each call reaches a handler with the
model and the call's arguments, bound to ``fit``'s own signature, and the handler decides what
to run. ``diagnose`` times the first call and stops the script; ``run`` optimises the datasets
and calls the real ``fit``.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import runpy
import sys
from collections.abc import Callable

from tfspeed.errors import UsageError


class Stop(BaseException):  # noqa: N818 -- not an error
    """The handler has what it needed: the script ends here. A BaseException, so that a
    script's ``except Exception`` cannot swallow it."""

    def __init__(self, result=None):
        super().__init__()
        self.result = result


def check_script(path: str) -> str:
    if not path.endswith(".py") or not os.path.isfile(path):
        raise UsageError(f"{path}: not a Python script; give the training script as it is run, "
                         "e.g. python -m tfspeed.run train.py --epochs=3")
    return os.path.abspath(path)


@contextlib.contextmanager
def fit_calls(handler: Callable):
    """Within the block every ``keras.Model.fit(...)`` calls ``handler(model, fit, args)``
    where ``fit`` is the real method and ``args`` the call's arguments by name."""
    import keras

    from tfspeed.attach import graph

    real = keras.Model.fit
    signature = inspect.signature(real)
    busy = []  # the handler's own fits (timings, the optimised call) go to the real one

    def fit(self, *args, **kwargs):
        if busy:
            return real(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        named = dict(bound.arguments)  # only what the script passed: Keras warns on some
        named.pop("self")
        named.update(named.pop("kwargs", {}))
        busy.append(True)
        try:
            return handler(self, real, named)
        finally:
            busy.pop()

    fit.__doc__, fit.__signature__ = real.__doc__, signature
    keras.Model.fit = fit
    try:
        # The script's own iterations of its shuffles (not the handler's): a rebuilt one
        # goes on from where the script left it.
        with graph.count_iterations(lambda: not busy):
            yield
    finally:
        keras.Model.fit = real


def run(path: str, argv: list[str], handler: Callable):
    """Runs the script at ``path`` with ``argv`` as ``__main__``, ``fit`` going to
    ``handler``; returns the handler's ``Stop`` or None when the script ended by itself."""
    path = check_script(path)
    old_argv, old_path = sys.argv, list(sys.path)
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(path))
    try:
        with fit_calls(handler):
            runpy.run_path(path, run_name="__main__")
    except Stop as stop:
        return stop
    except Exception as e:
        e.tfspeed_script = path  # the script's own error: cli shows it as Python does
        raise
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
    return None


def as_dataset(model, args: dict):
    """The training data of a ``fit`` call as a ``tf.data.Dataset`` of batches, through
    Keras' own adapters (arrays, ``PyDataset``, generators, datasets)."""
    import tensorflow as tf
    from keras.src.trainers.data_adapters import get_data_adapter

    x = args.get("x")
    if isinstance(x, tf.data.Dataset):
        return x
    adapter = get_data_adapter(x, args.get("y"), sample_weight=args.get("sample_weight"),
                               batch_size=args.get("batch_size") or 32,
                               steps_per_epoch=args.get("steps_per_epoch"),
                               shuffle=args.get("shuffle", True))
    return adapter.get_tf_dataset()
