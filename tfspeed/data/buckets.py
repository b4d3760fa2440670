"""Bucket planning, in numpy: the boundaries that bring a length histogram's padding lowest
(``choose_boundaries``, an exact dynamic programme) and the sequences each bucket's batch
holds (``bucket_batch_sizes``).

No TensorFlow: ``data.text.resolve`` plans the buckets (and predicts their padding) from a
split's lengths before any pipeline is built; ``sequences.bucket`` batches by them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# A bucket of ``batch_size`` sequences holds at most WIDE_BATCH times the tokens of a batch of
# mean-length ones (``tokens_per_batch``), and at least ``batch_size // WIDE_BATCH`` sequences.
# Short texts have a long tail: at 32 texts in every bucket, a few hundred texts of 200-512
# tokens cannot fill two batches a pass in narrow buckets, so they shared wide ones (pydocs:
# 18% padding, most of it in batches of 32 x 512 tokens, whose attention costs most). Smaller
# batches there keep the tail's buckets narrow (11%, simulated on the split's lengths) and
# bound a batch's memory; every text still weighs 1 / batch_size in the loss.
WIDE_BATCH = 4


def bucket_batch_sizes(boundaries: Sequence[int], tokens_per_batch: int,
                       batch_multiple: int = 1, batch_size: int = 0) -> list[int]:
    """Sequences per batch of each bucket: ``batch_size`` if given (fewer in wide buckets,
    see ``WIDE_BATCH``; all of them where ``tokens_per_batch`` is 0), else
    ``tokens_per_batch // boundary``; rounded down to a multiple of ``batch_multiple`` (e.g.
    the number of replicas), and at least that."""
    def size(b):
        if not batch_size:
            return tokens_per_batch // b
        if not tokens_per_batch:
            return batch_size
        return min(batch_size, max(batch_size // WIDE_BATCH, WIDE_BATCH * tokens_per_batch // b))

    return [max(batch_multiple, size(b) // batch_multiple * batch_multiple) for b in boundaries]


def length_counts_of(lengths) -> np.ndarray:
    """The one length-histogram format: ``counts[n]`` sequences of length n, from lengths."""
    return np.bincount(np.asarray(lengths, np.int64).reshape(-1)).astype(float)


def choose_boundaries(counts, max_length: int, num_buckets: int = 5,
                      multiple: int = 8, tokens_per_batch: int = 0,
                      min_batches: float = 0.0, batch_size: int = 0) -> tuple[list[int], float]:
    """Bucket boundaries that minimise the expected padding for per-length counts.

    An exact dynamic programme over candidate boundaries (multiples of ``multiple``, for
    hardware-friendly shapes, plus the last one): cost = sum over lengths of count × the
    boundary it is padded to. The last boundary covers the longest sequence (up to
    ``max_length``: longer ones are the long policy's, applied before bucketing).

    Args:
      counts: ``counts[n]`` sequences of length n (``length_counts_of`` makes it from a list
        of lengths; ``tfspeed.data.text.length_counts`` from a split's schema).
      max_length: the longest T any batch may have.
      num_buckets: at most this many boundaries.
      multiple: candidate boundaries are multiples of this.
      tokens_per_batch, min_batches: with both, every bucket must hold at least
        ``min_batches`` of its batches (``bucket_batch_sizes`` with ``batch_size``;
        ``counts`` being one pass): a bucket that fills less often
        holds its sequences back for passes while the others' batches go on
        (``group_by_window`` emits full batches only).
        Where no set of boundaries can, the constraint is dropped.

    Returns:
      ``(boundaries, expected_padding_fraction)``: padded tokens / computed tokens, if every
      sequence were padded to its bucket's boundary.
    """
    counts = np.asarray(counts, float)
    over = counts[max_length + 1:].sum()
    counts = np.pad(counts[: max_length + 1], (0, max(0, max_length + 1 - counts.size)))
    counts[max_length] += over
    longest = int(np.flatnonzero(counts)[-1]) if counts.any() else 1
    top = min(max_length, -(-max(longest, 1) // multiple) * multiple)
    cands = [*range(multiple, top, multiple), top]
    below = np.concatenate([[0.0], np.cumsum(counts)])  # below[x]: sequences shorter than x
    bounds = np.asarray(cands, np.float64)
    upto = below[np.asarray(cands) + 1]  # sequences that fit each candidate
    n, k = len(cands), min(num_buckets, len(cands))
    # A bucket ending at cands[i] must hold this many sequences (0: no constraint).
    per_batch = np.maximum(1, bucket_batch_sizes(cands, tokens_per_batch, 1, batch_size))
    need = (min_batches * per_batch if (tokens_per_batch or batch_size) and min_batches
            else np.zeros(n))
    cost, back = _bucket_costs(upto, bounds, need, k)
    if not np.isfinite(cost[1:, n - 1]).any():  # nothing meets it: the least padding
        cost, back = _bucket_costs(upto, bounds, np.zeros(n), k)
    j = int(np.argmin(cost[1:, n - 1])) + 1  # fewer buckets if more would not help
    chosen, i = [], n - 1
    while j >= 1:
        chosen.append(cands[i])
        i, j = back[j, i], j - 1
    real = float(np.dot(np.arange(max_length + 1), counts))
    computed = float(cost[len(chosen), n - 1])
    return sorted(chosen), (1.0 - real / computed) if computed else 0.0


def _bucket_costs(upto, bounds, need, k: int):
    """``choose_boundaries``' dynamic programme: cost[j, i], the least padded size of
    everything up to candidate i in j buckets, the last ending there (inf where a bucket
    would hold fewer than ``need`` sequences); back[j, i], where the bucket before it ends."""
    n = len(bounds)
    cost = np.full((k + 1, n), np.inf)
    back = np.zeros((k + 1, n), np.int64)
    cost[1] = np.where(upto >= need, upto * bounds, np.inf)
    held = upto[None, :] - upto[:, None]  # [p, i]: sequences in a bucket (cands[p], cands[i]]
    # [p, i]: a previous bucket must end before i, and the bucket must fill often enough.
    invalid = np.tril(np.ones((n, n), bool)) | (held < need[None, :])
    for j in range(2, k + 1):
        total = cost[j - 1][:, None] + held * bounds[None, :]
        total[invalid] = np.inf
        back[j] = np.argmin(total, axis=0)
        cost[j] = total[back[j], np.arange(n)]
    return cost, back
