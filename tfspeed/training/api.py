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
        callbacks: Sequence = ()) -> dict:
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
      validation: a dataset of ``(x, y)`` batches, evaluated once at the end.
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
      callbacks: ``keras.callbacks.Callback``s: ``on_train_begin``, ``on_epoch_end(epoch,
        logs)`` with the training metrics, ``on_train_end`` with ``val_*`` added.

    Returns:
      The report (also written to ``model_dir/report.json``, less the model): ``history``
      (every log point), ``train_metrics``, ``eval_metrics``, throughput,
      ``optimizer_updates``, the resolved ``config``, the runtime and objectives chosen and
      why, the files ``saved``, the ``model_dir``, and the trained ``model``.
    """
    import tensorflow as tf

    from tfspeed.training import checkpoints, objectives, report, trainer

    if not isinstance(train, tf.data.Dataset):
        raise UsageError(f"train must be a tf.data.Dataset of (x, y) batches, got "
                         f"{type(train).__name__}")
    if epochs is not None and steps is not None:
        raise UsageError("give tfspeed.fit epochs= or steps=, not both")
    config = fit_config(epochs=epochs, train_steps=steps, learning_rate=learning_rate,
                        optimizer=optimizer, steps_per_execution=steps_per_execution,
                        grad_accum_steps=grad_accum_steps, checkpoint_every=checkpoint_every,
                        log_every=log_every, strategy=strategy, cpu_replicas=cpu_replicas,
                        precision=precision, xla=xla, model_dir=model_dir)
    os.makedirs(config.model_dir, exist_ok=True)
    with locked_model_dir(config.model_dir, "model_dir"):
        rt = _runtime(strategy, config.runtime, model)
        batch, per_epoch = _batch_and_epoch(train)
        built = _build(model, rt, train)
        sequences = _token_batches(train)
        task = task or ("classification" if sequences else "regression"
                        if train.element_spec[1].dtype.is_floating else "classification")
        goals = objectives.resolve(loss or "", metrics, task, built, sequences=sequences)
        if task == "classification":
            _check_classes(built, train, "train")
        distribute = rt.strategy.experimental_distribute_dataset
        data = distribute(train.repeat().rebatch(batch, drop_remainder=True))
        with _label_errors(built):
            result = trainer.fit(
                built, data, distribute(validation) if validation is not None else None,
                config.train, rt, steps_per_epoch=per_epoch, eval_steps=None,
                global_batch_size=batch, model_dir=config.model_dir, objectives=goals,
                callbacks=callbacks, optimizer=None if isinstance(optimizer, str) else optimizer)
        out = {**dataclasses.asdict(result), "runtime": rt.to_json(),
               "objectives": goals.report, "model_dir": config.model_dir,
               "config": config.to_json()}
        if rt.is_chief:
            out["saved"] = checkpoints.export_model(built, config.model_dir)
            report.write(config.model_dir, out)
    return {**out, "model": built}


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


def _check_classes(model, dataset, name: str) -> None:
    """A classifier's outputs cover the first batch's labels: the command line checks the
    model against the schema's classes; here the data's own labels are all there is."""
    import numpy as np
    import tensorflow as tf

    x, y = next(iter(dataset))
    labels = tf.nest.flatten(y)[0]
    outputs = tf.nest.flatten(model(x, training=False))[0]
    if outputs.shape.rank != 2 or outputs.shape[-1] == 1 or not labels.dtype.is_integer:
        return
    n, top = int(outputs.shape[-1]), int(np.max(labels.numpy()))
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
    if built:  # its layers have their dtypes already
        config = dataclasses.replace(config, precision=model.dtype_policy.name)
    if strategy is None or isinstance(strategy, str):
        if built and config.strategy not in ("auto", "default"):
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


def _batch_and_epoch(train) -> tuple[int, int]:
    """The global batch (the first batch's size) and the batches in one pass."""
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
    if count == tf.data.INFINITE_CARDINALITY:
        raise UsageError("train repeats forever: give tfspeed.fit steps= (updates), or a "
                         "finite dataset with epochs=")
    if count == tf.data.UNKNOWN_CARDINALITY:
        count = int(train.reduce(0, lambda n, _: n + 1))  # one pass to count the batches
    return batch, max(count, 1)


def _build(model, rt, train):
    """The model, built (called once on a batch) in the strategy's scope."""
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
        x = next(iter(train))[0]
        with rt.strategy.scope():
            built(x)
    return built
