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
import inspect
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

    from tfspeed.training import checkpoints, report, trainer

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
    with locked_model_dir(config.model_dir, "model_dir"):
        job = _job(model, train, config, strategy, task, loss, metrics)
        distribute = job.runtime.strategy.experimental_distribute_dataset
        with _label_errors(job.model):
            result = trainer.fit(
                job.model, distribute(job.data),
                distribute(validation) if validation is not None else None,
                config.train, job.runtime, steps_per_epoch=job.per_epoch, eval_steps=None,
                global_batch_size=job.batch, model_dir=config.model_dir,
                objectives=job.objectives, callbacks=callbacks,
                optimizer=None if isinstance(optimizer, str) else optimizer,
                weight_scale=job.weight_scale)
        out = {**dataclasses.asdict(result), "runtime": job.runtime.to_json(),
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


@dataclasses.dataclass
class _FitJob:
    """What ``tfspeed.fit`` resolved before training: the data as the engine takes it (never
    rebatched for token batches), the model, objectives and runtime."""

    data: object
    model: object
    objectives: object
    runtime: object
    batch: int
    per_epoch: int
    weight_scale: float | None


def _job(model, train, config, strategy, task, loss, metrics) -> _FitJob:
    """The job of a ``tfspeed.fit`` call, resolved as the driver resolves its own (the
    same runtime rules, precision probe and XLA choice for static token batches)."""
    import tensorflow as tf

    from tfspeed import runtime
    from tfspeed.training import job as job_lib
    from tfspeed.training import objectives

    rt = _runtime(strategy, config.runtime, model)
    sequences = _token_batches(train)
    endless = int(train.cardinality()) == tf.data.INFINITE_CARDINALITY
    first, batch, per_epoch = _batch_and_epoch(train, config.train)
    if sequences:  # packed rows have one static shape: XLA compiles them once
        static = first[0]["tokens"].shape.is_fully_defined() and all(
            s.shape.is_fully_defined() for s in tf.nest.flatten(train.element_spec))
        rt = runtime.for_batching(rt, config.runtime, "pack" if static else "bucket")
    task = task or ("classification" if sequences else "regression"
                    if train.element_spec[1].dtype.is_floating else "classification")
    run_steps = config.train.train_steps * config.train.grad_accum_steps or (
        config.train.epochs * per_epoch)
    if callable(model) and not isinstance(model, _keras_model()) and \
            job_lib.precision_to_measure(config, rt):
        held = iter(rt.strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensors(first).repeat()))

        def engine_for(policy):
            built = _build(model, rt, first)
            goals = objectives.resolve(loss or "", metrics, task, built, sequences=sequences)
            return _probe_engine(built, goals, config, rt, batch, sequences, first)

        rt = job_lib.measure_precision(config, rt, engine_for, held, run_steps)
    built = _build(model, rt, first)
    goals = objectives.resolve(loss or "", metrics, task, built, sequences=sequences)
    if task == "classification":
        _check_classes(built, first, "train")
    if sequences:  # as they come: a bucket's batches differ in rows and width
        data = train if endless else train.repeat()
    else:
        data = (train if endless else train.repeat()).rebatch(batch, drop_remainder=True)
    return _FitJob(data, built, goals, rt, batch, per_epoch,
                   _first_weight(first) if sequences else None)


def _probe_engine(model, goals, config, rt, batch, sequences, first):
    """An engine for the precision probe of ``tfspeed.fit``."""
    from tfspeed.training import job as job_lib
    from tfspeed.training import trainer

    return trainer.make_engine(model, goals, config.train, rt, batch, job_lib.PROBE_UPDATES,
                               weight_scale=_first_weight(first) if sequences else None)


def _first_weight(batch) -> float:
    """Token batches: the first batch's weight (real tokens, or sequences): the constant
    each micro-batch's summed loss is divided by, so it keeps a mean's magnitude."""
    import numpy as np

    return max(1.0, float(np.asarray(batch[1]["weight"]).sum()))


def _keras_model():
    import keras

    return keras.Model


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


def _token_batches(dataset) -> bool:
    """Whether ``dataset`` holds token batches (``tfspeed.data.sequences``' contract): targets
    ``{"label", "weight"}``, trained with a loss per real token or per sequence."""
    targets = dataset.element_spec[1]
    return isinstance(targets, dict) and {"label", "weight"} <= set(targets)


def _check_classes(model, batch, name: str) -> None:
    """A classifier's outputs cover the first batch's labels: the command line checks the
    model against the schema's classes; here the data's own labels are all there is."""
    import keras
    import numpy as np

    x, y = batch
    labels = np.asarray(keras.tree.flatten(y)[0])
    outputs = keras.tree.flatten(model(x, training=False))[0]
    if len(outputs.shape) != 2 or outputs.shape[-1] == 1 or labels.dtype.kind not in "iu":
        return
    n, top = int(outputs.shape[-1]), int(np.max(labels))
    if top >= n:
        raise UsageError(f"the model outputs {n} classes, but {name}'s labels reach {top}; end "
                         f"the model with keras.layers.Dense({top + 1}) or more, or relabel "
                         f"to 0..{n - 1}")


@contextlib.contextmanager
def _label_errors(model):
    """A label past the model's outputs, met during training (the first batch was fine):
    one line instead of TensorFlow's traceback."""
    import tensorflow as tf

    try:
        yield
    except tf.errors.InvalidArgumentError as e:
        text = str(e.message)
        marker = "Received a label value of "
        if marker not in text:
            raise
        found = text[text.index(marker):].split("\n")[0].split(".")[0]
        raise UsageError(f"{found.lower()}: the model has fewer outputs than the data has "
                         f"classes; end it with keras.layers.Dense(number of classes)"
                         ) from None


def _runtime(strategy, config, model):
    """The Runtime: resolved from ``config``, or around a strategy object."""
    import keras

    from tfspeed import runtime

    built = isinstance(model, keras.Model)
    jax = runtime.backend() == "jax"  # the engine places the arrays: no scope to build in
    if built:  # its layers have their dtypes already
        config = dataclasses.replace(config, precision=model.dtype_policy.name)
    if strategy is not None and not isinstance(strategy, str) and jax:
        raise UsageError(f"strategy={type(strategy).__name__} is TensorFlow's; on the JAX "
                         "backend pass strategy='mirrored' (data parallel over the devices) or "
                         "'default'")
    if strategy is None or isinstance(strategy, str):
        if built and config.strategy not in ("auto", "default") and not jax:
            raise UsageError(f"strategy={config.strategy!r} needs the model built in its scope: "
                             "pass a function that builds the model, and tfspeed calls it there")
        if built:
            config = dataclasses.replace(config, strategy="default")
        return runtime.setup(config)
    plan = runtime.resolve(dataclasses.replace(config, strategy="default"),
                           runtime.detect_hardware())
    plan = dataclasses.replace(plan, strategy=type(strategy).__name__,
                               reasons={**plan.reasons, "strategy": "given"})
    keras.mixed_precision.set_global_policy(plan.precision)
    return runtime.Runtime(strategy=strategy, plan=plan)


def _batch_and_epoch(train, config) -> tuple[tuple, int, int]:
    """The first batch, the global batch (its size) and the batches in one pass (an endless
    dataset, with ``steps=``: the run's micro-steps)."""
    import tensorflow as tf

    first = next(iter(train), None)
    if first is None:
        raise UsageError("train is empty: give tfspeed.fit a dataset with at least one batch")
    if not isinstance(first, (tuple, list)) or len(first) != 2:
        raise UsageError("train must yield (x, y) batches; map it to pairs, e.g. "
                         "ds.map(lambda d: (d['image'], d['label']))")
    labels = tf.nest.flatten(first[1])[0]
    if labels.shape.rank == 0:
        raise UsageError("train yields single examples (its labels have no batch axis); "
                         "batch it first: train.batch(N)")
    batch = int(tf.shape(labels)[0])
    count = int(train.cardinality())
    if count == tf.data.INFINITE_CARDINALITY and not config.train_steps:
        raise UsageError("train repeats forever: give tfspeed.fit steps= (updates), or a "
                         "finite dataset with epochs=")
    if config.train_steps and count < 0:  # endless, or of unknown length: steps= bounds it
        return first, batch, config.train_steps * config.grad_accum_steps
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(train.reduce(0, lambda n, _: n + 1))  # one pass to count the batches
    return first, batch, max(count, 1)


def _build(model, rt, first):
    """The model, built (called once on the first batch) in the strategy's scope."""
    import keras

    if isinstance(model, keras.Model):
        built = model
    elif callable(model) and not inspect.signature(model).parameters:
        with rt.strategy.scope():
            built = model()
        if not isinstance(built, keras.Model):
            raise UsageError(f"the model function returned {type(built).__name__}, not a "
                             "keras.Model")
    else:
        raise UsageError("model must be a keras.Model or a function of no arguments that "
                         "builds one")
    if not built.built:
        with rt.strategy.scope():
            built(first[0])
    return built
