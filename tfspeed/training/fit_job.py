"""The job of a ``tfspeed.fit`` call: a user's dataset and model, built in the driver's order.

``training.job`` builds the driver's job from a converted data directory; this module builds
``tfspeed.fit``'s from what a Keras user has instead (a ``tf.data.Dataset`` of ``(x, y)``
batches, a model or a function that builds one, maybe a strategy object) and returns the same
``job.Job``. Both follow one order: the data is checked, then every model is checked against
the data as it is built (the driver's ``models.build`` against the schema's classes, here the
first batch's labels), then the precision probe (``job.measure_precision``, shared) times
models that passed, then training. So a mistake is one line before any step runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

from tfspeed.errors import UsageError
from tfspeed.training import job as job_lib


def prepare(config, model, train, validation=None, *, strategy=None, task=None, loss=None,
            metrics=None):
    """The ``Job`` that ``tfspeed.fit`` trains: runtime, checked data, probed precision and
    the model with its objectives.

    Args:
      config: the ``Config`` of the call (``api.fit_config``).
      model: a ``keras.Model``, or a function of no arguments that builds one.
      train: a ``tf.data.Dataset`` of ``(x, y)`` batches.
      validation: a dataset of ``(x, y)`` batches, or None.
      strategy: a strategy name (in ``config``), or a ``tf.distribute.Strategy`` object.
      task, loss, metrics: as ``tfspeed.fit`` takes them (None: by the data).

    Returns:
      The ``job.Job``: ``train_data`` distributed and repeating, ``eval_data`` distributed,
      ``epoch_batches`` the micro-steps of one pass, ``config.data.batch_size`` the global
      batch of the data, ``token_weight`` for token batches.
    """
    import tensorflow as tf

    from tfspeed import runtime

    rt = _runtime(strategy, config.runtime, model)
    # The data first: its batches, their size and the passes they make.
    first, batch, per_epoch = first_batch(train, config.train)
    sequences = token_batches(train)
    if sequences:  # packed rows have one static shape: XLA compiles them once
        static = first[0]["tokens"].shape.is_fully_defined() and all(
            s.shape.is_fully_defined() for s in tf.nest.flatten(train.element_spec))
        rt = runtime.for_batching(rt, config.runtime, "pack" if static else "bucket")
    task = task or ("classification" if sequences else "regression"
                    if train.element_spec[1].dtype.is_floating else "classification")
    weight = first_weight(first) if sequences else None

    def build(rt):  # every model of the job, the probe's included, checked as it is built
        built = _build(model, rt, first)
        if task in ("classification", "lm"):
            check_classes(built, first, "train")
        return built, _objectives(built, loss, metrics, task, sequences)

    given = isinstance(model, _keras_model())  # keeps its own precision: nothing to probe
    probed = ""
    if not given and job_lib.precision_to_measure(config, rt):
        probed = "measured"
        held = iter(rt.distribute(
            tf.data.Dataset.from_tensors(first).repeat()))
        run_steps = config.train.train_steps * config.train.grad_accum_steps or (
            config.train.epochs * per_epoch)
        rt = job_lib.measure_precision(
            config, rt, lambda policy, rt=rt: _probe_engine(*build(rt), config, rt, batch,
                                                            weight),
            held, run_steps)
    built, goals = build(rt)
    endless = int(train.cardinality()) == tf.data.INFINITE_CARDINALITY
    data = train if endless else train.repeat()
    if not sequences:  # token batches as they come: a bucket's batches differ in rows, width
        data = data.rebatch(batch, drop_remainder=True)
    distribute = rt.distribute
    # The job's config holds the batch as the data gives it (the driver's --batch_size).
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=batch))
    return job_lib.Job(
        config=config, runtime=rt, schema=None, model=built, train_data=distribute(data),
        eval_data=distribute(validation) if validation is not None else None,
        eval_steps=None, input_shape=(), num_train=per_epoch * batch, prepare_seconds=0.0,
        objectives=goals, epoch_batches=per_epoch, token_weight=weight,
        plan=job_lib.runtime_plan(config, rt, probed))


def _objectives(model, loss, metrics, task: str, sequences: bool):
    from tfspeed.training import objectives

    return objectives.resolve(loss or "", metrics, task, model, sequences=sequences)


def _probe_engine(model, goals, config, rt, batch: int, weight):
    """An engine of the precision probe: the job's model and objectives, timed only."""
    from tfspeed.training import trainer

    return trainer.make_engine(model, goals, config.train, rt, batch, job_lib.PROBE_UPDATES,
                               weight_scale=weight)


def first_weight(batch) -> float:
    """Token batches: the first batch's weight (real tokens, or sequences): the constant
    each micro-batch's summed loss is divided by, so it keeps a mean's magnitude."""
    import numpy as np

    return max(1.0, float(np.asarray(batch[1]["weight"]).sum()))


def _keras_model():
    import keras

    return keras.Model


def token_batches(dataset) -> bool:
    """Whether ``dataset`` holds token batches (``tfspeed.data.sequences``' contract): targets
    ``{"label", "weight"}``, trained with a loss per real token or per sequence."""
    targets = dataset.element_spec[1]
    return isinstance(targets, dict) and {"label", "weight"} <= set(targets)


def check_classes(model, batch, name: str) -> None:
    """A classifier's outputs cover the first batch's labels: the command line checks the
    model against the schema's classes; here the data's own labels are all there is. Scores
    have a classes axis after the labels' (``[batch]``, token batches' ``[batch, S]`` or
    ``[batch, T]``), or after a label axis of 1."""
    import keras
    import numpy as np

    x, y = batch
    labels = np.asarray(keras.tree.flatten(y)[0])  # token batches: "label" before "weight"
    outputs = keras.tree.flatten(model(x, training=False))[0]
    rank = len(outputs.shape)
    scores = rank == labels.ndim + 1 or (rank == labels.ndim and labels.shape[-1] == 1)
    if rank < 2 or not scores or outputs.shape[-1] == 1 or labels.dtype.kind not in "iu":
        return
    n, top = int(outputs.shape[-1]), int(np.max(labels))
    if top >= n:
        raise UsageError(f"the model outputs {n} classes, but {name}'s labels reach {top}; end "
                         f"the model with keras.layers.Dense({top + 1}) or more, or relabel "
                         f"to 0..{n - 1}")


@contextlib.contextmanager
def label_errors():
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
    # Without tf.distribute the engine places the arrays: no strategy object, no scope.
    jax = not runtime.backends.current().tf_distribute
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


def first_batch(train, config) -> tuple[tuple, int, int]:
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
        with rt.scope():
            built = model()
        if not isinstance(built, keras.Model):
            raise UsageError(f"the model function returned {type(built).__name__}, not a "
                             "keras.Model")
    else:
        raise UsageError("model must be a keras.Model or a function of no arguments that "
                         "builds one")
    if not built.built:
        with rt.scope():
            built(first[0])
    return built
