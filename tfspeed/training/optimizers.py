"""The optimizer and its learning-rate schedule, counted in optimizer updates (never
micro-batches), with the linear scaling rule for large batches."""

from __future__ import annotations

import keras
import tensorflow as tf

from tfspeed.config import TrainConfig

# Linear scaling rule (Goyal et al. 2017): the learning rate is given for this batch size.
REFERENCE_BATCH = 256


def peak_learning_rate(config: TrainConfig, global_batch_size: int) -> float:
    """``learning_rate``, scaled by effective batch / 256 with ``scale_lr_with_batch``."""
    if not config.scale_lr_with_batch:
        return config.learning_rate
    return config.learning_rate * global_batch_size * config.grad_accum_steps / REFERENCE_BATCH


class WarmupConstant(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up from 0 to ``rate`` over ``warmup_steps`` updates, then constant."""

    def __init__(self, rate: float, warmup_steps: int):
        self.rate, self.warmup_steps = rate, warmup_steps

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        return self.rate * tf.minimum(1.0, (step + 1.0) / float(max(self.warmup_steps, 1)))

    def get_config(self):
        return {"rate": self.rate, "warmup_steps": self.warmup_steps}


def make_optimizer(config: TrainConfig, total_updates: int, global_batch_size: int):
    """The optimizer, with its schedule counted in updates (never micro-batches)."""
    rate = peak_learning_rate(config, global_batch_size)
    warmup = min(config.warmup_steps, total_updates)
    if config.lr_schedule == "cosine":
        schedule = keras.optimizers.schedules.CosineDecay(
            initial_learning_rate=0.0 if warmup else rate,
            decay_steps=max(total_updates - warmup, 1),
            warmup_target=rate if warmup else None,
            warmup_steps=warmup,
        )
    elif warmup:
        schedule = WarmupConstant(rate, warmup)
    else:
        schedule = rate
    if config.optimizer == "sgd":
        return keras.optimizers.SGD(schedule, momentum=0.9, nesterov=True)
    if config.optimizer == "adamw":
        return keras.optimizers.AdamW(schedule)
    return keras.optimizers.Adam(schedule)
