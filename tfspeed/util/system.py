"""Facts about this process and machine that reports and benchmark records carry."""

from __future__ import annotations

import os
import platform
import resource
import sys


def cpus_available() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's share,
    not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def versions() -> dict[str, str]:
    """Versions of what shapes speed and results: Python, TensorFlow, Keras, the machine,
    and the host allocator (malloc slows decoding input pipelines: benchmarks/host_allocator.py)."""
    import keras
    import tensorflow as tf

    from tfspeed.runtime import hostmem

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "machine": platform.machine(),
        "cpus": str(os.cpu_count()),
        "host_allocator": hostmem.describe(),
    }


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow with its C++ start-up banner silenced.

    TF writes "All log messages before absl::InitializeLog()..." and oneDNN notices to
    file descriptor 2 before ``TF_CPP_MIN_LOG_LEVEL`` takes effect, so a one-line error
    would arrive buried under them. A failed import restores stderr first, so its
    traceback is still seen.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
