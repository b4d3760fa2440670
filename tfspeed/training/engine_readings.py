"""What an engine reports of its training so far: the figures the loop, the meters and the
report read, apart from the step that produces them."""

from __future__ import annotations

import tensorflow as tf


class EngineReadings:
    """Read-only figures of a TensorFlow engine: its optimizer, its state variables
    (``_state``, ``_nonfinite_step``, ``_nonfinite_loss``) and its compiled functions."""

    @property
    def learning_rate(self):
        """The optimizer's current learning rate (its schedule at this update), as a value:
        under tf.distribute the optimizer's is a MirroredVariable, which float() refuses."""
        rate = self.optimizer.learning_rate
        return rate.numpy() if hasattr(rate, "numpy") else rate

    @property
    def updates(self) -> tf.Tensor:
        """Optimizer updates applied so far."""
        return self.optimizer.iterations.value.read_value()

    @property
    def micro_steps(self) -> tf.Tensor:
        """Micro-batches trained on so far (int64 scalar)."""
        return self._state.micro_steps.read_value()

    @property
    def skipped_updates(self) -> tf.Tensor:
        """Updates skipped because their gradients were not finite (loss scaling only)."""
        return self._state.skipped_updates.read_value()

    @property
    def first_nonfinite_loss(self) -> tuple[tf.Tensor, tf.Tensor]:
        """`(micro-step, loss)` of the first micro-step whose loss was NaN or Inf; micro-step 0
        if none was. Recorded on the device each step without a host sync; not tracked with
        loss scaling, where non-finite steps are skipped instead."""
        return self._nonfinite_step.read_value(), self._nonfinite_loss.read_value()

    @property
    def compiled_functions(self) -> int:
        """Traces of the training step (`train` and `train_one`) so far: one per input
        signature, so batches of static shapes (one per bucket) give at most one each."""
        return sum(int(f.experimental_get_tracing_count())
                   for f in (self._train_fn, self._train_one_fn))

    @property
    def loss_scale(self) -> tf.Tensor:
        """The current dynamic loss scale (1.0 without loss scaling)."""
        return self._scale()
