"""The disk cache of decoded records: keyed by what shapes them, safe against killed writers."""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import socket

from absl import logging

from tfspeed.config import DataConfig
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

CACHE_FORMAT = 2  # bump when what a cache holds changes (2: int32 labels, standardised features)


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


def apply(ds, schema, config, split, num_pipelines, pipeline_id, mode=None):
    """``ds.cache(...)`` as ``mode`` (default ``config.cache``) says: memory, a disk file, or
    not at all."""
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
    if not _claim_disk_cache(path):
        return ds
    return ds.cache(path)


def _claim_disk_cache(path: str) -> bool:
    """Makes ``path`` usable as a cache file; False if another live process is writing it.

    A run killed while writing a cache leaves ``<path>_0.lockfile`` behind, and TF then fails
    every later run with AlreadyExistsError. We record the writer's pid next to the cache and
    clear leftovers whose writer is gone.
    """
    if os.path.exists(path + ".index"):
        return True  # finished cache: reading needs no lock
    owner_file = path + ".owner"
    owner = _read_owner(owner_file)
    me = {"host": socket.gethostname(), "pid": os.getpid()}
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
    schema_lib.write_json_atomic(owner_file, me)
    return True


def _read_owner(owner_file: str) -> dict | None:
    try:
        with open(owner_file) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


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
