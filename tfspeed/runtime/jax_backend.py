"""The runtime on Keras' JAX backend: its devices and its resolution of the runtime flags.

On JAX there is no strategy to build models in: the engine (``training.backends.jax``)
places the state on the runtime's devices itself and shards each batch along its first axis
(data parallelism, as ``keras.distribution.DataParallel`` lays it out). Input pipelines build
global batches (no per-replica split); batch sizes stay multiples of the device count.
"""

from __future__ import annotations

import dataclasses

from tfspeed.errors import UsageError


def resolve(config, hw, name: str):
    """``runtime.resolve`` on JAX: data parallelism over the devices instead of a strategy,
    every step compiled (jit), and no float16 loss scaling (bfloat16 where the hardware has
    it).

    Raises:
      UsageError: for the flags JAX cannot honour (float16 loss scaling, multi-worker).
    """
    from tfspeed import runtime

    if config.precision == "mixed_float16":
        raise UsageError("--precision=mixed_float16 needs loss scaling, which tfspeed runs on "
                         "the TensorFlow backend; on JAX use --precision=auto "
                         "(mixed_bfloat16 where the hardware has it)")
    if config.strategy == "multi_worker":
        raise UsageError("--strategy=multi_worker runs on the TensorFlow backend; on JAX train "
                         "on one host's devices (--strategy=mirrored)")
    plan = runtime.resolve(dataclasses.replace(config, xla="on"),
                           dataclasses.replace(hw, cluster_tasks=0))
    reasons = dict(plan.reasons)
    if hw.cluster_tasks > 1:
        reasons["strategy"] += "; TF_CONFIG's cluster is TensorFlow's: ignored on JAX"
    precision = plan.precision
    if precision == "mixed_float16":  # auto chose it for a GPU before Ampere
        precision = "float32"
        reasons["precision"] = ("auto: this GPU has float16 but not bfloat16 tensor cores, and "
                                "float16 loss scaling runs on the TensorFlow backend: float32")
    reasons["xla"] = "JAX jits each step" + (" (--xla=off ignored)" if config.xla == "off" else "")
    return dataclasses.replace(plan, precision=precision, loss_scale=False, xla=True,
                               reasons=reasons, backend=name)


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


def devices(plan) -> tuple:
    """The devices of ``plan``: one, or all of the accelerator's (or ``cpu_replicas`` CPUs)
    for ``mirrored``."""
    import jax

    found = jax.devices()
    if plan.strategy != "mirrored":
        return tuple(found[:1])
    if plan.cpu_replicas:
        cpus = _devices("cpu")
        if len(cpus) < plan.cpu_replicas:
            raise UsageError(f"cpu_replicas={plan.cpu_replicas} could not be applied: JAX had "
                             f"already started with {len(cpus)} CPU device(s); from Python, "
                             f"call tfspeed.split_cpu({plan.cpu_replicas}) first")
        return tuple(cpus[: plan.cpu_replicas])
    return tuple(found)
