"""Trainer: compile and fit a model on datasets. Knows nothing of features or files."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

import keras
import tensorflow as tf

from tfspeed import callbacks as callbacks_lib
from tfspeed.config import TrainConfig
from tfspeed.runtime import Runtime


@dataclasses.dataclass
class FitResult:
    """What training produced: Keras history, final evaluation, throughput and timings."""

    history: dict
    eval_metrics: dict[str, float]
    throughput: dict[str, float]
    optimizer_updates: int
    seconds: dict[str, float]


def make_optimizer(config: TrainConfig) -> keras.optimizers.Optimizer:
    """The optimizer named by ``config.optimizer`` at ``config.learning_rate``."""
    if config.optimizer == "sgd":
        return keras.optimizers.SGD(config.learning_rate, momentum=0.9, nesterov=True)
    if config.optimizer == "adamw":
        return keras.optimizers.AdamW(config.learning_rate)
    return keras.optimizers.Adam(config.learning_rate)


def plan_steps(config: TrainConfig, steps_per_epoch: int) -> tuple[int, int]:
    """Returns (epochs, steps per epoch) so that training makes the updates asked for."""
    if config.train_steps:
        per_epoch = min(steps_per_epoch, config.train_steps)
        return math.ceil(config.train_steps / per_epoch), per_epoch
    return config.epochs, steps_per_epoch


def fit(
    model: keras.Model,
    train_ds: tf.data.Dataset,
    eval_ds: tf.data.Dataset | None,
    config: TrainConfig,
    runtime: Runtime,
    *,
    steps_per_epoch: int,
    eval_steps: int | None,
    global_batch_size: int,
    model_dir: str,
) -> FitResult:
    """Trains ``model`` (built in ``runtime.strategy.scope()``) and evaluates it.

    Args:
      model: an uncompiled Keras model that outputs logits.
      train_ds: an endlessly repeating training dataset of (inputs, labels) batches.
      eval_ds: a finite evaluation dataset, or None.
      config: optimisation settings.
      runtime: strategy, precision and XLA choice.
      steps_per_epoch: batches in one pass over the train split.
      eval_steps: batches in ``eval_ds`` (known from the schema's counts).
      global_batch_size: examples in one step (for throughput).
      model_dir: logs and the backup for resumption go below it.

    Returns:
      A ``FitResult``.
    """
    with runtime.strategy.scope():
        model.compile(
            optimizer=make_optimizer(config),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
            steps_per_execution=config.steps_per_execution,
            jit_compile=runtime.xla,
        )
    epochs, per_epoch = plan_steps(config, steps_per_epoch)
    log_dir = os.path.join(model_dir, "logs")
    meter = callbacks_lib.ThroughputMeter(
        global_batch_size, config.log_every, os.path.join(log_dir, "train")
    )
    cbs = [
        meter,
        keras.callbacks.TensorBoard(log_dir=log_dir, update_freq="epoch", profile_batch=0),
        # Keras' own resumption: an interrupted fit restarts from the last finished epoch.
        keras.callbacks.BackupAndRestore(os.path.join(model_dir, "backup")),
    ]
    if config.train_steps:
        cbs.append(callbacks_lib.StopAtStep(config.train_steps))
    start = time.perf_counter()
    history = model.fit(
        train_ds,
        epochs=epochs,
        steps_per_epoch=per_epoch,
        callbacks=cbs,
        verbose=1 if sys.stdout.isatty() else 2,
    )
    fit_seconds = time.perf_counter() - start
    start = time.perf_counter()
    eval_metrics = {}
    if eval_ds is not None:
        if config.eval_steps:
            eval_steps = min(config.eval_steps, eval_steps or config.eval_steps)
        eval_metrics = model.evaluate(eval_ds, steps=eval_steps, return_dict=True, verbose=0)
    return FitResult(
        history=history.history,
        eval_metrics={k: float(v) for k, v in eval_metrics.items()},
        throughput=meter.summary(),
        optimizer_updates=int(model.optimizer.iterations.numpy()),
        seconds={"fit": fit_seconds, "evaluate": time.perf_counter() - start},
    )
