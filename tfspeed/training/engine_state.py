"""The TensorFlow engine's state between calls: counters, gradient accumulators, the weight
sum of a weighted update and the loss scale, all trackable so that a checkpoint holds a
half-accumulated update. Also the per-batch helpers its step uses.
"""

from __future__ import annotations

import tensorflow as tf

from tfspeed.training import batch_ops
from tfspeed.training.batch_ops import fill_empty_rows, sparse_accuracy  # noqa: F401
from tfspeed.training.engine import EngineOptions

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


def ensure_cpu_devices(n: int = 2) -> int:
    """Splits the first physical CPU into `n` logical devices, if TF still allows it.

    Must run before any op; if TF is already initialised (or the split was made already) the
    existing devices are kept.

    Returns:
        The number of logical CPU devices.
    """
    cpus = tf.config.list_physical_devices("CPU")
    try:
        if len(tf.config.get_logical_device_configuration(cpus[0]) or ()) < n:
            tf.config.set_logical_device_configuration(
                cpus[0], [tf.config.LogicalDeviceConfiguration()] * n
            )
    except RuntimeError:  # "Virtual devices cannot be modified after being initialized"
        pass
    return len(tf.config.list_logical_devices("CPU"))


class EngineState(tf.Module):
    """The engine's variables, trackable so a checkpoint holds a half-accumulated update."""

    def __init__(self, trainable_variables: list, options: EngineOptions,
                 weighted: bool = False):
        super().__init__(name="engine")
        counter = dict(trainable=False, dtype=tf.int64, aggregation=_ONLY_FIRST)
        self.micro_steps = tf.Variable(0, name="micro_steps", **counter)
        self.skipped_updates = tf.Variable(0, name="skipped_updates", **counter)
        on_read_sum = dict(trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)
        # ON_READ/SUM: each replica adds to its own copy without communication; a read in
        # cross-replica context (and a checkpoint) sees the sum over replicas, and a restore
        # splits it evenly again, so the sum survives a change in the number of replicas.
        self.accumulators = (
            [
                tf.Variable(tf.zeros(v.shape, _accumulator_dtype(v.dtype)),
                            name=f"grad_accum_{i}", **on_read_sum)
                for i, v in enumerate(trainable_variables)
            ]
            if options.grad_accum_steps > 1
            else []
        )
        if weighted and options.grad_accum_steps > 1:
            # The weight sum of the micro-batches accumulated so far (the W of the update), so
            # a checkpoint taken mid-update resumes it exactly.
            self.weight_sum = tf.Variable(0.0, name="weight_sum", **on_read_sum)
        if options.loss_scale:
            self.loss_scale = tf.Variable(
                options.initial_loss_scale,
                name="loss_scale",
                trainable=False,
                dtype=tf.float32,
                aggregation=_ONLY_FIRST,
            )
            self.good_steps = tf.Variable(0, name="good_steps", **counter)


def _accumulator_dtype(dtype) -> tf.DType:
    # Summing K half-precision gradients in half precision would lose the small ones.
    dtype = tf.as_dtype(dtype)  # Keras variables give their dtype as a string
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def token_counts(x) -> tf.Tensor:
    """int64 ``[real tokens, computed tokens, sequences]`` of a token batch, or an empty
    vector for any other input (``batch_ops.token_counts``)."""
    counts = batch_ops.token_counts(x)
    return tf.zeros([0], tf.int64) if counts is None else tf.cast(counts, tf.int64)
