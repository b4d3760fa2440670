"""The disk cache of decoded records: keyed by what shapes them, safe against killed writers,
and checked before use: a damaged cache is derived data, so it is rebuilt, never fatal.

A finished cache (``PATH.index`` and ``PATH.data-*``, written by ``ds.cache(PATH)``) used for
the first time is read once through TF, which checks every element's checksum, and its
elements are counted against the records of its shards. That leaves a sidecar,
``PATH.verified.json``, with each file's size and crc32c; later runs only compare the files
with it. A run that wrote a cache itself records the sidecar at its end (``seal_built``).
A cache that fails either check is deleted with one warning and written again from the
shards. Cost: the first check (TF read, crc32c, sidecar) more than a later one, once per
pipeline build; nothing per element (measured once on 2 cores, not benchmarked).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import hashlib
import json
import os
import socket

import google_crc32c
import tensorflow as tf
from absl import logging

from tfspeed.config import DataConfig
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

CACHE_FORMAT = 2  # bump when what a cache holds changes (2: int32 labels, standardised features)
VERIFIED = ".verified.json"  # the sidecar of a cache checked whole: its files' sizes and crc32c

_built: dict[str, tuple[int, list[str]]] = {}  # caches this process writes: records, shards


def cache_path(config: DataConfig, schema, split: str, num_pipelines=1, pipeline_id=0) -> str:
    """The disk cache file for this split and these settings.

    Its name hashes everything that shapes the cached records (the dataset's fingerprint,
    its shards' checksums and the decode settings), so a changed source or setting gets a
    new cache instead of silently reusing a stale one.
    """
    key = {
        "cache_format": CACHE_FORMAT,
        "fingerprint": schema.fingerprint,
        "shards": [dataclasses.asdict(s) for s in schema.split(split).shards],
        "feature": schema.input_feature.to_json(),
        "image_size": config.image_size,
        # A decoding augmentation (random_resized_crop) caches the encoded images instead.
        "encoded": any(a == "random_resized_crop" for a in config.augment),
        "pipelines": [num_pipelines, pipeline_id],
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    cache_dir = config.cache_dir or os.path.join(config.data_dir, "cache")
    return os.path.join(cache_dir, f"{split}-{digest}")


def apply(ds, schema, config, split, num_pipelines, pipeline_id, records, mode=None):
    """``ds.cache(...)`` as ``mode`` (default ``config.cache``) says: memory, a disk file, or
    not at all.

    Args:
      ds: the decoded records of this input pipeline.
      schema, config, split, num_pipelines, pipeline_id: what keys the cache file.
      records: how many records ``ds`` yields in one pass: a finished disk cache must hold
        as many.
      mode: the resolved cache mode (``tfspeed.data.plan``), if not ``config.cache``.

    Returns:
      ``ds`` with the cache applied; a damaged disk cache is deleted first (one warning).
    """
    mode = mode or config.cache
    if mode == "none":
        return ds
    if mode == "memory":
        return ds.cache()
    path = cache_path(config, schema, split, num_pipelines, pipeline_id)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create cache dir {os.path.dirname(path)}: {e.strerror}; "
                         "pass a writable --cache_dir") from None
    if os.path.exists(path + ".index"):
        problem = _check(ds, path, records)
        if problem is None:
            return ds.cache(path)
        if not _discard(path, problem):
            return ds
    if not _claim_disk_cache(path):
        return ds
    _built[path] = (records, schema.shard_paths(config.data_dir, split))
    return ds.cache(path)


def seal_built() -> None:
    """Records the sidecar of each disk cache this process wrote and finished, so the next
    run checks it by checksum instead of reading it through TF. Not for a cache of shards
    that lost records (it holds fewer than it should: the next run rebuilds it)."""
    from tfspeed.data import reader

    lost = reader.corruption_report()
    for path, (records, shards) in list(_built.items()):
        if not os.path.exists(path + ".index"):
            continue  # not finished (a run shorter than an epoch): written by a later run
        del _built[path]
        if not any(shard in lost for shard in shards):
            schema_lib.write_json_atomic(path + VERIFIED, {"records": records,
                                                           "files": _file_sums(path)})


def _check(ds, path: str, records: int) -> str | None:
    """Why the finished cache at ``path`` must not be used, or None if it is sound."""
    verified = _read_json(path + VERIFIED)
    if verified:
        then, now = verified.get("files"), _file_sums(path)
        then = then if isinstance(then, dict) else {}
        changed = [n for n in sorted({**now, **then}) if now.get(n) != then.get(n)]
        return (f"{changed[0]} no longer has the size and crc32c it had when verified"
                if changed else None)
    try:  # never verified: read it whole; TF checks each element's checksum
        count = int(ds.cache(path).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1))
    except tf.errors.OpError as e:
        reason = e.message.split("}}")[-1].split("[Op:")[0].strip().splitlines()[0][:200]
        return f"reading it failed: {reason}"
    if count != records:
        return f"it holds {count} records, its shards {records}"
    schema_lib.write_json_atomic(path + VERIFIED, {"records": records,
                                                   "files": _file_sums(path)})
    return None


def _file_sums(path: str) -> dict[str, list]:
    """``file name -> [size, crc32c]`` of the cache's files."""
    sums = {}
    for file in sorted(glob.glob(glob.escape(path) + ".index")
                       + glob.glob(glob.escape(path) + ".data-*")):
        crc = google_crc32c.Checksum()
        with open(file, "rb") as f:
            while block := f.read(1 << 22):
                crc.update(block)
        sums[os.path.basename(file)] = [os.path.getsize(file), crc.hexdigest().decode()]
    return sums


def _discard(path: str, problem: str) -> bool:
    """Deletes a damaged cache (one warning); False if another live process still uses it."""
    owner = _read_json(path + ".owner")
    if owner and owner != _me() and _alive(owner):
        logging.warning("disk cache %s is damaged (%s), but pid %s, which wrote it, still "
                        "runs: this run reads without it", path, problem, owner.get("pid"))
        return False
    for file in glob.glob(glob.escape(path) + ".*"):
        if not file.endswith(".owner"):
            os.remove(file)
    logging.warning("disk cache %s is damaged (%s); deleted it, this run writes it again from "
                    "the shards", path, problem)
    return True


def _claim_disk_cache(path: str) -> bool:
    """Makes ``path`` usable as a cache file; False if another live process is writing it.

    A run killed while writing a cache leaves ``<path>_0.lockfile`` behind, and TF then fails
    every later run with AlreadyExistsError. We record the writer's pid next to the cache and
    clear leftovers whose writer is gone.
    """
    if os.path.exists(path + ".index"):
        return True  # finished cache: reading needs no lock
    owner_file = path + ".owner"
    owner = _read_json(owner_file)
    me = _me()
    if owner and owner != me and _alive(owner):
        logging.warning("cache %s is being written by pid %s; this run reads without it",
                        path, owner["pid"])
        return False
    leftovers = glob.glob(glob.escape(path) + "_*")
    for stale in leftovers:
        os.remove(stale)
    if leftovers:
        logging.warning("removed %d leftover file(s) of an unfinished cache at %s",
                        len(leftovers), path)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path + VERIFIED)  # of an earlier cache at this path, deleted by hand
    schema_lib.write_json_atomic(owner_file, me)
    return True


def _me() -> dict:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _alive(owner: dict) -> bool:
    if owner.get("host") != socket.gethostname():
        return True  # cannot tell for another host: assume it is alive
    try:
        os.kill(int(owner["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError, KeyError, TypeError):
        return True
    return True
