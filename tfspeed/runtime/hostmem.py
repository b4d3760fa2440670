"""TensorFlow's host-memory allocator: a BFC pool wherever TensorFlow would use malloc.

TensorFlow allocates CPU tensors with malloc unless oneDNN is on; with oneDNN on, its larger
buffers come from a BFC pool that keeps them. On Linux, oneDNN is on by default
only on CPUs with AVX512_VNNI, AVX512_BF16, AVX_VNNI or AMX (Cascade Lake, Zen 4 and newer:
``DefaultOneDnnPolicy`` in tensorflow/core/util/port.cc). Skylake and older, Zen 1-3 (many GPU
hosts among them), and any process run with ``TF_ENABLE_ONEDNN_OPTS=0`` get malloc. There,
every decoded photo, resize buffer and float batch is a fresh allocation of 0.1-40 MB whose
pages are faulted in anew, in kernel time on every photo. Input pipelines that decode,
resize or cast, tfspeed's and the plain tf.data ones alike, then run slower than with
TensorFlow's own BFC allocator (``TF_CPU_ALLOCATOR_USE_BFC``); uint8 batches from a cache,
which allocate little, gain least. ``benchmarks/host_allocator.py`` measures both, on real
photos with oneDNN off.

TensorFlow reads that variable once, when it makes its CPU allocator (at the first tensor), so
``import tfspeed`` sets it where it helps (``apply``), before that. A user's own setting wins.
This module does not import TensorFlow.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

# CPU features for which TensorFlow turns oneDNN on by default on Linux (names as in
# /proc/cpuinfo).
ONEDNN_CPU_FLAGS = frozenset({"avx512_vnni", "avx512_bf16", "avx_vnni",
                              "amx_tile", "amx_int8", "amx_bf16"})
USE_BFC = "TF_CPU_ALLOCATOR_USE_BFC"
BFC_LIMIT_MB = "TF_CPU_BFC_MEM_LIMIT_IN_MB"  # TensorFlow's default: 64 GB, whatever the host has


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where there is no such list)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def onednn_on(environ: Mapping[str, str], flags: frozenset[str]) -> bool:
    """Whether TensorFlow will turn oneDNN on: ``TF_ENABLE_ONEDNN_OPTS`` if it is set to a
    value TensorFlow accepts, else TensorFlow's Linux default for a CPU with ``flags``."""
    value = environ.get("TF_ENABLE_ONEDNN_OPTS", "").strip().lower()
    if value in ("0", "false"):
        return False
    if value in ("1", "true"):
        return True
    return bool(flags & ONEDNN_CPU_FLAGS)


def settings(environ: Mapping[str, str], flags: frozenset[str], total_mb: int) -> dict[str, str]:
    """The environment variables that give TensorFlow a BFC host allocator where it would
    otherwise use malloc: none where oneDNN's pool is on, or where the user chose already.

    The pool may grow to ``total_mb`` (the host's memory) instead of TensorFlow's fixed 64 GB,
    so that a large in-memory cache on a large host does not run out of pool first.
    """
    if USE_BFC in environ or onednn_on(environ, flags):
        return {}
    wanted = {USE_BFC: "1"}
    if BFC_LIMIT_MB not in environ and total_mb > 0:
        wanted[BFC_LIMIT_MB] = str(total_mb)
    return wanted


def total_memory_mb() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20
    except (ValueError, OSError, AttributeError):  # not a POSIX host
        return 0


def apply(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Sets ``settings`` in ``environ`` (Linux only: elsewhere TensorFlow's default stays).
    Returns what it set."""
    if not sys.platform.startswith("linux"):
        return {}
    wanted = settings(environ, cpu_flags(), total_memory_mb())
    environ.update(wanted)
    return wanted


def describe() -> str:
    """Which allocator TensorFlow's CPU tensors come from in this process: ``"pool"`` (BFC,
    its own or oneDNN's) or ``"malloc"``. Makes the CPU allocator if none exists yet."""
    import tensorflow as tf

    try:
        tf.config.experimental.get_memory_info("CPU:0")  # only pooling allocators count
    except ValueError:
        return "malloc"
    return "pool"


def advice(environ: Mapping[str, str] = os.environ) -> str | None:
    """One line for a process whose CPU tensors come from malloc although the user did not
    ask for it (TensorFlow made its allocator before ``import tfspeed``); else None."""
    if environ.get(USE_BFC, "").strip().lower() in ("0", "false") or describe() != "malloc":
        return None
    return ("TensorFlow allocates host memory with malloc in this process (oneDNN is off on "
            "this CPU or by TF_ENABLE_ONEDNN_OPTS=0), which makes input pipelines that decode "
            "or cast slower (benchmarks/host_allocator.py): import tfspeed before creating any tensor, or set "
            "TF_CPU_ALLOCATOR_USE_BFC=1 in the environment (=0 to keep malloc and silence this)")
