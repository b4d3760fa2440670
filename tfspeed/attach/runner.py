"""The two ways into a user's script: ``diagnose_script`` (a verdict on its first ``fit``)
and ``run_script`` (the script as it is, its datasets through ``tfspeed.optimize``)."""

from __future__ import annotations

import os
import statistics
import time

from tfspeed.attach import arrays, script, step


def diagnose_script(path: str, argv: list[str], out_dir: str = "tfspeed_diagnose",
                    seconds: float | None = None) -> dict:
    """Runs the script up to its first ``fit``, times that fit's data and model, prints the
    verdict and writes ``out_dir/diagnose.json`` and ``diagnose.png``; the script stops there.

    Returns:
      The verdict (``tfspeed.attach.verdict.diagnose``'s result).
    """
    from tfspeed.attach import verdict

    def handler(model, fit, args):
        data = script.as_dataset(model, args)
        options = {"seconds": seconds} if seconds else {}
        raise script.Stop(verdict.diagnose(data, model, out_dir=out_dir,
                                           given=verdict.given_kind(args.get("x")), **options))

    stop = script.run(path, argv, handler)
    if stop is None:
        from tfspeed.errors import UsageError

        raise UsageError(f"{path} ended without calling model.fit: tfspeed diagnose times the "
                         "first fit a script makes")
    for line in verdict.lines(stop.result):
        print(line)
    print(f"details: {os.path.join(out_dir, 'diagnose.json')}, chart: {stop.result['chart']}")
    return stop.result


def run_script(path: str, argv: list[str], min_engine_seconds: float | None = None,
               min_engine_speedup: float | None = None) -> list[dict]:
    """Runs the script to its end, each ``fit``'s datasets given to ``tfspeed.optimize`` and
    its step to tfspeed's engine after a first epoch on Keras' own (``attach.step``); a
    ``fit`` the engine cannot take runs on Keras' own throughout, with the reason. Prints one line per ``fit``.

    Args:
      path, argv: the script and its arguments.
      min_engine_seconds: a fit's later epochs move to the engine only where Keras would
        take this long for them (None: ``step.MIN_ENGINE_SECONDS``).
      min_engine_speedup: the epochs after the engine's first stay on it only where it
        measured at least this many times Keras' examples/s (None: ``step.MIN_SPEEDUP``).

    Returns:
      Per ``fit`` call: what was optimised, where the step ran and the epochs' clocks.
    """

    fits: list[dict] = []
    limits = {"seconds": step.MIN_ENGINE_SECONDS if min_engine_seconds is None
              else min_engine_seconds,
              "speedup": step.MIN_SPEEDUP if min_engine_speedup is None
              else min_engine_speedup}

    def handler(model, fit, args):
        record = {"changed": [], "epoch_seconds": [], "initial": args.get("initial_epoch") or 0}
        fits.append(record)
        # NumPy arrays as the batches Keras' fit makes of them, where the engine takes the
        # fit that way; else as written.
        converted, note = arrays.as_datasets(args)
        reason = step.why_not(model, converted or args)
        if converted is not None and reason is None:
            args.clear()
            args.update(converted)
        elif converted is not None:
            note = "x: NumPy arrays, fed by Keras as written"
        if note:
            record["changed"].append(note)
        written = {name: args.get(name) for name in ("x", "validation_data")}
        if reason is None:
            try:  # on the data as written: the adapted model's outputs are the same
                first = step.first_batch(written["x"])
                goals = step.objectives(model, first)
            except step.NotOnEngine as e:  # met before any epoch ran
                reason = str(e)
        if reason is not None:  # Keras' fit on the model as given: no adapted model
            for name in ("x", "validation_data"):
                args[name] = _optimized(args.get(name), name, record)
            record["keras_fit"] = reason
            args["callbacks"] = [*(args.get("callbacks") or []), _EpochClock(record)]
            history = fit(model, **args)
            print(_summary(len(fits), record) + f"; the step ran on Keras' own fit: {reason}")
            return history
        engine_model = _optimized_with_model(model, args, record)
        history = step.run_fit(model, fit, {**args, "written": written, "first": first,
                                            "engine_model": engine_model, "goals": goals},
                               record, limits["seconds"], limits["speedup"])
        print(step.summary(len(fits), record) + "; data: " + "; ".join(record["changed"]))
        return history

    _DONE.clear()
    _AGAIN.clear()
    try:
        script.run(path, argv, handler)
    finally:
        _DONE.clear()
        _AGAIN.clear()
    return fits


def _optimized_with_model(model, args: dict, record: dict):
    """``args``' datasets through ``optimize`` with the model (uint8 images, text by length)
    for the engine's epochs; returns the model they train: an adapted one around the user's
    layers, or the user's. The validation data goes through the same rewrite, or stays as
    written where the adapted model takes it; where it cannot be made to fit, both datasets
    are optimised without the model, and the line says why."""

    x, adapted = _once(args["x"], model)
    val = args.get("validation_data")
    if adapted is model or val is None or _same_inputs(x, val):
        _note(x, "x", record)
        args["x"], args["validation_data"] = x, _optimized(val, "validation_data", record)
        return adapted
    val_out, _ = _once(val, model)
    if _same_inputs(x, val_out):
        _note(x, "x", record)
        _note(val_out, "validation_data", record)
        args["x"], args["validation_data"] = x, val_out
        return adapted
    record["changed"].append(
        f"validation_data is not rewritten as x was ({val_out.element_spec[0]} against "
        f"{x.element_spec[0]}): both optimised without the model, which trains as given")
    for name in ("x", "validation_data"):
        args[name] = _optimized(args.get(name), name, record)
    return model


# optimize's result for each dataset (and model) a script's fits were given, by id, with the
# objects kept alive: a later fit on the same dataset gets the same optimised one. A shuffle
# keeps its seed generator in its dataset object, so a script whose second fit reshuffles on
# from where its first left off does so on the optimised data too (a fresh rewrite would
# start again from the first order).
_DONE: dict[tuple[int, int], tuple] = {}
_AGAIN: set[int] = set()  # ids of the optimised datasets that a later fit got again


def _once(data, model=None):
    """``optimize(data[, model])``, once per dataset: a later fit on the same dataset gets an
    earlier fit's rewrite, so that its shuffles go on from the orders that fit drew. Without
    a model it takes one made for a model that came back as given (nothing in it is for that
    model alone); with a model, one made without (its model is the one given)."""
    from tfspeed.attach.optimize import optimize

    key = (id(data), id(model))
    if key not in _DONE:
        key = next((k for k, (_, given, out) in _DONE.items() if k[0] == id(data) and (
            given is None or (model is None and out[1] is given))), key)
    if key in _DONE:
        out = _DONE[key][2]
        _AGAIN.add(id(out[0] if isinstance(out, tuple) else out))
    else:
        _DONE[key] = (data, model, optimize(data) if model is None else optimize(data, model))
    out = _DONE[key][2]
    if model is None:
        return out[0] if isinstance(out, tuple) else out
    return out if isinstance(out, tuple) else (out, model)


def _same_inputs(train, val) -> bool:
    """Whether ``val``'s inputs have the dtypes and shapes (any where ``train``'s have
    none) of ``train``'s: the model adapted to ``train`` takes them."""
    import tensorflow as tf

    ours, theirs = (tf.nest.flatten(d.element_spec[0]) for d in (train, val))
    return len(ours) == len(theirs) and all(
        a.dtype == b.dtype and a.shape.is_compatible_with(b.shape)
        for a, b in zip(ours, theirs, strict=True))


def _optimized(data, name: str, record: dict):
    import tensorflow as tf

    if getattr(data, "tfspeed_arrays", False):  # in memory already: nothing to store
        return data
    if not isinstance(data, tf.data.Dataset):
        if data is not None and name == "x" and not record["changed"]:  # arrays say so
            record["changed"].append(f"fit({name}=...) is not a tf.data.Dataset "
                                     f"({type(data).__name__}): fed by Keras as written")
        return data
    out = _once(data)
    _note(out, name, record)
    return out


def _note(out, name: str, record: dict) -> None:
    report = out.tfspeed_report
    state, verdict = report.state, report.verdict
    if id(out) in _AGAIN:  # an earlier fit's: its store is written
        verdict = f"the dataset an earlier fit optimised ({verdict})"
        state = "reused" if state == "writing" else state
    record["changed"].append(f"{name}: {verdict}")
    record["state"] = state if name == "x" else record.get("state", "")
    record.setdefault("stores", {})[name] = report.store


def _epoch_clock_class():
    import keras

    class EpochClock(keras.callbacks.Callback):
        def __init__(self, record):
            super().__init__()
            self.record = record

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.record["epoch_seconds"].append(time.perf_counter() - self.start)

    return EpochClock


def _EpochClock(record):  # noqa: N802 -- reads as the callback it makes
    return _epoch_clock_class()(record)


def _summary(n: int, record: dict) -> str:
    times = record["epoch_seconds"]
    if len(times) < 2:
        return (f"tfspeed.run: fit {n}: {len(times)} epoch ({sum(times):.1f} s); one epoch "
                "shows no replay: " + "; ".join(record["changed"]))
    # Both on Keras' fit: epoch 1 against the later epochs is Keras' own compile and the
    # store's first pass, not a speed tfspeed gave; no ratio is printed for it.
    later = statistics.median(times[1:])
    return (f"tfspeed.run: fit {n}: epoch {record['initial'] + 1} {times[0]:.2f} s "
            f"({step.first_epoch(record)}; "
            f"it also compiles the step), later epochs {later:.2f} s median; "
            + "; ".join(record["changed"]))
