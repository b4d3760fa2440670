"""``tfspeed.fit``: the engine for a model and data you build yourself.

    import tfspeed
    report = tfspeed.fit(make_model, train_ds, validation=val_ds, epochs=5,
                         strategy="mirrored", grad_accum_steps=4, model_dir="runs/mine")

Everything the driver does where stock ``fit`` fails, for any ``tf.data.Dataset`` of
``(x, y)`` batches: accumulation, steps_per_execution and per-replica XLA under
MirroredStrategy, exact resume from ``model_dir``, the throughput meter, TensorBoard logs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Sequence

from tfspeed.errors import UsageError


def fit(model, train, validation=None, *, epochs: int | None = None,
        steps: int | None = None, loss=None, metrics: Sequence | None = None,
        optimizer=None, learning_rate: float | None = None, task: str | None = None,
        strategy=None, cpu_replicas: int | None = None, precision: str | None = None,
        xla: str | None = None, grad_accum_steps: int | None = None,
        steps_per_execution: int | str | None = None, model_dir: str | None = None,
        checkpoint_every: int | None = None, log_every: int | None = None,
        eval_every_epochs: int | None = None, callbacks: Sequence = ()) -> dict:
    """Trains ``model`` on ``train`` with tfspeed's engine; evaluates on ``validation``.

    Every keyword left out takes the default of ``tfspeed.config`` (the dataclasses the
    command line's flags come from), so ``tfspeed.fit(model, train)`` resolves the same
    settings as ``python -m tfspeed.train`` without flags: one epoch, ``auto`` strategy,
    precision, XLA and steps per execution, Adam at 1e-3.

    Args:
      model: a ``keras.Model``, or a function of no arguments that builds one (tfspeed then
        calls it inside the strategy's scope, under the precision policy). A model passed
        built keeps its own precision and needs ``strategy`` "auto" or "default" (or a
        strategy in whose scope it was created).
      train: a ``tf.data.Dataset`` of ``(x, y)`` batches (``x`` may be a dict of named
        inputs). Token batches (``tfspeed.data.build`` on text: ``x`` the dict of tokens,
        segment ids and positions, ``y`` the dict of label and weight) train with a loss per
        sequence, or per real token with ``task="lm"``, exact whatever the padding. Its batch size is the global batch of one micro-step; a last partial batch
        is dropped, and epochs follow one another without a short batch.
      validation: a dataset of ``(x, y)`` batches, evaluated at the end (and every
        ``eval_every_epochs`` passes).
      epochs / steps: passes over ``train``, or optimizer updates (at most one of the two).
      loss: a Keras loss name, ``package.module:function`` or a function returning one loss
        per example; None: by task (sparse categorical cross-entropy, or mse).
      metrics: names or per-example functions; None: by task (accuracy, or mae).
      optimizer: ``adam``, ``adamw``, ``sgd`` or a Keras optimizer made in the strategy scope.
      learning_rate: for a named optimizer.
      task: ``classification``, ``regression`` or ``lm`` (token batches); None: integer
        labels classify.
      strategy: ``auto``, ``default``, ``one_device``, ``mirrored``, ``multi_worker`` or a
        ``tf.distribute.Strategy``.
      cpu_replicas: split the CPU into this many logical devices (MirroredStrategy on CPU).
      precision / xla: as the driver's ``--precision`` / ``--xla``.
      grad_accum_steps: micro-batches per optimizer update.
      steps_per_execution: micro-steps per compiled call, or ``auto``.
      model_dir: checkpoints (a rerun resumes), TensorBoard logs, the weights and
        ``report.json``; None: a new temporary directory.
      checkpoint_every: updates between checkpoints (0: at the end).
      log_every: micro-steps between logged metrics.
      eval_every_epochs: also evaluate ``validation`` after every N passes over ``train``
        (0: at the end only): the report's ``eval_history``, TensorBoard, and ``val_*`` in
        the callbacks' ``on_epoch_end`` logs.
      callbacks: ``keras.callbacks.Callback``s: ``on_train_begin``, ``on_epoch_end(epoch,
        logs)`` with the training metrics, ``on_train_end`` with ``val_*`` added.

    Returns:
      The report (also written to ``model_dir/report.json``, less the model): ``history``
      (every log point), ``train_metrics``, ``eval_metrics``, ``eval_history`` (every
      evaluation, with the training seconds before it), throughput,
      ``optimizer_updates``, the resolved ``config``, the runtime and objectives chosen and
      why, the files ``saved``, the ``model_dir``, and the trained ``model``.
    """
    import tensorflow as tf

    from tfspeed.training import checkpoints, fit_job, report, trainer
    from tfspeed.training import job as job_lib

    if not isinstance(train, tf.data.Dataset):
        raise UsageError(f"train must be a tf.data.Dataset of (x, y) batches, got "
                         f"{type(train).__name__}")
    if epochs is not None and steps is not None:
        raise UsageError("give tfspeed.fit epochs= or steps=, not both")
    if eval_every_epochs and validation is None:
        raise UsageError(f"tfspeed.fit(eval_every_epochs={eval_every_epochs}) evaluates on "
                         "validation=, which was not given: pass a validation dataset")
    config = fit_config(epochs=epochs, train_steps=steps, learning_rate=learning_rate,
                        optimizer=optimizer, steps_per_execution=steps_per_execution,
                        grad_accum_steps=grad_accum_steps, checkpoint_every=checkpoint_every,
                        log_every=log_every, eval_every_epochs=eval_every_epochs,
                        strategy=strategy, cpu_replicas=cpu_replicas,
                        precision=precision, xla=xla, model_dir=model_dir)
    os.makedirs(config.model_dir, exist_ok=True)
    with locked_model_dir(config.model_dir, "model_dir"), fit_job.label_errors():
        job = fit_job.prepare(config, model, train, validation, strategy=strategy, task=task,
                              loss=loss, metrics=metrics)
        result = trainer.fit(
            job.model, job.train_data, job.eval_data, config.train, job.runtime,
            steps_per_epoch=job.steps_per_epoch, eval_steps=None,
            global_batch_size=job.config.data.batch_size,
            model_dir=config.model_dir, objectives=job.objectives, callbacks=callbacks,
            optimizer=None if isinstance(optimizer, str) else optimizer,
            weight_scale=job.token_weight)
        out = {**dataclasses.asdict(result), "runtime": job.runtime.to_json(),
               "plan": job_lib.report_plan(job, result.steps_per_execution),
               "objectives": job.objectives.report, "model_dir": config.model_dir,
               "config": config.to_json(), **_image_input(train)}
        if job.runtime.is_chief:
            out["saved"] = checkpoints.export_model(job.model, config.model_dir)
            report.write(config.model_dir, out)
    report.check_evaluation(result.eval_metrics, config.model_dir)
    return {**out, "model": job.model}


def _image_input(train) -> dict:
    """Image batches: the dtype they travel in, and where float32 ones go to the device
    (4x the bytes of uint8), the fix, logged once: ``tfspeed.fit`` does not own the model,
    so it cannot move the scale into it as the driver does."""
    from absl import logging

    from tfspeed.data import images

    x = train.element_spec[0]  # images: a TensorSpec (batch, height, width, channels)
    if getattr(x, "shape", None) is None or x.shape.rank != 4:
        return {}
    if not x.dtype.is_floating:
        return {"input": {"image_dtype": x.dtype.name}}
    advice = images.float_images_advice(
        "build the data with tfspeed.data.build(..., image_dtype='uint8') and put "
        "tfspeed.data.scaling_layer() first in the model: the scale then runs inside the "
        "compiled step")
    logging.warning("%s", advice)
    return {"input": {"image_dtype": x.dtype.name, "advice": advice}}


def fit_config(*, model_dir: str | None = None, **given):
    """The ``Config`` that ``tfspeed.fit`` trains with: the dataclasses' defaults, with each
    keyword that was given (not None) in its place. An optimizer or strategy object is
    recorded by its default name (the object itself is used)."""
    import tempfile

    from tfspeed.config import Config, RuntimeConfig, TrainConfig

    def chosen(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in given.items() if k in names and v is not None
                and (k not in ("optimizer", "strategy") or isinstance(v, str))}

    train = TrainConfig(**chosen(TrainConfig)).validate()
    runtime = RuntimeConfig(**chosen(RuntimeConfig)).validate()
    return Config(runtime=runtime, train=train,
                  model_dir=model_dir or tempfile.mkdtemp(prefix="tfspeed-fit-"))


@contextlib.contextmanager
def locked_model_dir(model_dir: str, flag: str = "--model_dir"):
    """Holds the lock on ``model_dir`` for the block: two runs writing one directory would
    overwrite each other's checkpoints, logs and report."""
    from tfspeed.util import locks

    lock = locks.lock_model_dir(model_dir, flag)
    try:
        yield lock
    finally:
        lock.release()
