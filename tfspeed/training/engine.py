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

from typing import Any, Protocol, runtime_checkable

from tfspeed.training.engine_state import EngineOptions  # noqa: F401 -- part of the interface


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
