"""The training engine on Keras' JAX backend (``tfspeed.training.engine.Engine``): the
step's arithmetic (``training.step``) as a pure function of (state, batch), compiled once by
``jax.jit``.

What stays the same as on TensorFlow: the job (data, model, objectives, report) and the
step's arithmetic (``training.step``: accumulation, the exact token weighting, skipped
updates, the non-finite record, what a call reports). Gradients are accumulated in the
state, and a NaN/Inf loss is recorded on the device without a sync.

What is JAX's own:

* **One program per call, on accelerators.** ``train(iterator, n)`` stacks n host batches of
  one shape and runs the n micro-steps inside one jitted ``lax.fori_loop`` (Keras 3.15's own
  ``steps_per_execution`` on JAX does not lift the per-step ceiling, keras#23527); batches of
  differing shapes (buckets) run one dispatch each. The loop bound is a traced value, so a
  short last call reuses the compiled program. **On the CPU, one program per micro-step**,
  dispatched n times with no loop in it: XLA:CPU (jax 0.10) leaves the convolutions of a
  loop's body in forms it runs as generic loops (the weight gradients' ``f01b_i01o->01bf``
  instead of ``b01f_01io->b01f``; jax#12868, open), which made a small CNN's step 6-10x
  slower (55-86 ms against 8-9 ms; Keras' own fit dispatches one step at a time too).
  Dispatch is asynchronous, so the host prepares the next step while this one runs.
* **Input ahead of the step.** JAX dispatches asynchronously: while the device runs one call,
  the host reads and places the next call's batches. The tf.data iterator is advanced only
  by the batches a dispatched call consumes, so a checkpoint's input position is exact.
* **Data parallelism** (``keras.distribution.DataParallel``'s layout): the batch is sharded
  over the devices along its first axis, the state replicated, and XLA's SPMD partitioner
  inserts the all-reduce. The loss is the global batch's, so nothing needs rescaling.
* **Checkpoints** reuse ``tf.train.Checkpoint``: ``checkpoint_items`` holds TensorFlow
  mirrors of the state, copied from the device before a save and back after a restore.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import keras
import numpy as np
from keras import tree

from tfspeed.training import batch_ops
from tfspeed.training.engine import EngineOptions, check_arguments
from tfspeed.training.step import StepMath

LossFn = Callable


class JaxEngine:
    """Trains a Keras model on the JAX backend; see the module docstring.

    Args: as ``training.backends.tensorflow.TensorFlowEngine``, with the JAX ``devices`` the
    batch is sharded over instead of a strategy (``Runtime.devices``; None: one, the first).
    """

    def __init__(self, model: keras.Model, optimizer: keras.optimizers.Optimizer,
                 devices, loss_fn: LossFn, options: EngineOptions | None = None, *,
                 global_batch_size: int, preprocess=None, metrics=None, weighted: bool = False,
                 weight_scale: float | None = None):
        options = EngineOptions() if options is None else options
        check_arguments(model, optimizer, options, global_batch_size)
        if options.loss_scale:
            raise ValueError("loss scaling (mixed_float16) runs on the TensorFlow backend; on "
                             "JAX use mixed_bfloat16 or float32")
        self.model, self.optimizer, self.options = model, optimizer, options
        self.weighted = weighted
        self._loss_fn = loss_fn
        self._preprocess = preprocess or (lambda x: x)
        self._metrics = dict({"accuracy": batch_ops.sparse_accuracy} if metrics is None
                             else metrics)
        self._global_batch_size = global_batch_size
        self._weight_scale = float(weight_scale or global_batch_size)
        # The loss is the global batch's (the batch is sharded, not split): one replica.
        self._math = StepMath(loss_fn, self._metrics, weighted, self._weight_scale,
                              global_batch_size, 1, options.grad_accum_steps)
        if not optimizer.built:
            optimizer.build(model.trainable_variables)
        self._placement = _Placement(devices)
        # Steps in a device loop, or one dispatch each (CPU: see the module docstring).
        self._loop_on_device = self._placement.devices[0].platform != "cpu"
        self._state = self._placement.replicate(self._initial_state())
        self._signatures: set = set()  # (batch shape, slots) programs compiled so far
        self._last_shape = None
        self._in_step_runs: dict = {}  # in-step sources -> their compiled program
        self._mirrors = None
        self._run = jax.jit(self._run_steps, donate_argnums=0)
        self._eval = jax.jit(self._eval_sums)
        self.objectives = None

    # ---------------------------------------------------------------- state
    def _initial_state(self) -> dict:
        """Copies of the model's and optimizer's values: the step donates its state's
        buffers, which the Keras variables must not share."""
        k = self.options.grad_accum_steps
        trainable = [jnp.array(v.value, copy=True) for v in self.model.trainable_variables]
        return {
            "trainable": trainable,
            "non_trainable": [jnp.array(v.value, copy=True)
                              for v in self.model.non_trainable_variables],
            "optimizer": [jnp.array(v.value, copy=True) for v in self.optimizer.variables],
            "accumulators": [jnp.zeros(v.shape, jnp.float32) for v in trainable] if k > 1
            else [],
            "weight_sum": jnp.zeros([], jnp.float32),
            "micro_steps": jnp.zeros([], jnp.int32),
            "skipped": jnp.zeros([], jnp.int32),
            "nonfinite_step": jnp.zeros([], jnp.int32),
            "nonfinite_loss": jnp.zeros([], jnp.float32),
        }

    def sync_model(self) -> None:
        """Writes the trained values into the Keras model and optimizer variables (for
        evaluation outside the engine, export and reports)."""
        state = self._state
        pairs = [*zip(self.model.trainable_variables, state["trainable"], strict=True),
                 *zip(self.model.non_trainable_variables, state["non_trainable"], strict=True),
                 *zip(self.optimizer.variables, state["optimizer"], strict=True)]
        for variable, value in pairs:  # copies: the next step donates the state's buffers
            variable.assign(jnp.array(value, copy=True))

    @property
    def learning_rate(self):
        """The optimizer's current learning rate (its schedule at the state's iteration)."""
        with keras.StatelessScope(state_mapping=list(zip(
                self.optimizer.variables, self._state["optimizer"], strict=True))):
            return jnp.array(self.optimizer.learning_rate, copy=True)

    # ---------------------------------------------------------------- public API
    def train(self, iterator, steps: int | None = None) -> dict:
        """Runs ``steps`` micro-steps (default ``steps_per_execution``); returns what the
        TensorFlow engine's ``train`` returns, as device scalars (no host sync)."""
        steps = self.options.steps_per_execution if steps is None else steps
        if getattr(iterator, "in_step", False):  # the split on the device: nothing to fetch
            return self._train_in_step(iterator, steps)
        batches, waited = [], 0.0
        for _ in range(steps):
            start = time.perf_counter()
            batches.append(_to_numpy(next(iterator)))
            waited += time.perf_counter() - start
        totals = np.zeros([len(self._metrics) + 2], np.float32)
        tokens = np.zeros([3], np.int32)
        if not steps:  # a call of no steps (the tuner times the call overhead)
            return self._outputs(self._state, totals, tokens, np.float32(0), np.float64(0))
        groups = _same_shapes(batches)
        # One shape (images, tables, packed or padded-to-fixed rows), on an accelerator: the
        # whole call in one program of `_slots` micro-steps (a power of two, or one compiled
        # already: calls of other lengths reuse it; its unused slots are not run). Several
        # shapes (buckets), or the CPU: one program per batch, one compile per shape.
        # Everything a call reports is computed inside them: an eager JAX op per call cost
        # more than a small step.
        runs = ([(groups[0], self._slots(steps, _shape_key(groups[0][0])))]
                if len(groups) == 1 and self._loop_on_device else [([b], 1) for b in batches])
        for group, slots in runs:
            self._last_shape = _shape_key(group[0])
            self._signatures.add((self._last_shape, slots))
            stacked = self._placement.batches(group + group[-1:] * (slots - len(group)))
            # The running sums placed alike in every run: a host array in the first and the
            # previous run's device array in the next would be two programs for one shape.
            totals, tokens = self._placement.replicate((totals, tokens))
            self._state, totals, tokens, out = self._run(
                self._state, stacked, np.int32(len(group)), totals, tokens, np.float32(steps))
        return {**out, "input_wait_s": np.float64(waited)}

    def _train_in_step(self, source, steps: int) -> dict:
        """``steps`` micro-steps on batches gathered inside the program from ``source``
        (``ingraph_jax.InStepArrays``): one program whatever ``steps`` is (run once per
        micro-step on the CPU)."""
        run = self._in_step_runs.get(id(source))
        if run is None:
            run = self._in_step_runs[id(source)] = jax.jit(
                lambda state, arrays, n, totals, tokens, steps: self._run_source(
                    source, state, arrays, n, totals, tokens, steps), donate_argnums=0)
            self._signatures.add(("in-step", id(source)))
        self._last_shape = ("in-step", id(source))
        totals = np.zeros([len(self._metrics) + 2], np.float32)
        tokens = np.zeros([3], np.int32)
        if not steps:  # a call of no steps (the tuner times the call overhead)
            return self._outputs(self._state, totals, tokens, np.float32(0), np.float64(0))
        for n in [steps] if self._loop_on_device else [1] * steps:
            totals, tokens = self._placement.replicate((totals, tokens))
            self._state, totals, tokens, out = run(self._state, source.arrays, np.int32(n),
                                                   totals, tokens, np.float32(steps))
        return {**out, "input_wait_s": np.float64(0.0)}

    def _run_source(self, source, state, arrays, n, totals, tokens, steps):
        def body(_, carry):
            state, totals, tokens = carry
            x, y = source.batch(arrays, state["micro_steps"])
            state, metrics, counts = self._micro_step(state, x, y)
            return state, totals + metrics, tokens + counts

        state, totals, tokens = self._loop(n, body, (state, totals, tokens))
        return state, totals, tokens, self._outputs(state, totals, tokens, steps)

    def _loop(self, n, body, carry):
        """``n`` runs of ``body`` in a device loop; on the CPU one run, no loop (n is 1)."""
        if self._loop_on_device:
            return jax.lax.fori_loop(0, n, body, carry)
        return body(0, carry)

    def is_warm(self, steps: int) -> bool:
        """Whether a call of ``steps`` on batches like the last ones runs a program already
        compiled (the trainer leaves calls that compile out of its throughput)."""
        if self._last_shape and self._last_shape[0] == "in-step":
            return self._last_shape in self._signatures
        return (self._last_shape, self._slots(steps, self._last_shape)) in self._signatures

    def _slots(self, steps: int, shape) -> int:
        """Slots of the program for a call of ``steps`` on batches of ``shape``: the smallest
        compiled one that holds them, else the next power of two (a new compile)."""
        if not self._loop_on_device:
            return 1
        compiled = [slots for key, slots in self._signatures if key == shape and slots >= steps]
        return min(compiled) if compiled else 1 << max(steps - 1, 0).bit_length()

    def train_one(self, iterator) -> dict:
        """One micro-step (the profiler's unit)."""
        return self.train(iterator, 1)

    def evaluate(self, dataset, steps: int | None = None) -> dict[str, float]:
        """Mean loss and metrics over a finite dataset (weighted: over its weight sum)."""
        totals = np.zeros([len(self._metrics) + 2])
        state = (self._state["trainable"], self._state["non_trainable"])
        for batch in itertools.islice(dataset, steps):
            x, y = self._placement.batch(_to_numpy(batch))
            totals += np.asarray(self._eval(state, x, y))
        return self._math.evaluation(totals.tolist(), "JaxEngine")

    @property
    def metric_names(self) -> list[str]:
        return list(self._metrics)

    @property
    def micro_steps(self):
        return self._state["micro_steps"]

    @property
    def skipped_updates(self):
        return self._state["skipped"]

    @property
    def first_nonfinite_loss(self):
        return self._state["nonfinite_step"], self._state["nonfinite_loss"]

    @property
    def compiled_functions(self) -> int:
        """Programs compiled for the training step: one per input signature (and per number
        of stacked micro-steps)."""
        return len(self._signatures)

    @property
    def loss_scale(self):
        return jnp.ones([], jnp.float32)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint_state(self):
        """TensorFlow mirrors of the whole state, for ``tf.train.Checkpoint`` (the same
        checkpoints, damaged-file handling and input position as on TensorFlow): filled by
        ``before_save``, read back by ``after_restore``."""
        if self._mirrors is None:
            import tensorflow as tf

            module = tf.Module()
            module.values = {name: [tf.Variable(np.asarray(v)) for v in _listed(value)]
                             for name, value in self._state.items()}
            self._mirrors = module
        return self._mirrors

    @property
    def updates(self):
        """Optimizer updates applied so far (the optimizer's iteration counter)."""
        return self._state["optimizer"][0]

    def before_save(self) -> None:
        mirrors = self.checkpoint_state().values
        for name, value in self._state.items():
            for mirror, v in zip(mirrors[name], _listed(value), strict=True):
                mirror.assign(np.asarray(v))

    def after_restore(self) -> None:
        mirrors = self.checkpoint_state().values
        restored = {}
        for name, value in self._state.items():
            arrays = [jnp.asarray(m.numpy()) for m in mirrors[name]]
            restored[name] = arrays if isinstance(value, list) else arrays[0]
        self._state = self._placement.replicate(restored)
        self.sync_model()

    def all_finite(self) -> bool:
        """Whether every weight and optimizer value is finite (before a save)."""
        leaves = self._state["trainable"] + self._state["optimizer"]
        return all(bool(jnp.all(jnp.isfinite(v))) for v in leaves
                   if jnp.issubdtype(v.dtype, jnp.floating))

    # ---------------------------------------------------------------- the pure step
    def _forward(self, trainable, non_trainable, x, y, training: bool):
        """``StepMath.sums`` of the batch, and the new non-trainables."""
        outputs, non_trainable, losses = self.model.stateless_call(
            trainable, non_trainable, self._preprocess(self._math.inputs(x, y)),
            training=training, return_losses=True)
        return (*self._math.sums(y, outputs, losses), non_trainable)

    def _micro_step(self, state: dict, x, y):
        """One micro-batch: gradients accumulated, the update applied every K-th."""
        def loss(trainable):
            loss_sum, reg, sums, count, non_trainable = self._forward(
                trainable, state["non_trainable"], x, y, training=True)
            loss, reported = self._math.objective(loss_sum, reg, count)
            return loss, (reported, sums, count, non_trainable)

        grads, (reported, sums, count, non_trainable) = jax.grad(
            loss, has_aux=True)(state["trainable"])
        state = {**state, "non_trainable": non_trainable,
                 "micro_steps": state["micro_steps"] + 1}
        if self.options.grad_accum_steps > 1:
            state["accumulators"] = [a + g.astype(jnp.float32)
                                     for a, g in zip(state["accumulators"], grads, strict=True)]
            state["weight_sum"] = state["weight_sum"] + count
            state = jax.lax.cond(self._math.update_is_due(state["micro_steps"]),
                                 self._apply_accumulated, lambda s: s, state)
        else:
            state = self._apply(state, grads, count)
        metrics = self._math.figures(reported, sums, count)
        state["nonfinite_step"], state["nonfinite_loss"] = self._math.first_nonfinite(
            state["micro_steps"], state["nonfinite_step"], state["nonfinite_loss"],
            self._math.step_loss(metrics))
        tokens = batch_ops.token_counts(x)
        tokens = jnp.zeros([3], jnp.int32) if tokens is None else tokens
        return state, metrics, tokens

    def _apply_accumulated(self, state: dict) -> dict:
        state = self._apply(state, state["accumulators"], state["weight_sum"])
        state["accumulators"] = [jnp.zeros_like(a) for a in state["accumulators"]]
        state["weight_sum"] = jnp.zeros([], jnp.float32)
        return state

    def _apply(self, state: dict, grads, weight) -> dict:
        """Applies one update: unweighted, the mean of K micro-batches' gradients; weighted,
        their sum times ``weight_scale / W``, skipped when W = 0."""
        grads = self._math.scaled(grads, self._math.apply_factor(weight),
                                  [v.dtype for v in state["trainable"]])

        def update(s):
            new_trainable, new_optimizer = self.optimizer.stateless_apply(
                s["optimizer"], grads, s["trainable"])
            return {**s, "trainable": list(new_trainable), "optimizer": list(new_optimizer)}

        def skip(s):
            return {**s, "skipped": s["skipped"] + 1}

        if not self.weighted:
            return update(state)
        return jax.lax.cond(self._math.has_weight(weight), update, skip, state)

    def _run_steps(self, state: dict, batches, n, totals, tokens, steps):
        """``n`` micro-steps over the first n of ``batches`` (stacked along axis 0), adding
        to a call's running ``totals`` and ``tokens``; returns them and the call's outputs
        as if it ended here (``steps``: its micro-steps)."""
        def body(i, carry):
            state, totals, tokens = carry
            x, y = tree.map_structure(lambda t: jax.lax.dynamic_index_in_dim(t, i, 0, False),
                                      batches)
            state, metrics, counts = self._micro_step(state, x, y)
            return state, totals + metrics, tokens + counts

        state, totals, tokens = self._loop(n, body, (state, totals, tokens))
        return state, totals, tokens, self._outputs(state, totals, tokens, steps)

    def _eval_sums(self, state, x, y):
        trainable, non_trainable = state
        *sums, _ = self._forward(trainable, non_trainable, x, y, training=False)
        return self._math.eval_figures(*sums)

    def _outputs(self, state, totals, tokens, steps, waited=None) -> dict:
        """What ``train`` returns (traced inside ``_run_steps``; eagerly for a call of 0)."""
        out = {
            **self._math.outputs(totals, tokens, steps),
            "updates": state["optimizer"][0],  # the optimizer's iteration counter
            "skipped": state["skipped"],
            "loss_scale": jnp.ones([], jnp.float32),
        }
        return out if waited is None else {**out, "input_wait_s": waited}


class _Placement:
    """Where the engine's arrays live: one device, or a batch sharded over several."""

    def __init__(self, devices=None):
        devices = list(devices or jax.devices()[:1])
        self.mesh = jax.sharding.Mesh(np.asarray(devices), ("batch",))
        P = jax.sharding.PartitionSpec  # noqa: N806
        self.replicated = jax.sharding.NamedSharding(self.mesh, P())
        self.sharded = jax.sharding.NamedSharding(self.mesh, P("batch"))
        self.stacked = jax.sharding.NamedSharding(self.mesh, P(None, "batch"))
        self.devices = devices

    def replicate(self, state):
        return jax.device_put(state, self.replicated)

    def batch(self, batch):
        """One batch, sharded over the devices; whole on each where its rows do not divide
        evenly (a last evaluation batch)."""
        rows = tree.flatten(batch)[0].shape[0]
        return jax.device_put(batch, self.sharded if rows % len(self.devices) == 0
                              else self.replicated)

    def batches(self, group: list):
        """Micro-batches of one shape, stacked along a new first axis and placed."""
        stacked = tree.map_structure(lambda *a: np.stack(a), *group)
        return jax.device_put(stacked, self.stacked)


def _to_numpy(batch):
    return tree.map_structure(np.asarray, batch)


def _shape_key(batch) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in tree.flatten(batch))


def _same_shapes(batches: list) -> list[list]:
    """Runs of consecutive batches of one shape (a bucket's batches differ in width)."""
    groups: list[list] = []
    for batch in batches:
        if groups and _shape_key(groups[-1][0]) == _shape_key(batch):
            groups[-1].append(batch)
        else:
            groups.append([batch])
    return groups


def _listed(value) -> list:
    return value if isinstance(value, list) else [value]
