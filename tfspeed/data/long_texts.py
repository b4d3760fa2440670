"""The long-text policy (``--long``): what becomes of a sequence longer than a row can hold.

One implementation for every place that applies or predicts it: the converter (on a text's
token ids), the batching (``sequences.pack`` and the long stage of pad and bucket, one
window of sequences at a time) and the statistics behind ``--batching=auto`` and the report
(on a split's per-length counts). Numpy only: the converter's workers import it without
TensorFlow.

* ``truncate``: the first ``max_length`` tokens are kept.
* ``split``: consecutive pieces of ``max_length`` tokens, each its own sequence (the last
  holds the rest). ``overlap`` tokens are shared by neighbouring pieces: a language-model
  record (``<bos> ... <eos>``) is split with an overlap of 1, so every next-token pair stays
  inside a piece; examples already shifted into (inputs, labels) need none.
* ``skip``: the sequence is dropped.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfspeed.config import LONG_DEFAULT as DEFAULT  # noqa: F401 -- the converter's and driver's
from tfspeed.config import LONG_POLICIES as POLICIES


@dataclasses.dataclass(frozen=True)
class Pieces:
    """The pieces a policy makes of some sequences (one entry per piece, in order).

    Attributes:
      source: the index of the sequence each piece comes from.
      offset: where in that sequence the piece starts.
      length: the piece's tokens.
    """

    source: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def pieces(lengths, max_length: int, long: str, overlap: int = 0) -> Pieces:
    """The pieces of sequences of ``lengths`` under ``long`` (``max_length`` 0: no limit).

    Args:
      lengths: int [N], each sequence's tokens.
      max_length: the most tokens a piece holds (>= 2 when ``overlap`` is 1).
      long: one of ``POLICIES``.
      overlap: tokens shared by neighbouring pieces under ``split``.

    Returns:
      ``Pieces``: a sequence within the limit is one piece, whole.
    """
    if long not in POLICIES:
        raise ValueError(f"long={long!r} is not one of {POLICIES}")
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    source = np.arange(lengths.size)
    zeros = np.zeros_like(lengths)
    if not max_length or not (lengths > max_length).any():
        return Pieces(source, zeros, lengths)
    over = lengths > max_length
    if long == "skip":
        return Pieces(source[~over], zeros[~over], lengths[~over])
    if long == "truncate":
        return Pieces(source, zeros, np.minimum(lengths, max_length))
    stride = max_length - overlap
    count = np.where(over, -(-(lengths - overlap) // stride), 1)
    source = np.repeat(source, count)
    index = np.arange(source.size) - np.repeat(np.cumsum(count) - count, count)
    offset = index * stride
    return Pieces(source, offset, np.minimum(max_length, lengths[source] - offset))


def events(lengths, max_length: int, long: str, overlap: int = 0,
           weights=None) -> dict[str, int]:
    """What the policy does to sequences of ``lengths`` (each counted ``weights`` times).

    Returns:
      ``{"sequences", "over", "truncated", "truncated_tokens", "split", "pieces",
      "skipped"}``: the sequences in, those longer than ``max_length``, and per policy
      the sequences truncated (with the tokens cut), split (into how many pieces, all
      counted), or skipped.
    """
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    weights = np.ones(lengths.size) if weights is None else np.asarray(weights, float)
    lengths, weights = lengths[weights > 0], weights[weights > 0]
    over = (lengths > max_length) if max_length else np.zeros(lengths.size, bool)
    out = dict.fromkeys(("truncated", "truncated_tokens", "split", "pieces", "skipped"), 0)
    out.update(sequences=int(round(weights.sum())), over=int(round(weights[over].sum())))
    if not over.any():
        return out
    if long == "skip":
        out["skipped"] = out["over"]
    elif long == "truncate":
        out["truncated"] = out["over"]
        out["truncated_tokens"] = int(round(float(
            np.dot(weights[over], lengths[over] - max_length))))
    else:
        made = pieces(lengths[over], max_length, long, overlap)
        out["split"] = out["over"]
        out["pieces"] = int(round(float(weights[over][made.source].sum())))
    return out


def piece_counts(counts: np.ndarray, max_length: int, long: str) -> np.ndarray:
    """Per-length counts after the policy: ``counts[n]`` sequences of length n become
    ``out[m]`` pieces of length m (``len(out) == max_length + 1``)."""
    counts = np.asarray(counts, float)
    present = np.flatnonzero(counts)  # only lengths that occur: a split's longest can be 10^6
    made = pieces(present, max_length, long)
    size = (max_length or max(counts.size - 1, 0)) + 1
    return np.bincount(made.length, weights=counts[present][made.source],
                       minlength=size)[:size]
