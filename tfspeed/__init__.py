"""tfspeed: make TensorFlow/Keras training as fast as the hardware allows.

Measure first, then remove the bottleneck. The package is split by concern:
``tfspeed.convert`` (the converter), ``tfspeed.data`` (tf.data pipeline builders),
``tfspeed.runtime`` (strategy, precision, XLA), ``tfspeed.training.models``, ``tfspeed.training.trainer`` and
the ``tfspeed.train`` entry point.
"""

import importlib.util


def _has_tensorflow() -> bool:
    try:
        return importlib.util.find_spec("tensorflow") is not None
    except (ImportError, ValueError):  # a broken or blocked install
        return False


if not _has_tensorflow():
    raise ImportError(
        "tfspeed needs TensorFlow: install it with `pip install 'tfspeed[cpu]'` "
        "(or `'tfspeed[gpu]'` on a machine with NVIDIA GPUs)"
    )

__version__ = "0.1.0"

# Before TensorFlow makes its CPU allocator: a BFC pool where it would use malloc (see
# tfspeed.runtime.hostmem): decoding input pipelines run faster on CPUs without oneDNN's pool
# (measured by benchmarks/host_allocator.py).
from tfspeed.runtime import hostmem as _hostmem  # noqa: E402

_hostmem.apply()

# tfspeed.fit itself, its signature and docstring for help(): its module imports TensorFlow
# only when called, so `import tfspeed` stays free of it.
from tfspeed.training.api import fit  # noqa: E402

__all__ = ["__version__", "fit", "split_cpu"]


def split_cpu(replicas: int) -> None:
    """Splits the CPU into ``replicas`` logical devices, so that ``strategy="mirrored"`` runs
    on a CPU machine (what ``--cpu_replicas`` does); call it before making any dataset, tensor
    or model. See ``tfspeed.runtime.split_cpu``."""
    from tfspeed.runtime import split_cpu as _split

    _split(replicas)
