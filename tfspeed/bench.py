"""Shared helpers for ``benchmarks/``: timing a dataset, and one JSON record format.

Every benchmark prints one record::

    {"name": ..., "config": {...}, "figures": {...}, "ratios": {...},
     "versions": {...}, "machine": {...}}

Figures are compared as ratios within one run: these machines are shared and noisy.
"""

from __future__ import annotations

import os
import platform
import resource
import time

import tensorflow as tf


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def time_dataset(ds: tf.data.Dataset, batches: int, warmup: int, batch_size: int) -> dict:
    """Iterates ``warmup`` batches untimed, then times ``batches`` batches.

    Returns:
      ``{"images_per_sec", "batches_per_sec", "seconds", "batches", "peak_rss_mb"}``.
    """
    iterator = iter(ds)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    return {
        "images_per_sec": batches * batch_size / seconds,
        "batches_per_sec": batches / seconds,
        "seconds": seconds,
        "batches": batches,
        "peak_rss_mb": peak_rss_mb(),
    }


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "node": platform.node()}


def versions() -> dict:
    import keras

    return {"python": platform.python_version(), "tensorflow": tf.__version__,
            "keras": keras.__version__}


def record(name: str, config: dict, figures: dict, ratios: dict) -> dict:
    """The one JSON record every benchmark prints."""
    return {"name": name, "config": config, "figures": figures, "ratios": ratios,
            "versions": versions(), "machine": machine()}
