"""A script's ``fit``, its step on tfspeed's engine (``python -m tfspeed.run``).

The first epoch runs on Keras' own ``fit``, on the datasets ``tfspeed.optimize`` returned (a
first run stores them while it trains, a later one replays the store): it is the pace the
engine must beat, measured in this run. Every epoch reads the optimised data, whichever step
runs it. The later epochs continue on ``tfspeed.fit`` from the same weights and optimizer state (the same optimizer object and variables: on TensorFlow its variables, on
JAX the values the engine copies in and writes back), with the model's own loss, metrics and
optimizer, steps per call and XLA as the driver resolves them. A built model keeps its own
precision (``tfspeed.fit``'s rule): the saved model is the one the script built.

The script's callbacks see one training run, as Keras calls them: ``on_train_begin`` once,
epochs numbered on from the first, ``val_*`` in each epoch's logs, ``on_train_end`` once,
and ``model.stop_training`` honoured. ``fit`` returns a ``keras.callbacks.History`` with the
keys Keras' would have.

What the engine cannot take (``why_not``) runs on Keras' ``fit``, on the optimised data, with
one line that says why.
"""

from __future__ import annotations

import shutil
import tempfile
import time

from tfspeed.attach import handback

# fit's arguments the engine takes as Keras does; any other given runs on Keras' fit.
TAKEN = {"x", "y", "validation_data", "epochs", "callbacks", "verbose", "shuffle",
         "batch_size", "initial_epoch", "validation_freq"}


# Epochs 2 on move to the engine only where Keras' fit would take at least this long for
# them (estimated from epoch 1): the engine's setup, compile and steps-per-call probes cost
# about 1.5 s on a tiny CNN on 2 CPU cores (its 4 later epochs took 5.6 s against 4.7 s on
# Keras' fit), more for larger models; a shorter rest cannot repay them.
MIN_ENGINE_SECONDS = 20.0
# The epochs after the engine's first stay on it only where it ran at least this many times
# Keras' examples/s (``handback``).
MIN_SPEEDUP = 1.0


class NotOnEngine(Exception):  # noqa: N818 -- a reason, not an error
    """Why this ``fit`` runs on Keras' own ``fit``: its one line."""


def why_not(model, args: dict) -> str | None:
    """Why the engine cannot take this ``fit`` call (None: it can).

    Args:
      model: the model ``fit`` was called on.
      args: the call's arguments by name.

    Returns:
      One phrase (what, and that Keras runs it), or None.
    """
    import keras
    import tensorflow as tf

    x, val = args.get("x"), args.get("validation_data")
    if not isinstance(x, tf.data.Dataset):
        return f"x is a {type(x).__name__}, not a tf.data.Dataset"
    others = sorted(set(args) - TAKEN)
    if others:
        return f"fit({', '.join(others)}=...) is Keras' own"
    if args.get("y") is not None:
        return "y= was given beside a dataset"
    if args.get("validation_freq", 1) != 1:
        return "validation_freq was given"
    if val is not None and not isinstance(val, tf.data.Dataset):
        return f"validation_data is a {type(val).__name__}, not a tf.data.Dataset"
    for name, data in (("x", x), ("validation_data", val)):
        if data is not None and not _pairs(data):
            return f"{name} yields no (inputs, labels) pairs (sample weights, or inputs alone)"
    if args.get("epochs", 1) - (args.get("initial_epoch") or 0) < 2:
        return "one epoch: too short to measure Keras' pace against the engine's"
    if getattr(model, "_compile_config", None) is None or model.optimizer is None:
        return "the model is not compiled"
    for method in ("train_step", "compute_loss", "test_step"):
        if getattr(type(model), method) is not getattr(keras.Model, method):
            return f"the model has its own {method}"
    if _sparse_rows(model) and type(model.optimizer) is not keras.optimizers.SGD:
        return ("the embedding's gradients are sparse rows, which Keras' fit gives "
                f"{type(model.optimizer).__name__} as they are and the engine would sum: SGD "
                "alone updates both alike")
    if isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer):
        return "the optimizer scales the loss (mixed precision): Keras' step owns that"
    strategy = getattr(model, "distribute_strategy", None)  # TensorFlow's backend only
    if tf.distribute.has_strategy() or keras.distribution.distribution() is not None or (
            strategy is not None and strategy is not tf.distribute.get_strategy()):
        return "the model is distributed (a tf.distribute scope or keras.distribution)"
    config = model._compile_config.config
    if config.get("loss_weights") or config.get("weighted_metrics"):
        return "loss_weights or weighted_metrics were compiled"
    if len(getattr(model, "outputs", None) or [None]) != 1:
        return "the model has several outputs"
    return None


def _sparse_rows(model) -> bool:
    """Whether, on TensorFlow, an embedding of ``model`` trains on gradients of sparse rows
    (``tf.IndexedSlices``): Keras' own fit gives them to the optimizer as they are, an id
    repeated in a batch as several rows, which an update not linear in the gradient (Adam's
    square of it) takes otherwise than the summed row the engine applies."""
    import keras

    from tfspeed.runtime import backends

    return backends.current().sparse_gradients and any(
        isinstance(layer, keras.layers.Embedding) and layer.trainable_weights
        for layer in model._flatten_layers())


def _pairs(data) -> bool:
    spec = data.element_spec
    return isinstance(spec, tuple) and len(spec) == 2


def objectives(model, first) -> tuple:
    """The compiled loss and metrics as the engine takes them: one value per example, with
    Keras' semantics (its own functions, arguments and "accuracy" resolution).

    Args:
      model: the compiled model.
      first: the first ``(x, y)`` batch of its training data (``first_batch``): it resolves
        "accuracy" as Keras' ``compile`` does (binary, sparse or categorical).

    Returns:
      ``(loss, metrics)``: a function, and functions named as Keras names the metrics.

    Raises:
      NotOnEngine: a loss or metric the engine cannot average per example.
    """
    import keras
    from keras.src.losses.losses import LossFunctionWrapper
    from keras.src.trainers import compile_utils

    config = model._compile_config.config
    loss = config.get("loss")
    if isinstance(loss, (dict, list, tuple)) or loss is None:
        raise NotOnEngine("the loss is not one function")
    if not isinstance(loss, keras.losses.Loss):
        loss = keras.losses.get(loss) if isinstance(loss, str) else loss
        loss = LossFunctionWrapper(loss)  # as Keras' compile wraps a function
    if loss.reduction != "sum_over_batch_size":
        raise NotOnEngine(f"the loss reduces by {loss.reduction!r}, not the batch mean")
    metrics = config.get("metrics") or []
    if isinstance(metrics, dict) or any(isinstance(m, (list, dict)) for m in metrics):
        raise NotOnEngine("metrics are given per output")
    x, y = first
    outputs = model(x, training=False)
    out = []
    for given in metrics:
        metric = compile_utils.get_metric(given, y, outputs)
        if not isinstance(metric, keras.metrics.MeanMetricWrapper):
            raise NotOnEngine(f"metric {metric.name} ({type(metric).__name__}) is not a mean "
                              "of per-example values")
        out.append(_per_example(lambda t, p, m=metric: m._fn(t, p, **m._fn_kwargs),
                                metric.name))
    return _per_example(loss.call, "loss"), out


def first_batch(data):
    """``data``'s first element, read from a copy with the same seeds (``graph.copy``): an
    iterator of ``data`` itself would advance its shuffle's seed generator, and the epochs
    that follow would see other orders than the script as written. (A pipeline with steps
    ``graph`` cannot rebuild, a store's cache among them, is read itself.)"""
    from tfspeed.attach import graph

    return next(iter(graph.copy(data).take(1)))


def _per_example(fn, name: str):
    """``fn`` returning one value per example: extra axes (a sequence's steps) averaged, as
    Keras' mean over all elements does for batches of one shape."""
    import keras

    def per_example(labels, outputs):
        values = fn(labels, outputs)
        if len(values.shape) > 1:
            values = keras.ops.mean(values, axis=tuple(range(1, len(values.shape))))
        return values

    per_example.__name__ = name
    return per_example


def run_fit(model, fit, args: dict, record: dict,
            min_engine_seconds: float = MIN_ENGINE_SECONDS, min_speedup: float = MIN_SPEEDUP):
    """Runs one ``fit`` call: epoch 1 on Keras' ``fit``, the rest on ``tfspeed.fit``, or,
    where the engine's first epoch measured slower than Keras' (``handback``), the epochs
    after it on Keras' fit again; every epoch on ``args``' datasets (optimised where the
    runner did so) and the model that takes them (``engine_model``). Where the epochs
    left are too short to repay the engine's setup, they stay on the same Keras fit.

    Args:
      model: the compiled model (``why_not`` found nothing against it).
      fit: Keras' own ``fit``.
      args: the call's arguments by name, its datasets optimised; ``goals`` holds the
        ``objectives`` and ``engine_model`` the model that trains on them (the user's, or
        one around its layers that takes the rewritten data: ``optimize(ds, model)``'s).
      min_engine_seconds: the later epochs stay on Keras' fit where it would take less
        (``MIN_ENGINE_SECONDS``).
      min_speedup: the engine keeps the epochs after its first only where it ran at
        least this many times Keras' examples/s (``MIN_SPEEDUP``).
      record: filled with ``epochs`` (each epoch's clock, per phase) and ``engine`` (what
        the engine resolved).

    Returns:
      The ``keras.callbacks.History`` of all the epochs.
    """
    import keras

    # The data as written's first batch (the same batches; ``args["first"]``): a copy of the
    # optimised data, where it reads a store, cannot be rebuilt, and reading it would advance
    # its shuffle.
    first = args.get("first") or first_batch(args.get("written", args)["x"])
    record["batch"] = int(keras.tree.flatten(first[1])[0].shape[0])
    epochs, verbose = args.get("epochs", 1), args.get("verbose", "auto")
    # A fit from initial_epoch on (fine-tuning's second fit): the script's epoch numbers
    # start there, on Keras' fit, the engine and back alike.
    initial = record["initial"] = args.get("initial_epoch") or 0
    verbose = 1 if verbose == "auto" else verbose
    history = keras.callbacks.History()
    steps = int(args["x"].cardinality())
    inner = keras.callbacks.CallbackList(
        [*(args.get("callbacks") or []), history], add_progbar=verbose != 0, model=model,
        verbose=verbose, epochs=epochs, steps=steps if steps > 0 else None)
    keras_clock, engine_clock = [], []
    record["epochs"] = {"keras": keras_clock, "engine": engine_clock}
    record["start"] = time.perf_counter()

    def move() -> bool:
        """At epoch 1's end: whether the epochs left move to the engine; else they go on in
        the same Keras fit (a second fit would cost its setup again), and the record says why."""
        left = epochs - initial - 1
        if len(keras_clock) != 1 or left < 1:
            return False
        rest = _keras_seconds(keras_clock[0]) * left
        if rest < min_engine_seconds:
            record["keras_rest"] = (
                f"the {left} epoch{'s' if left > 1 else ''} left would take ~{rest:.1f} s on "
                f"Keras' fit (epoch {initial + 1} measured), under {min_engine_seconds:g} s: "
                "too short to repay the engine's setup and compile; --min_engine_seconds=0 "
                "moves them anyway")
        elif varying := _varying(args["x"]):
            record["keras_rest"] = varying
        return "keras_rest" not in record

    model.stop_training = False  # as Keras' fit does: epoch 1 may train a model around it
    relay = _relay(inner, keras_clock, first=True, user=model, slower=move)
    fit(args.get("engine_model", model), args["x"], validation_data=args.get("validation_data"),
        epochs=epochs, initial_epoch=initial, verbose=0, callbacks=[relay])
    if relay.handed_back:  # epoch 1 ended with the rest moving to the engine
        args.get("engine_model", model).stop_training = False  # the relay's stop, not a user's
        _rest_on_engine(model, fit, args, epochs, inner, record, min_speedup)
    record["end"] = time.perf_counter()
    return history


def _rest_on_engine(model, fit, args, epochs: int, inner, record, min_speedup: float) -> None:
    """The epochs after Keras' first on the engine; where its job refuses the data or model
    before any step (a ``UsageError``), on Keras' fit, the reason in ``record["keras_rest"]``;
    where its first epoch ran slower than Keras' (``handback``), the epochs after it on
    Keras' fit, the reason in ``record["handed_back"]``."""
    from tfspeed.errors import UsageError

    clock, done = record["epochs"]["engine"], record["initial"] + 1  # epochs trained
    model_dir = tempfile.mkdtemp(prefix="tfspeed-run-")
    slower = handback.judge(record, min_speedup, epochs - done - 1)
    try:
        record["engine"] = _engine_fit(
            args.get("engine_model", model), args["x"], args.get("validation_data"),
            epochs - done, *args["goals"], model_dir,
            _relay(inner, clock, offset=done, user=model, slower=slower))
    except UsageError as e:
        if clock:  # met while training: the script's own mistake, as Keras would meet it
            raise
        record["keras_rest"] = str(e)
        _rest_on_keras(model, fit, args, epochs, inner, record, done)
    finally:
        shutil.rmtree(model_dir, ignore_errors=True)
    if "handed_back" in record:
        _rest_on_keras(model, fit, args, epochs, inner, record, done + len(clock))


def _rest_on_keras(model, fit, args, epochs: int, inner, record, initial: int) -> None:
    """Epochs ``initial + 1`` on, on Keras' fit as its first epoch ran (the optimised data,
    the model that takes it), numbered on and ending the run."""
    fit(args.get("engine_model", model), args["x"], validation_data=args.get("validation_data"),
        epochs=epochs, initial_epoch=initial, verbose=0,
        callbacks=[_relay(inner, record["epochs"]["keras"], user=model)])


def _varying(train) -> str:
    """Why the engine cannot take ``train``: inputs whose batches vary in shape beyond the
    batch axis (text batched by length), which its fixed-size rebatching would mix."""
    import tensorflow as tf

    shapes = [s.shape for s in tf.nest.flatten(train.element_spec[0])]
    if all(s.rank is not None and None not in s.as_list()[1:] for s in shapes):
        return ""
    return (f"x's batches vary in shape ({', '.join(str(s) for s in shapes)}: text batched "
            "by length) and the engine takes one shape")


def _keras_seconds(epoch: dict) -> float:
    """An epoch of Keras' fit without its compile: from its first call's end to its own
    end (validation included), plus one batch at the pace that followed."""
    calls = epoch["calls"]
    if not calls:
        return 0.0
    (first, start), (last, end) = calls[0], calls[-1]
    per_batch = (end - start) / (last - first) if last > first else end - start
    return epoch["end"] - start + per_batch


def _engine_fit(model, train, val, epochs: int, loss, metrics, model_dir: str, relay) -> dict:
    """``tfspeed.fit``'s job and loop (``fit_job.prepare``, ``trainer.fit``) without its
    files: the script saves its model itself, and the export, report and lock that
    ``tfspeed.fit`` adds cost a second per call. The engine checkpoints only at the end.

    Returns:
      What the engine resolved: steps per call, XLA, precision.
    """
    from tfspeed.training import api, fit_job, trainer

    config = api.fit_config(epochs=epochs, xla="auto", steps_per_execution="auto",
                            eval_every_epochs=1 if val is not None else 0,
                            checkpoint_every=0, model_dir=model_dir)
    with fit_job.label_errors():
        job = fit_job.prepare(config, model, train, val, loss=loss, metrics=metrics)
        result = trainer.fit(
            job.model, job.train_data, job.eval_data, config.train, job.runtime,
            steps_per_epoch=job.steps_per_epoch, eval_steps=None,
            global_batch_size=job.config.data.batch_size, model_dir=model_dir,
            objectives=job.objectives, callbacks=[relay], optimizer=model.optimizer,
            weight_scale=job.token_weight)
    tuning = result.steps_per_execution
    chosen = tuning.get("chosen", tuning.get("value")) if isinstance(tuning, dict) else tuning
    return {"xla": job.runtime.plan.xla, "precision": job.runtime.plan.precision,
            "steps_per_execution": chosen if chosen is not None else "?"}


def _relay(inner, clock: list, first: bool = False, offset: int = 0, user=None,
           slower=None):
    """A callback for one phase (Keras' epochs, the engine's): passes each hook on to the
    script's callbacks (``inner``), epochs numbered from ``offset``; only the first phase
    begins training, only the last ends it. Times each epoch into ``clock``.

    A phase may train a model around the user's (``user``): a stop the script's callbacks
    set on the user's model stops it too. Where ``slower()`` says so at an epoch's end, the
    phase stops there without ending the run (``handed_back``): Keras' fit goes on after the
    engine's, the engine after Keras' epoch 1."""
    import keras

    def stop(model):
        if user is not None and user is not model and user.stop_training:
            model.stop_training = True

    class Relay(keras.callbacks.Callback):
        handed_back = False

        def on_train_begin(self, logs=None):
            if first:
                inner.on_train_begin(logs)

        def on_train_end(self, logs=None):
            if not self.handed_back:
                inner.on_train_end(logs)

        def on_epoch_begin(self, epoch, logs=None):
            clock.append({"begin": time.perf_counter(), "calls": []})
            inner.on_epoch_begin(epoch + offset, logs)

        def on_epoch_end(self, epoch, logs=None):
            clock[-1]["end"] = time.perf_counter()
            inner.on_epoch_end(epoch + offset, logs)
            stop(self.model)
            if slower is not None and not self.model.stop_training and slower():
                self.handed_back = self.model.stop_training = True

        def on_train_batch_begin(self, batch, logs=None):
            inner.on_train_batch_begin(batch, logs)

        def on_train_batch_end(self, batch, logs=None):
            clock[-1]["calls"].append((batch, time.perf_counter()))
            inner.on_train_batch_end(batch, logs)
            stop(self.model)

        def on_test_begin(self, logs=None):  # Keras' validation tells the callbacks
            inner.on_test_begin(logs)

        def on_test_batch_begin(self, batch, logs=None):
            inner.on_test_batch_begin(batch, logs)

        def on_test_batch_end(self, batch, logs=None):
            inner.on_test_batch_end(batch, logs)

        def on_test_end(self, logs=None):
            inner.on_test_end(logs)

    return Relay()


def summary(n: int, record: dict) -> str:
    """The line of one ``fit`` on the engine: Keras' examples/s (its epoch 1 past its first
    step, which compiles, on the optimised data) against tfspeed's (its later epochs; its
    only one past its first call where it ran one), and the epochs' seconds."""
    import statistics

    keras_epochs, engine_epochs = record["epochs"]["keras"], record["epochs"]["engine"]
    initial = record.get("initial", 0)  # the script's numbering: from its initial_epoch
    first = f"epoch {initial + 1} on Keras' fit ({first_epoch(record)})"
    if "keras_rest" in record:
        rest = _span(initial + 2, initial + len(keras_epochs))
        return (f"tfspeed.run: fit {n}: {first}; {rest} stayed on Keras' fit: "
                f"{record['keras_rest']}; epoch seconds {_seconds(keras_epochs)}")
    if "handed_back" in record:
        on = initial + 1 + len(engine_epochs)
        last = initial + len(keras_epochs) + len(engine_epochs)
        return (f"tfspeed.run: fit {n}: {first}, {_span(initial + 2, on)} on tfspeed's "
                f"engine, {_span(on + 1, last)} back on Keras' fit: {record['handed_back']}; epoch "
                f"seconds {_seconds(keras_epochs[:1])} on Keras, {_seconds(engine_epochs)} "
                f"on tfspeed, {_seconds(keras_epochs[1:])} on Keras")
    before = handback.epoch_rate(keras_epochs[0], warm=False) if keras_epochs else None
    later = [r for r in (handback.epoch_rate(e, warm=True) for e in engine_epochs[1:]) if r]
    after = statistics.median(later) if later else (
        handback.epoch_rate(engine_epochs[0], warm=False) if engine_epochs else None)
    batch = record["batch"]
    last = initial + len(engine_epochs) + 1  # the first ran on Keras
    which = (f"{_span(initial + 3, last)} on tfspeed's engine"
             + (", median" if len(later) > 1 else "") if later
             else f"epoch {initial + 2} on tfspeed's engine past its first call, which "
                  "compiles")
    if not before or not after:
        return (f"tfspeed.run: fit {n}: too few steps to time ({first}, "
                f"{len(engine_epochs)} on tfspeed's engine)")
    engine = record.get("engine", {})
    seconds = [e["end"] - e["begin"] for e in engine_epochs if "end" in e]
    return (f"tfspeed.run: fit {n}: {before * batch:.0f} examples/s on Keras ({first} past "
            f"its first step) -> {after * batch:.0f} examples/s ({which}): "
            f"{after / before:.2f}x; epoch seconds {_seconds(keras_epochs)} on Keras, "
            + ", ".join(f"{s:.2f}" for s in seconds) + " on tfspeed (validation included; "
            f"the whole fit {record['end'] - record['start']:.1f} s); "
            f"step: {engine.get('steps_per_execution', '?')} steps per call, XLA "
            f"{engine.get('xla', '?')}, precision {engine.get('precision', '?')} (the model's)"
            + (f"; kept on the engine: {record['engine_check']}" if "engine_check" in record
               else ""))


def first_epoch(record: dict) -> str:
    """What Keras' epoch 1 read: the optimised data as this run found its store."""
    return {"writing": "storing the optimised data as it reads it",
            "complete": "replaying an earlier run's store",
            "reused": "replaying the store an earlier fit wrote"}.get(
                record.get("state", ""), "the optimised data")


def _span(first: int, last: int) -> str:
    return f"epochs {first}-{last}" if last > first else f"epoch {first}"


def _seconds(epochs: list) -> str:
    return ", ".join(f"{e['end'] - e['begin']:.2f}" for e in epochs if "end" in e)
