"""Variable-length token sequences -> batches with one contract: pad, pad_fixed, bucket, pack.

Every mode yields ``(inputs, targets)`` batches::

    inputs  = {"tokens": int32 [B, T], "segment_ids": int32 [B, T], "positions": int32 [B, T]}
    targets = {"label": int32 [B, S], "weight": float32 [B, S]}   # classification
    targets = {"label": int32 [B, T], "weight": float32 [B, T]}   # lm: the next token

``segment_ids`` is 0 at padding and 1..S for the sequences of a row (always 1 unless packed);
``positions`` counts from 0 within each sequence (0 at padding); ``weight`` is 1.0 where a
real sequence (classification) or token (lm) is. T is ``max_length`` for ``pad_fixed`` and
``pack``, the bucket's boundary for ``bucket`` (a handful of shapes: one trace per bucket) and
the batch's longest for ``pad`` (the TF guide's ``padded_batch``, the baseline).

The input of every mode is ``to_examples``' per-sequence elements, so the canonical order is
parse -> ``to_examples`` -> cache -> shuffle(seed) -> repeat -> bucket/pack -> prefetch; the
task (classification or lm) is read from the element spec. The per-sequence cost is one
``map`` (``to_examples``) and, for ``bucket``, the grouping key; the rest runs per batch, and
``pack``'s first-fit runs once per window of sequences (numpy), not once per sequence.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

from tfspeed.data import buckets, long_texts

AUTOTUNE = tf.data.AUTOTUNE
TASKS = ("classification", "lm")
LONG_POLICIES = long_texts.POLICIES
Element = dict[str, tf.Tensor]
Batch = tuple[Element, Element]
_PAD = -1  # tokens are padded with -1 inside a batch, so id 0 needs no special meaning


def make_to_example(task: str) -> Callable[[Element], Element]:
    """A parsed record ``{"tokens": int64 [L], "label": int64 []}`` -> one sequence.

    Args:
      task: ``"classification"`` (keeps ``label``) or ``"lm"`` (causal: inputs ``t[:-1]``,
        labels ``t[1:]``, shifted here, before any batching, so that a packed row never
        predicts across sequences).

    Returns:
      An op ``record -> {"tokens": int32 [L'], "label": int32 [] | [L']}``: the one cast to
      int32 of the pipeline. Fuse it into the parse map where there is one.
    """
    if task not in TASKS:
        raise ValueError(f"task={task!r} is not one of {TASKS}")

    def to_example(record: Element) -> Element:
        tokens = tf.cast(record["tokens"], tf.int32)
        if task == "lm":
            return {"tokens": tokens[:-1], "label": tokens[1:]}
        return {"tokens": tokens, "label": tf.cast(record["label"], tf.int32)}

    return to_example


def to_examples(ds: tf.data.Dataset, task: str, deterministic: bool = True) -> tf.data.Dataset:
    """``ds`` of parsed records -> per-sequence elements (see ``make_to_example``)."""
    return ds.map(make_to_example(task), num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def _is_lm(ds: tf.data.Dataset) -> bool:
    """The task, from the spec: lm labels are sequences, classification labels scalars."""
    return ds.element_spec["label"].shape.rank == 1


def _fit(x: tf.Tensor, length, value: int) -> tf.Tensor:
    """``x`` [B, t] cut or padded with ``value`` to [B, length]."""
    x = x[:, :length]
    x = tf.pad(x, [[0, 0], [0, length - tf.shape(x)[1]]], constant_values=value)
    return tf.ensure_shape(x, [None, length]) if isinstance(length, int) else x


def _finish(batch: Element, lm: bool, length=None) -> Batch:
    """A padded batch (tokens padded with ``_PAD``) -> the batch contract, optionally cut or
    padded to ``length``. Runs once per batch: vectorised over [B, T]."""
    tokens, label = batch["tokens"], batch["label"]
    if length is not None:
        tokens = _fit(tokens, length, _PAD)
        label = _fit(label, length, 0) if lm else label
    real = tf.cast(tokens >= 0, tf.int32)
    positions = tf.range(tf.shape(tokens)[1], dtype=tf.int32)[None, :] * real
    inputs = {"tokens": tokens * real, "segment_ids": real, "positions": positions}
    if lm:
        return inputs, {"label": label * real, "weight": tf.cast(real, tf.float32)}
    return inputs, {"label": label[:, None], "weight": tf.ones_like(label, tf.float32)[:, None]}


def _padding_values(ds):
    lm = _is_lm(ds)
    return {"tokens": tf.constant(_PAD, tf.int32), "label": tf.constant(0, tf.int32)}, lm


def pad(ds: tf.data.Dataset, batch_size: int, drop_remainder: bool = False,
        deterministic: bool = True) -> tf.data.Dataset:
    """The TF guide's ``padded_batch``: each batch padded to its longest sequence (dynamic T).

    Args:
      ds: per-sequence elements from ``to_examples``.
      batch_size: sequences per batch.
      drop_remainder: drop a last short batch (static B, as ``tf.distribute`` wants).

    Returns:
      ``(inputs, targets)`` batches of shape [B, None].
    """
    values, lm = _padding_values(ds)
    ds = ds.padded_batch(batch_size, padding_values=values, drop_remainder=drop_remainder)
    return ds.map(lambda b: _finish(b, lm), num_parallel_calls=AUTOTUNE,
                  deterministic=deterministic)


def pad_fixed(ds: tf.data.Dataset, batch_size: int, max_length: int,
              drop_remainder: bool = True, deterministic: bool = True) -> tf.data.Dataset:
    """Every batch padded (longer sequences truncated) to ``max_length``: T static.

    Truncation happens per batch (a slice), not per sequence.

    Returns:
      ``(inputs, targets)`` batches of shape [B, max_length].
    """
    values, lm = _padding_values(ds)
    ds = ds.padded_batch(batch_size, padding_values=values, drop_remainder=drop_remainder)
    return ds.map(lambda b: _finish(b, lm, max_length), num_parallel_calls=AUTOTUNE,
                  deterministic=deterministic)


def bucket(ds: tf.data.Dataset, boundaries: Sequence[int], tokens_per_batch: int,
           batch_multiple: int = 1, drop_remainder: bool = True,
           deterministic: bool = True, batch_size: int = 0) -> tf.data.Dataset:
    """Sequences grouped by length; each batch padded to its bucket's boundary.

    Bucket i holds lengths in ``(boundaries[i-1], boundaries[i]]`` (inclusive: a sequence of
    length == boundary fits); longer than the last boundary are truncated to it. Built on
    ``group_by_window`` rather than ``bucket_by_sequence_length(pad_to_bucket_boundary=True)``:
    that one pads to ``boundary - 1`` and fails on a sequence beyond the last boundary, so it
    needs a per-sequence truncation first; here the cut and the pad run once per batch.

    Args:
      ds: per-sequence elements from ``to_examples`` (shuffled first, if training).
      boundaries: ascending bucket lengths, e.g. from ``buckets.choose_boundaries``.
      tokens_per_batch: the token budget of a batch (see ``buckets.bucket_batch_sizes``).
      batch_multiple: every batch size is a multiple of this (the number of replicas).
      drop_remainder: drop each bucket's last short batch at the end of the input.
      batch_size: sequences per batch instead of a token budget, fewer in buckets so wide
        that they would hold more than ``buckets.WIDE_BATCH`` budgets (0: the budget decides).

    Returns:
      ``(inputs, targets)`` batches of shape [B_i, boundaries[i]]; the spec says [None, None],
      but only ``len(boundaries)`` shapes occur.
    """
    bounds = sorted(int(b) for b in boundaries)
    edges = tf.constant(bounds, tf.int32)
    sizes = tf.constant(buckets.bucket_batch_sizes(bounds, tokens_per_batch, batch_multiple,
                                                   batch_size), tf.int64)
    last = len(bounds) - 1
    values, lm = _padding_values(ds)

    def key(element):
        above = tf.reduce_sum(tf.cast(tf.size(element["tokens"]) > edges, tf.int64))
        return tf.minimum(above, last)

    def reduce(bucket_id, window):
        return window.padded_batch(sizes[bucket_id], padding_values=values,
                                   drop_remainder=drop_remainder)

    def finish(batch):
        # The batch's width says its bucket: every sequence in it lies in that bucket.
        width = tf.shape(batch["tokens"])[1]
        length = edges[tf.minimum(tf.reduce_sum(tf.cast(width > edges, tf.int32)), last)]
        return _finish(batch, lm, length)

    ds = ds.group_by_window(key, reduce, window_size_func=lambda bucket_id: sizes[bucket_id])
    return ds.map(finish, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def group(ds: tf.data.Dataset, size: int) -> tf.data.Dataset:
    """Per-sequence elements -> groups of ``size``, padded with -1 to the group's longest:
    one tensor per group for work done a group at a time (the long policy here, a transfer
    from tf.data service workers). Undone by ``ungroup``."""
    pad = tf.constant(_PAD, tf.int32)
    return ds.padded_batch(size, padding_values={"tokens": pad, "label": pad})


def ungroup(groups: tf.data.Dataset) -> tf.data.Dataset:
    """``group``'s groups -> the per-sequence elements again (padding cut off).

    The lengths are counted per group; the cut is one slice per sequence: on this process
    the cheapest way back to plain tensors measured (about 2× the sequences/s of unbatching
    a RaggedTensor, whose elements ``padded_batch`` also refuses; measured once on 2
    cores, not benchmarked).
    """

    def lengths(batch):
        counted = tf.reduce_sum(tf.cast(batch["tokens"] >= 0, tf.int32), axis=1)
        return {**batch, "length": counted}

    def cut(element):
        n = element["length"]
        label = element["label"]
        return {"tokens": element["tokens"][:n], "label": label[:n] if label.shape.rank else label}

    return groups.map(lengths).unbatch().map(cut)


def apply_long(ds: tf.data.Dataset, max_length: int, long: str,
               deterministic: bool = True) -> tf.data.Dataset:
    """The long-text policy (``tfspeed.data.long_texts``) on per-sequence elements, before
    any batching: a sequence longer than ``max_length`` becomes its pieces (or is cut, or
    dropped), by the same numpy function the converter and the packer use.

    Per sequence, before any window is padded: one text of 400,000 tokens in a window of
    1,024 padded to its length took gigabytes. The numpy call runs only for the sequences
    over the limit; add the stage only where the split has one (its lengths tell).
    """
    lm = _is_lm(ds)

    def cut(tokens, labels):
        made = long_texts.pieces([tokens.size], max_length, long)
        column = np.arange(max_length)[None, :]
        inside = column < made.length[:, None]
        at = np.minimum(made.offset[:, None] + column, tokens.size - 1)
        pieces = np.where(inside, tokens[at], _PAD).astype(np.int32)
        if lm:
            return pieces, np.where(inside, labels[at], _PAD).astype(np.int32)
        return pieces, np.repeat(labels, made.length.size).astype(np.int32)

    def rows(element):
        tokens, labels = element["tokens"], element["label"]

        def over():
            made = tf.numpy_function(cut, [tokens, labels], [tf.int32, tf.int32],
                                     stateful=False)
            return (tf.ensure_shape(made[0], [None, max_length]),
                    tf.ensure_shape(made[1], [None, max_length] if lm else [None]))

        def within():
            return tf.pad(tokens[None], [[0, 0], [0, max_length - tf.size(tokens)]],
                          constant_values=_PAD), (
                tf.pad(labels[None], [[0, 0], [0, max_length - tf.size(labels)]],
                       constant_values=_PAD) if lm else labels[None])

        pieces, labels = tf.cond(tf.size(tokens) > max_length, over, within)
        return {"tokens": pieces, "label": labels}

    return ungroup(ds.map(rows, num_parallel_calls=AUTOTUNE, deterministic=deterministic))


@dataclasses.dataclass
class TokenStats:
    """A thread-safe tally of real and computed tokens (and what ``pack`` dropped).

    ``pack(stats=...)`` fills it once per window as it packs; any mode's batches can be
    added with ``add_batch``. Counts are for this process (not tf.data service workers).
    """

    sequences: int = 0  # sequences read (before the long policy)
    skipped: int = 0  # sequences dropped by long="skip"
    truncated_tokens: int = 0  # tokens cut by long="truncate"
    real_tokens: int = 0
    computed_tokens: int = 0  # rows × max_length (padding included)
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, **counts: int) -> None:
        with self._lock:
            for name, value in counts.items():
                setattr(self, name, getattr(self, name) + int(value))

    def add_batch(self, inputs: Element) -> None:
        real, computed = count_tokens(inputs)
        self.add(real_tokens=real, computed_tokens=computed)

    @property
    def padding_fraction(self) -> float:
        return 1.0 - self.real_tokens / self.computed_tokens if self.computed_tokens else 0.0


def count_tokens(inputs: Element) -> tuple[tf.Tensor, tf.Tensor]:
    """``(real, computed)`` tokens of a batch's inputs: one reduction, cheap per step."""
    segments = inputs["segment_ids"]
    return tf.math.count_nonzero(segments, dtype=tf.int64), tf.size(segments, tf.int64)


def padding_fraction(inputs: Element) -> tf.Tensor:
    """The fraction of a batch's [B, T] positions that are padding (float32 scalar)."""
    real, computed = count_tokens(inputs)
    return 1.0 - tf.cast(real, tf.float32) / tf.cast(computed, tf.float32)


def pack(ds: tf.data.Dataset, max_length: int, rows_per_batch: int, window: int = 1024,
         max_segments: int | None = None, long: str = "truncate",
         stats: TokenStats | None = None, drop_remainder: bool = True,
         deterministic: bool = True) -> tf.data.Dataset:
    """Whole sequences packed first-fit-decreasing into rows of ``max_length`` tokens.

    ``window`` sequences at a time are packed by one numpy call (a per-window cost);
    rows leave in the order of their first sequence, so a batch mixes long and short
    sequences; the output depends only on the input order (seed the shuffle before). The
    numpy call (``tf.numpy_function``, under the GIL) ties ``pack`` to
    this Python process: with the tf.data service, pack after the service's output.

    Args:
      ds: per-sequence elements from ``to_examples``.
      max_length: T, tokens per row.
      rows_per_batch: B.
      window: sequences packed together (more: less padding, more latency and memory).
      max_segments: S, sequences per row at most (default ``max(1, max_length // 8)``); a
        row with S sequences is full.
      long: a sequence longer than a row is cut to ``max_length`` ("truncate"), cut into
        ``max_length`` pieces, each its own sequence ("split"), or dropped ("skip").
      stats: if given, tallies sequences, skipped, truncated and real/computed tokens.
      drop_remainder: drop a last short batch (static B).

    Returns:
      ``(inputs, targets)`` batches of static shape [B, max_length] (targets [B, S] for
      classification).
    """
    if long not in LONG_POLICIES:
        raise ValueError(f"long={long!r} is not one of {LONG_POLICIES}")
    segments = max_segments or max(1, max_length // 8)
    lm = _is_lm(ds)
    packer = Packer(max_length, segments, long, lm, stats)
    out_types = [tf.int32, tf.int32, tf.int32, tf.int32, tf.float32]
    width = max_length if lm else segments

    def pack_window(group):
        rows = tf.numpy_function(packer, [group["tokens"], group["label"]], out_types,
                                 stateful=False)
        rows = [tf.ensure_shape(r, [None, max_length]) for r in rows[:3]] + [
            tf.ensure_shape(r, [None, width]) for r in rows[3:]]
        inputs = dict(zip(("tokens", "segment_ids", "positions"), rows[:3], strict=True))
        return inputs, {"label": rows[3], "weight": rows[4]}

    # A window arrives padded with -1 to its longest sequence: ``padded_batch`` costs far less
    # per sequence than ``ragged_batch``, which maps every element to a RaggedTensor (measured
    # once on 2 cores, not benchmarked).
    # The price is memory: window × the window's longest sequence, per tensor.
    values = {"tokens": tf.constant(_PAD, tf.int32), "label": tf.constant(_PAD, tf.int32)}
    ds = ds.padded_batch(window, padding_values=values).map(
        pack_window, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    return ds.rebatch(rows_per_batch, drop_remainder=drop_remainder)


class Packer:
    """The numpy side of ``pack``: one window of sequences (padded with -1) -> rows."""

    def __init__(self, max_length, max_segments, long, lm, stats):
        self.t, self.s, self.long, self.lm, self.stats = max_length, max_segments, long, lm, stats

    def __call__(self, tokens, labels):
        real = tokens >= 0  # each row: its sequence, then -1s
        flat = tokens[real]
        labels = labels[real] if self.lm else labels
        splits = np.concatenate([[0], np.cumsum(real.sum(axis=1))])
        starts, lengths, source = self._pieces(splits)
        row, segment, offset, rows = self._first_fit(lengths)
        # Rows in the order of their first sequence: long and short ones mix in a batch.
        first = np.full(rows, len(source), np.int64)
        np.minimum.at(first, row, source)
        rank = np.empty(rows, np.int64)
        rank[np.argsort(first, kind="stable")] = np.arange(rows)
        row = rank[row]
        piece = np.repeat(np.arange(len(lengths)), lengths)  # per token: its piece
        position = np.arange(piece.size) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        r, c, src = row[piece], offset[piece] + position, starts[piece] + position
        out = [np.zeros((rows, self.t), np.int32) for _ in range(3)]
        out[0][r, c], out[1][r, c], out[2][r, c] = flat[src], segment[piece] + 1, position
        if self.lm:
            label = np.zeros((rows, self.t), np.int32)
            label[r, c] = labels[src]
            weight = (out[1] > 0).astype(np.float32)
        else:
            label = np.zeros((rows, self.s), np.int32)
            weight = np.zeros((rows, self.s), np.float32)
            label[row, segment], weight[row, segment] = labels[source], 1.0
        if self.stats is not None:
            self.stats.add(real_tokens=piece.size, computed_tokens=rows * self.t)
        return out + [label, weight]

    def rows(self, lengths: np.ndarray) -> int:
        """Rows the first-fit makes of sequences of ``lengths`` (each at most a row)."""
        return self._first_fit(np.minimum(np.asarray(lengths, np.int64), self.t))[3]

    def _pieces(self, splits):
        """Start, length and source sequence of each piece after the ``long`` policy."""
        lengths = np.diff(splits)
        made = long_texts.pieces(lengths, self.t, self.long)
        if self.stats is not None:
            done = long_texts.events(lengths, self.t, self.long)
            self.stats.add(sequences=lengths.size, skipped=done["skipped"],
                           truncated_tokens=done["truncated_tokens"])
        keep = made.length > 0
        return ((splits[made.source] + made.offset)[keep], made.length[keep],
                made.source[keep])

    def _first_fit(self, lengths):
        """First-fit decreasing: the row, segment index and offset of each piece.

        The leftmost row with room is found in a max-tree over the rows' free space: O(log n)
        per piece, not a scan of the open rows.
        """
        n = lengths.size
        size = 1 << max(0, (n - 1).bit_length())
        free = [0] * size + [self.t] * n + [-1] * (size - n)  # leaves: free tokens per row
        for node in range(size - 1, 0, -1):
            free[node] = max(free[2 * node], free[2 * node + 1])
        used = [0] * n  # segments per row
        row, segment, offset = [0] * n, [0] * n, [0] * n
        sizes = lengths.tolist()
        for i in np.argsort(-lengths, kind="stable").tolist():
            length, node = sizes[i], 1
            while node < size:  # every piece fits a fresh row, so the root always has room
                node = 2 * node if free[2 * node] >= length else 2 * node + 1
            r = node - size
            row[i], segment[i], offset[i] = r, used[r], self.t - free[node]
            used[r] += 1
            free[node] = free[node] - length if used[r] < self.s else -1  # -1: row is full
            node >>= 1
            while node:  # up to the root, while the max changes
                left, right = free[2 * node], free[2 * node + 1]
                most = left if left >= right else right
                if free[node] == most:
                    break
                free[node] = most
                node >>= 1
        row = np.asarray(row, np.int64)
        return row, np.asarray(segment, np.int64), np.asarray(offset, np.int64), (
            int(row.max()) + 1 if n else 0)
