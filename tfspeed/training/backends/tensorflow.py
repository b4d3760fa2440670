"""The training engine on Keras' TensorFlow backend (``tfspeed.training.engine.Engine``):
the step's arithmetic (``training.step``) placed on a ``tf.distribute`` strategy, with
gradient accumulation, per-replica XLA, dynamic loss scaling and many micro-steps per
``tf.function`` call.

Stock Keras 3 (3.15, TF 2.21) fails under `MirroredStrategy` with 2 replicas for each of these
features, so the engine replaces `model.fit` with a loop that keeps every collective and every
variable update out of the places where tf.distribute breaks:

* **Accumulation** (keras#20582: the optimizer's `ops.cond` around `merge_call` in replica
  context). Each replica adds its gradients into `ON_READ`/`SUM` variables; "apply now?" is a
  `tf.cond` on the micro-step counter taken in *cross-replica* context, whose branch all-reduces
  the accumulators, applies them with the optimizer (in cross-replica context, so Keras does not
  all-reduce a second time) and zeroes them. `optimizer.iterations` counts updates.
* **XLA** (keras#19005, tensorflow#56423: one XLA cluster cannot touch variables of two
  devices). Only the per-replica forward+backward is `tf.function(jit_compile=True)`; the
  all-reduce and `apply_gradients` run outside XLA.
* **steps_per_execution** (Keras' own fails with 2 replicas): one `tf.function` runs a
  `tf.range` loop that calls `strategy.run` and reduces the metrics inside the loop.
* **Loss scaling**: the loss is multiplied by a scale variable that only changes at update
  boundaries, so all micro-batches of one update share it; the sum is unscaled once, checked for
  inf/NaN after the all-reduce (so every replica takes the same branch) and skipped if not finite.
* **Weighted objectives** (token data, ``weighted=True``; ``training.step``): each replica
  adds its micro-batches' weight sum to an ``ON_READ``/``SUM`` accumulator, so the update's
  W is the sum over all K micro-batches on all replicas.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable

import keras
import tensorflow as tf
from absl import logging

from tfspeed.training.engine import EngineOptions, check_arguments
from tfspeed.training.engine_state import (  # noqa: F401 -- ensure_cpu_devices re-exported
    EngineState,
    ensure_cpu_devices,
    sparse_accuracy,
    token_counts,
)
from tfspeed.training.step import StepMath

LossFn = Callable[[tf.Tensor, tf.Tensor], tf.Tensor]
_SUM = tf.distribute.ReduceOp.SUM


@tf.function
def _all_finite(variables) -> tf.Tensor:
    return tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in variables])

_ONLY_FIRST = tf.VariableAggregation.ONLY_FIRST_REPLICA


class TensorFlowEngine:
    """Trains a Keras model with a custom loop; see the module docstring for the design.

    Args:
        model: a built Keras model created under `strategy.scope()`; its output (logits or
            probabilities, float32 preferred) goes to `loss_fn`.
        optimizer: a Keras optimizer created under `strategy.scope()`, without
            `gradient_accumulation_steps` and not a `LossScaleOptimizer` (use `options`).
        strategy: the `tf.distribute.Strategy` that owns the model.
        loss_fn: `loss_fn(labels, outputs) -> per-example loss`, e.g.
            `lambda y, p: keras.losses.sparse_categorical_crossentropy(y, p, from_logits=True)`.
        options: accumulation, steps per execution, XLA and loss scaling (default: none).
        global_batch_size: examples per micro-step over all replicas; each replica's loss is
            divided by it (as `tf.nn.compute_average_loss` does). Training batches must all have
            this size (batch with `drop_remainder=True`).
        preprocess: `x -> x` run on each replica's inputs inside the compiled step, before
            the model (e.g. uint8 images to float32 in [0, 1]: the input pipeline and the
            host-to-device copy then move 4× fewer bytes).
        metrics: name -> `fn(labels, outputs) -> one value per example`, averaged over the
            examples of a call (training) or of the whole dataset (`evaluate`). Default:
            `{"accuracy": sparse_accuracy}` (the arg-max of the outputs equals the label).
        weighted: token data (`tfspeed.training.objectives.resolve(..., sequences=True)`):
            `loss_fn(targets, outputs)` and each metric return per-element values already
            multiplied by `targets["weight"]` (any shape); losses and metrics are their sums
            divided by the sum of the weights over an update (training, with gradients to
            match) or over the dataset (`evaluate`), exactly, however the real elements are
            spread over micro-batches and replicas.
        weight_scale: weighted: what each replica's summed loss is divided by before the
            gradient (undone at apply time, so the update stays exact whatever it is): the
            weight one micro-batch holds over all replicas, e.g. its real tokens for an lm,
            so the scaled loss keeps a per-token mean's magnitude under a loss scale. None:
            ``global_batch_size`` (sequences), which for an lm made it ~T times a mean.
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: keras.optimizers.Optimizer,
        strategy: tf.distribute.Strategy,
        loss_fn: LossFn,
        options: EngineOptions | None = None,
        *,
        global_batch_size: int,
        preprocess: Callable[[tf.Tensor], tf.Tensor] | None = None,
        metrics: dict[str, LossFn] | None = None,
        weighted: bool = False,
        weight_scale: float | None = None,
    ):
        options = EngineOptions() if options is None else options
        self._preprocess = preprocess or (lambda x: x)
        self._metrics = dict({"accuracy": sparse_accuracy} if metrics is None else metrics)
        if "loss" in self._metrics:
            raise ValueError("metrics: 'loss' is the loss itself; name the metric otherwise")
        check_arguments(model, optimizer, options, global_batch_size)
        for what, variable in (("model", model.trainable_variables[0]),
                               ("optimizer", optimizer.iterations)):
            if not strategy.extended.variable_created_in_scope(variable.value):
                raise ValueError(f"create the {what} under strategy.scope() of the engine's "
                                 "strategy")
        self.model, self.optimizer, self.strategy = model, optimizer, strategy
        self.options = options
        self.objectives = None  # the job's, set by trainer.make_engine
        self._loss_fn = loss_fn
        self._global_batch_size = global_batch_size
        self.weighted = weighted
        self._weight_scale = float(weight_scale or global_batch_size)
        self._variables = list(model.trainable_variables)
        self._math = StepMath(loss_fn, self._metrics, weighted, self._weight_scale,
                              global_batch_size, strategy.num_replicas_in_sync,
                              options.grad_accum_steps)
        with strategy.scope():
            if not optimizer.built:
                optimizer.build(self._variables)
            self._state = EngineState(self._variables, options, weighted)
            # The first micro-step whose loss was not finite (0: none yet) and that loss. Not in
            # the checkpointed state: a checkpoint never holds a diverged run.
            self._nonfinite_step = tf.Variable(0, trainable=False, dtype=tf.int64,
                                               aggregation=_ONLY_FIRST)
            self._nonfinite_loss = tf.Variable(0.0, trainable=False, aggregation=_ONLY_FIRST)
        if options.loss_scale is False and model.dtype_policy.name == "mixed_float16":
            logging.warning("mixed_float16 without loss scaling: small gradients will underflow")
        # No autograph anywhere in the step: its Python branches are on Python values, and
        # converting each function the step calls made the first call (the trace) take 6.7 s
        # against 3.9 s without (pydocs' transformer, 2 cores, 3 runs each; Keras' own
        # functions are never converted either).
        jit = tf.function(jit_compile=True, autograph=False) if options.xla else (lambda f: f)
        self._forward_backward = jit(self._replica_forward_backward)
        self._forward = jit(self._replica_forward)
        self._train_fn = tf.function(self._train_execution, autograph=False)
        self._train_one_fn = tf.function(self._train_one, autograph=False)
        self._eval_fn = tf.function(self._eval_step, reduce_retracing=True, autograph=False)

    # ---------------------------------------------------------------- public API
    def train(self, iterator: Iterable, steps: int | None = None) -> dict[str, tf.Tensor]:
        """Runs `steps` micro-steps (default `steps_per_execution`), each on the next `(x, y)`.

        Args:
            iterator: an iterator over a distributed dataset (`iter(strategy.
                experimental_distribute_dataset(ds))`) of `(x, y)` micro-batches of
                `global_batch_size` examples; it must not run out mid-call (`.repeat()` it).
                Or an in-graph source (`tfspeed.data.ingraph.InGraphInput`): an object whose
                `replica_batch(micro_step)` gives this replica's `(x, y)` inside the step.
            steps: micro-steps in this call. Passed as a tensor, so changing it (a last short
                execution, the steps_per_execution tuner) does not retrace.

        Returns:
            Scalar tensors (no host sync): `loss` and each metric (`metric_names`) averaged
            over this call's micro-batches (weighted: their sums over the call divided by its
            weight sum), `updates` (= `optimizer.iterations`, applied updates so far),
            `skipped` (updates skipped for non-finite gradients, or weighted with no weight,
            so far), `loss_scale`, `input_wait_s` (seconds this call spent waiting for input
            batches), and for token inputs (a dict with `segment_ids`; 0 otherwise) int64
            `real_tokens` (segment_ids > 0), `computed_tokens` (B x T) and `sequences`
            (segments) over the call's micro-batches.
        """
        steps = self.options.steps_per_execution if steps is None else steps
        return self._train_fn(iterator, tf.constant(steps, tf.int32))

    def is_warm(self, steps: int) -> bool:
        """Whether a call of ``steps`` runs a function traced already: the step count is a
        tensor, so after the first call every one is."""
        return self.compiled_functions > 0

    def train_one(self, iterator: Iterable) -> dict[str, tf.Tensor]:
        """One micro-step, without the in-graph loop; returns what `train` returns.

        For the profiler: xprof finds no step markers for steps inside a `tf.while_loop`
        ("No step time measured"), so profiled steps run one call each.
        """
        return self._train_one_fn(iterator)

    def evaluate(self, dataset: Iterable, steps: int | None = None) -> dict[str, float]:
        """Mean loss (data loss + regularisation) and accuracy over a finite distributed dataset.

        Args:
            dataset: a distributed dataset of `(x, y)` batches. A last partial batch is fine,
                also when it leaves a replica (or a worker) with no examples: that replica skips
                the forward pass (oneDNN's convolutions fail on an empty batch).
            steps: evaluate at most this many batches (None: the whole dataset).

        Returns:
            `{"loss": float, <metric>: float, ...}`; weighted: sums over the dataset divided
            by its weight sum.
        """
        totals = self._math.empty_figures()
        for batch in itertools.islice(dataset, steps):
            totals += self._eval_fn(batch)  # stays on device until the loop ends
        return self._math.evaluation(totals.numpy().tolist(), "TensorFlowEngine")

    @property
    def checkpoint_items(self) -> dict[str, tf.Module]:
        """Model, optimizer and engine state (accumulators, counters, loss scale), for
        `tf.train.Checkpoint(**engine.checkpoint_items)`."""
        return {"model": self.model, "optimizer": self.optimizer, "engine": self._state}

    def checkpoint_state(self) -> tf.Module:
        """The training state as the ``tf.Variable``s behind the Keras variables, for
        ``tfspeed.training.checkpoints``.

        Async checkpointing of Keras 3 ``Variable`` objects fails from the second save on
        ("tf.function only supports singleton tf.Variables", raised in Keras'
        ``_copy_trackable_to_cpu``); the underlying TF variables save asynchronously fine.
        Variables are keyed by position: layer names (``dense_12``) depend on what else the
        process built, positions only on the architecture.
        """
        state = tf.Module()
        state.model = [v.value for v in self.model.variables]
        state.optimizer = [v.value for v in self.optimizer.variables]
        state.engine = self._state
        return state

    def before_save(self) -> None:
        """Nothing to copy: the checkpointed variables are the ones the step updates."""

    def after_restore(self) -> None:
        """Nothing to copy back (see ``before_save``)."""

    def sync_model(self) -> None:
        """The model's variables are the trained ones already."""

    def all_finite(self) -> bool:
        """Whether every weight and optimizer value is finite (one host sync)."""
        floats = [v.value for v in self.model.variables + self.optimizer.variables
                  if tf.as_dtype(v.dtype).is_floating]
        return bool(_all_finite(floats))

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

    # ---------------------------------------------------------------- replica context
    def _replica_forward(self, x, y, training: bool = False):
        """This replica's summed loss, regularisation, metric sums and count
        (``StepMath.sums``)."""
        outputs = self.model(self._preprocess(self._math.inputs(x, y)), training=training)
        return self._math.sums(y, outputs, self.model.losses)

    def _replica_forward_backward(self, x, y):
        """Scaled gradients and the step's figures (``StepMath.figures``); what ``xla=True``
        compiles."""
        with tf.GradientTape() as tape:
            loss_sum, reg, sums, count = self._replica_forward(x, y, training=True)
            loss, reported = self._math.objective(loss_sum, reg, count)
            scaled_loss = loss * self._scale() if self.options.loss_scale else loss
        grads = tape.gradient(scaled_loss, self._variables)
        missing = [v.path for g, v in zip(grads, self._variables, strict=True) if g is None]
        if missing:
            raise ValueError(f"no gradient for {missing}: mark them trainable=False")
        return ([tf.convert_to_tensor(g) for g in grads],
                self._math.figures(reported, sums, count))

    def _replica_grads(self, x, y):
        grads, metrics = self._forward_backward(x, y)
        # Weighted: unscaled at apply time, when the global weight sum is known.
        return grads if self.weighted else self._unscale(grads), metrics, token_counts(x)

    def _replica_accumulate(self, x, y):
        grads, metrics = self._forward_backward(x, y)
        for acc, g in zip(self._state.accumulators, grads, strict=True):
            acc.assign_add(tf.cast(g, acc.dtype))
        if self.weighted:
            self._state.weight_sum.assign_add(metrics[-1])
        return metrics, token_counts(x)

    def _replica_read_accumulators(self, factor=None):
        return self._unscale([acc.read_value() for acc in self._state.accumulators], factor)

    def _replica_zero_accumulators(self):
        for acc in self._state.accumulators:
            acc.assign(tf.zeros_like(acc))
        if self.weighted:
            self._state.weight_sum.assign(0.0)

    def _unscale(self, grads, factor=None):
        """Undoes the loss scale and averages over the K micro-batches, in one multiply
        (weighted: `factor`, from `_weight_factor`)."""
        if factor is None:
            factor = self._math.apply_factor(scale=self._scale())
        return self._math.scaled(grads, factor)

    def _weight_factor(self, weight):
        """Scaled sums of an update over `weight_scale` -> its weighted mean's gradients."""
        return self._math.apply_factor(weight, self._scale())

    def _scale(self) -> tf.Tensor:
        return self._state.loss_scale.read_value() if self.options.loss_scale else tf.constant(1.0)

    # ---------------------------------------------------------------- cross-replica context
    @property
    def metric_names(self) -> list[str]:
        """The metrics `train` and `evaluate` report besides the loss."""
        return list(self._metrics)

    def _train_execution(self, iterator, steps):
        totals = self._math.empty_figures()  # loss, metric sums, count
        tokens = tf.zeros([3], tf.int64)  # real, computed, sequences
        waited = tf.constant(0.0, tf.float64)

        def body(i, totals, tokens, waited):
            metrics, counts, wait = self._timed_micro_step(iterator)
            return i + 1, totals + metrics, tokens + counts, waited + wait

        _, totals, tokens, waited = tf.while_loop(
            lambda i, *_: i < steps, body, (tf.constant(0, steps.dtype), totals, tokens, waited))
        return self._outputs(totals, tokens, waited, steps)

    def _train_one(self, iterator):
        return self._outputs(*self._timed_micro_step(iterator), 1)

    def _timed_micro_step(self, iterator):
        if hasattr(iterator, "replica_batch"):  # in-graph input: nothing to wait for
            metrics, tokens = self._micro_step(None, None, iterator)
            if not self.options.loss_scale:
                self._record_nonfinite(self._math.step_loss(metrics))
            return metrics, tokens, tf.constant(0.0, tf.float64)
        # Host time spent inside get_next: ~0 when prefetch keeps up, the stall otherwise.
        # The timestamps are ordered around it by control dependencies; no host sync.
        before = tf.timestamp()
        with tf.control_dependencies([before]):
            x, y = next(iterator)
        with tf.control_dependencies(tf.nest.flatten((x, y), expand_composites=True)):
            wait = tf.timestamp() - before
        metrics, tokens = self._micro_step(x, y)
        if not self.options.loss_scale:
            self._record_nonfinite(self._math.step_loss(metrics))
        return metrics, tokens, wait

    def _record_nonfinite(self, loss):
        step, loss = self._math.first_nonfinite(
            self._state.micro_steps.read_value(), self._nonfinite_step.read_value(),
            self._nonfinite_loss.read_value(), loss)
        self._nonfinite_step.assign(step)
        self._nonfinite_loss.assign(loss)

    def _outputs(self, totals, tokens, waited, steps):
        return {
            **self._math.outputs(totals, tokens, steps),
            "updates": self.optimizer.iterations.value.read_value(),
            "skipped": self._state.skipped_updates.read_value(),
            "loss_scale": self._scale(),
            "input_wait_s": waited,
        }

    def _micro_step(self, x, y, source=None):
        """Trains on one micro-batch; returns its metrics and token counts, all-reduced (one
        small reduce each per micro-step, inside the loop: what works with 2 replicas)."""
        micro_steps = self._state.micro_steps.assign_add(1)
        grads_fn, accumulate_fn, args = self._replica_grads, self._replica_accumulate, (x, y)
        if source is not None:  # each replica gathers its part of micro-step `step` itself
            args = (micro_steps - 1,)
            grads_fn = lambda step: self._replica_grads(*source.replica_batch(step))  # noqa: E731
            accumulate_fn = lambda step: self._replica_accumulate(  # noqa: E731
                *source.replica_batch(step))
        if self.options.grad_accum_steps == 1:
            grads, metrics, tokens = self.strategy.run(grads_fn, args=args)
            if not self.weighted:
                self._apply(grads)
                return self._reduce(metrics), self._reduce_tokens(tokens)
            metrics = self._reduce(metrics)
            grads = self.strategy.run(self._unscale,
                                      args=(grads, self._weight_factor(metrics[-1])))
            self._apply(grads, weight=metrics[-1])
            return metrics, self._reduce_tokens(tokens)
        metrics, tokens = self.strategy.run(accumulate_fn, args=args)
        # Decided here, in cross-replica context, never by a cond in replica context
        # around apply_gradients (keras#20582).
        tf.cond(self._math.update_is_due(micro_steps), self._apply_accumulated, lambda: None)
        return self._reduce(metrics), self._reduce_tokens(tokens)

    def _reduce(self, per_replica):
        return self.strategy.reduce(_SUM, per_replica, axis=None)

    def _reduce_tokens(self, per_replica):
        """Summed token counts, or zeros without a token input (known when traced)."""
        if not self.strategy.experimental_local_results(per_replica)[0].shape[0]:
            return tf.zeros([3], tf.int64)
        return self._reduce(per_replica)

    def _apply_accumulated(self):
        if self.weighted:
            # An ON_READ/SUM variable read in cross-replica context: the sum over replicas.
            weight = self._state.weight_sum.read_value()
            self._apply(self.strategy.run(self._replica_read_accumulators,
                                          args=(self._weight_factor(weight),)), weight)
        else:
            self._apply(self.strategy.run(self._replica_read_accumulators))
        self.strategy.run(self._replica_zero_accumulators)

    def _apply(self, per_replica_grads, weight=None):
        """All-reduces unscaled, averaged per-replica gradients and applies them if finite
        (and, weighted, if the update's weight sum `weight` is above 0)."""
        pairs = [(g, v.value) for g, v in zip(per_replica_grads, self._variables, strict=True)]
        # One batched all-reduce; the results stay on each replica's device.
        grads = self.strategy.extended.batch_reduce_to(_SUM, pairs)
        if not self.options.loss_scale and weight is None:
            self.optimizer.apply_gradients(zip(grads, self._variables, strict=True))
            return

        def update():
            if not self.options.loss_scale:
                self.optimizer.apply_gradients(zip(grads, self._variables, strict=True))
                return
            # After the all-reduce every replica holds the same sum: one check decides for all.
            tf.cond(self._math.all_finite(grads), lambda: self._apply_finite(grads),
                    self._skip_update)

        if weight is None:
            update()
        else:  # no real element in the update: nothing to learn, skipped (scale unchanged)
            tf.cond(self._math.has_weight(weight), update, self._skip_empty_update)

    def _skip_empty_update(self):
        self._state.skipped_updates.assign_add(1)

    def _apply_finite(self, grads):
        self.optimizer.apply_gradients(zip(grads, self._variables, strict=True))
        state = self._state
        scale, good = self._math.loss_scale_after_finite(
            state.loss_scale.read_value(), state.good_steps.read_value(),
            self.options.loss_scale_growth_interval)
        state.loss_scale.assign(scale)
        state.good_steps.assign(good)

    def _skip_update(self):
        state = self._state
        state.skipped_updates.assign_add(1)
        state.loss_scale.assign(self._math.loss_scale_after_skip(state.loss_scale.read_value()))
        state.good_steps.assign(0)

    def _eval_step(self, batch):
        x, y = batch
        metrics = self.strategy.run(self._replica_eval, args=(x, y))
        return self.strategy.reduce(_SUM, metrics, axis=None)

    def _replica_eval(self, x, y):
        def forward():
            return self._math.eval_figures(*self._forward(x, y))

        # An uneven last batch leaves some replicas an empty one (tf.distribute splits the
        # partial batch and pads with empty batches across workers); it adds nothing.
        return tf.cond(tf.shape(tf.nest.flatten(y)[0])[0] > 0, forward,
                       self._math.empty_figures)
