"""NumPy arrays given to ``fit``, as the tf.data pipeline Keras' own fit makes of them, so that
``tfspeed.run`` can move the fit's later epochs to tfspeed's engine.

Keras' fit turns arrays into batches itself: ``validation_split`` takes the last share of the
examples (before any shuffle), the rest is reshuffled every epoch and cut into batches of
``batch_size`` (32 where none is given), the last one shorter. Here that is done by Keras'
own functions (``train_validation_split`` and its array adapter's ``get_tf_dataset``), so the
batches, their split and their shuffling are the ones Keras makes; only the random orders
differ from a seeded script's.
"""

from __future__ import annotations

# fit's arguments about the arrays, answered by the datasets made of them.
ARRAY_ARGS = ("y", "batch_size", "shuffle", "validation_split", "validation_batch_size")


def as_datasets(args: dict) -> tuple[dict | None, str]:
    """``args`` with ``x``/``y`` (and array validation data) as Keras' own datasets of them.

    Args:
      args: a ``fit`` call's arguments by name.

    Returns:
      ``(args, what was done)``; ``(None, why not)`` where they stay as given, and
      ``(None, "")`` where ``x`` is not arrays at all.
    """
    from keras.src.trainers.data_adapters.array_slicing import train_validation_split

    x, y = args.get("x"), args.get("y")
    if not _arrays(x):
        return None, ""
    reason = _refused(args)
    if reason:
        return None, f"x is NumPy arrays with {reason}: fed by Keras as written"
    batch = args.get("batch_size") or 32
    val, split = args.get("validation_data"), args.get("validation_split") or 0.0
    if split and val is None:
        (x, y, _), val = train_validation_split((x, y, None), validation_split=split)
    out = {k: v for k, v in args.items() if k not in ARRAY_ARGS}
    out["x"] = _dataset(x, y, batch, shuffle=args.get("shuffle", True))
    count = len(_first(x))
    note = (f"x: {count} examples in NumPy arrays as Keras batches them ({batch} a batch"
            f"{', reshuffled every epoch' if args.get('shuffle', True) else ''})")
    if val is not None:
        val_x, val_y = val[0], val[1]
        out["validation_data"] = _dataset(val_x, val_y,
                                          args.get("validation_batch_size") or batch,
                                          shuffle=False)
        how = f"the last {split:.0%} of them" if split and args.get("validation_data") is None \
            else "arrays"
        note += f"; validation_data: {len(_first(val_x))} examples ({how})"
    return out, note


def _refused(args: dict) -> str:
    """What about an arrays ``fit`` only Keras' own fit handles ("" where nothing)."""
    if not _arrays(args.get("y")):
        return "no label arrays (y)"
    if args.get("sample_weight") is not None or args.get("class_weight") is not None:
        return "sample or class weights"
    if args.get("shuffle", True) == "batch" or args.get("steps_per_epoch"):
        return "shuffle='batch' or steps_per_epoch"
    val = args.get("validation_data")
    if val is not None and not (isinstance(val, (tuple, list)) and len(val) == 2
                                and all(_arrays(v) for v in val)):
        return "validation_data that is not an (x, y) pair of arrays"
    return ""


def _arrays(value) -> bool:
    """Whether ``value`` is a NumPy array, or a dict, list or tuple of them."""
    import numpy as np

    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(isinstance(v, np.ndarray) for v in value)
    return isinstance(value, np.ndarray)


def _first(value):
    if isinstance(value, dict):
        return next(iter(value.values()))
    return value[0] if isinstance(value, (list, tuple)) else value


def _dataset(x, y, batch: int, shuffle: bool):
    from keras.src.trainers.data_adapters import get_data_adapter

    dataset = get_data_adapter(x, y, batch_size=batch, shuffle=shuffle).get_tf_dataset()
    dataset.tfspeed_arrays = True  # tfspeed.run's runner stores none of it
    return dataset
