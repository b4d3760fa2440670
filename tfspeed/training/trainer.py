"""Trainer: the optimisation loop around ``tfspeed.training.engine.Engine``. Knows nothing of features.

Stock ``model.fit`` fails under MirroredStrategy with gradient accumulation (keras#20582),
``jit_compile`` (keras#19005) or ``steps_per_execution > 1``, so training runs on the engine
(`tfspeed.training.backends.tensorflow` says how it avoids each); this module adds what a run
needs around it: the learning-rate schedule, checkpoints and resumption, the steps_per_execution
tuner, progress, TensorBoard scalars and throughput.

Fault tolerance: checkpoints hold the input position where tf.data can save it, so a killed
run resumes without repeating or skipping data; SIGTERM/SIGINT end the current execution,
save and raise ``Stopped``; a NaN/Inf loss raises ``LossDiverged`` before it is checkpointed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf
from absl import logging

from tfspeed.config import TrainConfig, is_auto
from tfspeed.data import ingraph
from tfspeed.errors import UsageError
from tfspeed.probes import autotune, profiling
from tfspeed.runtime import Runtime, backends
from tfspeed.training import decisions as decisions_lib
from tfspeed.training import meters
from tfspeed.training.callbacks import Callbacks
from tfspeed.training.checkpoints import Checkpoints, LossDiverged  # noqa: F401 -- re-exported
from tfspeed.training.engine import Engine, EngineOptions
from tfspeed.training.optimizers import (
    make_optimizer,
    peak_learning_rate,
)
from tfspeed.training.stops import Stopped, StopRequests  # noqa: F401 -- Stopped re-exported
from tfspeed.util import locks


@dataclasses.dataclass
class FitResult:
    """What training produced.

    Attributes:
      train_metrics: the last logged training loss and metrics.
      eval_metrics: final evaluation loss and metrics (empty without an eval split).
      history: every log point: update, micro-step, loss, metrics and the meter's rates.
      eval_history: every evaluation (``--eval_every_epochs``, and the last at the end):
        epoch (passes trained, may be fractional), update, micro-step, its metrics,
        ``train_seconds`` (training before it, evaluations left out) and ``seconds`` (its
        own).
      throughput: the meter's median rates and step time (``meters.ThroughputMeter``).
      optimizer_updates: optimizer iterations at the end (updates, not micro-batches).
      micro_steps: micro-batches trained on, this run and any resumed one.
      skipped_updates: updates skipped for non-finite gradients (loss scaling).
      resumed_from_update: the update restored from a checkpoint (0: fresh start).
      steps_per_execution: the value used (tuned when ``auto``), with the tuner's table.
      learning_rate: the peak learning rate after batch scaling.
      profile: the profiler summary (empty without ``profile_steps``).
      seconds: wall time per phase: ``fit`` the training loop less the evaluations
        during it, ``evaluate`` every evaluation.
      compiled_programs: the step's compiled programs (TensorFlow's traces, JAX's programs:
        one per input shape; with static bucket shapes, at most one per bucket).
    """

    train_metrics: dict
    eval_metrics: dict
    history: list
    throughput: dict
    optimizer_updates: int
    micro_steps: int
    skipped_updates: int
    resumed_from_update: int
    steps_per_execution: dict
    learning_rate: float
    profile: dict
    seconds: dict
    compiled_programs: int = 0
    eval_history: list = dataclasses.field(default_factory=list)


def make_engine(model: keras.Model, objectives, config: TrainConfig, runtime: Runtime,
                global_batch_size: int, total_updates: int, preprocess=None,
                optimizer=None, weight_scale: float | None = None) -> Engine:
    """The engine that runs the training step: optimizer, accumulation, XLA, loss scaling.

    Args:
      model: a Keras model built in ``runtime.scope()``.
      objectives: the resolved loss and metrics (``tfspeed.training.objectives.resolve``): there is
        no default, so an engine never trains on a loss the job did not ask for.
      config: optimisation settings.
      runtime: strategy, precision, loss scaling and XLA choice.
      global_batch_size: examples in one micro-batch, over all replicas.
      total_updates: the schedule's length in optimizer updates.
      preprocess: ``x -> x`` on each batch's inputs inside the compiled step.
      optimizer: a Keras optimizer made in the strategy's scope, instead of ``config``'s.
      weight_scale: token data: one micro-batch's expected weight (real tokens for an lm,
        sequences for classification), the constant its summed loss is divided by.

    Returns:
      The ``Engine`` of the runtime's backend (``runtime.backends``).
    """
    if objectives is None or not callable(getattr(objectives, "loss", None)):
        raise TypeError("make_engine needs the job's resolved objectives "
                        "(tfspeed.training.objectives.resolve), not None")
    options = EngineOptions(grad_accum_steps=config.grad_accum_steps,
                            steps_per_execution=(1 if is_auto(config.steps_per_execution)
                                                 else config.steps_per_execution),
                            xla=runtime.xla, loss_scale=runtime.plan.loss_scale)
    shared = dict(global_batch_size=global_batch_size, preprocess=preprocess,
                  metrics=objectives.metrics, weighted=getattr(objectives, "weighted", False),
                  weight_scale=weight_scale)
    with runtime.scope():
        optimizer = optimizer or make_optimizer(config, total_updates, global_batch_size)
        adapter = backends.engine_class(runtime.backend)
        engine = adapter(model, optimizer, runtime.placement, objectives.loss, options,
                         **shared)
    engine.objectives = objectives  # what it trains on, for the reports of probes
    return engine


def fit(
    model: keras.Model,
    train_data,
    eval_data,
    config: TrainConfig,
    runtime: Runtime,
    *,
    steps_per_epoch: int,
    eval_steps: int | None,
    global_batch_size: int,
    model_dir: str,
    objectives,
    preprocess=None,
    callbacks=(),
    optimizer=None,
    weight_scale: float | None = None,
    decisions=None,
) -> FitResult:
    """Trains ``model`` on ``train_data`` and evaluates it on ``eval_data``.

    Args:
      model: a built Keras model created in ``runtime.scope()``, outputting logits.
      train_data: a distributed, endlessly repeating dataset of (inputs, labels) micro-batches.
      eval_data: a distributed finite dataset, or None.
      config: optimisation settings.
      runtime: strategy, precision, loss scaling and XLA choice.
      steps_per_epoch: micro-batches in one pass over the train split.
      eval_steps: batches in ``eval_data``.
      global_batch_size: examples in one micro-batch, over all replicas.
      model_dir: checkpoints and TensorBoard logs go below it.
      preprocess: ``x -> x`` on each batch's inputs inside the compiled step.
      objectives: the resolved loss and metrics (``tfspeed.training.objectives.resolve``).
      callbacks: ``keras.callbacks.Callback``s, called as Keras' ``fit`` calls them
        (``tfspeed.training.callbacks``); ``model.stop_training`` ends the run.
      optimizer: a Keras optimizer made in the strategy's scope, instead of the one
        ``config`` describes.
      weight_scale: token data: one micro-batch's expected weight (``make_engine``).
      decisions: ``training.decisions``: steps per call measured once, reused by a rerun.

    Returns:
      A ``FitResult``.
    """
    k = config.grad_accum_steps
    total_updates = config.train_steps or config.epochs * (steps_per_epoch // k)
    if total_updates < 1:
        raise UsageError(f"one update needs --batch_size x --grad_accum_steps = "
                         f"{global_batch_size * k} examples, more than the train split holds; "
                         "lower them")
    engine = make_engine(model, objectives, config, runtime, global_batch_size, total_updates,
                         preprocess, optimizer, weight_scale)
    with _worker_dir(model_dir, None if runtime.is_chief else runtime.worker_index) as write_dir:
        return _fit(engine, train_data, eval_data, config, runtime, steps_per_epoch,
                    eval_steps, global_batch_size, model_dir, write_dir, total_updates,
                    callbacks=list(callbacks), decisions=decisions)


@contextlib.contextmanager
def _worker_dir(model_dir: str, worker_index: int | None):
    """Where this process writes checkpoints and logs: ``model_dir`` on the chief
    (``worker_index`` None), which ``train.prepare`` locked; on the other workers of a
    multi-worker job ``MODEL_DIR/.worker-I-PID``, removed at the end.

    A killed earlier attempt leaves its ``.worker-I-*`` behind; they are removed, but only
    while holding worker I's lock: a second job on the same directory, still running, is
    told so in one line instead of losing its directory.
    """
    if worker_index is None:
        yield model_dir
        return
    with locks.own_dir(model_dir, f".worker-{worker_index}",
                       f"worker {worker_index}'s directory in --model_dir={model_dir}",
                       "stop that job first, or use another --model_dir") as path:
        yield path


def _fit(engine, train_data, eval_data, config, runtime, steps_per_epoch, eval_steps,
         global_batch_size, model_dir, write_dir, total_updates, callbacks=(),
         decisions=None) -> FitResult:
    k = config.grad_accum_steps
    # An in-graph source is its own "iterator": each step gathers its batch in the graph.
    iterator = train_data if ingraph.is_in_step(train_data) else iter(train_data)
    multi_worker = runtime.num_workers > 1
    # Multi-worker saves are synchronous: every worker must save at the same step.
    checkpoints = Checkpoints(engine, model_dir, config, iterator, write_dir=write_dir,
                              asynchronous=not multi_worker)
    resumed = checkpoints.restore()
    finished = resumed >= total_updates
    if finished:
        logging.warning("model_dir %s already holds a run trained to update %d of %d: it "
                        "resumed at the end, so nothing is trained and it only evaluates (use a "
                        "new model_dir to train again)", model_dir, resumed, total_updates)
    elif resumed and not checkpoints.restores_position:
        _fast_forward(iterator, int(engine.micro_steps) % steps_per_epoch)
    evaluate = (lambda: engine.evaluate(eval_data, eval_steps)) if eval_data is not None else None
    hooks = Callbacks(callbacks, engine.model, steps_per_epoch, total_updates * k,
                      engine.metric_names, sync=engine.sync_model)
    loop = _Loop(engine, config, global_batch_size, write_dir, total_updates * k, steps_per_epoch,
                 agree=runtime.mean_over_workers, hooks=hooks, evaluate=evaluate, decisions=decisions)
    hooks.train_begin()
    start = time.perf_counter()
    # A signal reaches one worker of a multi-worker job first; one stopping alone would
    # leave the others waiting in a collective. There, SIGTERM ends the process and the
    # job resumes from the last periodic checkpoint (python -m tfspeed.launch restarts it).
    with StopRequests(enabled=not multi_worker) as stop:
        loop.run(iterator, checkpoints, stop)
    fit_seconds = time.perf_counter() - start - loop.eval_seconds
    checkpoints.save(final=True)
    engine.sync_model()  # on JAX the model's variables learn the trained values here
    if stop.signum:
        raise Stopped(stop.signum, int(engine.updates))
    eval_metrics = loop.evaluate_now(int(engine.micro_steps), fit_seconds) if evaluate else {}
    loop.flush()
    hooks.end_epoch(eval_metrics)  # the last epoch's: evaluated at the end of the run
    hooks.train_end({**loop.last_metrics, **{f"val_{name}": v for name, v in eval_metrics.items()}})
    return FitResult(
        train_metrics=loop.last_metrics,
        history=loop.history,
        eval_metrics=eval_metrics,
        throughput=loop.meter.summary(),
        optimizer_updates=int(engine.updates),
        micro_steps=int(engine.micro_steps),
        skipped_updates=int(engine.skipped_updates),
        resumed_from_update=resumed,
        steps_per_execution=loop.tuning,
        learning_rate=peak_learning_rate(config, global_batch_size),
        profile=loop.profile.summary if loop.profile else {},
        seconds={"fit": fit_seconds, "evaluate": loop.eval_seconds},
        compiled_programs=engine.compiled_functions,
        eval_history=loop.eval_history,
    )


def _fast_forward(iterator, batches: int) -> None:
    """Without a checkpointed input position, skips to the same place in the epoch.

    The epoch boundary then falls where it would have (no epoch repeated or cut short);
    the exact records match only when the data order is deterministic.
    """
    if batches:
        logging.info("resuming the data stream %d batches into its epoch", batches)
        for _ in range(batches):
            next(iterator)


class _Loop:
    """Runs executions of micro-steps until ``total_micro`` and reports along the way."""

    def __init__(self, engine: Engine, config: TrainConfig, global_batch_size: int,
                 model_dir: str, total_micro: int, steps_per_epoch: int,
                 agree=lambda value: value, hooks=None, evaluate=None, decisions=None):
        self.engine, self.config, self.total_micro = engine, config, total_micro
        self.decisions = decisions  # steps per call: measured once, reused by a rerun
        self.evaluate = evaluate  # () -> metrics over the eval split, or None
        # Micro-steps between evaluations during the run (0: only the one at the end).
        self.eval_every = config.eval_every_epochs * steps_per_epoch if evaluate else 0
        self.eval_history: list[dict] = []
        self.eval_seconds = 0.0
        self._started = time.perf_counter()
        self.steps_per_epoch = steps_per_epoch
        self.hooks = hooks or Callbacks((), None, steps_per_epoch, total_micro, ())
        self.agree = agree  # makes timing-based choices identical on every worker
        self.k = config.grad_accum_steps
        self.meter = meters.ThroughputMeter(global_batch_size, os.path.join(model_dir, "logs", "train"))
        self.eval_writer = tf.summary.create_file_writer(os.path.join(model_dir, "logs", "eval"))
        self.progbar = keras.utils.Progbar(total_micro // self.k, unit_name="update",
                                           verbose=1 if sys.stdout.isatty() else 0)
        self.last_metrics: dict = {}
        self.history: list[dict] = []  # one entry per log point
        self.tuning: dict = {"value": config.steps_per_execution}
        self.profile = (profiling.ProfileWindow(os.path.join(model_dir, "logs"),
                                                *config.profile_steps)
                        if config.profile_steps else None)
        self._warm = False  # whether the step function has been traced (by a call)
        self._logged = self._measured_from = 0  # micro-steps at the last log / measured since
        self._waited = 0.0
        self._tokens = []  # per call since the last window: device-side (real, computed, seqs)

    def run(self, iterator, checkpoints, stop) -> None:
        done = int(self.engine.micro_steps)  # > 0 after a resume
        self._logged = done
        self._started = time.perf_counter()
        # A resumed run does not repeat the evaluations its first attempt made.
        self._evaluated = done // self.eval_every if self.eval_every else 0
        spe = self.config.steps_per_execution
        if is_auto(spe) and done < self.total_micro and self.profile and (
                self.profile.first <= done + autotune.PROBE_SHARE * (self.total_micro - done)):
            # The tuner's probe calls would run the window's steps untraced: capture it first
            # (in calls as long as the window allows), then tune on the steps after it.
            done = self._steps(iterator, checkpoints, stop, done,
                               min(self.profile.last, self.total_micro), self.total_micro)
        if is_auto(spe) and done < self.total_micro and not stop.signum and not self.hooks.stop:
            probed_from = done
            spe, done = self._tune(iterator, done)
            # A probe (it may be skipped in a short run) traced the step function.
            self._warm, self._logged = self._warm or done > probed_from, done
        # done == total_micro: a finished run, not one more step (not even the tuner's).
        done = self._steps(iterator, checkpoints, stop, done, self.total_micro, spe)
        if self.profile:
            self.profile.stop(done)  # the run ended before or inside the window

    def _steps(self, iterator, checkpoints, stop, done: int, until: int, spe: int) -> int:
        """Runs calls of up to ``spe`` micro-steps from ``done`` to ``until``; returns ``done``.

        Calls are cut at the profile window's edges, and each of its steps runs as a traced
        call of its own. The meter measures only settled calls: the first call traces and
        compiles the step function (the engine passes the step count as a tensor, so it is
        the only trace), and profiled calls carry the profiler; both are synced at their end
        and left out, as the tuner's probes are. The first call runs a single step: a short
        run whose steps all fit one call had no timed step left otherwise.
        """
        self.meter.restart()
        self._measured_from, self._waited, out = done, 0.0, None
        self._tokens = []
        start = done
        while done < until and not stop.signum and not self.hooks.stop:
            # Calls end on multiples of spe from the start (where logs and checkpoints fall),
            # but the one that traces runs one step, so that every later one is timed.
            n = min(spe - (done - start) % spe if self._warm else 1, until - done)
            profiled = bool(self.profile) and self.profile.covers(done)
            if self.profile:
                n = self.profile.limit(done, n)
            if self.eval_every:  # a call ends where an evaluation falls
                n = min(n, (done // self.eval_every + 1) * self.eval_every - done)
            if self.hooks:  # and where an epoch ends, for Keras callbacks
                n = min(n, (done // self.steps_per_epoch + 1) * self.steps_per_epoch - done)
            # A call that compiles (the first; on JAX also a new number of steps) is warm-up.
            warm_up = profiled or not self._warm or not self.engine.is_warm(n)
            if warm_up:
                self._close_measured(out, done)
            out = self._call(iterator, done, n, profiled)
            done += n
            if self.profile:
                self.profile.after(done)
            if warm_up:
                self._warm = True
                self._exclude(out, done)
            if done - self._logged >= self.config.log_every or done == self.total_micro:
                checkpoints.check_finite(weights=False)
                self._log(out, done, done - self._measured_from, float(self._waited))
                self._logged, self._measured_from, self._waited = done, done, 0.0
                if done < self.total_micro:  # the end saves anyway
                    checkpoints.maybe_save_in_time(done // self.k, self.agree)
            checkpoints.maybe_save(done // self.k)
            evaluated = {}
            if self.eval_every and done // self.eval_every > self._evaluated and (
                    done < self.total_micro):  # the end evaluates anyway
                self._evaluated = done // self.eval_every
                self._close_measured(out, done)
                evaluated = self.evaluate_now(done)
                self.meter.restart()  # the evaluation is in no window
                self._measured_from, self._waited = done, 0.0
            if self.hooks.epoch_ends(done, n):
                self.hooks.end_epoch(evaluated)
        return done

    def evaluate_now(self, done: int, train_seconds: float | None = None) -> dict:
        """Evaluates on the eval split after ``done`` micro-steps: TensorBoard and
        ``eval_history``; its time goes to ``eval_seconds``, not to training's."""
        start = time.perf_counter()
        if train_seconds is None:
            train_seconds = start - self._started - self.eval_seconds
        metrics = self.evaluate()
        seconds = time.perf_counter() - start
        self.eval_seconds += seconds
        self.log_eval(metrics, done)
        self.eval_history.append({
            "epoch": round(done / self.steps_per_epoch, 4), "update": done // self.k,
            "micro_step": done, **metrics, "train_seconds": train_seconds, "seconds": seconds})
        if self.eval_every and done < self.total_micro:
            logging.info("evaluation at update %d (epoch %.4g): %s", done // self.k,
                         done / self.steps_per_epoch,
                         " ".join(f"{name}={value:.4f}" for name, value in metrics.items()))
        return metrics

    def _call(self, iterator, done: int, n: int, profiled: bool) -> dict:
        if profiled:
            with self.profile.trace(done):
                out = self.hooks.call(done, n, lambda: self.engine.train_one(iterator))
        else:
            out = self.hooks.call(done, n, lambda: self.engine.train(iterator, n))
        self._waited = self._waited + out["input_wait_s"]  # a device-side sum: no sync
        # Kept, not summed: a sum per call is an op per call (on JAX an eager dispatch that
        # cost more than a small model's step); they are summed at the next sync point.
        self._tokens.append((out["real_tokens"], out["computed_tokens"], out["sequences"]))
        return out

    def _take_tokens(self) -> tuple[int, int, int]:
        """The token counts since the last window (at a sync point), and a new start."""
        calls, self._tokens = self._tokens, []
        return tuple(int(sum(int(np.asarray(c[i])) for c in calls)) for i in range(3))

    def _close_measured(self, out, done: int) -> None:
        """Before a warm-up call: the measured calls since the last log form a window."""
        if out is not None and done > self._measured_from:
            np.asarray(out["loss"])  # they have finished
            self.meter.close(done - self._measured_from, float(self._waited),
                             self._take_tokens())
            self._measured_from, self._waited = done, 0.0

    def _exclude(self, out, done: int) -> None:
        """Leaves the call that just ended out of the throughput figures (warm-up)."""
        np.asarray(out["loss"])  # its time must not spill into the next measured call
        self.meter.exclude(done - self._measured_from, float(self._waited),
                           self._take_tokens())
        self._measured_from, self._waited = done, 0.0

    def _log(self, out, done: int, steps: int, waited: float) -> None:
        values = {name: float(v) for name, v in out.items()}  # the one sync per log
        updates = int(values["updates"])
        lr = self.engine.learning_rate
        metrics = {name: values[name] for name in ("loss", *self.engine.metric_names)}
        figures = self.meter.tick(steps, done, waited, also={
            **metrics, "learning_rate": float(lr),
            "loss_scale": values["loss_scale"]}, tokens=self._take_tokens())
        self.last_metrics = metrics
        # A window of warm-up calls only has no speed of its own (None; the progress bar
        # leaves it out).
        tokens = "real_tokens_per_sec" in figures  # text: tokens and sequences, not examples
        speed = ({"real tokens/s": figures["real_tokens_per_sec"],
                  "sequences/s": figures["sequences_per_sec"]} if tokens
                 else {"examples/s": figures.get("batch_examples_per_sec")})
        speed["input wait %"] = figures.get("input_wait_pct")
        rates = ("real_tokens_per_sec", "sequences_per_sec") if tokens else (
            "batch_examples_per_sec",)
        self.history.append({"update": updates, "micro_step": done, **metrics,
                             **{name: figures.get(name) for name in rates}})
        self.progbar.update(updates, [*metrics.items(),
                                      *((k, v) for k, v in speed.items() if figures)])
        if not self.progbar.verbose:
            shown = " ".join(f"{name}={value:.4f}" for name, value in metrics.items())
            rate = (", ".join(f"{v:.0f} {k}" for k, v in speed.items() if not k.startswith(
                "input")) + f", {figures['input_wait_pct']:.0f}% waiting for input"
                if figures else "warm-up (not timed)")
            logging.info("update %d/%d (micro-step %d): %s %s", updates,
                         self.total_micro // self.k, done, shown, rate)

    def log_eval(self, metrics: dict, done: int) -> None:
        if metrics:
            with self.eval_writer.as_default(step=done):
                for name, value in metrics.items():
                    tf.summary.scalar(name, value)
            self.eval_writer.flush()

    def flush(self) -> None:
        if self.meter.writer:
            self.meter.writer.flush()

    def _tune(self, iterator, done: int) -> tuple[int, int]:
        """steps_per_execution=auto: a cost model from two short probes (``autotune``).

        Keras 3 dropped tf-keras' ``steps_per_execution="auto"``. The probe's steps are real
        training steps (they count towards the total) and take at most 5% of the run; the
        engine takes N as a tensor, so trying values does not retrace.
        """

        at = [done]  # where the next probe call starts, for the callbacks

        def run_call(n: int) -> None:
            np.asarray(self.hooks.call(at[0], n, lambda: self.engine.train(iterator, n),
                                       end_epoch=True)["loss"])
            at[0] += n

        n, used, self.tuning = decisions_lib.tuned(
            self.decisions, lambda: autotune.tune_steps_per_execution(
                run_call, self.total_micro - done, self.steps_per_epoch, self.agree))
        logging.info("steps_per_execution=auto chose %d (%s)", n,
                     ", ".join(f"{k}={v}" for k, v in self.tuning.items() if k != "value"))
        return n, done + used
