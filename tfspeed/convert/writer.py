"""Writes a converted dataset's shards: sharded, parallel and atomic.

`shard_counts` and `plan_tasks` cut the splits into shards; `write_shard` writes one
(temporary file, fsync, rename), `tfspeed.convert.pool` many at once. Who calls them is a
runner (`tfspeed.convert.runners`); every runner records each finished shard in the
`tfspeed.convert.plan.Plan`, which makes a conversion resumable.

Writing imports no TensorFlow: records are ``tf.train.Example`` bytes built with protobuf
(`tfspeed.convert.example`) and framed in Python (`tfspeed.data.integrity.frame`). Importing
TF cost each spawned worker seconds, which made more workers and more shards slower
(``benchmarks/conversion.py`` times the converter across workers and shards).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import math
import os
from collections.abc import Callable, Mapping

from tfspeed.convert import example
from tfspeed.convert.sources import Chunk, Skip, StoredImage, lengths
from tfspeed.data import integrity
from tfspeed.data import schema as schema_lib

# The automatic shard count of the train split, at least: enough files for parallel reads
# (interleave) and for splitting by file over 8+ training workers.
MIN_SHARDS = 16


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """Shard ``file`` of ``split``: the split's items ``[start, stop)``."""

    split: str
    file: str
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class ShardResult:
    """A finished shard, the source items it skipped, its images' shortest and longest
    side (0 without images), and its texts' token counts (`lengths.ShardLengths.result`)."""

    file: str
    num_records: int
    num_bytes: int
    sha256: str
    skipped: tuple[dict, ...] = ()
    min_image_side: int = 0
    max_image_side: int = 0
    text: dict = dataclasses.field(default_factory=dict)

    def to_shard(self) -> schema_lib.Shard:
        return schema_lib.Shard(self.file, self.num_records, self.num_bytes, self.sha256)


def shard_counts(
    sizes: Mapping[str, int], split_bytes: Mapping[str, int], shards: int, target_shard_mb: float
) -> dict[str, int]:
    """How many shards each split gets; never more than its items, at least 1.

    Args:
      sizes: split -> number of items.
      split_bytes: split -> estimated bytes, used when ``shards`` is 0.
      shards: shards of the train split (the largest split if there is no train split);
        the others get proportionally fewer. 0 = automatic: `MIN_SHARDS`, or about
        ``target_shard_mb`` per shard, whichever gives more.
      target_shard_mb: the shard size the automatic count aims at.

    Returns:
      split -> shard count.
    """
    reference = "train" if "train" in sizes else max(sizes, key=sizes.get)
    if shards == 0:
        by_size = math.ceil(split_bytes[reference] / (target_shard_mb * 2**20))
        shards = max(MIN_SHARDS, by_size)
    counts = {s: round(shards * n / sizes[reference]) for s, n in sizes.items()}
    return {s: min(max(c, 1), sizes[s]) for s, c in counts.items()}


def plan_tasks(sizes: Mapping[str, int], counts: Mapping[str, int]) -> list[ShardTask]:
    """Cuts each split into ``counts[split]`` contiguous, near-equal shards."""
    tasks = []
    for split, n in sizes.items():
        count = counts[split]
        for i in range(count):
            name = schema_lib.shard_name(split, i, count)
            tasks.append(ShardTask(split, name, i * n // count, (i + 1) * n // count))
    return tasks


def write_shard(
    out_dir: str,
    file: str,
    chunk: Chunk,
    template: schema_lib.Schema,
    on_record: Callable[[], None] | None = None,
) -> ShardResult:
    """Writes one shard atomically: temporary file, fsync, rename. Imports no TensorFlow.

    Args:
      out_dir: the output directory.
      file: the shard's file name.
      chunk: yields the shard's records (dicts) and skipped items.
      template: the schema whose features encode the records.
      on_record: called after each source item (progress).

    Returns:
      The shard's metadata.
    """
    keep_freed_memory()
    tmp = os.path.join(out_dir, f".{file}.tmp-{os.getpid()}")
    skipped, count, size, sides, texts = [], 0, 0, _Sides(), lengths.ShardLengths()
    digest = hashlib.sha256()  # of the bytes as written: no second pass over the file
    try:
        with open(tmp, "wb") as f:
            for record in chunk.records():
                if isinstance(record, Skip):
                    skipped.append(record.to_json())
                    texts.skip(record)
                else:
                    record = texts.unwrap(sides.unwrap(record))
                    framed = integrity.frame(example.serialize(template.features, record))
                    f.write(framed)
                    digest.update(framed)
                    size += len(framed)
                    count += 1
                if on_record:
                    on_record()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, os.path.join(out_dir, file))
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(out_dir)
    return ShardResult(file, count, size, digest.hexdigest(), tuple(skipped), *sides.range(),
                       texts.result())


@functools.cache
def keep_freed_memory() -> None:
    """Lets glibc's malloc keep freed memory for reuse instead of returning it at once.

    Each image passes through arrays of 0.15-0.6 MB. In a fresh worker process glibc maps
    and unmaps blocks that size (or trims the heap under them) for every image, so every
    image faults in its memory anew: many times the page faults and system time at
    --image_size=224, which made two workers slower than one (``benchmarks/conversion.py``
    times 1, 2, 4... workers at that size). (The converting process itself got there by
    chance: freeing a large block, like the storage probe's, raises glibc's dynamic
    thresholds.) Not glibc: nothing to do.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 64 << 20)
        libc.mallopt(_M_TRIM_THRESHOLD, 128 << 20)
    except (OSError, AttributeError):
        pass


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


class _Sides:
    """The shortest and longest side of the `StoredImage`s seen."""

    def __init__(self):
        self.shortest, self.longest = 0, 0

    def unwrap(self, record: dict) -> dict:
        """``record`` with its stored images replaced by their values, their sides noted."""
        images = {k: v for k, v in record.items() if isinstance(v, StoredImage)}
        for image in images.values():
            short, long = sorted((image.height, image.width))
            self.shortest = min(self.shortest, short) if self.shortest else short
            self.longest = max(self.longest, long)
        return {**record, **{k: v.value for k, v in images.items()}} if images else record

    def range(self) -> tuple[int, int]:
        return self.shortest, self.longest


def fsync_dir(path: str) -> None:
    """fsyncs the directory ``path``."""
    # Makes a rename durable across a power loss, not only a process kill.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


