"""uint8 images out of a user's own pipeline, scaled after it: the same numbers, 4x fewer bytes.

Where the pipeline's last map computes a float image as ``cast(uint8 argument)`` followed by
scalar or per-channel constants (``tf.cast(x, tf.float32) / 255.``,
``tf.image.convert_image_dtype(x, tf.float32)``, ``keras.layers.Rescaling`` on uint8), that map
is rebuilt to hand the uint8 argument on as it is, and the cast and its constants, read from
the map's own graph, are applied later:

- with the user's model: in ``scale_model.uint8_model``, a Keras model that takes the uint8
  images, looks each value up in a table of what those ops give (``table``) inside the
  compiled step, and calls the user's model (its weights);
- without one: after the store, with the same ops in the same order, so the stored part is
  uint8 (4x smaller) and yields float32.

Either way exact: ``x / 255`` and ``x * (1/255)`` differ in the last bit for 126 of the 256
values, and compilers make that swap (Grappler's constant folding, XLA), so a division stays a
division in tf.data and becomes a lookup in a model. Nothing that is not exact is rewritten: an
image that leaves a resize (``tf.image.resize`` interpolates, as
``keras.utils.image_dataset_from_directory`` does) holds fractional values no uint8 can give
back, and is left as it is with one line that says so.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# Binary ops with one constant side that keep the values an exact function of the uint8 ones;
# the op names of the graph, each with the name ``apply`` calls.
AFFINE = {"Mul": "multiply", "RealDiv": "divide", "Div": "divide", "AddV2": "add",
          "Add": "add", "Sub": "subtract"}
NOT_WITH_CONSTANT_LEFT = ("RealDiv", "Div")  # c / x is no scale
PASSING = ("Identity", "StopGradient")
SHAPING = (*PASSING, "Squeeze", "ExpandDims", "Reshape", "EnsureShape")  # what a reason looks past
# Chain nodes that carry elements of any dtype unchanged (a padded batch does not: its padding
# would be scaled): the scale moves past them.
CARRIERS = ("_BatchDataset", "_ParallelBatchDataset", "_PrefetchDataset", "_OptionsDataset",
            "_ShuffleDataset", "_RepeatDataset", "_TakeDataset", "_SkipDataset",
            "_UnbatchDataset", "_RestructuredDataset", "_CacheDataset")
MAPS = ("_MapDataset", "_ParallelMapDataset")


@dataclasses.dataclass(frozen=True)
class Step:
    """One op of a scale: ``op`` a graph op type of ``AFFINE``; ``left`` when the constant is
    its first operand (``c - x``)."""

    op: str
    value: np.ndarray
    left: bool = False


@dataclasses.dataclass
class Found:
    """What ``find`` read: ``uint8`` the pipeline yielding the uint8 images (None when not
    rewritten, with ``reason``), ``scales`` the float dtype and steps of each scaled component,
    by its position in the flattened element."""

    uint8: object | None
    reason: str = ""
    scales: dict = dataclasses.field(default_factory=dict)

    def formula(self) -> str:
        dtype, steps = next(iter(self.scales.values()))
        text = f"cast(x, {dtype})"
        for k, s in enumerate(steps):
            sign = {"multiply": "*", "divide": "/", "add": "+", "subtract": "-"}[AFFINE[s.op]]
            value = (np.array2string(s.value, precision=4, separator=", ") if s.value.size > 1
                     else f"{s.value.item():g}")
            text = f"({text})" if k else text
            text = f"{value} {sign} {text}" if s.left else f"{text} {sign} {value}"
        return text


def find(dataset, model=None) -> Found:
    """Reads ``dataset``'s last map for float images scaled from uint8 ones and, where every
    step is exact, builds the pipeline that yields them as uint8.

    Args:
      dataset: the user's ``tf.data.Dataset``.
      model: the user's model, or None; checked here, before anything runs.

    Returns:
      A ``Found``: ``uint8`` set, or ``reason`` in words.

    Raises:
      UsageError: ``model`` is not a Keras model.
    """
    if model is not None:
        import keras  # only here: without a model, Keras need not load

        if not isinstance(model, keras.Model):
            from tfspeed.errors import UsageError

            raise UsageError(f"tfspeed.optimize(dataset, model): model must be a keras.Model, "
                             f"got {type(model).__name__}; pass the model you give to fit, "
                             "or none")
    try:
        return _find(dataset)
    except Exception as e:  # noqa: BLE001  an op or a node this module does not know
        return Found(None, f"its last map cannot be read ({str(e).splitlines()[0][:120]})")


def _find(dataset) -> Found:
    from tfspeed.attach import graph

    nodes = graph.chain(dataset)
    last = len(nodes) - 1
    while last > 0 and type(nodes[last]).__name__ in CARRIERS:
        if type(nodes[last]).__name__ == "_CacheDataset" and _cache_file(nodes[last]):
            return Found(None, "a cache to a file follows its last map: a uint8 element would "
                               "not match the float32 one that file holds")
        last -= 1
    node = nodes[last]
    if type(node).__name__ not in MAPS:
        what = "nothing" if last == 0 else graph._name(node)
        return Found(None, f"{what} precedes the end of the pipeline where a map would scale "
                           "images: no cast of uint8 to float to move")
    scales, reason = _scales(node)
    if not scales:
        return Found(None, reason)
    out = _uint8_map(node, node._input_dataset, {i: arg for i, (arg, _, _) in scales.items()})
    for later in nodes[last + 1:]:
        out = _carry(later, out)
    return Found(out, scales={i: (dtype, steps) for i, (_, dtype, steps) in scales.items()})


def _cache_file(node) -> str:
    name = getattr(node, "_filename", "")
    return name.numpy().decode() if hasattr(name, "numpy") else str(name or "")


def _scales(node) -> tuple[dict, str]:
    """The map's float outputs that are exact scales of a uint8 argument, by output position:
    (argument position, dtype, steps); else the reason of the largest float output."""
    fn = node._map_func.function
    args = fn.graph.inputs[:len(fn.graph.inputs) - len(fn.captured_inputs)]
    found, reasons = {}, []
    for i, tensor in enumerate(fn.graph.outputs):
        if not tensor.dtype.is_floating:
            continue
        traced = _trace(tensor, args)
        if not isinstance(traced, str) and tensor.shape != args[traced[0]].shape:
            traced = (f"its scale changes the images' shape ({args[traced[0]].shape} to "
                      f"{tensor.shape}): left as it is")
        if isinstance(traced, str):
            reasons.append((tensor.shape.rank or 0, traced))
        else:
            found[i] = traced
    if found or not reasons:
        return found, "" if found else ("no float output leaves its last map: nothing to send "
                                        "as uint8")
    return {}, max(reasons, key=lambda r: r[0])[1]


def _trace(tensor, args: list):
    """(argument position, dtype, steps) where ``tensor`` is cast(uint8 argument) through
    ``AFFINE`` ops with constants, else why not."""
    from tensorflow.python.framework import tensor_util

    steps = []
    while True:
        op = tensor.op
        if op.type in PASSING:
            tensor = op.inputs[0]
        elif op.type in AFFINE:
            first, second = (tensor_util.constant_value(t) for t in op.inputs)
            if second is not None and first is None:
                steps.append(Step(op.type, np.asarray(second)))
                tensor = op.inputs[0]
            elif first is not None and second is None and op.type not in NOT_WITH_CONSTANT_LEFT:
                steps.append(Step(op.type, np.asarray(first), left=True))
                tensor = op.inputs[1]
            else:
                return (f"its images are computed by {op.type} of two tensors, not scaled by "
                        "constants")
        elif op.type == "Cast":
            source = op.inputs[0]
            if source.dtype.name != "uint8":
                return (f"its images reach the cast as {source.dtype.name} "
                        f"({_origin(source)}), not uint8: not exact")
            position = next((k for k, a in enumerate(args) if a is source), None)
            if position is None:
                return ("its images are made uint8 and scaled in the same map: write the "
                        "scale as a map of its own (ds.map(load).map(scale)) to send uint8")
            return position, tensor.dtype.name, tuple(steps[::-1])
        else:
            return _origin(tensor, leaves=True)


def _origin(tensor, leaves: bool = False) -> str:
    """Where a float tensor comes from, past the ops that only reshape it, in words."""
    while tensor.op.type in SHAPING:
        tensor = tensor.op.inputs[0]
    kind = tensor.op.type
    if kind.startswith(("Resize", "ScaleAndTranslate")):
        return ("its images leave a resize (" + kind + ") as fractional float32, as "
                "keras.utils.image_dataset_from_directory's do: uint8 cannot give the model the "
                "same numbers" if leaves else f"a {kind}, fractional")
    if kind == "Placeholder":
        return ("its float images come from before its last map (e.g. tf.image.resize, which "
                "interpolates): not k*uint8+b, so uint8 would change the numbers"
                if leaves else "float from before this map")
    return (f"its images leave {kind}, not a cast of uint8 scaled by constants: not exact"
            if leaves else f"from {kind}")


def _uint8_map(node, base, passed: dict):
    """``node``'s map on ``base`` with each output of ``passed`` replaced by the argument it
    scaled: the function still runs for the other outputs."""
    import tensorflow as tf

    fn = node._map_func.function

    # Plain Python over tensors: AutoGraph would only spend time transpiling it (~0.2 s).
    @tf.autograph.experimental.do_not_convert
    def call(*args):
        flat_args = tf.nest.flatten(args)
        flat = tf.nest.flatten(fn(*flat_args))
        for out, arg in passed.items():
            flat[out] = flat_args[arg]
        return tf.nest.pack_sequence_as(node._map_func.output_structure, flat)

    parallel = getattr(node, "_num_parallel_calls", None)
    deterministic = {"true": True, "false": False}.get(getattr(node, "_deterministic", ""))
    return base.map(call, num_parallel_calls=None if parallel is None else int(parallel),
                    deterministic=deterministic)


def _carry(node, base):
    from tfspeed.attach import graph

    if type(node).__name__ == "_CacheDataset":  # in RAM (a file cache was refused): uint8 there
        return base.cache()
    return graph.rebuild(node, base)


def apply(x, dtype: str, steps, ops):
    """``steps`` on ``x`` after a cast to ``dtype``, op for op, with ``ops`` (TensorFlow's)."""
    x = ops.cast(x, dtype)
    for s in steps:
        value = np.asarray(s.value, dtype=dtype)
        fn = getattr(ops, AFFINE[s.op])
        x = fn(value, x) if s.left else fn(x, value)
    return x


def restore(found: Found, dataset):
    """``dataset`` (yielding ``found``'s uint8 images) scaled back to the pipeline's floats
    with the same ops, batched where the pipeline batches: the same numbers."""
    import tensorflow as tf

    spec, ops = dataset.element_spec, _tf_ops()

    @tf.autograph.experimental.do_not_convert  # AutoGraph cost 0.7 s of a later run's setup
    def scale(*args):
        flat = tf.nest.flatten(args)
        for i, (dtype, steps) in found.scales.items():
            flat[i] = apply(flat[i], dtype, steps, ops)
        return tf.nest.pack_sequence_as(spec, flat)

    return dataset.map(scale, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


TABLE_MOST = 2**20  # entries of a model's lookup table (4 MiB in float32)


def table(dtype: str, steps) -> tuple[np.ndarray, tuple]:
    """The scale of every uint8 value, as TensorFlow's CPU kernels compute it in the pipeline:
    ``(values, shape)``, ``values[v * n + p]`` the result for value ``v`` at position ``p`` of
    ``shape`` (the constants' broadcast shape, ``n`` its size).

    A model looks its inputs up here instead of computing them: a lookup is exact on every
    backend and compiler, where arithmetic is not (XLA turns ``x / 255`` into
    ``x * (1/255)``, as Grappler's constant folding does in a compiled step; half the uint8
    values then differ in the last bit).
    """
    import tensorflow as tf

    shape = np.broadcast_shapes(*(np.shape(s.value) for s in steps)) if steps else ()
    values = np.arange(256, dtype=np.uint8).reshape((256,) + (1,) * len(shape))
    with tf.device("/CPU:0"):
        out = apply(tf.constant(values), dtype, steps, _tf_ops()).numpy()
    return np.broadcast_to(out, (256, *shape)).reshape(-1), tuple(shape)


def _tf_ops():
    """The functions ``apply`` calls, TensorFlow's (a pipeline's, whatever Keras' backend)."""
    import types

    import tensorflow as tf

    return types.SimpleNamespace(cast=tf.cast, multiply=tf.math.multiply, divide=tf.math.truediv,
                                 add=tf.math.add, subtract=tf.math.subtract)


def finish(found: Found, original, source, out, model, report):
    """Applies what ``find`` found to ``out`` (what the store made of ``source``), and says so
    in ``report``.

    Returns:
      (the dataset, the model): uint8 images and the model that scales them where a model is
      given and can be wrapped; else float32 images, uint8 in the store where one is read.
    """
    if found.uint8 is None:
        report.unchanged.append(f"dtypes: images leave the pipeline as they did: {found.reason}")
        return out, model
    why = "give the model too, optimize(ds, model), to send uint8 and scale inside its step"
    if model is not None:
        adapted = _uint8_model(found, model, out.element_spec)
        if not isinstance(adapted, str):
            report.changed.append(
                f"dtypes: images leave as uint8 (4x fewer bytes to the device); the returned "
                f"model gives each value what {found.formula()} gave (looked up, inside its "
                "step) and calls yours (the same weights): the same numbers")
            report.verdict += "; uint8 images, scaled inside the returned model"
            return out, adapted
        why = adapted
    if out is source:  # nothing stored: the pipeline as written
        report.unchanged.append(f"dtypes: images leave as float32: {why}")
        return original, model
    restored = restore(found, out)
    if restored.element_spec != original.element_spec:
        report.unchanged.append("dtypes: the uint8 store would change the element_spec to "
                                f"{restored.element_spec}: images leave as float32")
        return original, model
    report.changed.append(f"dtypes: the store holds uint8 images (4x smaller); "
                          f"{found.formula()} runs after it: the same numbers")
    report.unchanged.append(f"dtypes: images still leave as float32: {why}")
    return restored, model


def _uint8_model(found: Found, model, spec):
    """``scale_model.uint8_model`` with ``found``'s tables, or why not."""
    from tfspeed.attach import scale_model  # Keras, only where a model is given

    tables = {}
    for i, (dtype, steps) in found.scales.items():
        size = 256 * int(np.prod(np.broadcast_shapes(*(np.shape(s.value) for s in steps))))
        if size > TABLE_MOST:  # a mean image, say, rather than a value per channel
            return (f"its scale's constants vary over {size // 256} positions: the model's "
                    f"lookup table of {size} values would be too large")
        values, shape = table(dtype, steps)
        tables[i] = (values, shape, dtype)
    return scale_model.uint8_model(tables, model, spec)
