"""tfspeed: make TensorFlow/Keras training as fast as the hardware allows.

Measure first, then remove the bottleneck. From Python: ``tfspeed.fit`` (your own Keras model
and ``tf.data.Dataset`` on tfspeed's engine), ``tfspeed.data.build`` (the input pipeline of a
converted dataset), ``tfspeed.convert.convert`` (the converter) and ``tfspeed.split_cpu``.
The commands: ``python -m tfspeed.train`` (``tune``, ``diagnose``, ``verify``, ...).
``import tfspeed`` does not start TensorFlow; the first call that needs it does.
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

# The public functions themselves, their signatures and docstrings for help(): their modules
# import TensorFlow only when called, so `import tfspeed` stays free of it. `tfspeed.diagnose`
# is the command's module, callable as tfspeed.attach.verdict.diagnose(dataset, model).
from tfspeed.attach.optimize import optimize  # noqa: E402
from tfspeed.training.api import fit  # noqa: E402

__all__ = ["__version__", "convert", "data", "diagnose", "fit", "optimize", "split_cpu"]

# Imported on first use (PEP 562), as `import tfspeed; tfspeed.data.build(...)` expects;
# neither starts TensorFlow.
_SUBPACKAGES = ("config", "convert", "data", "runtime", "training", "diagnose")


def __getattr__(name: str):
    if name in _SUBPACKAGES:
        return importlib.import_module(f"tfspeed.{name}")
    raise AttributeError(f"module 'tfspeed' has no attribute {name!r}")


def split_cpu(replicas: int) -> None:
    """Splits the CPU into ``replicas`` logical devices, so that ``strategy="mirrored"`` runs
    on a CPU machine (what ``--cpu_replicas`` does); call it before making any dataset, tensor
    or model. See ``tfspeed.runtime.split_cpu``."""
    from tfspeed.runtime import split_cpu as _split

    _split(replicas)
