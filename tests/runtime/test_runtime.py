"""The ``auto`` resolution for each kind of machine (the hardware description is faked,
TensorFlow is not), and device setup on this CPU."""

import pytest

from tfspeed.config import RuntimeConfig
from tfspeed.errors import UsageError
from tfspeed.runtime import Hardware, Runtime, for_batching, resolve
from tfspeed.runtime.threads import AUTO as AUTO_THREADS
from tfspeed.runtime.threads import choose as choose_threads
from tfspeed.runtime.threads import forward_flops

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


@pytest.mark.parametrize("xla, batching, on", [
    ("auto", "pack", True),  # one static shape: one compile
    ("auto", "bucket", False),  # a compile per bucket
    ("auto", "pad", False),
    ("off", "pack", False),  # the user's choice stands
])
def test_xla_auto_turns_on_for_packed_batches_on_a_cpu(xla, batching, on):
    config = RuntimeConfig(strategy="auto", precision="auto", xla=xla)
    before = Runtime(strategy=None, plan=resolve(config, CPU_PLAIN))
    after = for_batching(before, config, batching)
    assert not before.xla and after.xla == on
    assert after.plan.reasons["xla"].startswith(
        "auto: on for packed token batches" if on else before.plan.reasons["xla"])


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


@pytest.mark.parametrize(
    "requested, flops, gpus, threads, reason",
    [
        (AUTO_THREADS, 5.6e6, 0, 0, "auto: TF_NUM_INTRAOP_THREADS=4 is set"),
        (AUTO_THREADS, 5.6e6, 0, 1, "auto: a small step (5.6 MFLOP"),
        (AUTO_THREADS, 192e6, 0, 0, "auto: 192 MFLOP forward per replica step"),
        (AUTO_THREADS, 5.6e6, 1, 0, "auto: the step runs on a GPU"),
        (AUTO_THREADS, None, 0, 0, "auto: the model's size could not be counted"),
        (0, 5.6e6, 0, 0, "--intra_op_threads=0: TF's default"),
        (3, 192e6, 0, 3, "--intra_op_threads=3: 3 per op"),
    ],
    ids=["environment", "tiny-step", "big-step", "gpu", "uncounted", "explicit-default", "explicit"],
)
def test_intra_op_threads_choice(requested, flops, gpus, threads, reason):
    environ = "4" if "TF_NUM_INTRAOP_THREADS" in reason else None
    chosen, why = choose_threads(requested, flops, gpus, environ)
    assert chosen == threads and why.startswith(reason)


def test_forward_flops_counts_the_mlp_without_starting_tensorflow():
    """The 256-256 MLP on 8x8 digits at batch 32: its three matmuls are 2·32·(64·256 +
    256·256 + 256·10) FLOPs, plus bias adds; counted in a graph, so no op runs."""
    from tfspeed.config import ModelConfig
    from tfspeed.training import models

    flops = forward_flops(lambda: models.build(ModelConfig(name="mlp"), (8, 8, 1), 10),
                          (8, 8, 1), 32)
    matmuls = 2 * 32 * (64 * 256 + 256 * 256 + 256 * 10)
    assert matmuls <= flops <= 1.05 * matmuls
    assert forward_flops(lambda: models.build(ModelConfig(name="cnn"), (8, 8, 1), 10),
                         (8, 8, 1), 64) > 10 * flops


def test_forward_flops_of_a_model_that_does_not_build_is_none():
    def broken():
        raise ValueError("no such layer")

    assert forward_flops(broken, (8, 8, 1), 32) is None


def test_threads_set_after_tensorflow_started_are_reported_not_applied():
    """This test process has run ops already: the setting cannot change, and the report
    says so instead of claiming it."""
    import tensorflow as tf

    from tfspeed.runtime import setup

    tf.constant(1.0) + 1  # the runtime is running
    current = tf.config.threading.get_intra_op_parallelism_threads()
    rt = setup(RuntimeConfig(intra_op_threads=current + 1), CPU_PLAIN)
    assert tf.config.threading.get_intra_op_parallelism_threads() == current
    assert rt.plan.intra_op_threads == current
    assert "not applied: TensorFlow had started" in rt.plan.reasons["intra_op_threads"]


def test_negative_threads_are_a_usage_error():
    with pytest.raises(UsageError, match="--intra_op_threads=-2 must be >= 0"):
        RuntimeConfig(intra_op_threads=-2).validate()
