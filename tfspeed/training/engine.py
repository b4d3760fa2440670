"""The engine interface: what the trainer, checkpoints, probes and reports use of the
compiled training step, whichever Keras backend runs it.

One step, thin backends (as Keras' own ``Trainer`` over ``keras/src/backend/*/trainer.py``):
the step's arithmetic (forward sums, the exact token weighting, the accumulate / apply / skip
decisions, what a call reports, evaluation) is written once in ``training.step``; each
backend's adapter in ``training.backends`` adds only placement, compiling, the loop of steps
per call and its checkpoint state. ``tfspeed.runtime.backends`` says which adapter a backend
has and what it cannot do.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable

import keras


@dataclasses.dataclass(frozen=True)
class EngineOptions:
    """How `Engine` runs training.

    Attributes:
        grad_accum_steps: micro-batches per optimizer update (K). K micro-batches of global size
            b give the update of one batch of size K*b.
        steps_per_execution: micro-steps run by one `Engine.train` call (one `tf.function` call).
            Need not be a multiple of `grad_accum_steps`: accumulation spans calls.
        xla: compile the per-replica forward+backward with XLA.
        loss_scale: dynamic loss scaling (use with mixed_float16).
        initial_loss_scale: starting scale (Keras' default).
        loss_scale_growth_interval: finite updates in a row after which the scale doubles.
    """

    grad_accum_steps: int = 1
    steps_per_execution: int = 1
    xla: bool = False
    loss_scale: bool = False
    initial_loss_scale: float = 2.0**15
    loss_scale_growth_interval: int = 2000

    def __post_init__(self):
        for name in ("grad_accum_steps", "steps_per_execution", "loss_scale_growth_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineOptions.{name} must be an int >= 1, got {value!r}")
        if not self.initial_loss_scale >= 1:
            raise ValueError(
                f"EngineOptions.initial_loss_scale must be >= 1, got {self.initial_loss_scale!r}"
            )


def check_arguments(model, optimizer, options, global_batch_size) -> None:
    """Rejects what no engine can train with, with the fix.

    Raises:
      TypeError, ValueError: naming the argument and what to pass instead.
    """
    if not isinstance(options, EngineOptions):
        raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
    if not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(f"global_batch_size must be an int >= 1, got {global_batch_size!r}")
    if not model.built or not model.trainable_variables:
        raise ValueError("the model must be built (call it once) and have trainable variables")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise ValueError(
            "pass the inner optimizer and EngineOptions(loss_scale=True), not a LossScaleOptimizer"
        )
    if optimizer.gradient_accumulation_steps:
        raise ValueError(
            "optimizer(gradient_accumulation_steps=...) fails under tf.distribute (keras#20582); "
            "use EngineOptions(grad_accum_steps=...) instead"
        )



@runtime_checkable
class Engine(Protocol):
    """A training step on one backend.

    Adapters are built as ``Adapter(model, optimizer, placement, loss_fn, options, *,
    global_batch_size, preprocess=None, metrics=None, weighted=False, weight_scale=None)``:
    ``placement`` is what the backend places arrays on (a ``tf.distribute.Strategy``, or JAX's
    devices). Counters (``updates``, ``micro_steps``, ...) are device scalars: reading one
    is a host sync.
    """

    model: Any
    optimizer: Any
    options: EngineOptions
    weighted: bool
    objectives: Any  # the job's resolved objectives (set by ``trainer.make_engine``)

    def train(self, iterator, steps: int | None = None) -> dict:
        """Runs ``steps`` micro-steps (default ``options.steps_per_execution``) on the next
        batches of ``iterator``; returns the call's loss and metrics (``step.StepMath.
        outputs``), ``updates``, ``skipped``, ``loss_scale`` and ``input_wait_s``."""

    def train_one(self, iterator) -> dict:
        """One micro-step in a call of its own (the profiler's unit)."""

    def evaluate(self, dataset, steps: int | None = None) -> dict[str, float]:
        """Mean loss and metrics over a finite dataset (weighted: over its weight sum)."""

    def is_warm(self, steps: int) -> bool:
        """Whether a call of ``steps`` runs a program compiled already."""

    @property
    def metric_names(self) -> list[str]: ...

    @property
    def updates(self): ...

    @property
    def micro_steps(self): ...

    @property
    def skipped_updates(self): ...

    @property
    def first_nonfinite_loss(self) -> tuple: ...

    @property
    def compiled_functions(self) -> int: ...

    @property
    def loss_scale(self): ...

    @property
    def learning_rate(self): ...

    def checkpoint_state(self):
        """The state as ``tf.Variable``s for ``tfspeed.training.checkpoints``."""

    def before_save(self) -> None:
        """Copies the state into ``checkpoint_state`` (where it is not the same)."""

    def after_restore(self) -> None:
        """Copies a restored ``checkpoint_state`` back into the step's state."""

    def sync_model(self) -> None:
        """Writes the trained values into the Keras model and optimizer variables."""

    def all_finite(self) -> bool:
        """Whether every weight and optimizer value is finite (one host sync)."""
