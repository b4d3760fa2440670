"""Keep the engine only where it measures faster (``python -m tfspeed.run``).

After a fit's epoch 1 on Keras' ``fit`` as written, epochs move to tfspeed's engine. Its first
epoch there is timed against Keras' epoch 1, both in training batches per second and without
their compiles where the clocks separate them; where the engine is slower than
``min_speedup`` times Keras, the epochs left go back to Keras' ``fit`` as written (the same
model, weights and optimizer). On JAX the engine was measured 3-7x slower than Keras-JAX on
small CNNs: this is what keeps such a script from running slower than as written.
"""

from __future__ import annotations


def settled_rate(epoch: dict) -> tuple[float | None, str]:
    """Training batches per second of one epoch's clock (``step._relay``'s: its begin and
    each call's ``(last batch, time)``), validation left out, and how it was taken.

    The second half of the epoch's batches where it spans two calls or more (the first
    call compiles; the steps-per-call tuner's probes, some compiling on JAX, come early);
    else past the first call; else the whole epoch, its compile included.
    """
    calls = epoch.get("calls") or []
    if not calls:
        return None, "no batch"
    last, end = calls[-1]
    half = next((i for i, (batch, _) in enumerate(calls) if i and batch >= last / 2), None)
    if half is not None and half < len(calls) - 1:
        batch, start = calls[half]
        return (last - batch) / max(end - start, 1e-9), "its later half"
    if len(calls) > 1:
        batch, start = calls[0]
        return (last - batch) / max(end - start, 1e-9), "past its first call"
    return (last + 1) / max(end - epoch["begin"], 1e-9), "its compile included (one call)"


def judge(record: dict, min_speedup: float, epochs_left: int):
    """A function called at the end of the engine's first epoch: True where the engine was
    slower than ``min_speedup`` times Keras' epoch 1 and epochs are left; it then writes why
    in ``record["handed_back"]``.

    Args:
      record: the fit's record, with ``epochs`` (``keras`` and ``engine`` clocks).
      min_speedup: the engine's batches/s must reach this many times Keras'.
      epochs_left: epochs after the engine's first.

    Returns:
      The function, of no arguments.
    """
    from tfspeed.attach import step

    def slower() -> bool:
        clocks = record["epochs"]
        if epochs_left < 1 or len(clocks["engine"]) != 1 or not clocks["keras"]:
            return False
        keras_rate = step._rate(clocks["keras"][0], warm=False)
        engine_rate, how = settled_rate(clocks["engine"][0])
        if not keras_rate or not engine_rate:
            return False
        batch = record.get("batch", 1)
        record["engine_check"] = (
            f"the engine's first epoch {engine_rate * batch:.0f} examples/s ({how}) against "
            f"Keras' epoch 1 {keras_rate * batch:.0f} ({engine_rate / keras_rate:.2f}x)")
        if engine_rate >= min_speedup * keras_rate:
            return False
        record["handed_back"] = (
            f"{record['engine_check']}, under {min_speedup:g}x: the epochs after it went back "
            "to Keras' fit (the same weights and optimizer)")
        return True

    return slower
