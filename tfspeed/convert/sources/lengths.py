"""Token counts of text records: gathered per shard by the writer, merged per split.

A text chunk yields its ``tokens`` as `TokenIds` (the ids and what the long-text policy did
to the item) and the items it drops as `TextSkip`. The writer unwraps them with a
`ShardLengths` and keeps the shard's counts in its `ShardResult` (so in the plan): a resumed
conversion keeps the counts of the shards it keeps, and the parent merges all shards' counts
into each split's ``text`` entry of ``schema.json`` (`split_stats`).

Imports nothing heavy: the writer's worker processes import it.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from tfspeed.convert.sources.base import Skip

# Events of the long-text policy (--long), as counted in the summary and schema.json.
TRUNCATED, SPLIT = "truncated", "split_into"
SKIPPED_LONG = "skipped_long"


@dataclasses.dataclass(frozen=True)
class TokenIds:
    """A record's token ids, and what the long-text policy did to its item.

    Attributes:
      ids: the int64 token ids stored in the record.
      truncated: the item was cut to ``--max_length`` tokens.
      part: this record's index among the pieces of a split item (``--long=split``).
      parts: how many records the item was split into (1: not split).
      charset: the charset its text was decoded from (counted once per text); "" for a
        text that was no bytes (pystdlib).
    """

    ids: np.ndarray
    truncated: bool = False
    part: int = 0
    parts: int = 1
    charset: str = ""


@dataclasses.dataclass(frozen=True)
class TextSkip(Skip):
    """A text item that yields no record; ``kind`` (``binary``, ``undecodable``,
    ``unreadable``, ``empty``, ``skipped_long``) is counted per split, and ``charset`` (the
    charset of a text decoded, then dropped) with the charsets."""

    kind: str = ""
    charset: str = ""

    def to_json(self) -> dict:
        return {"item": self.item, "reason": self.reason, "kind": self.kind}


class ShardLengths:
    """The token counts, long-text events and charsets of one shard's records."""

    def __init__(self):
        self.lengths: collections.Counter = collections.Counter()
        self.events: collections.Counter = collections.Counter()
        self.charsets: collections.Counter = collections.Counter()  # texts decoded by each

    def unwrap(self, record: dict) -> dict:
        """``record`` with its `TokenIds` replaced by the ids, their counts noted."""
        found = {k: v for k, v in record.items() if isinstance(v, TokenIds)}
        for value in found.values():
            self.lengths[len(value.ids)] += 1
            self.events[TRUNCATED] += value.truncated
            self.events[SPLIT] += value.parts > 1 and value.part == 0
            if value.charset and value.part == 0:
                self.charsets[value.charset] += 1
        return {**record, **{k: v.ids for k, v in found.items()}} if found else record

    def skip(self, skip: Skip) -> None:
        """Counts a skipped text item by its kind."""
        if isinstance(skip, TextSkip):
            self.events[skip.kind] += 1
            if skip.charset:
                self.charsets[skip.charset] += 1

    def result(self) -> dict:
        """The shard's counts as JSON (empty for a shard without text)."""
        if not self.lengths and not self.events:
            return {}
        found = {
            "lengths": {str(n): c for n, c in sorted(self.lengths.items())},
            "events": {k: c for k, c in sorted(self.events.items()) if c},
        }
        return {**found, "charsets": dict(sorted(self.charsets.items()))} if self.charsets else found


def split_stats(shards: Sequence[Mapping]) -> dict | None:
    """A split's ``text`` entry from its shards' counts (`ShardLengths.result`).

    Returns:
      ``records``, ``tokens``, ``min``, ``median``, ``mean``, ``p90``, ``p99``, ``max``
      token counts, ``histogram`` (records per power-of-2 bin: ``bounds[i-1] < length <=
      bounds[i]``), ``lengths`` (every length and its count: exact, for choosing buckets),
      the counts of truncated, split and skipped items, and ``charsets``: the texts each
      charset decoded, most first (empty for texts that were no bytes); None for a split
      without text.
    """
    if not any(shards):
        return None
    lengths: collections.Counter = collections.Counter()
    events: collections.Counter = collections.Counter()
    charsets: collections.Counter = collections.Counter()
    for shard in shards:
        lengths.update({int(n): c for n, c in shard.get("lengths", {}).items()})
        events.update(shard.get("events", {}))
        charsets.update(shard.get("charsets", {}))
    stats = {**_summary(lengths), "histogram": _histogram(lengths)}
    stats.update({k: events.get(k, 0) for k in (TRUNCATED, SPLIT, SKIPPED_LONG)})
    stats["skipped_by_kind"] = {
        k: c for k, c in sorted(events.items()) if k not in (TRUNCATED, SPLIT)
    }
    stats["charsets"] = _most_first(charsets)
    stats["lengths"] = [[n, c] for n, c in sorted(lengths.items())]
    return stats


def _most_first(counts: Mapping[str, int]) -> dict[str, int]:
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _summary(lengths: Mapping[int, int]) -> dict:
    if not lengths:
        return {"records": 0, "tokens": 0}
    values = np.asarray(sorted(lengths), np.int64)
    counts = np.asarray([lengths[v] for v in values], np.int64)
    cumulative = np.cumsum(counts)

    def quantile(q: float) -> int:  # the smallest length with at least q of the records
        return int(values[np.searchsorted(cumulative, q * cumulative[-1])])

    return {
        "records": int(cumulative[-1]),
        "tokens": int((values * counts).sum()),
        "min": int(values[0]),
        "median": quantile(0.5),
        "mean": round(float((values * counts).sum() / cumulative[-1]), 2),
        "p90": quantile(0.9),
        "p99": quantile(0.99),
        "max": int(values[-1]),
    }


def _histogram(lengths: Mapping[int, int]) -> dict:
    """Records per power-of-2 bin of token counts."""
    top = max(lengths, default=1)
    bounds = [1 << i for i in range(max(top - 1, 1).bit_length() + 1)]
    counts = [0] * len(bounds)
    for n, c in lengths.items():
        counts[max(n - 1, 0).bit_length()] += c
    return {"bounds": bounds, "counts": counts}


def totals(splits: Iterable[Mapping | None]) -> dict:
    """Counts over all splits for the converter's summary (``charsets`` summed too)."""
    keys = ("tokens", TRUNCATED, SPLIT, SKIPPED_LONG)
    out = dict.fromkeys(keys, 0)
    charsets: collections.Counter = collections.Counter()
    for stats in splits:
        for key in keys:
            out[key] += (stats or {}).get(key, 0)
        charsets.update((stats or {}).get("charsets", {}))
    return {**out, "charsets": _most_first(charsets)}
