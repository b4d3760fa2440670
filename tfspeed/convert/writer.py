"""Writes a converted dataset's shards: sharded, parallel, atomic and resumable.

An output directory holds:
  ``<split>-NNNNN-of-MMMMM.tfrecord``  the shards;
  ``schema.json``                      written last: its presence means the conversion finished;
  ``.tfspeed-plan.jsonl``              the plan: a header line (fingerprint, planned shard
                                       files), then one line per finished shard (records,
                                       bytes, sha256, skipped items);
  ``.<shard>.tmp-<pid>``               a shard being written.

Crash safety: a shard is written under its temporary name, fsynced, renamed into place, and
only then recorded in the plan (append + fsync). After a kill at any moment a rerun keeps
the shards the plan records whose sha256 still matches, deletes everything else of ours
(temporary files, unrecorded shards) and writes what is missing. Records are deterministic,
so the result is byte-identical to an uninterrupted run.

Who calls `write_shard` is a runner (`tfspeed.convert.runners`): this process, a spawned pool
(`write_shards`) or an Apache Beam pipeline; every runner records each shard in the `Plan`.

Writing imports no TensorFlow: records are ``tf.train.Example`` bytes built with protobuf
(`tfspeed.convert.example`) and framed in Python (`tfspeed.data.integrity.frame`). Importing
TF cost each spawned worker 3-5 s, which made more workers and more shards slower.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import dataclasses
import functools
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence

from absl import logging

from tfspeed.convert import example
from tfspeed.convert.sources import Chunk, Skip, StoredImage
from tfspeed.data import integrity
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

PLAN_FILE = ".tfspeed-plan.jsonl"
# The automatic shard count of the train split, at least: enough files for parallel reads
# (interleave) and for splitting by file over 8+ training workers.
MIN_SHARDS = 16
PROBE_FILE = ".tfspeed-probe"  # storage.measure's read-back test file (+ .tmp-PID)
# Temporary files of ours: shards, plan rewrites, schema.json rewrites (write_json_atomic),
# the storage probe.
_TEMP = re.compile(
    r"^(\..+\.tfrecord|\.tfspeed-plan\.jsonl|schema\.json|\.tfspeed-probe)\.tmp-\d+$"
)


@dataclasses.dataclass(frozen=True)
class ShardTask:
    """Shard ``file`` of ``split``: the split's items ``[start, stop)``."""

    split: str
    file: str
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class ShardResult:
    """A finished shard, the source items it skipped, and its images' shortest and longest
    side (0 without images)."""

    file: str
    num_records: int
    num_bytes: int
    sha256: str
    skipped: tuple[dict, ...] = ()
    min_image_side: int = 0
    max_image_side: int = 0

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
    _keep_freed_memory()
    tmp = os.path.join(out_dir, f".{file}.tmp-{os.getpid()}")
    skipped, count, size, sides = [], 0, 0, _Sides()
    digest = hashlib.sha256()  # of the bytes as written: no second pass over the file
    try:
        with open(tmp, "wb") as f:
            for record in chunk.records():
                if isinstance(record, Skip):
                    skipped.append(record.to_json())
                else:
                    record = sides.unwrap(record)
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
    _fsync_dir(out_dir)
    return ShardResult(file, count, size, digest.hexdigest(), tuple(skipped), *sides.range())


@functools.cache
def _keep_freed_memory() -> None:
    """Lets glibc's malloc keep freed memory for reuse instead of returning it at once.

    Each image passes through arrays of 0.15-0.6 MB. In a fresh worker process glibc maps
    and unmaps blocks that size (or trims the heap under them) for every image, so every
    image faults in its memory anew: 14x the page faults and 2 s of system time per 600
    photos at --image_size=224, which made two workers slower than one. (The converting
    process itself got there by chance: freeing a large block, like the storage probe's, raises
    glibc's dynamic thresholds.) Not glibc: nothing to do.
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


def start_pool(workers: int, warm: int) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of up to ``workers`` spawned processes, ``warm`` of them started right away.

    A worker takes ~0.3 s to start (Python, numpy, PIL, protobuf). Started before the work is
    known, that overlaps with listing the source and measuring storage.
    """
    # spawn, not fork: forking a process that has imported TensorFlow can deadlock.
    context = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)
    for _ in range(min(warm, workers)):
        pool.submit(_ready)  # each submit starts a process while none is idle
    return pool


def _ready() -> None:
    _keep_freed_memory()


def write_shards(
    out_dir: str,
    tasks: Sequence[ShardTask],
    make_chunk: Callable[..., Chunk],
    template: schema_lib.Schema,
    *,
    workers: int,
    on_result: Callable[[ShardResult], None],
    on_record: Callable[[], None] | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> None:
    """Writes ``tasks``, in this process (workers=1) or in ``workers`` spawned processes.

    Args:
      out_dir: the output directory.
      tasks: the shards to write.
      make_chunk: ``(split, start, stop) -> Chunk``.
      template: the schema whose features encode the records.
      workers: processes to use.
      on_result: called in this process with each finished shard, in completion order.
      on_record: called after each item when writing in-process (progress).
      pool: a `start_pool` of ``workers`` to use (else one is started, and stopped after).
    """
    if workers == 1 or len(tasks) <= 1:
        for task in tasks:
            chunk = make_chunk(task.split, task.start, task.stop)
            on_result(write_shard(out_dir, task.file, chunk, template, on_record))
        return
    workers = min(workers, len(tasks))
    own = pool is None
    pool = start_pool(workers, warm=0) if own else pool
    pending: dict[concurrent.futures.Future, ShardTask] = {}
    queue = iter(tasks)
    try:
        # Chunks are made only when submitted, so at most ~2 per worker are held in memory.
        for task in _take(queue, 2 * workers):
            pending[_submit(pool, out_dir, task, make_chunk, template)] = task
        while pending:
            done, _ = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                del pending[future]
                on_result(future.result())
                for task in _take(queue, 1):
                    pending[_submit(pool, out_dir, task, make_chunk, template)] = task
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    if own:
        pool.shutdown()


def _take(iterator: Iterator, n: int) -> list:
    return list(itertools.islice(iterator, n))


def _submit(pool, out_dir, task, make_chunk, template) -> concurrent.futures.Future:
    chunk = make_chunk(task.split, task.start, task.stop)
    return pool.submit(write_shard, out_dir, task.file, chunk, template)


def _sha256(path: str) -> str:
    """The sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    # Makes a rename durable across a power loss, not only a process kill.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def verify(out_dir: str, shard: ShardResult | schema_lib.Shard) -> bool:
    """Whether ``shard``'s file exists with the recorded size and sha256."""
    path = os.path.join(out_dir, shard.file)
    try:
        if os.path.getsize(path) != shard.num_bytes:
            return False
        return _sha256(path) == shard.sha256
    except OSError:
        return False


@contextlib.contextmanager
def locked(out_dir: str) -> Iterator[None]:
    """Holds an exclusive lock on ``out_dir`` (released by the OS even on SIGKILL)."""
    try:
        import fcntl
    except ImportError:  # Windows: no concurrent-run protection
        yield
        return
    fd = os.open(out_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"another conversion is writing into {out_dir} right now; "
                "wait for it to finish or choose another --output"
            ) from None
        except OSError:  # a file system without locks (some NFS): go on unprotected
            pass
        yield
    finally:
        os.close(fd)


class Plan:
    """The conversion's state on disk: which shards are planned and which are finished."""

    def __init__(
        self, out_dir: str, fingerprint: str, files: Sequence[str], storage: Mapping | None = None
    ):
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        self.files = list(files)
        self.storage = dict(storage or {})  # how images are stored and why: kept for a rerun
        self.path = os.path.join(out_dir, PLAN_FILE)
        self.schema_path = os.path.join(out_dir, schema_lib.SCHEMA_FILE)

    def finished(self) -> schema_lib.Schema | None:
        """The schema of this very conversion if it finished and all its shards verify."""
        if _read_json(self.schema_path).get("fingerprint") != self.fingerprint:
            return None
        try:
            schema = schema_lib.read(self.out_dir)
        except UsageError:
            return None
        shards = [s for split in schema.splits.values() for s in split.shards]
        if sorted(s.file for s in shards) != sorted(self.files) or self._strays():
            return None
        return schema if all(verify(self.out_dir, s) for s in shards) else None

    def prepare(self, overwrite: bool) -> dict[str, ShardResult]:
        """Makes the directory ready to write; returns the verified shards to keep.

        Args:
          overwrite: remove our files even if they belong to another conversion.

        Returns:
          file -> result of the finished shards that are kept.
        """
        reason = self._foreign()
        if reason and not overwrite:
            raise UsageError(
                f"{self.out_dir} holds another dataset ({reason}); pass --overwrite "
                "to replace it, or choose another --output"
            )
        if overwrite:
            self._remove(lambda name: name.endswith(".tfrecord"))
            self._remove(lambda name: name == PLAN_FILE)
        self._remove(lambda name: bool(_TEMP.match(name)) or name == schema_lib.SCHEMA_FILE)
        kept = {f: r for f, r in self.recorded().items() if verify(self.out_dir, r)}
        unverified = set(self.files) - set(kept)  # half-written or unrecorded: rewrite them
        self._remove(lambda name: name in unverified)
        self._rewrite(kept)  # before any shard is written: from now on the plan is ours
        return kept

    def record(self, result: ShardResult) -> None:
        """Appends a finished (renamed) shard to the plan; safe from concurrent processes."""
        line = (json.dumps(dataclasses.asdict(result)) + "\n").encode()
        # One write() under O_APPEND: lines of concurrent writers (Beam workers) never interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def recorded(self) -> dict[str, ShardResult]:
        """The finished shards the plan records (a torn last line, from a kill, is ignored)."""
        if self._header().get("fingerprint") != self.fingerprint:
            return {}
        results = {}
        with open(self.path) as f:
            for line in list(f)[1:]:
                try:
                    d = json.loads(line)
                    result = ShardResult(**{**d, "skipped": tuple(d["skipped"])})
                except (ValueError, TypeError, KeyError):
                    continue
                if result.file in self.files:
                    results[result.file] = result
        return results

    def finish(self, schema: schema_lib.Schema, results: Mapping[str, ShardResult]) -> None:
        """Writes the plan in canonical order, then ``schema.json`` (last)."""
        self._rewrite(results)
        schema.write(self.out_dir)
        _fsync_dir(self.out_dir)

    def _foreign(self) -> str | None:
        """Why the directory holds another conversion's files, or None."""
        theirs = _read_json(self.schema_path).get("fingerprint")
        if os.path.exists(self.schema_path) and theirs != self.fingerprint:
            return f"its schema.json has fingerprint {str(theirs)[:12]}, this conversion {self.fingerprint[:12]}"
        header = self._header()
        if os.path.exists(self.path) and header.get("fingerprint") != self.fingerprint:
            return f"{PLAN_FILE} of an unfinished conversion of another source or options"
        strays = self._strays()
        if strays:
            return f"{len(strays)} .tfrecord files this conversion did not plan, e.g. {strays[0]}"
        return None

    def _strays(self) -> list[str]:
        ours = os.path.exists(self.path) or os.path.exists(self.schema_path)
        planned = set(self.files) if ours else set()
        return [
            n
            for n in sorted(os.listdir(self.out_dir))
            if n.endswith(".tfrecord") and n not in planned
        ]

    def _header(self) -> dict:
        try:
            with open(self.path) as f:
                return json.loads(f.readline())
        except (OSError, ValueError):
            return {}

    def _rewrite(self, results: Mapping[str, ShardResult]) -> None:
        """Atomically replaces the plan: header and ``results`` in planned order."""
        header = {"fingerprint": self.fingerprint, "files": self.files, "storage": self.storage}
        lines = [json.dumps(header)]
        lines += [json.dumps(dataclasses.asdict(results[f])) for f in self.files if f in results]
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _remove(self, match: Callable[[str], bool]) -> None:
        for name in os.listdir(self.out_dir):
            path = os.path.join(self.out_dir, name)
            if match(name) and os.path.isfile(path):
                logging.debug("removing %s", path)
                os.remove(path)


def earlier(out_dir: str) -> tuple[str, dict]:
    """The fingerprint and ``storage`` entry of the conversion ``out_dir`` holds (finished or
    not); empty if none. A rerun adopts its measured choice of storage, to resume it."""
    for path, line in ((schema_lib.SCHEMA_FILE, False), (PLAN_FILE, True)):
        try:
            with open(os.path.join(out_dir, path)) as f:
                d = json.loads(f.readline()) if line else json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("storage"), dict):
            return str(d.get("fingerprint", "")), d["storage"]
    return "", {}


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}
