"""Runtime: the strategy, precision policy and XLA choice, resolved once from RuntimeConfig.

Resolution is split in two so the "auto" logic can be tested for every kind of machine:
``detect_hardware()`` describes this machine (the only part that asks TensorFlow), and
``resolve(config, hardware)`` is a pure function from that description to choices, each
with the reason it was made. ``setup`` applies the choices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
from collections.abc import Callable

from absl import logging

from tfspeed import plan as plan_lib
from tfspeed.config import RuntimeConfig, is_auto
from tfspeed.errors import UsageError
from tfspeed.plan import BFLOAT16_MIN_CC, FLOAT16_MIN_CC  # noqa: F401 -- re-exported
from tfspeed.runtime import backends, hostmem
from tfspeed.runtime.backends import BACKENDS  # noqa: F401 -- re-exported
from tfspeed.runtime.backends import unsupported as unsupported_backend  # noqa: F401

CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What this machine offers.

    Attributes:
      gpus: compute capability (major, minor) of each visible GPU.
      tpus: number of TPU devices.
      cpu_flags: the CPU's feature flags (from /proc/cpuinfo), lower case.
      cluster_tasks: chief + worker tasks in ``TF_CONFIG`` (0: no cluster configured).
    """

    gpus: tuple[tuple[int, int], ...] = ()
    tpus: int = 0
    cpu_flags: frozenset[str] = frozenset()
    cluster_tasks: int = 0

    @property
    def cpu_has_bf16(self) -> bool:
        return any(flag in self.cpu_flags for flag in CPU_BF16_FLAGS)


@dataclasses.dataclass(frozen=True)
class Resolved:
    """The resolved runtime choices, before anything is applied (``tfspeed.plan.Plan`` records
    them with their reasons, as report.json's plan).

    Attributes:
      strategy: ``default``, ``one_device`` or ``mirrored``.
      cpu_replicas: logical CPU devices to create (0: none).
      precision: Keras dtype policy name.
      loss_scale: dynamic loss scaling (float16 only).
      xla: XLA-compile the per-replica step.
      gpu_memory_growth: allocate GPU memory as needed instead of all at start.
      reasons: one sentence per choice.
      intra_op_threads: threads one op may use (0: TF's default); set by ``setup``.
      backend: Keras' backend the step runs on (``tensorflow`` or ``jax``).
    """

    strategy: str
    cpu_replicas: int
    precision: str
    loss_scale: bool
    xla: bool
    gpu_memory_growth: bool
    reasons: dict[str, str]
    intra_op_threads: int = 0
    backend: str = "tensorflow"


def backend() -> str:
    """Keras' backend (``KERAS_BACKEND``), checked: one of ``backends.BACKENDS``.

    Raises:
      UsageError: for a backend tfspeed has no engine for.
    """
    return backends.current().name


def detect_hardware() -> Hardware:
    """Describes this machine's accelerators and CPU features (as the backend sees them:
    on JAX its devices, on TensorFlow TF's)."""
    import tensorflow as tf

    if not backends.current().tf_distribute:  # its own devices
        from tfspeed.runtime import jax_backend

        return Hardware(gpus=jax_backend.gpus(), tpus=jax_backend.tpus(),
                        cpu_flags=hostmem.cpu_flags(), cluster_tasks=cluster_tasks())
    gpus = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        gpus.append(tuple(details.get("compute_capability", (0, 0))))
    return Hardware(
        gpus=tuple(gpus),
        tpus=len(tf.config.list_physical_devices("TPU")),
        cpu_flags=hostmem.cpu_flags(),
        cluster_tasks=cluster_tasks(),
    )


def cluster_tasks(environ=None) -> int:
    """Chief and worker tasks of the cluster in ``TF_CONFIG`` (0 without one).

    Raises:
      UsageError: if ``TF_CONFIG`` is set but is not the JSON TensorFlow expects.
    """
    text = (os.environ if environ is None else environ).get("TF_CONFIG", "")
    if not text.strip():
        return 0
    try:
        config = json.loads(text)
        cluster = config["cluster"]
        tasks = len(cluster.get("chief", [])) + len(cluster.get("worker", []))
        task = config["task"]
        task["type"], int(task["index"])
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UsageError('TF_CONFIG is not a cluster description like {"cluster": {"worker": '
                         '["host:port", ...]}, "task": {"type": "worker", "index": 0}}; fix it '
                         "or start workers with python -m tfspeed.launch") from None
    return tasks


def resolve(config: RuntimeConfig, hw: Hardware, backend_name: str = "tensorflow") -> Resolved:
    """Turns ``config`` (possibly ``auto``) into concrete choices for ``hw`` on Keras'
    ``backend_name``.

    Raises:
      UsageError: for settings this machine (or backend) cannot honour, naming the flag and
        the fix.
    """
    if not backends.get(backend_name).tf_distribute:
        from tfspeed.runtime import jax_backend

        return jax_backend.resolve(config, hw, backend_name)
    reasons = {}
    if config.cpu_replicas and hw.gpus:
        raise UsageError(f"--cpu_replicas={config.cpu_replicas} splits the CPU for testing, but "
                         f"{len(hw.gpus)} GPU(s) are present: drop --cpu_replicas")
    strategy = config.strategy
    if strategy == "multi_worker" and not hw.cluster_tasks:
        raise UsageError("--strategy=multi_worker needs a cluster in TF_CONFIG; start the "
                         "workers with python -m tfspeed.launch --workers=N -- <flags>")
    if strategy == "multi_worker" and config.cpu_replicas:
        raise UsageError("--cpu_replicas splits one process's CPU for MirroredStrategy; drop it "
                         "with --strategy=multi_worker (each worker is one replica on CPU)")
    if strategy == "auto":
        if hw.cluster_tasks > 1 and not config.cpu_replicas:
            strategy, reasons["strategy"] = "multi_worker", (
                f"auto: TF_CONFIG describes a cluster of {hw.cluster_tasks} tasks")
        elif len(hw.gpus) > 1:
            strategy, reasons["strategy"] = "mirrored", f"auto: {len(hw.gpus)} GPUs visible"
        elif config.cpu_replicas > 1:
            strategy, reasons["strategy"] = "mirrored", (
                f"auto: --cpu_replicas={config.cpu_replicas} logical CPU devices")
        else:
            strategy, reasons["strategy"] = "default", "auto: one device"
    else:
        reasons["strategy"] = f"--strategy={strategy}"

    decided = plan_lib.precision(config.precision, hw)
    precision, loss_scale, reasons["precision"] = decided.value, False, decided.reason
    if precision == "mixed_float16":
        loss_scale = True
        reasons["precision"] += "; dynamic loss scaling keeps small float16 gradients"

    decided = plan_lib.xla(config.xla, bool(hw.gpus or hw.tpus))
    xla, reasons["xla"] = decided.value, decided.reason
    return Resolved(strategy=strategy, cpu_replicas=config.cpu_replicas, precision=precision,
                loss_scale=loss_scale, xla=xla, gpu_memory_growth=bool(hw.gpus), reasons=reasons)


def for_batching(runtime: Runtime, config: RuntimeConfig, batching: str) -> Runtime:
    """``runtime`` once the job's token batching is known, with ``tfspeed.plan.xla``'s
    decision for it (``--xla=auto`` turns XLA on for ``pack`` on a CPU too)."""
    if runtime.plan.xla:  # on already: an accelerator, JAX, or --xla=on
        return runtime
    decided = plan_lib.xla(config.xla, False, batching)
    if not decided.value:
        return runtime
    reasons = {**runtime.plan.reasons, "xla": decided.reason}
    return dataclasses.replace(runtime, plan=dataclasses.replace(runtime.plan, xla=True,
                                                                 reasons=reasons))


@dataclasses.dataclass(frozen=True)
class Runtime:
    """What the step runs on, and why each choice was made.

    Attributes:
      strategy: the ``tf.distribute`` strategy (None on a backend without one, JAX); build
        models and optimizers in ``scope()``.
      plan: the resolved choices and their reasons.
      devices: without a strategy, the devices the engine places the state on and shards
        each global batch over (``jax_backend.devices``).
    """

    strategy: object
    plan: Resolved
    devices: tuple = ()

    @property
    def num_replicas(self) -> int:
        return len(self.devices) if self.strategy is None else self.strategy.num_replicas_in_sync

    @property
    def placement(self):
        """What the engine places arrays on: the strategy, or the devices."""
        return self.devices if self.strategy is None else self.strategy

    def scope(self):
        """Where models and optimizers are built (the strategy's scope)."""
        return contextlib.nullcontext() if self.strategy is None else self.strategy.scope()

    def distribute(self, dataset):
        """``dataset``'s batches as the engine takes them: split over the replicas, or whole
        (global batches, sharded by the engine)."""
        if self.strategy is None:
            return dataset
        return self.strategy.experimental_distribute_dataset(dataset)

    def distribute_from_function(self, dataset_fn):
        """One pipeline per worker from ``dataset_fn(input_context)`` (None: one process)."""
        if self.strategy is None:
            return dataset_fn(None)
        return self.strategy.distribute_datasets_from_function(dataset_fn)

    @property
    def backend(self) -> str:
        """``tensorflow`` or ``jax``: which engine runs the step."""
        return self.plan.backend

    @property
    def precision(self) -> str:
        return self.plan.precision

    @property
    def xla(self) -> bool:
        return self.plan.xla

    @property
    def num_workers(self) -> int:
        """Processes training together (1 unless multi-worker)."""
        return getattr(getattr(self.strategy, "extended", None), "_num_workers", 1)

    @property
    def worker_index(self) -> int:
        return getattr(getattr(self.strategy, "extended", None), "_task_id", 0) or 0

    @property
    def is_chief(self) -> bool:
        """Whether this process writes checkpoints, logs, the model and report.json."""
        return self.num_workers == 1 or bool(self.strategy.extended.should_checkpoint)

    def mean_over_workers(self, value: float) -> float:
        """``value`` averaged over all replicas of all workers (itself with one worker), so
        that decisions taken from local measurements agree on every worker."""
        if self.num_workers == 1:
            return value
        import tensorflow as tf

        strategy = self.strategy

        @tf.function
        def mean(v):
            per_replica = strategy.run(lambda: tf.identity(v))
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, per_replica, axis=None)

        return float(mean(tf.constant(value, tf.float64)))

    def to_json(self) -> dict:
        return {
            "backend": self.plan.backend,
            "strategy": self.plan.strategy,
            "num_workers": self.num_workers,
            "worker_index": self.worker_index,
            "num_replicas": self.num_replicas,
            "devices": _devices(self.strategy) if self.strategy else list(map(str, self.devices)),
            "precision": self.plan.precision,
            "loss_scale": self.plan.loss_scale,
            "xla": self.plan.xla,
            "intra_op_threads": self.plan.intra_op_threads,
            "reasons": dict(self.plan.reasons),
        }


def _devices(strategy) -> list[str]:
    try:
        return list(strategy.extended.worker_devices)
    except RuntimeError:  # the default strategy does not list its one device
        return []


def setup(config: RuntimeConfig, hw: Hardware | None = None,
          forward_flops: Callable[[int], float | None] | None = None) -> Runtime:
    """Resolves ``config`` for this machine, configures devices, threads and the precision
    policy.

    Must run before TensorFlow executes any op when ``cpu_replicas``, GPU memory growth or
    intra-op threads apply (they are fixed once the runtime starts).

    Args:
      config: the runtime flags.
      hw: this machine (detected if None).
      forward_flops: replicas -> the model's forward FLOPs per replica step (None if
        unknown), for ``--intra_op_threads=auto``; called before TensorFlow starts.
    """
    import keras
    import tensorflow as tf

    name = backend()
    own_devices = not backends.get(name).tf_distribute
    if own_devices and config.cpu_replicas > 1:  # before anything starts JAX's backends
        from tfspeed.runtime import jax_backend

        jax_backend.split_cpu(config.cpu_replicas)
    hw = hw or detect_hardware()
    plan = resolve(config, hw, name)
    if own_devices:
        from tfspeed.runtime import jax_backend

        keras.mixed_precision.set_global_policy(plan.precision)
        plan = dataclasses.replace(plan, reasons={
            **plan.reasons, "intra_op_threads": "JAX: the step runs on XLA's own threads; "
            "TensorFlow's setting (its default) is left to tf.data"})
        return Runtime(strategy=None, plan=plan, devices=jax_backend.devices(plan))
    plan = _with_threads(plan, config, hw, forward_flops)
    if plan.gpu_memory_growth:
        for gpu in tf.config.list_physical_devices("GPU"):
            _configure(lambda g=gpu: tf.config.experimental.set_memory_growth(g, True),
                       "GPU memory growth")
    if plan.cpu_replicas > 1:
        split_cpu(plan.cpu_replicas)
    keras.mixed_precision.set_global_policy(plan.precision)
    runtime = Runtime(strategy=_make_strategy(plan), plan=plan)
    if line := hostmem.advice():
        logging.warning(line)
    return runtime


def _with_threads(plan: Resolved, config: RuntimeConfig, hw: Hardware, forward_flops) -> Resolved:
    """``plan`` with the intra-op threads chosen (``tfspeed.runtime.threads``) and set."""
    from tfspeed.runtime import threads

    flops, environ = None, os.environ.get("TF_NUM_INTRAOP_THREADS")
    if is_auto(config.intra_op_threads) and forward_flops and not (hw.gpus or environ):
        flops = forward_flops(_replicas_before_strategy(plan))
    count, why = threads.choose(config.intra_op_threads, flops, len(hw.gpus), environ)
    applied = threads.apply(count, config.intra_op_threads)
    if applied != count:
        why += f" (not applied: TensorFlow had started; {applied or 'its default'} in force)"
    return dataclasses.replace(plan, intra_op_threads=applied,
                               reasons={**plan.reasons, "intra_op_threads": why})


def _replicas_before_strategy(plan: Resolved) -> int:
    """Replicas a global batch is split over, as known before the strategy exists (on a
    host without GPUs: the CPU replicas, or one)."""
    return max(plan.cpu_replicas, 1)


def split_cpu(replicas: int) -> None:
    """Splits the CPU into ``replicas`` logical devices, for MirroredStrategy on a CPU machine.

    Must run before TensorFlow initialises its devices (before any dataset, tensor or model
    is made); afterwards it logs a warning and changes nothing. On the JAX backend: that many
    JAX CPU devices, before JAX starts its backends.
    """
    import tensorflow as tf

    if not backends.current().tf_distribute:
        from tfspeed.runtime import jax_backend

        jax_backend.split_cpu(replicas)
        return

    cpu = tf.config.list_physical_devices("CPU")[0]
    current = tf.config.get_logical_device_configuration(cpu) or []
    if len(current) >= replicas:
        return
    _configure(lambda: tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * replicas), "--cpu_replicas")


def _configure(apply, what: str) -> None:
    try:
        apply()
    except RuntimeError as e:  # TF already initialised its devices in this process
        logging.warning("%s not applied: %s", what, e)


def _make_strategy(plan: Resolved):
    import tensorflow as tf

    if plan.strategy == "multi_worker":  # before anything initialises the TF runtime
        return multi_worker_strategy()
    gpus = tf.config.list_logical_devices("GPU")
    if plan.strategy == "default":
        return tf.distribute.get_strategy()
    if plan.strategy == "one_device":
        return tf.distribute.OneDeviceStrategy(gpus[0].name if gpus else "/cpu:0")

    if gpus:
        return mirrored_strategy()
    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if plan.cpu_replicas and len(cpus) < plan.cpu_replicas:
        raise UsageError(f"cpu_replicas={plan.cpu_replicas} could not be applied: TensorFlow "
                         "had already initialised its devices; from Python, call "
                         f"tfspeed.split_cpu({plan.cpu_replicas}) before making any dataset, "
                         "tensor or model")
    if plan.cpu_replicas:
        cpus = cpus[: plan.cpu_replicas]
    elif len(cpus) > 1:
        cpus = cpus[:1]  # logical devices made by someone else: --cpu_replicas decides
    return mirrored_strategy(tuple(cpus))


@functools.cache
def mirrored_strategy(devices: tuple[str, ...] | None = None):
    """One MirroredStrategy per device set and process.

    A second MirroredStrategy over the same devices reuses the first one's collective
    instance keys, and its all-reduces then fail with "Shape mismatch in the collective
    instance 100"; reusing the strategy avoids that (and is what a real job does anyway).
    """
    import tensorflow as tf

    return tf.distribute.MirroredStrategy(list(devices) if devices else None)


@functools.cache
def multi_worker_strategy():
    """MultiWorkerMirroredStrategy over the cluster in ``TF_CONFIG`` (one per process).

    Stock Keras ``fit`` fails under it on this stack (keras#20582, keras#19005: see
    `tfspeed.training.backends.tensorflow`); the engine's custom loop works. Collectives use NCCL
    between GPUs and gRPC ring all-reduce on CPU (``AUTO``).
    """
    import tensorflow as tf

    return tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=tf.distribute.experimental.CommunicationImplementation.AUTO))
