"""What a run minimises and reports: ``--loss`` and ``--metrics`` resolved into per-example
functions for the engine.

Both take a Keras name (``mse``, ``sparse_categorical_crossentropy``, ``mae``, ...) or
``package.module:function``. The engine sums per-example values over replicas and micro-
batches itself (that is what makes accumulation and several replicas exact), so a loss must
return one value per example, and a metric must be a mean of per-example values; a Keras
metric that is not (AUC, precision) is refused with a one-line reason.

Defaults follow the task: sparse categorical cross-entropy and accuracy for classification,
mean squared error and mean absolute error for regression. Cross-entropies take logits or
probabilities as the model gives them: a model whose last layer is a softmax or a sigmoid
outputs probabilities, any other outputs logits (tfspeed's own models do).

Token data (``sequences=True``: the targets are ``{"label", "weight"}``, see
``tfspeed.training.transformer``) has a variable number of real elements per batch, so a
per-example mean is not exact. There the objectives are *weighted*: the loss returns each
element's loss already multiplied by its weight (0 at padding and absent sequences) and a
metric each element's value times its weight; the engine divides their sums by the global
weight sum of an update. The defaults are the cross-entropy per real token (``lm``) or per
sequence (``classification``) and token or sequence accuracy. ``--loss=module:function`` is
then ``fn(targets: dict, outputs) -> weighted per-element losses`` (any shape, summed), and a
``--metrics=module:function`` likewise returns weighted per-element values.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import keras

from tfspeed.errors import UsageError
from tfspeed.training import transformer
from tfspeed.training.batch_ops import sparse_accuracy

TASKS = ("classification", "regression", "lm")
DEFAULT_LOSS = {"classification": "sparse_categorical_crossentropy", "regression": "mse",
                "lm": "sparse_categorical_crossentropy"}
DEFAULT_METRICS = {"classification": ("accuracy",), "regression": ("mae",), "lm": ("accuracy",)}
_PER = {"lm": "per real token", "classification": "per sequence"}  # what a weight counts
_CROSS_ENTROPIES = ("sparse_categorical_crossentropy", "categorical_crossentropy",
                    "binary_crossentropy")


@dataclasses.dataclass(frozen=True)
class Objectives:
    """The resolved loss and metrics, and what was decided about them.

    Attributes:
      loss: ``fn(labels, outputs) -> one loss per example``.
      metrics: name -> ``fn(labels, outputs) -> one value per example``.
      report: the names and decisions (logits or probabilities, output dtype), for
        report.json.
      weighted: token data: ``loss`` and ``metrics`` take the targets dict and return
        weighted per-element values, which the engine normalises by the global weight sum.
    """

    loss: Callable
    metrics: dict[str, Callable]
    report: dict
    weighted: bool = False


def resolve(loss: str | Callable, metrics: Sequence[str | Callable] | None, task: str,
            model: keras.Model, sequences: bool = False) -> Objectives:
    """Resolves ``--loss`` ('' : the task's default) and ``--metrics`` (None: the task's
    defaults) for ``model``. Functions (per example) are taken as they are.

    Args:
      loss: a Keras loss name, ``package.module:function``, a function, or '' (default).
      metrics: names or functions, or None (the task's defaults).
      task: one of ``TASKS``; ``"lm"`` needs ``sequences``.
      model: the model whose outputs the loss takes.
      sequences: the data is token batches (``{"label", "weight"}`` targets): resolve the
        weighted objectives (see the module docstring).

    Raises:
      UsageError: an unknown name, a module that does not import, a name that is not
        callable, or a metric that is not a mean of per-example values.
    """
    if task not in TASKS:
        raise UsageError(f"task {task!r} is not one of: {', '.join(TASKS)}")
    if sequences:
        return _resolve_weighted(loss, metrics, task, model)
    if task == "lm":
        raise UsageError("task 'lm' needs token data (a dataset converted from text)")
    probabilities = outputs_probabilities(model)
    loss_name = _name(loss) if callable(loss) else loss or DEFAULT_LOSS[task]
    loss_fn = loss if callable(loss) else _loss(loss_name, probabilities)
    names = DEFAULT_METRICS[task] if metrics is None else tuple(metrics)
    resolved = {_name(name): name if callable(name) else _metric(name, task) for name in names}
    if task == "regression":  # targets [B] against outputs [B, 1] would broadcast to [B, B]
        loss_fn = _float_labels(loss_fn)
        resolved = {name: _float_labels(fn) for name, fn in resolved.items()}
    dtype = str(model.outputs[0].dtype) if getattr(model, "outputs", None) else "float32"
    report = {"task": task, "loss": loss_name, "metrics": list(resolved),
              "outputs": "probabilities" if probabilities else "logits",
              "output_dtype": dtype.split(".")[-1]}
    if "float32" not in dtype:
        report["output_cast"] = f"the model outputs {report['output_dtype']}: cast to float32 " \
                                "before the loss"
    return Objectives(loss_fn, resolved, report)


def _resolve_weighted(loss, metrics, task: str, model: keras.Model) -> Objectives:
    """``resolve`` for token batches: weighted per-element loss and metrics."""
    if task not in _PER:
        raise UsageError(f"token data trains task 'lm' or 'classification', not {task!r}")
    loss_name = _name(loss) if callable(loss) else loss or DEFAULT_LOSS[task]
    if callable(loss) or ":" in loss_name:
        loss_fn = loss if callable(loss) else load_callable(loss_name, "loss")
    elif loss_name != "sparse_categorical_crossentropy":
        raise UsageError(f"--loss={loss_name}: token data trains with "
                         "sparse_categorical_crossentropy or package.module:function "
                         "(targets dict, outputs) -> per-element losses times targets['weight']")
    elif outputs_probabilities(model):
        raise UsageError("token data needs a model that outputs logits (its last layer has no "
                         "softmax): the weighted cross-entropy takes logits")
    else:
        loss_fn = transformer.weighted_sparse_ce
    resolved = {}
    for spec in DEFAULT_METRICS[task] if metrics is None else tuple(metrics):
        if callable(spec) or ":" in spec:
            resolved[_name(spec)] = spec if callable(spec) else load_callable(spec, "metrics")
        elif spec in ("accuracy", "acc"):
            resolved[spec] = transformer.weighted_correct
        else:
            raise UsageError(f"--metrics={spec}: token data takes accuracy or "
                             "package.module:function (targets dict, outputs) -> per-element "
                             "values times targets['weight']")
    dtype = str(model.outputs[0].dtype) if getattr(model, "outputs", None) else "float32"
    per = _PER[task]
    report = {"task": task, "loss": f"{loss_name} ({per})",
              "metrics": [f"{name} ({per})" for name in resolved], "outputs": "logits",
              "output_dtype": dtype.split(".")[-1],
              "normalisation": f"sums over an update divided by its weight sum ({per})"}
    return Objectives(loss_fn, resolved, report, weighted=True)


def outputs_probabilities(model: keras.Model) -> bool:
    """Whether the model's last layer ends in a softmax or a sigmoid."""
    layers = getattr(model, "layers", None) or []
    last = layers[-1] if layers else None
    if isinstance(last, keras.layers.Softmax):
        return True
    activation = getattr(last, "activation", None)
    name = getattr(activation, "__name__", "") or (
        activation if isinstance(activation, str) else "")
    return name in ("softmax", "sigmoid")


def load_callable(spec: str, flag: str) -> Callable:
    """``package.module:function`` -> the function; one-line UsageErrors otherwise."""
    import importlib
    import os
    import sys

    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"--{flag}={spec} is not package.module:function")
    if os.getcwd() not in sys.path:  # importable from the working directory, as documented
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise UsageError(f"--{flag}={spec}: module {module_name!r} is not importable from the "
                         f"working directory or PYTHONPATH ({type(e).__name__}: {e})") from None
    found = getattr(module, attribute, None)
    if not callable(found):
        what = "no attribute" if found is None else f"{type(found).__name__} (not callable)"
        raise UsageError(f"--{flag}={spec}: {module_name} has {what} {attribute!r}; name a "
                         "function")
    return found


def _loss(name: str, probabilities: bool) -> Callable:
    if ":" in name:
        return load_callable(name, "loss")
    try:
        fn = keras.losses.get(name)
    except (ValueError, TypeError):
        raise UsageError(f"--loss={name} is not a Keras loss nor package.module:function; e.g. "
                         "--loss=mse, --loss=huber or --loss=my_losses:focal") from None
    if not callable(fn) or isinstance(fn, keras.losses.Loss):
        raise UsageError(f"--loss={name} is a reducing Keras Loss object; name its function "
                         "(e.g. mse) or give package.module:function")
    if fn.__name__ in _CROSS_ENTROPIES and not probabilities:
        return lambda labels, outputs: fn(labels, outputs, from_logits=True)
    return fn


def _name(spec) -> str:
    """A metric's (or loss's) name in logs: the function's name, or what follows the ':'."""
    if callable(spec):
        return getattr(spec, "__name__", type(spec).__name__)
    return spec.partition(":")[2] if ":" in spec else spec


def _metric(name: str, task: str) -> Callable:
    if ":" in name:
        return load_callable(name, "metrics")
    if name in ("accuracy", "acc"):
        if task != "classification":
            raise UsageError(f"--metrics={name} needs a classification task; for regression "
                             "use e.g. mae or mse")
        return sparse_accuracy
    try:
        metric = keras.metrics.get(name)
    except (ValueError, TypeError):
        raise UsageError(f"--metrics={name} is not a Keras metric nor package.module:function;"
                         " e.g. --metrics=accuracy or --metrics=mae") from None
    fn = getattr(metric, "_fn", None)  # MeanMetricWrapper: the mean of a per-example fn
    if isinstance(metric, keras.metrics.Metric) and fn is None:
        raise UsageError(f"--metrics={name} is not a mean of per-example values "
                         f"({type(metric).__name__}); the engine averages per-example metrics:"
                         " use e.g. accuracy, mae, mse or package.module:function")
    return fn if fn is not None else metric


def _float_labels(fn):
    """Regression targets as float32 of the outputs' shape."""

    def wrapped(labels, outputs):
        labels = keras.ops.reshape(keras.ops.cast(labels, outputs.dtype),
                                   keras.ops.shape(outputs))
        return fn(labels, outputs)

    return wrapped
