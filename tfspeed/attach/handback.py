"""Keep the engine only where it measures faster (``python -m tfspeed.run``).

After a fit's epoch 1 on Keras' ``fit`` (on the optimised data), epochs move to tfspeed's
engine. Its first epoch there (past its compiles, where enough calls separate them; else its
second) is timed against Keras' epoch 1 past its first step, both in training batches per
second; where the engine is slower than ``min_speedup`` times Keras, the epochs left go back
to Keras' ``fit`` (the same data, model, weights and optimizer). On JAX the engine was
measured 3-7x slower than Keras-JAX on small CNNs: this is what keeps such a script from
running slower than on Keras. (On a first run Keras' epoch 1 also stores the data, which the
engine's epochs then replay: a small head start for the engine, measured in the record.)
"""

from __future__ import annotations

import itertools
import statistics

SETTLED_CALLS = 4  # calls past the first that the engine's first epoch needs to be judged


def settled_rate(epoch: dict, first: bool) -> tuple[float | None, str]:
    """Training batches per second of one epoch's clock (``step._relay``'s: its begin and
    each call's ``(last batch, time)``), validation left out, and how it was taken; None
    where it cannot be told apart from compiles.

    The engine's first epoch (``first``) compiles: its first call, and on JAX each new
    number of steps per call (the tuner's probes try several). There the median call's
    pace past the first call, where ``SETTLED_CALLS`` calls or more follow it; else None.
    A later epoch compiled nothing (or one short call): its whole training time.
    """
    calls = epoch.get("calls") or []
    if not calls:
        return None, "no batch"
    if not first:
        last, end = calls[-1]
        return (last + 1) / max(end - epoch["begin"], 1e-9), "a whole epoch"
    paces = [(b - a) / max(t - s, 1e-9) for (a, s), (b, t) in itertools.pairwise(calls)
             if b > a]
    if len(paces) < SETTLED_CALLS:
        return None, f"{len(calls)} call(s): too few to leave its compiles out"
    return float(statistics.median(paces)), "its median call past the first"


def judge(record: dict, min_speedup: float, epochs_left: int):
    """A function called at the end of each of the engine's epochs until one is timed (the
    first, past its compiles, else the second): True where the engine was slower than
    ``min_speedup`` times Keras' epoch 1 and epochs are left; it then writes why in
    ``record["handed_back"]``.

    Args:
      record: the fit's record, with ``epochs`` (``keras`` and ``engine`` clocks).
      min_speedup: the engine's batches/s must reach this many times Keras'.
      epochs_left: the engine's epochs after its first.

    Returns:
      The function, of no arguments.
    """
    def slower() -> bool:
        clocks = record["epochs"]
        done = len(clocks["engine"])
        if "engine_check" in record or epochs_left - (done - 1) < 1 or not clocks["keras"]:
            return False
        keras_rate = epoch_rate(clocks["keras"][0], warm=False)
        engine_rate, how = settled_rate(clocks["engine"][-1], first=done == 1)
        if not keras_rate or not engine_rate:
            return False  # judged at the next epoch's end
        batch, initial = record.get("batch", 1), record.get("initial", 0)
        record["engine_check"] = (
            f"the engine's epoch {initial + done + 1} {engine_rate * batch:.0f} examples/s "
            f"({how}) against Keras' epoch {initial + 1} {keras_rate * batch:.0f} "
            f"({engine_rate / keras_rate:.2f}x)")
        if engine_rate >= min_speedup * keras_rate:
            return False
        record["handed_back"] = (
            f"{record['engine_check']}, under {min_speedup:g}x: the epochs after it went back "
            "to Keras' fit (the same weights and optimizer)")
        return True

    return slower


def epoch_rate(epoch: dict, warm: bool) -> float | None:
    """An epoch's training batches per second, to its last call's end (its validation
    left out): from its start where ``warm`` (nothing compiles), else past its first call."""
    calls = epoch["calls"]
    if not calls:
        return None
    last, end = calls[-1]
    if warm:
        return (last + 1) / (end - epoch["begin"])
    first, start = calls[0]
    return (last - first) / (end - start) if last > first and end > start else None
