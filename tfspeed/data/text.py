"""Token records (text) -> batches: how a split is batched, chosen once from ``schema.json``.

The text branch of ``tfspeed.data.pipeline``: records are parsed, turned into per-sequence
examples (``sequences.to_examples``: the one cast to int32), cached, shuffled, repeated and
then batched by one of ``sequences``' modes, all to the batch contract documented there.
``resolve`` decides the mode (``--batching``), the row length (``--max_length``), the token
budget (``--tokens_per_batch``) and the buckets from the split's length histogram alone, so
the job, the model (its position table and segment count) and the report agree with the
pipeline without building it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfspeed.data import sequences
from tfspeed.errors import UsageError

INPUT_NAMES = ("tokens", "segment_ids", "positions")
MAX_BUCKETS = 16
BUCKET_PADDING_TARGET = 0.10  # the fewest buckets that keep expected padding below this
PACK_WINDOW = 1024  # sequences first-fit together (sequences.pack)


@dataclasses.dataclass(frozen=True)
class Batching:
    """How token records become batches, and why (global figures: all replicas).

    Attributes:
      mode: ``pad``, ``bucket`` or ``pack``.
      reason: one sentence, citing the expected padding of the alternatives.
      max_length: T of a packed row, the last bucket's boundary, the longest a padded batch
        gets; longer sequences follow ``long``.
      tokens_per_batch: the token budget of a bucket's or a packed batch.
      batch_size: sequences per padded batch (``pad``).
      rows_per_batch: rows per packed batch (``pack``), a multiple of the replicas.
      boundaries: the buckets' lengths (``bucket``).
      bucket_batch_sizes: sequences per batch of each bucket, multiples of the replicas.
      max_segments: S, sequences per row (1 unless packed).
      long: what happens to a sequence longer than ``max_length``.
      expected_padding: the fraction of computed tokens that would be padding, per mode,
        from the split's lengths (``pad``: each random batch padded to its longest).
    """

    mode: str
    reason: str
    max_length: int
    tokens_per_batch: int
    batch_size: int
    rows_per_batch: int
    boundaries: tuple[int, ...]
    bucket_batch_sizes: tuple[int, ...]
    max_segments: int
    long: str
    expected_padding: dict

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def is_text(schema) -> bool:
    """Whether ``schema`` holds token records (``encoding: tokens``)."""
    return not schema.named_inputs and schema.input_feature.encoding == "tokens"


def input_spec() -> dict[str, tuple]:
    """The model input of a token schema: three int32 [batch, T] tensors (T varies)."""
    return {name: (None,) for name in INPUT_NAMES}


def length_counts(schema, split: str) -> np.ndarray:
    """``counts[n]``: the sequences of length n that ``sequences.to_examples`` makes of the
    split (an lm's example is one token shorter than its record: inputs ``t[:-1]``).

    Exact from the per-length counts the converter records; from its power-of-2 histogram
    (spread evenly over each bin) where a schema has only that.
    """
    stats = schema.split(split).text or {}
    shift = 1 if schema.task == "lm" else 0
    if stats.get("lengths"):
        pairs = np.asarray(stats["lengths"], np.int64).reshape(-1, 2)
        counts = np.zeros(int(pairs[:, 0].max()) + 1)
        np.add.at(counts, np.maximum(pairs[:, 0] - shift, 0), pairs[:, 1])
        return counts
    histogram = stats.get("histogram")
    if not histogram:
        raise UsageError(f"schema.json has no token statistics for split {split!r}; reconvert "
                         "the text with this version of scripts/to_tfrecord.py")
    bounds, bins = histogram["bounds"], histogram["counts"]  # bounds[i-1] < length <= bounds[i]
    counts = np.zeros(int(bounds[-1]) + 1)
    for lo, hi, n in zip([0, *bounds[:-1]], bounds, bins, strict=True):
        if n:
            counts[max(lo + 1 - shift, 0):hi + 1 - shift] += n / (hi - lo)
    return counts


def piece_counts(counts: np.ndarray, max_length: int, long: str) -> np.ndarray:
    """Length counts after the ``long`` policy (``split``: a sequence of L > T becomes
    L // T pieces of T and one of L % T)."""
    out = np.zeros(max_length + 1)
    out[: min(len(counts), max_length + 1)] += counts[: max_length + 1]
    over = np.arange(len(counts)) > max_length
    if long == "truncate":
        out[max_length] += counts[over].sum()
    elif long == "split":
        lengths = np.flatnonzero(over)
        out[max_length] += float(np.dot(counts[lengths], lengths // max_length))
        np.add.at(out, lengths % max_length, counts[lengths])
        out[0] = 0.0
    return out


def expected_padding(counts: np.ndarray, batch_size: int) -> dict:
    """Expected padding fractions of ``counts`` (lengths after the long policy).

    Returns:
      ``{"pad", "fixed", "bucket", "boundaries"}``: ``pad`` pads a batch of ``batch_size``
      random sequences to its longest (E[max] from the length distribution), ``fixed`` every
      sequence to the longest allowed, ``bucket`` each to its bucket's boundary, with the
      fewest buckets (up to ``MAX_BUCKETS``) that bring it under ``BUCKET_PADDING_TARGET``.
    """
    max_length = len(counts) - 1
    total = counts.sum()
    if not total:
        return {"pad": 0.0, "fixed": 0.0, "bucket": 0.0, "boundaries": [max_length]}
    lengths = np.arange(max_length + 1)
    mean = float(np.dot(lengths, counts)) / total
    cdf = np.cumsum(counts) / total
    below = np.concatenate([[0.0], cdf[:-1]])
    longest = float(np.dot(lengths, cdf ** batch_size - below ** batch_size))
    histogram = {"edges": np.arange(max_length + 2), "counts": counts}
    for buckets in range(1, MAX_BUCKETS + 1):
        boundaries, bucket = sequences.choose_boundaries(histogram, max_length, buckets)
        if bucket <= BUCKET_PADDING_TARGET:
            break
    return {"pad": round(float(1 - mean / longest), 4) if longest else 0.0,
            "fixed": round(float(1 - mean / max_length), 4), "bucket": round(float(bucket), 4),
            "boundaries": [int(b) for b in boundaries]}


def choose_batching(schema, split: str, takes_segments: bool, *, batch_size: int = 32,
                    max_length: int = 0, long: str = "split") -> tuple[str, str]:
    """What ``--batching=auto`` picks for ``split`` and why.

    Pack when the model takes segment ids (its attention and pooling keep packed
    sequences apart): padding-free whatever the lengths. Otherwise bucket when bucketing's
    expected padding is much below (at most half, and 5 points under) that of padding
    each batch to its longest; else pad (one shape fewer to trace, no grouping buffer).

    Args:
      schema: a token schema.
      split: whose length statistics decide.
      takes_segments: the model takes ``segment_ids`` and attends within segments.
      batch_size: sequences per padded batch (the longest of more sequences is longer).
      max_length: T (0: as ``resolve_max_length``).
      long: the policy for sequences longer than T.

    Returns:
      ``(mode, reason)``: the reason cites the expected padding figures.
    """
    counts = length_counts(schema, split)
    max_length = max_length or resolve_max_length(schema, counts)
    padding = expected_padding(piece_counts(counts, max_length, long), batch_size)
    return _choose(padding, takes_segments, batch_size)


def _choose(padding: dict, takes_segments: bool, batch_size: int) -> tuple[str, str]:
    pad, bucket, n = padding["pad"], padding["bucket"], len(padding["boundaries"])
    figures = (f"expected padding: {pad:.0%} padding each batch of {batch_size} to its "
               f"longest, {bucket:.0%} in {n} bucket(s) {padding['boundaries']}")
    if takes_segments:
        return "pack", f"auto: pack, the model takes segment ids ({figures}; packed ~0%)"
    if bucket <= pad / 2 and pad - bucket >= 0.05:
        return "bucket", f"auto: bucket, the model takes no segment ids ({figures})"
    return "pad", f"auto: pad, bucketing would not save much ({figures})"


def resolve_max_length(schema, counts: np.ndarray, requested: int = 0) -> int:
    """``requested``, else the conversion's ``--max_length``, else the longest example
    rounded up to a multiple of 8."""
    if requested:
        return requested
    converted = int(schema.text.get("max_length") or 0)
    longest = int(np.flatnonzero(counts)[-1]) if counts.any() else 1
    return converted or max(8, -(-longest // 8) * 8)


def resolve(config, schema, takes_segments: bool = False, replicas: int = 1) -> Batching:
    """The ``Batching`` of a DataConfig (``batching``, ``max_length``, ``tokens_per_batch``,
    ``long``, ``batch_size``) on a token schema, from its train split's lengths (every split
    is batched alike: one set of compiled shapes).

    Args:
      config: the data settings.
      schema: a token schema.
      takes_segments: the model takes segment ids (``auto`` then packs).
      replicas: every global batch is a multiple of this many sequences or rows.
    """
    split = config.train_split if config.train_split in schema.splits else next(
        iter(schema.splits))
    counts = length_counts(schema, split)
    max_length = resolve_max_length(schema, counts, config.max_length)
    tokens = config.tokens_per_batch or config.batch_size * max_length
    padding = expected_padding(piece_counts(counts, max_length, config.long), config.batch_size)
    mode, reason = config.batching, f"--batching={config.batching}"
    if mode == "auto":
        mode, reason = _choose(padding, takes_segments, config.batch_size)
    boundaries = tuple(padding["boundaries"])
    rows = max(replicas, tokens // max_length // replicas * replicas)
    return Batching(
        mode=mode, reason=reason, max_length=max_length, tokens_per_batch=tokens,
        batch_size=config.batch_size, rows_per_batch=rows,
        boundaries=boundaries if mode == "bucket" else (),
        bucket_batch_sizes=(tuple(sequences.bucket_batch_sizes(boundaries, tokens, replicas))
                            if mode == "bucket" else ()),
        max_segments=max(1, max_length // 8) if mode == "pack" else 1,
        long=config.long, expected_padding=padding)


def batches_per_epoch(batching: Batching, schema, split: str) -> int:
    """Training batches (drop-remainder) in one pass over ``split``, from its lengths: what an
    epoch is for token data, where a batch holds a token budget rather than a fixed number of
    records. ``pack`` is counted as if rows were full (its padding is a few per cent)."""
    counts = piece_counts(length_counts(schema, split), batching.max_length, batching.long)
    if batching.mode == "pad":
        return int(counts.sum()) // batching.batch_size
    if batching.mode == "bucket":
        lengths, total = np.arange(len(counts)), 0
        lower = 0
        for boundary, size in zip(batching.boundaries, batching.bucket_batch_sizes,
                                  strict=True):
            held = counts[(lengths > lower) & (lengths <= boundary)].sum()
            total += int(held) // size
            lower = boundary
        return total
    tokens = float(np.dot(np.arange(len(counts)), counts))
    return int(tokens // batching.max_length) // batching.rows_per_batch


def make_to_example(task: str):
    """A parsed record ``{"inputs": tokens, "label"?}`` -> ``sequences``' per-sequence
    element (tokens int32; an lm's inputs and next-token labels)."""
    import tensorflow as tf

    to_example = sequences.make_to_example(task)

    def convert(record):
        tokens = record["inputs"]
        if isinstance(tokens, tf.RaggedTensor):  # a record of a ragged group: its values
            tokens = tokens.flat_values
        return to_example({"tokens": tokens, "label": record.get("label", 0)})

    return convert


def to_service_groups(ds, size: int):
    """``make_to_example``'s elements -> groups of ``size``, padded with -1 to the group's
    longest: how sequences travel from tf.data service workers (one transfer per group, a
    plain batch, no per-sequence work on the worker). Undone by ``from_service_groups``."""
    import tensorflow as tf

    pad = tf.constant(sequences._PAD, tf.int32)
    return ds.padded_batch(size, padding_values={"tokens": pad, "label": pad})


def from_service_groups(groups):
    """``to_service_groups``' groups -> the per-sequence elements again (padding cut off).

    The lengths are counted per group; the cut is one slice per sequence: on this process
    the cheapest way back to plain tensors measured (about 2× the sequences/s of unbatching
    a RaggedTensor, whose elements ``padded_batch`` also refuses; measured once on 2
    cores, not benchmarked).
    """
    import tensorflow as tf

    def lengths(group):
        counted = tf.reduce_sum(tf.cast(group["tokens"] >= 0, tf.int32), axis=1)
        return {**group, "length": counted}

    def cut(element):
        n = element["length"]
        label = element["label"]
        return {"tokens": element["tokens"][:n], "label": label[:n] if label.shape.rank else label}

    return groups.map(lengths).unbatch().map(cut)


def batch(ds, batching: Batching, *, training: bool, longest: int, num_pipelines: int = 1,
          local_replicas: int = 1, deterministic: bool = True):
    """Per-sequence elements -> the batch contract, as ``batching`` says.

    Training batches are full (drop_remainder) and each pipeline's share of the global
    batch is one batch cut into ``local_replicas`` equal consecutive parts, which
    ``distribute_datasets_from_function`` hands to its replicas in turn: every replica of a
    step gets the same static [B, T]. Evaluation drops nothing: a short last batch (per
    bucket) is filled with empty rows (weight 0).

    Args:
      ds: ``make_to_example``'s elements (shuffled and repeated for training).
      batching: from ``resolve``.
      training: full batches only.
      longest: the longest example in the split (the long policy runs only if it is above
        ``max_length``).
      num_pipelines: input pipelines sharing the global batch (workers).
      local_replicas: replicas this pipeline feeds.
    """
    import tensorflow as tf

    t, drop = batching.max_length, training
    if longest > t and batching.mode != "pack":  # pack applies the policy while packing
        ds = _apply_long(ds, batching.long, t)
    if batching.mode == "pack":
        rows = batching.rows_per_batch // num_pipelines
        ds = sequences.pack(ds, t, rows, window=PACK_WINDOW, max_segments=batching.max_segments,
                            long=batching.long, drop_remainder=drop, deterministic=deterministic)
        ds = ds if drop else ds.map(lambda x, y: _fill((x, y), rows))
    elif batching.mode == "bucket":
        tokens = batching.tokens_per_batch // num_pipelines
        ds = sequences.bucket(ds, batching.boundaries, tokens, local_replicas, drop_remainder=drop,
                              deterministic=deterministic)
        if not drop:
            edges = tf.constant(batching.boundaries, tf.int32)
            sizes = tf.constant(sequences.bucket_batch_sizes(batching.boundaries, tokens,
                                                             local_replicas), tf.int32)

            def fill(x, y):
                index = tf.argmax(tf.cast(edges == tf.shape(x["tokens"])[1], tf.int32))
                return _fill((x, y), sizes[index])

            ds = ds.map(fill)
    else:
        size = batching.batch_size // num_pipelines
        ds = sequences.pad(ds, size, drop_remainder=drop, deterministic=deterministic)
        ds = ds if drop else ds.map(lambda x, y: _fill((x, y), size))
    return _per_replica(ds, local_replicas) if local_replicas > 1 else ds


def _apply_long(ds, long: str, max_length: int):
    """The long policy for pad and bucket (pack has its own): per sequence, so added only
    where the split has a sequence longer than ``max_length``."""
    import tensorflow as tf

    if long == "skip":
        return ds.filter(lambda e: tf.size(e["tokens"]) <= max_length)
    if long == "truncate":
        return ds.map(lambda e: {k: v[:max_length] if v.shape.rank else v for k, v in e.items()})

    def pieces(element):  # split: consecutive pieces of max_length, each its own sequence
        starts = tf.range(0, tf.size(element["tokens"]), max_length)
        return tf.data.Dataset.from_tensor_slices(starts).map(lambda start: {
            k: v[start:start + max_length] if v.shape.rank else v for k, v in element.items()})

    return ds.flat_map(pieces)


def _fill(batch, rows):
    """A batch with empty rows (zeros: padding, weight 0) added up to ``rows``."""
    import tensorflow as tf

    def fill(x):
        padding = [[0, rows - tf.shape(x)[0]]] + [[0, 0]] * (x.shape.rank - 1)
        x = tf.pad(x, padding)
        return tf.ensure_shape(x, [rows, *x.shape[1:]]) if isinstance(rows, int) else x

    return tf.nest.map_structure(fill, batch)


def _per_replica(ds, replicas: int):
    """Each batch -> ``replicas`` consecutive batches of an equal part of its rows."""
    import tensorflow as tf

    def split(*batch):
        def cut(x):
            rows = x.shape[0] // replicas if x.shape[0] is not None else -1
            return tf.reshape(x, tf.concat([[replicas, rows], tf.shape(x)[1:]], 0))

        out = tf.nest.map_structure(cut, batch)
        return tf.nest.map_structure(
            lambda a, b: tf.ensure_shape(a, [replicas, b.shape[0] // replicas
                                             if b.shape[0] is not None else None,
                                             *b.shape[1:]]), out, batch)

    return ds.map(split).unbatch()
