"""The arithmetic of one training step, written once in ``keras.ops``: what both backends'
engines (``training.backends``) compute, while each adds only placement, compiling, its loop
of steps per call and its checkpoint state.

A step's figures travel as one vector, ``[loss, *metric sums, count]``: summed over replicas
(TensorFlow) or computed on the global batch (JAX), and added over the micro-steps of a call.
``count`` is the examples of the batch, or, for weighted objectives (token data), the sum of
the weights.

Weighted objectives: the number of real elements (tokens, sequences) varies per micro-batch,
so a mean of micro-batch means is not the update's mean. Each micro-batch's *sum* of weighted
losses is differentiated over a fixed ``weight_scale`` (an update's expected weight, for
magnitude); at apply time the gradients are multiplied by ``weight_scale / W``, W the weight
sum of the update's micro-batches, and an update with W = 0 is skipped. The recipe and its
reference are in ``tfspeed.training.transformer``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from keras import ops

from tfspeed.training import batch_ops


@dataclasses.dataclass(frozen=True)
class StepMath:
    """The objective of a step and how its figures are reduced.

    Attributes:
      loss_fn: ``loss_fn(labels, outputs) -> per-example loss`` (weighted: per-element, already
        multiplied by ``labels["weight"]``).
      metrics: name -> ``fn(labels, outputs)``, one value per example (or weighted element).
      weighted: token data: losses and metrics are divided by the weight sum, exactly.
      weight_scale: weighted: what a summed loss is divided by before the gradient.
      global_batch_size: examples of one micro-step over all replicas (unweighted).
      replicas: replicas whose loss shares are summed (1 where the loss is the global
        batch's, as on JAX).
      grad_accum_steps: micro-batches per update (K).
    """

    loss_fn: Callable
    metrics: dict
    weighted: bool
    weight_scale: float
    global_batch_size: int
    replicas: int = 1
    grad_accum_steps: int = 1

    # ------------------------------------------------------------------ forward
    def inputs(self, x, y):
        """The model's inputs: token batches with their empty rows filled
        (``batch_ops.fill_empty_rows``)."""
        return batch_ops.fill_empty_rows(x, y["weight"]) if self.weighted else x

    def sums(self, y, outputs, reg_losses: Sequence):
        """Summed loss, regularisation, metric sums (a vector in ``metrics`` order) and count
        of one batch, from the model's ``outputs`` and its regularisation ``reg_losses``."""
        outputs = ops.cast(outputs, "float32")
        per_example = ops.cast(self.loss_fn(y, outputs), "float32")
        if not self.weighted and len(per_example.shape) != 1:
            raise ValueError("loss_fn must return one loss per example (no reduction), got "
                             f"shape {per_example.shape}")
        reg = functools.reduce(ops.add, [ops.cast(r, "float32") for r in reg_losses],
                               ops.zeros([], "float32"))
        sums = [ops.sum(ops.cast(fn(y, outputs), "float32")) for fn in self.metrics.values()]
        count = (ops.sum(ops.cast(y["weight"], "float32")) if self.weighted
                 else ops.cast(ops.shape(per_example)[0], "float32"))
        return (ops.sum(per_example), reg, ops.stack(sums) if sums
                else ops.zeros([0], "float32"), count)

    def objective(self, loss_sum, reg, count):
        """``(loss to differentiate, loss to report)`` of a replica's batch.

        Unweighted: as ``tf.nn.compute_average_loss`` / ``scale_regularization_loss``, the sum
        over replicas of the shares is the global mean loss plus the regularisation. Weighted:
        the regularisation weighted by the batch's weight (times ``weight_scale / W`` at apply
        time, the shares add up to it once), over ``weight_scale``; reported as a sum.
        """
        if self.weighted:
            loss_sum = loss_sum + reg * count
            return loss_sum / self.weight_scale, loss_sum
        loss = loss_sum / self.global_batch_size + reg / self.replicas
        return loss, loss

    @staticmethod
    def figures(reported, sums, count):
        """A step's vector ``[reported loss, *metric sums, count]``."""
        return ops.concatenate([ops.stack([reported]), sums, ops.stack([count])])

    @staticmethod
    def eval_figures(loss_sum, reg, sums, count):
        """An evaluation batch's vector ``[loss sum, *metric sums, count]``."""
        return ops.concatenate([ops.stack([loss_sum + reg * count]), sums, ops.stack([count])])

    def empty_figures(self):
        return ops.zeros([len(self.metrics) + 2], "float32")

    # ------------------------------------------------------------------ the update
    def apply_factor(self, weight=None, scale=1.0):
        """What an update's summed (and loss-scaled) gradients are multiplied by: unweighted,
        ``1 / (scale * K)`` (the mean of K micro-batches); weighted, ``weight_scale /
        (scale * W)`` (0 when W = 0: that update is skipped)."""
        if self.weighted:
            return ops.divide_no_nan(ops.convert_to_tensor(self.weight_scale, "float32"),
                                     scale * weight)
        return 1.0 / (scale * self.grad_accum_steps)

    @staticmethod
    def scaled(grads, factor, dtypes=None):
        """``grads`` times ``factor``, each in its own dtype (or in ``dtypes``)."""
        dtypes = dtypes or [g.dtype for g in grads]
        return [ops.cast(g * ops.cast(factor, g.dtype), d)
                for g, d in zip(grads, dtypes, strict=True)]

    def update_is_due(self, micro_steps):
        """Whether the micro-step just counted ends an accumulated update."""
        return ops.equal(micro_steps % self.grad_accum_steps, 0)

    @staticmethod
    def has_weight(weight):
        """Weighted: an update with no real element has nothing to learn and is skipped."""
        return ops.greater(weight, 0)

    @staticmethod
    def all_finite(values):
        return ops.all(ops.stack([ops.all(ops.isfinite(v)) for v in values]))

    @staticmethod
    def loss_scale_after_finite(scale, good_steps, growth_interval: int):
        """``(scale, good steps)`` after a finite update: the scale doubles after
        ``growth_interval`` in a row."""
        good = good_steps + 1
        grow = good >= growth_interval
        return ops.where(grow, scale * 2.0, scale), ops.where(grow, ops.zeros_like(good), good)

    @staticmethod
    def loss_scale_after_skip(scale):
        """The scale after a non-finite update: halved, never under 1."""
        return ops.maximum(scale / 2.0, 1.0)

    # ------------------------------------------------------------------ what is reported
    def step_loss(self, figures):
        """A micro-step's loss from its figures (weighted: sum / weight sum)."""
        if not self.weighted:
            return figures[0]
        return figures[0] / ops.where(figures[-1] > 0, figures[-1], 1.0)

    @staticmethod
    def first_nonfinite(micro_steps, recorded_step, recorded_loss, loss):
        """``(step, loss)`` of the first non-finite loss, branch-free (a tiny select per step
        is cheaper than a branch inside the step loop); ``recorded_step`` 0: none yet."""
        first = ops.logical_and(ops.equal(recorded_step, 0),
                                ops.logical_not(ops.isfinite(loss)))
        return (ops.where(first, ops.cast(micro_steps, recorded_step.dtype), recorded_step),
                ops.where(first, loss, recorded_loss))

    def outputs(self, totals, tokens, steps) -> dict:
        """The loss and metrics of a call from its summed figures (weighted: over its weight
        sum), and its token counts. ``divide_no_nan``: a call of 0 steps (it times the call
        overhead) reports zeros."""
        count = totals[-1] if self.weighted else ops.cast(steps, "float32")
        return {
            "loss": ops.divide_no_nan(totals[0], count),
            **{name: ops.divide_no_nan(totals[1 + i], totals[-1])
               for i, name in enumerate(self.metrics)},
            "real_tokens": tokens[0], "computed_tokens": tokens[1], "sequences": tokens[2],
        }

    def evaluation(self, totals: Sequence[float], who: str) -> dict[str, float]:
        """``evaluate``'s result from a dataset's summed figures (host floats)."""
        loss_sum, *sums, count = [float(t) for t in totals]
        if count == 0:
            raise ValueError(f"{who}.evaluate: the dataset yielded no examples")
        return {"loss": loss_sum / count,
                **{name: total / count for name, total in zip(self.metrics, sums, strict=True)}}
