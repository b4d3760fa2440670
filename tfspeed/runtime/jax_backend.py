"""The runtime on Keras' JAX backend: its devices, and the small part of a
``tf.distribute`` strategy's interface that a job uses, so that one job builder serves both
backends.

On JAX there is no strategy to build models in: the engine (``training.engine_jax``) places
the state on the devices itself and shards each batch along its first axis (data
parallelism, as ``keras.distribution.DataParallel`` lays it out). Input pipelines build
global batches (no per-replica split); batch sizes stay multiples of the device count.
"""

from __future__ import annotations

import contextlib
import dataclasses

from tfspeed.errors import UsageError


@dataclasses.dataclass(frozen=True)
class _Extended:
    """What ``Runtime`` reads of ``strategy.extended``: one process, which is the chief."""

    worker_devices: tuple[str, ...]
    _num_workers: int = 1
    _task_id: int = 0
    should_checkpoint: bool = True


class JaxStrategy:
    """The devices a JAX job trains on, behind the interface the job builder uses of a
    ``tf.distribute.Strategy`` (``scope``, ``num_replicas_in_sync``, the dataset hooks)."""

    def __init__(self, devices):
        self.devices = list(devices)
        self.extended = _Extended(tuple(str(d) for d in self.devices))

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self.devices)

    def scope(self):
        return contextlib.nullcontext()

    def experimental_distribute_dataset(self, dataset):
        return dataset  # global batches: the engine shards them over the devices

    def distribute_datasets_from_function(self, dataset_fn):
        return dataset_fn(None)  # one pipeline of global batches


def gpus() -> tuple[tuple[int, int], ...]:
    """Compute capability of each GPU JAX sees."""
    found = []
    for device in _devices("gpu"):
        major, _, minor = str(getattr(device, "compute_capability", "0.0")).partition(".")
        found.append((int(major or 0), int(minor or 0)))
    return tuple(found)


def tpus() -> int:
    return len(_devices("tpu"))


def _devices(platform: str) -> list:
    import jax

    try:
        return jax.devices(platform)
    except RuntimeError:  # no such backend on this machine
        return []


def split_cpu(replicas: int) -> None:
    """``replicas`` CPU devices for data parallelism on a CPU-only machine (the JAX
    equivalent of TensorFlow's logical CPUs); only before JAX has started its backends."""
    import jax

    try:  # first: asking for the devices would start the backends
        jax.config.update("jax_num_cpu_devices", replicas)
    except RuntimeError as e:
        if len(_devices("cpu")) >= replicas:
            return  # started already, with enough
        raise UsageError(f"--cpu_replicas={replicas} could not be applied: JAX had already "
                         f"started its devices ({e}); pass it before anything runs on JAX"
                         ) from None


def make_strategy(plan) -> JaxStrategy:
    """The devices of ``plan``: one, or all of the accelerator's (or ``cpu_replicas`` CPUs)
    for ``mirrored``."""
    import jax

    devices = jax.devices()
    if plan.strategy != "mirrored":
        return JaxStrategy(devices[:1])
    if plan.cpu_replicas:
        cpus = _devices("cpu")
        if len(cpus) < plan.cpu_replicas:
            raise UsageError(f"cpu_replicas={plan.cpu_replicas} could not be applied: JAX had "
                             f"already started with {len(cpus)} CPU device(s); from Python, "
                             f"call tfspeed.split_cpu({plan.cpu_replicas}) first")
        return JaxStrategy(cpus[: plan.cpu_replicas])
    return JaxStrategy(devices)
