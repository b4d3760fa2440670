"""The ``auto`` resolution for each kind of machine (the hardware description is faked,
TensorFlow is not), and device setup on this CPU."""

import pytest

from tfspeed.config import RuntimeConfig
from tfspeed.errors import UsageError
from tfspeed.runtime import Hardware, resolve

CPU_PLAIN = Hardware(cpu_flags=frozenset({"avx2", "fma"}))
CPU_BF16 = Hardware(cpu_flags=frozenset({"avx2", "avx512_bf16"}))
CPU_AMX = Hardware(cpu_flags=frozenset({"amx_bf16", "amx_tile"}))
V100 = Hardware(gpus=((7, 0),))
T4_PAIR = Hardware(gpus=((7, 5), (7, 5)))
A100_X4 = Hardware(gpus=((8, 0),) * 4)
K80 = Hardware(gpus=((3, 7),))
TPU = Hardware(tpus=8)
AUTO = RuntimeConfig(strategy="auto", precision="auto", xla="auto")


@pytest.mark.parametrize(
    "hw, strategy, precision, loss_scale, xla",
    [
        (CPU_PLAIN, "default", "float32", False, False),
        (CPU_BF16, "default", "mixed_bfloat16", False, False),
        (CPU_AMX, "default", "mixed_bfloat16", False, False),
        (V100, "default", "mixed_float16", True, True),
        (T4_PAIR, "mirrored", "mixed_float16", True, True),
        (A100_X4, "mirrored", "mixed_bfloat16", False, True),
        (K80, "default", "float32", False, True),
        (TPU, "default", "mixed_bfloat16", False, True),
    ],
    ids=["cpu", "cpu-avx512bf16", "cpu-amx", "v100", "2xT4", "4xA100", "k80", "tpu"],
)
def test_auto_resolution_per_machine(hw, strategy, precision, loss_scale, xla):
    plan = resolve(AUTO, hw)
    assert (plan.strategy, plan.precision, plan.loss_scale, plan.xla) == (
        strategy, precision, loss_scale, xla)
    assert plan.gpu_memory_growth == bool(hw.gpus)
    assert set(plan.reasons) == {"strategy", "precision", "xla"}
    assert all(reason.startswith("auto") for reason in plan.reasons.values())


def test_explicit_choices_win_and_are_explained():
    config = RuntimeConfig(strategy="mirrored", cpu_replicas=2, precision="float32", xla="on")
    plan = resolve(config, CPU_BF16)
    assert (plan.strategy, plan.cpu_replicas, plan.precision, plan.xla) == (
        "mirrored", 2, "float32", True)
    assert plan.reasons["xla"] == "--xla=on"


def test_cpu_replicas_make_auto_mirrored():
    plan = resolve(RuntimeConfig(strategy="auto", cpu_replicas=2), CPU_PLAIN)
    assert plan.strategy == "mirrored" and "cpu_replicas" in plan.reasons["strategy"]


def test_float16_on_a_cpu_is_refused_with_the_fix():
    config = RuntimeConfig(precision="mixed_float16")
    with pytest.raises(UsageError, match="mixed_float16 needs a GPU.*bfloat16 is native"):
        resolve(config, CPU_BF16)
    with pytest.raises(UsageError, match="or float32"):
        resolve(config, CPU_PLAIN)
    assert resolve(config, V100).loss_scale


def test_cpu_replicas_with_gpus_is_refused():
    with pytest.raises(UsageError, match="--cpu_replicas=2 .* 2 GPU"):
        resolve(RuntimeConfig(cpu_replicas=2), T4_PAIR)
