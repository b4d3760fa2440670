"""The Keras backends tfspeed runs on, and what each can and cannot do: the one place that
names a backend. Everything else asks the ``Backend`` of the running one (``current()``,
chosen once from ``keras.backend.backend()``) instead of testing its name.

tf.data feeds both; the job (config, data, model, objectives, report) is one. What differs is
how a step runs (``training.backends``) and which of TensorFlow's tools see it.
"""

from __future__ import annotations

import dataclasses
import functools

from tfspeed.errors import UsageError


@dataclasses.dataclass(frozen=True)
class Backend:
    """A Keras backend's engine and its limits.

    Attributes:
      name: Keras' name for it (``KERAS_BACKEND``).
      engine: ``module:Class`` of its engine adapter (``tfspeed.training.engine.Engine``).
      tf_distribute: arrays are placed by a ``tf.distribute`` strategy (models built in its
        scope, per-replica batches, loss scaling, multi-worker clusters); otherwise the engine
        places them on the devices of ``runtime.jax_backend`` and shards global batches.
      tf_kernels: the step runs TensorFlow's kernels (oneDNN, its intra-op threads).
      tf_profiler: TensorFlow's profiler (and xprof's step analysis) sees its step.
      tf_function_probes: ``tfspeed.tune``'s candidates can be timed (they are ``tf.function``s).
      augment_in_step: augmentations can run inside the in-step gather.
      compiles_every_step: every step is compiled (so every batching's shapes compile).
      sparse_gradients: Keras' own fit gives the optimizer an embedding's gradient as sparse
        rows (``tf.IndexedSlices``), a repeated id as several rows.
    """

    name: str
    engine: str
    tf_distribute: bool
    tf_kernels: bool
    tf_profiler: bool
    tf_function_probes: bool
    augment_in_step: bool
    compiles_every_step: bool
    sparse_gradients: bool


DEFAULT = "tensorflow"  # Keras' own default, without KERAS_BACKEND
BACKENDS = {
    "tensorflow": Backend("tensorflow", "tfspeed.training.backends.tensorflow:TensorFlowEngine",
                          tf_distribute=True, tf_kernels=True, tf_profiler=True,
                          tf_function_probes=True, augment_in_step=True,
                          compiles_every_step=False, sparse_gradients=True),
    "jax": Backend("jax", "tfspeed.training.backends.jax:JaxEngine",
                   tf_distribute=False, tf_kernels=False, tf_profiler=False,
                   tf_function_probes=False, augment_in_step=False, compiles_every_step=True,
                   sparse_gradients=False),
}


def get(name: str) -> Backend:
    """The ``Backend`` called ``name``.

    Raises:
      UsageError: for a backend tfspeed has no engine for.
    """
    if name not in BACKENDS:
        raise UsageError(unsupported(name))
    return BACKENDS[name]


def current() -> Backend:
    """The running Keras backend's ``Backend`` (``KERAS_BACKEND``; tensorflow by default)."""
    import keras

    return get(keras.backend.backend())


def unsupported(name: str) -> str:
    """The one line for a Keras backend tfspeed has no engine for."""
    return (f"KERAS_BACKEND={name}: tfspeed's engine runs on {' and '.join(BACKENDS)} (tf.data "
            f"feeds both); there is no {name} step: set KERAS_BACKEND=tensorflow or jax")


@functools.cache
def engine_class(name: str) -> type:
    """The engine adapter class of backend ``name`` (imported only when used: a TensorFlow
    job never imports JAX)."""
    import importlib

    module, _, cls = get(name).engine.partition(":")
    return getattr(importlib.import_module(module), cls)
