"""Text padded to a fixed length, batched by length instead, where the model gives the same
numbers.

A tutorial's text pipeline pads every text to ``TextVectorization(output_sequence_length=L)``,
and most of each batch is then padding that the model computes on. Where the model accepts any
length, the same examples grouped by length, each batch trimmed to its longest row, cost a
fraction of that. Whether the model gives the same outputs when padding is trimmed is never
assumed from its layers: it is measured, on real batches, at the model's own weights and at
perturbed ones (masking hides padding at any weights; a model that merely happens to give
padding no weight now does not). The rewrite is kept only where its train steps measure faster.

The rewrite, after the user's pipeline: unbatch, group rows by the width their length rounds up
to (at most ``BUCKETS`` widths, chosen from the sample's lengths by ``data.buckets``' planner,
so that a compiled step sees few shapes), batch each group at the user's batch size, and trim
each batch to its width. Every example passes once per epoch, with
its tokens and labels as they were, less trailing padding; the last batches of an epoch may be
smaller (one per width).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time

import numpy as np

PAD = 0  # TextVectorization's padding id (and pad_sequences')
MIN_WIDTH = 8  # and every width a multiple of it
BUCKETS = 8  # widths at most, the padded length among them: shapes a compiled step sees
SAMPLE_BATCHES = 24  # read once: the check and the timing use them
CHECK_BATCHES = 4
TOLERANCE = 1e-5  # relative: float32 rounding of reductions over a few hundred positions
WORTH = 0.8  # tried only where rows would keep at most this share of the padded length
NOISE = 0.1  # the perturbation of each weight, relative to its spread
TIMING = "lengths-{}.json"


@dataclasses.dataclass
class Tokens:
    """Where the padded tokens are: ``index`` in the element's tuple (None: the element is
    the tensor), ``length`` the padded length; ``batch`` the pipeline's batch size and
    ``widths`` those batches are trimmed to, once a sample is read."""

    index: int | None
    length: int
    batch: int = 0
    widths: list[int] = dataclasses.field(default_factory=list)


def find(spec) -> Tokens | str | None:
    """The padded token tensor in a batched ``element_spec``: the features (the element, or
    the first of its tuple) when they are integer ids of a fixed length. None where there is
    no such tensor; a reason where there is one that cannot be trimmed."""
    import tensorflow as tf

    parts = spec if isinstance(spec, tuple) else (spec,)
    x = parts[0]
    if not (isinstance(x, tf.TensorSpec) and x.dtype.is_integer and x.shape.rank == 2
            and x.shape[1] is not None and x.shape[1] >= 2 * MIN_WIDTH):
        return None
    length = int(x.shape[1])
    for other in tf.nest.flatten(parts[1:]):
        shape = getattr(other, "shape", None)
        if shape is None or shape.rank is None or (shape.rank >= 2 and (
                shape[1] == length or None in shape[1:])):
            return (f"its labels or weights ({other}) are per token or of unknown shape: "
                    "only the token ids would be trimmed")
    return Tokens(0 if isinstance(spec, tuple) else None, length)


def choose_widths(lengths: np.ndarray, length: int) -> list[int]:
    """The widths batches are trimmed to: the bucket boundaries (multiples of 8) that bring
    the padding of rows of these lengths lowest, and ``length``, so that no row is ever cut.

    Args:
      lengths: a sample's row lengths, without padding.
      length: the padded length.

    Returns:
      At most ``BUCKETS`` ascending widths, the last ``length``.
    """
    from tfspeed.data import buckets

    bounds, _ = buckets.choose_boundaries(buckets.length_counts_of(lengths), length,
                                          num_buckets=BUCKETS - 1, multiple=MIN_WIDTH)
    return sorted(set(bounds) | {length})


def row_lengths(tokens: np.ndarray) -> np.ndarray:
    """Each row's length without its trailing padding."""
    nonzero = tokens != PAD
    last = tokens.shape[1] - np.argmax(nonzero[:, ::-1], axis=1)
    return np.where(nonzero.any(axis=1), last, 0)


def regroup(dataset, tokens: Tokens):
    """``dataset`` (batches of rows padded to ``tokens.length``) as batches of rows of about
    the same length, each trimmed to the width its longest row rounds up to."""
    import tensorflow as tf

    edges = tf.constant(tokens.widths, tf.int32)
    positions = tf.range(1, tokens.length + 1, dtype=tf.int32)

    def ids(parts):
        return parts if tokens.index is None else parts[tokens.index]

    def width(x):  # the first width at least as long as x's rows
        n = tf.reduce_max(tf.where(tf.not_equal(x, PAD), positions, 0))
        return tf.searchsorted(edges, tf.reshape(n, [1]), side="left")[0]

    def key(*parts):
        return tf.cast(width(ids(parts)), tf.int64)

    def trim(*parts):
        x = ids(parts)
        cut = x[:, :edges[width(x)]]
        if tokens.index is None:
            return cut
        return (*parts[:tokens.index], cut, *parts[tokens.index + 1:])

    rows = dataset.unbatch()
    grouped = rows.group_by_window(key, lambda _, window: window.batch(tokens.batch),
                                   window_size=tokens.batch)
    return grouped.map(trim, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


def by_length(dataset, source, model, report, probe_seconds: float):
    """``dataset`` batched by length where ``source``'s elements hold padded text and
    ``model`` gives the same outputs on them trimmed, and its steps measure faster.

    Args:
      dataset: the pipeline optimize returns so far (``source`` itself, or its stored form).
      source: the user's dataset (sampled through a copy, never iterated itself).
      model: the user's compiled Keras model, or None (then only the padding is reported).
      report: optimize's ``Report``: a line goes to ``changed`` or ``unchanged``.
      probe_seconds: each contender's timing, where no timing is kept beside the store.

    Returns:
      ``(dataset, model)``: rewritten, or as given. The model is a rebuilt one, sharing the
      user's layers and optimizer, where the user's was built for the fixed length only.
    """
    tokens = find(source.element_spec)
    if tokens is None:
        return dataset, model
    if isinstance(tokens, str):
        return _refused(dataset, model, report, tokens)
    if model is None:  # said from the spec alone: a sample costs batches of the user's work
        return _refused(dataset, model, report, f"padded to {tokens.length}: give the model, "
                        "`ds, model = tfspeed.optimize(ds, model)`, to batch it by length")
    sample = _sample(source)
    if not sample:
        return dataset, model
    tokens.batch = max(len(_ids(b, tokens)) for b in sample)
    lengths = np.concatenate([row_lengths(_ids(b, tokens)) for b in sample])
    tokens.widths = choose_widths(lengths, tokens.length)
    after = _mean_width(lengths, tokens.widths)
    why = _padding(sample, tokens, after)
    if why:
        return _refused(dataset, model, report, why)
    padded = (f"padded to {tokens.length} (mean text {lengths.mean():.0f} tokens, "
              f"{1 - lengths.mean() / tokens.length:.0%} padding)")
    accepting = checked(model, sample, tokens)
    if isinstance(accepting, str):
        return _refused(dataset, model, report, accepting)
    timed = _timing(accepting, model, sample, tokens, report, probe_seconds)
    if isinstance(timed, str):
        return _refused(dataset, model, report, timed)
    before, after_rate = timed["before_per_s"], timed["after_per_s"]
    extra = timed["first_steps_s"][1] - timed["first_steps_s"][0]
    rates = (f"{before:,.0f} -> {after_rate:,.0f} examples/s in train steps, "
             f"{extra:+.1f} s of first steps for its shapes, once")
    if after_rate <= before:
        return _refused(dataset, model, report, f"{padded}: by length measured no faster "
                        f"({rates})")
    line = (f"text batched by length: mean padded length {tokens.length} -> {after:.0f} "
            f"({rates})")
    if accepting is not model:
        line += "; the model rebuilt for any length, sharing its layers and optimizer"
    report.changed.append(line)
    report.verdict += f"; {line}"
    return regroup(dataset, tokens), accepting


def _refused(dataset, model, report, why: str):
    report.unchanged.append(f"text: {why}")
    if model is not None:  # asked for: the printed line says why not
        report.verdict += f"; text not batched by length: {why}"
    return dataset, model


def checked(model, sample, tokens: Tokens):
    """The model that takes rows of any length and gives the same outputs on them trimmed.

    Args:
      model: the user's compiled Keras model.
      sample: a few of the pipeline's batches, as NumPy.
      tokens: where their padded token ids are.

    Returns:
      ``model`` itself, or the same layers under an input of any length; or why neither.
    """
    if getattr(model, "optimizer", None) is None or not getattr(model, "compiled", False):
        return ("the model is not compiled: compile it before tfspeed.optimize, so that its "
                "steps can be timed")
    accepting = _accepting(model, sample[0], tokens)
    if isinstance(accepting, str):
        return accepting
    return _differs(accepting, sample[:CHECK_BATCHES], tokens) or accepting


def _ids(batch, tokens: Tokens) -> np.ndarray:
    return batch if tokens.index is None else batch[tokens.index]


def _sample(source) -> list:
    """A few of the user's batches, read through a copy of the pipeline (iterating the user's
    own object would advance its shuffles' seeds), as NumPy."""
    import tensorflow as tf

    from tfspeed.attach import graph

    batches = graph.copy(source).take(SAMPLE_BATCHES)
    return [tf.nest.map_structure(np.asarray, b) for b in batches]


def _mean_width(lengths: np.ndarray, widths: list[int]) -> float:
    """The mean width a row is batched at: its length rounded up to a width (each batch holds
    rows of one width)."""
    edges = np.asarray(widths)
    return float(edges[np.searchsorted(edges, lengths, side="left")].mean())


def _padding(sample, tokens: Tokens, after: float) -> str:
    """Why there is too little trailing padding to trim ('' when there is enough)."""
    x = np.concatenate([_ids(b, tokens) for b in sample])
    leading = np.mean((x[:, 0] == PAD) & (x[:, -1] != PAD))
    if leading > 0.5:
        return ("its rows are padded at the start (pad_sequences' padding='pre'): pad at "
                "the end (padding='post') to batch them by length")
    if after > WORTH * tokens.length:
        return (f"its rows fill most of their {tokens.length} positions (batched by length "
                f"they would still average {after:.0f}): nothing worth trimming")
    return ""


def _trimmed(batch, tokens: Tokens, width: int | None = None):
    x = _ids(batch, tokens)
    width = width or max(1, int(row_lengths(x).max()))
    return x[:, :width]


def _accepting(model, batch, tokens: Tokens):
    """``model`` where it takes rows of any length; else the same layers under an input of
    any length, compiled as ``model``; else why not."""
    import keras

    try:
        model(_trimmed(batch, tokens, MIN_WIDTH), training=False)
        return model
    except Exception:  # noqa: BLE001  Keras says "expected shape=(None, 256)"; rebuilt below
        pass
    try:
        given = model.inputs[0]
        rows = keras.Input((None,), dtype=given.dtype, name=getattr(given, "name", None))
        if isinstance(model, keras.Sequential):
            rebuilt = keras.Sequential([rows, *model.layers], name=model.name)
        else:
            rebuilt = keras.models.clone_model(model, input_tensors=rows,
                                               clone_function=lambda layer: layer)
        rebuilt(_trimmed(batch, tokens, MIN_WIDTH), training=False)
    except Exception as e:  # noqa: BLE001  a Flatten or Dense over the sequence
        return (f"the model takes only rows of {tokens.length} tokens, and rebuilt for any "
                f"length it fails ({str(e).splitlines()[0][:100]})")
    # Compiled as the user's, with its optimizer: fit trains the same variables and slots.
    rebuilt.compile(**{**model._compile_config.config, "optimizer": model.optimizer})
    return rebuilt


def _differs(model, batches, tokens: Tokens) -> str:
    """Why ``model``'s outputs change when padding is trimmed ('' when they do not), at its
    weights and at perturbed ones; the weights are given back as they were."""
    import keras

    why = _compare(model, batches, tokens)
    if why:
        return why
    weights = [v for v in model.trainable_variables
               if "float" in str(v.dtype) and len(v.shape) > 0]
    kept = [keras.ops.convert_to_numpy(v) for v in weights]
    rng = np.random.default_rng(0)
    try:
        for v, w in zip(weights, kept, strict=True):
            spread = float(np.std(w)) or 1.0
            v.assign((w + NOISE * spread * rng.standard_normal(w.shape)).astype(w.dtype))
        why = _compare(model, batches, tokens)
    finally:
        for v, w in zip(weights, kept, strict=True):
            v.assign(w)
    return why and f"{why}, at perturbed weights"


def _compare(model, batches, tokens: Tokens) -> str:
    """Each batch's rows that trimming shortens, padded against trimmed to their longest: a
    batch trimmed to its own longest row is itself wherever one row fills every position."""
    import tensorflow as tf

    compared = 0
    for batch in batches:  # the compiled predict step: an RNN runs eagerly step by step
        x = _ids(batch, tokens)
        lengths = row_lengths(x)
        rows = x[lengths < x.shape[1]]
        if not len(rows):
            continue
        compared += len(rows)
        full = model.predict_on_batch(rows)
        cut = model.predict_on_batch(rows[:, :max(1, int(lengths[lengths < x.shape[1]].max()))])
        for a, b in zip(tf.nest.flatten(full), tf.nest.flatten(cut), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            if a.shape != b.shape:
                return (f"the model's outputs are per token ({a.shape[1:]} padded, "
                        f"{b.shape[1:]} trimmed)")
            bound = TOLERANCE * (np.abs(a) + np.abs(a).mean())
            close = (np.abs(a - b) <= bound) | (np.isnan(a) & np.isnan(b))
            if not close.all():
                worst = float(np.nanmax(np.abs(a - b) / np.maximum(np.abs(a), 1e-12)))
                return ("the model's outputs change when padding is trimmed (by up to "
                        f"{worst:.1e} relative): it does not mask padding")
    if not compared:
        return (f"no sampled row is shorter than {tokens.length} tokens: the model's outputs "
                "on trimmed padding could not be checked")
    return ""


def _timing(accepting, model, sample, tokens: Tokens, report, seconds: float) -> dict | str:
    """Train steps on the sample, padded and by length, on copies of the model: kept beside
    the store, so timed once per store and model."""
    from tfspeed.util import files

    path = (os.path.join(report.store, TIMING.format(_model_key(model)))
            if report.store else None)
    if path and os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    try:
        timed = _time_steps(accepting, model, sample, tokens, seconds)
    except Exception as e:  # noqa: BLE001  a model that trains only at the fixed length
        return f"its train step fails on rows by length ({str(e).splitlines()[0][:100]})"
    if path:
        files.write_json_atomic(path, timed)
    return timed


def _model_key(model) -> str:
    """The model's layers, weights' shapes and loss, without the names Keras numbers per
    process (``gru_3``): the same code gives the same key in every run."""
    parts = []
    for layer in model.layers:
        try:
            config = {k: v for k, v in layer.get_config().items() if k != "name"}
        except Exception:  # noqa: BLE001  a custom layer without a config
            config = {}
        parts.append([type(layer).__name__, config, [list(w.shape) for w in layer.weights]])
    loss = model._compile_config.config.get("loss")  # a name, a function or a Loss
    described = loss.get_config() if hasattr(loss, "get_config") else getattr(
        loss, "__name__", loss if isinstance(loss, str) else None)
    parts += [type(loss).__name__, described, type(model.optimizer).__name__]
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _time_steps(accepting, model, sample, tokens: Tokens, seconds: float) -> dict:
    """Examples/s of train steps, padded and by length, each on a fresh copy of ``accepting``
    compiled as ``model``, interleaved, the best of two rounds each. The first step of each
    shape (a trace, or a compile: once per run, not per step) is timed apart."""
    padded = [b for b in sample if len(_ids(b, tokens)) == tokens.batch] or sample
    grouped = _grouped(sample, tokens)
    contenders = {"before": (_copy(accepting, model), padded),
                  "after": (_copy(accepting, model), grouped)}
    warm = {name: _warm(m, batches) for name, (m, batches) in contenders.items()}
    rates = {name: 0.0 for name in contenders}
    for _ in range(2):
        for name, (m, batches) in contenders.items():
            rates[name] = max(rates[name], _rate(m, batches, seconds / 2, tokens))
    return {"before_per_s": rates["before"], "after_per_s": rates["after"],
            "first_steps_s": [warm["before"], warm["after"]]}


def _grouped(sample, tokens: Tokens) -> list:
    """The sample's examples batched by length; its full batches where there are any."""
    import tensorflow as tf

    rows = tf.nest.map_structure(lambda *b: np.concatenate(b), *sample)
    ds = regroup(tf.data.Dataset.from_tensor_slices(rows).batch(tokens.batch), tokens)
    out = [tf.nest.map_structure(np.asarray, b) for b in ds]
    return [b for b in out if len(_ids(b, tokens)) == tokens.batch] or out


def _copy(accepting, model):
    import keras

    twin = keras.models.clone_model(accepting)
    optimizer = type(model.optimizer).from_config(model.optimizer.get_config())
    twin.compile(**{**model._compile_config.config, "optimizer": optimizer})
    return twin


def _step(model, batch):
    parts = batch if isinstance(batch, tuple) else (batch,)
    model.train_on_batch(*parts)


def _warm(model, batches) -> float:
    """Seconds of the first step of each shape."""
    seen, start = set(), time.perf_counter()
    for batch in batches:
        shape = tuple(np.shape(b) for b in (batch if isinstance(batch, tuple) else (batch,)))
        if shape not in seen:
            seen.add(shape)
            _step(model, batch)
    return time.perf_counter() - start


def _rate(model, batches, seconds: float, tokens: Tokens) -> float:
    """Examples/s over the batches, cycled for ``seconds``."""
    n, start = 0, time.perf_counter()
    while True:
        for batch in batches:
            _step(model, batch)
            n += len(_ids(batch, tokens))
            if time.perf_counter() - start >= seconds:
                return n / (time.perf_counter() - start)
