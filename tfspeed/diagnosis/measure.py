"""What ``python -m tfspeed.diagnose`` measures: where the time of a job goes.

Same flags as ``tfspeed.train``. After a warm-up, it measures for a bounded number of steps:
  (a) the input pipeline alone (examples/s),
  (b) the model's real training step alone on batches held in memory (the compute
      ceiling): one batch, ``Dataset.from_tensors(batch).repeat()``, where every batch has
      one shape; the batches (a) pulled, in turn, for token batches, whose shapes and
      sequences per batch vary from batch to batch,
  (c) both together (examples/s, and the share of step time spent waiting for input),
  (d) a profile of (c), read with xprof,
plus the time each pipeline stage adds, peak memory, and the step's time in each precision
policy that could pay (``precision``: the driver's probe where it ran). Each is also given
in ms per batch (per step): sequences/s of token batches count a different number of sequences per batch.
Each measurement stops after its steps or ``Options.seconds``, whichever comes first (a
padded batch of long texts can take seconds per step), and logs what it starts and finds.
From the figures ``advice`` gives a verdict — input-bound, compute-bound or memory-bound —
and next steps ranked by expected gain.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import numpy as np
from absl import logging

from tfspeed.diagnosis import precision
from tfspeed.errors import UsageError
from tfspeed.runtime import backends, hostmem

# Token batches the model alone cycles through: enough to sample the shapes and the
# sequences per batch that vary from batch to batch (the default --diagnose_steps times 40).
HELD_BATCHES = 40


@dataclasses.dataclass(frozen=True)
class Options:
    """How long each measurement runs: ``steps`` training steps after ``warmup`` steps, each
    part cut short once it has run ``seconds`` (it runs at least one step)."""

    steps: int = 40
    warmup: int = 10
    profile_steps: int = 10
    seconds: float = 10.0

    def validate(self) -> Options:
        if self.steps < 1 or self.warmup < 0 or self.profile_steps < 1 or self.seconds <= 0:
            raise UsageError(f"--diagnose_steps={self.steps} must be >= 1, --diagnose_warmup="
                             f"{self.warmup} >= 0 and --diagnose_seconds={self.seconds} > 0")
        return self

def measure(job, options: Options, out_dir: str) -> dict:
    """Runs (a)-(d) and the per-stage timing; returns the figures."""
    from tfspeed.data import ingraph, pipeline

    config, batch = job.config, job.config.data.batch_size
    in_step = ingraph.is_in_step(job.train_data)
    batching = job.input_report.get("batching")  # token records: sequences, not examples
    local = pipeline.build_from_config(job.train_data_config, config.data.train_split,
                                       training=True, schema=job.schema, batching=job.batching)
    warmup = options.warmup + min(job.steps_per_epoch, 200)  # fill an in-memory cache
    _say("input alone: up to %d batches after %d to warm up", options.steps, warmup)
    if in_step:  # what the job runs: batches gathered inside the step, no tf.data per step
        input_timing = _time_in_step_gather(job, options)
        held = [next(iter(local))]
    elif batching:  # token batches vary in size: count the sequences they hold
        input_timing, held = _time_token_iterator(iter(local), options, warmup)
    else:
        input_timing = _time_iterator(iter(local), options, warmup)
        held = [next(iter(local))]
    per_batch = (statistics.fmean(_sequences(x) for x, _ in held) if batching else batch)
    _say("input alone: %.1f ms per batch (%d batches)", 1000 / input_timing.rate,
         input_timing.steps)
    engine, alone, together = _time_model(job, held, options)
    # As many steps as fit the time limit at the step time just measured (at least 2).
    profile_steps = min(options.profile_steps, max(int(options.seconds * together.rate), 2))
    profile = _profile(engine, _batches(job), profile_steps, out_dir)
    if in_step:
        # xprof's input analysis reads tf.data iterators; a step that gathers its own batch
        # has none, and xprof then says it cannot tell. The step's own timing can.
        profile["conclusion"] = (
            "input is gathered inside the step (no tf.data iterator), so xprof's input "
            "analysis does not apply; the step's own timing above measures the wait")
        stages = {"in-step gather": 1000 / input_timing.rate}
    elif batching:
        # The cuts of ``pipeline.STAGES`` end in per-sequence elements of varying length,
        # which batch only as the text branch batches them: timed whole, as one stage.
        stages = {"read+batch": 1000 / input_timing.rate}
    else:
        stages = _stage_times(job, options)
    precision_ms = precision.measure(job, held[0])  # the probe's, or timed here
    placement = job.input_report.get("placement", {}).get("where", "host")
    text_figures = {} if not batching else _token_figures(batching, together.tokens)
    return {
        **text_figures,
        "examples_per_sec": {"input_alone": input_timing.rate * per_batch,
                             "compute_alone": alone.examples_per_sec(batch, batching),
                             "together": together.examples_per_sec(batch, batching)},
        # Per batch (per step): what the verdict compares. Token batches hold different
        # numbers of sequences, so their sequences/s compare only batches alike.
        "ms_per_batch": {"input_alone": 1000 / input_timing.rate,
                         "compute_alone": 1000 / alone.rate, "together": 1000 / together.rate},
        "input_wait_pct": together.wait_pct,
        "precision": precision_ms,
        "steps_timed": {"input_alone": input_timing.steps, "compute_alone": alone.steps,
                        "together": together.steps, "profile": profile_steps},
        "host_cpus": os.cpu_count() or 1,
        "stages_ms_per_batch": stages,
        "profile": profile,
        "memory": _memory(),
        "input_measured": ("the in-step gather the job trains on (--input_placement=device)"
                           if in_step else "the job's tf.data pipeline"),
        "settings": {"batch_size": batch, "model": config.model.name,
                     "objectives": engine.objectives.report,
                     "input_placement": placement,
                     "precision": job.runtime.precision, "xla": job.runtime.xla,
                     "cache": job.train_data_config.cache,
                     "image_dtype": job.input_report.get("image_dtype"),
                     **({"batching": batching["mode"],
                         "tokens_per_batch": batching["tokens_per_batch"],
                         "max_length": batching["max_length"]} if batching else {}),
                     "data_service": config.data.data_service or None,
                     "steps_per_execution":
                         config.train.steps_per_execution, "steps": options.steps,
                     "seconds": options.seconds},
    }


@dataclasses.dataclass(frozen=True)
class Timing:
    """One measurement: ``rate`` batches (steps) per second over ``steps`` timed batches,
    the % of that time spent waiting for input, and the token counts of the steps (zeros
    for batches without segment ids)."""

    rate: float
    steps: int
    wait_pct: float = 0.0
    tokens: dict = dataclasses.field(default_factory=dict)

    def examples_per_sec(self, batch: int, batching) -> float:
        """Examples/s; for token batches the sequences the timed steps trained on."""
        if batching:
            return self.tokens["sequences"] / self.tokens["seconds"]
        return self.rate * batch


def _say(message: str, *args) -> None:
    logging.info("diagnose: " + message, *args)


def _bounded(fn, count: int, seconds: float) -> int:
    """Calls ``fn`` up to ``count`` times, stopping once ``seconds`` have passed (after at
    least one call, if ``count`` > 0); returns the calls made."""
    start = time.perf_counter()
    for done in range(1, count + 1):
        fn()
        if time.perf_counter() - start > seconds:
            return done
    return count


def _time_model(job, held: list, options: Options) -> tuple:
    """(b) and (c): the engine, and its Timing alone on ``held`` and on the job's input."""
    import tensorflow as tf

    from tfspeed.training import job as job_lib

    engine = job_lib.build_engine(job.config, job.runtime, job.model, job.objectives,
                                  job.preprocess)
    # One held batch stands for all where they share a shape; token batches differ in shape
    # and in sequences per batch, so the step cycles through those the input alone pulled
    # (one flat choice among them: a chain of concatenations costs per batch what it is long).
    synthetic = tf.data.Dataset.choose_from_datasets(
        [tf.data.Dataset.from_tensors(b).repeat() for b in held],
        tf.data.Dataset.range(len(held)).repeat())
    _say("model alone: the step on %d batch(es) held in memory (the first calls trace it)",
         len(held))
    alone = _time_engine(engine, iter(job.runtime.distribute(
        synthetic)), options)
    _say("model alone: %.1f ms per step (%d steps)", 1000 / alone.rate, alone.steps)
    _say("together: the step on the job's input")
    together = _time_engine(engine, _batches(job), options)
    _say("together: %.1f ms per step (%d steps), %.0f%% waiting for input",
         1000 / together.rate, together.steps, together.wait_pct)
    return engine, alone, together


def _time_in_step_gather(job, options: Options) -> Timing:
    """Batches per second of the in-step input alone: the gathers (and augmentation) a step
    runs for its batch, in one compiled loop, with no model."""
    import tensorflow as tf

    source, strategy = job.train_data, job.runtime.strategy
    if not backends.get(job.runtime.backend).tf_distribute:
        return _time_jax_gather(source, options)

    @tf.function
    def gather(start, n):
        total = tf.constant(0.0)
        for step in tf.range(start, start + n):
            x, _ = strategy.run(source.replica_batch, (step,))
            for part in tf.nest.flatten(strategy.experimental_local_results(x)):
                total += tf.cast(tf.reduce_sum(part[:1]), tf.float32)
        return total

    gather(tf.constant(0, tf.int64), tf.constant(options.warmup, tf.int64)).numpy()
    start = time.perf_counter()
    gather(tf.constant(options.warmup, tf.int64), tf.constant(options.steps, tf.int64)).numpy()
    return Timing(options.steps / (time.perf_counter() - start), options.steps)


def _time_jax_gather(source, options: Options) -> Timing:
    """``_time_in_step_gather`` on JAX: the batches ``ingraph_jax.InStepArrays`` gathers, in
    one compiled loop, with no model."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def gather(arrays, start, n):
        def body(step, total):
            x, _ = source.batch(arrays, step)
            return total + sum(jnp.sum(part[:1]).astype(jnp.float32)
                               for part in jax.tree_util.tree_leaves(x))
        return jax.lax.fori_loop(start, start + n, body, jnp.float32(0))

    np.asarray(gather(source.arrays, 0, options.warmup))
    start = time.perf_counter()
    np.asarray(gather(source.arrays, options.warmup, options.steps))
    return Timing(options.steps / (time.perf_counter() - start), options.steps)


def _time_iterator(iterator, options: Options, warmup: int) -> Timing:
    """Batches per second pulled from ``iterator`` after ``warmup`` batches."""
    _bounded(lambda: next(iterator), warmup, options.seconds)
    start = time.perf_counter()
    steps = _bounded(lambda: next(iterator), options.steps, options.seconds)
    return Timing(steps / (time.perf_counter() - start), steps)


def _time_token_iterator(iterator, options: Options, warmup: int) -> tuple[Timing, list]:
    """Batches per second pulled from a token pipeline, and the first ``HELD_BATCHES`` of
    them (their sequences are counted after the clock stops: no part of the input's cost)."""
    _bounded(lambda: next(iterator), warmup, options.seconds)
    pulled = []

    def pull():
        batch = next(iterator)
        if len(pulled) < HELD_BATCHES:
            pulled.append(batch)

    start = time.perf_counter()
    steps = _bounded(pull, options.steps, options.seconds)
    return Timing(steps / (time.perf_counter() - start), steps), pulled


def _sequences(inputs) -> int:
    """Sequences in a token batch: segments start where a real position is 0."""
    import tensorflow as tf

    starts = tf.logical_and(inputs["segment_ids"] > 0, inputs["positions"] == 0)
    return int(tf.math.count_nonzero(starts))


def _token_figures(batching: dict, tokens: dict) -> dict:
    """What the trained-on token batches held: padding is computed, never learnt from."""
    computed = max(tokens["computed_tokens"], 1)
    return {"unit": "sequences",
            "padding_fraction": 1.0 - tokens["real_tokens"] / computed,
            "real_tokens_per_sec": tokens["real_tokens"] / tokens["seconds"],
            "tokens": {**{k: tokens[k] for k in ("real_tokens", "computed_tokens",
                                                 "sequences")},
                       "computed_tokens_per_sec": tokens["computed_tokens"] / tokens["seconds"]},
            "batching": {k: batching[k] for k in (
                "mode", "reason", "tokens_per_batch", "batch_size", "max_length",
                "expected_padding", "costs", "attention_length")}}


def _time_engine(engine, iterator, options: Options) -> Timing:
    """The real training step on ``iterator``: steps/s, % of time waiting for input, and the
    token counts of the timed steps."""
    n = max(engine.options.steps_per_execution, 1)
    # Each call waits for its result, so the clock (and the time limit) sees whole steps.
    _bounded(lambda: np.asarray(engine.train(iterator, n)["loss"]), max(options.warmup // n, 1),
             options.seconds)
    outs = []
    start = time.perf_counter()
    executions = _bounded(lambda: outs.append(_finished(engine.train(iterator, n))),
                          max(options.steps // n, 1), options.seconds)
    seconds = time.perf_counter() - start
    waited = sum(float(out["input_wait_s"]) for out in outs)
    tokens = {name: sum(int(out[name]) for out in outs)
              for name in ("real_tokens", "computed_tokens", "sequences")}
    return Timing(executions * n / seconds, executions * n,
                  100 * min(waited / seconds, 1.0), {**tokens, "seconds": seconds})


def _finished(out: dict) -> dict:
    np.asarray(out["loss"])
    return out


def _profile(engine, iterator, steps: int, out_dir: str) -> dict:
    """(d): a profile of ``steps`` steps, each in its own call, read with xprof."""
    from tfspeed.probes import profiling

    if not backends.current().tf_profiler:
        # The capture and its step analysis are TensorFlow's profiler and xprof's reading
        # of it; a JAX step does not show in them. The other figures are measured alike.
        _say("profile: not on the JAX backend (TensorFlow's profiler does not see its step)")
        return {"skipped": "not on the JAX backend: TensorFlow's profiler and xprof's step "
                           "analysis do not see a JAX step; the other figures are measured"}
    _say("profile: %d steps, each in its own call", steps)
    # The first call of the one-step function traces it (and under XLA compiles it): made
    # here, outside the capture, or its seconds count as step time and input wait (xprof
    # once called a packed transformer's step 21% input-bound for it).
    np.asarray(engine.train_one(iterator)["loss"])
    # One edge step on each side of the window: xprof leaves the first and last it sees out.
    edge = profiling.EDGE_STEPS
    window = profiling.ProfileWindow(os.path.join(out_dir, "logs"), 1 + edge, steps + edge)
    for step in range(window.last):
        with window.trace(step):
            engine.train_one(iterator)
        window.after(step + 1)
    window.stop()
    _say("profile: %s", window.summary.get("conclusion") or "no step analysis")
    return window.summary


def _batches(job):
    """What the engine trains on: the job's in-graph source, or an iterator over its data."""
    from tfspeed.data import ingraph  # imports TensorFlow, which --help does not start

    return job.train_data if ingraph.is_in_step(job.train_data) else iter(job.train_data)


STAGE_ROUNDS = 3


def _stage_times(job, options: Options) -> dict[str, float]:
    """Milliseconds each pipeline stage adds per batch, from pipelines cut after each stage.

    A stage's share is a difference of two timings, so a burst of another process's work
    during one cut's window moves it to the wrong stage (a shuffle once measured slower than
    decoding beside a busy test). The cuts are timed in ``STAGE_ROUNDS`` interleaved rounds,
    each cut's iterator warmed once, and each cut keeps the median of its rounds."""
    import statistics

    from tfspeed.data import pipeline

    config, batch = job.train_data_config, job.config.data.batch_size
    iterators = {}
    for stage in pipeline.STAGES:
        _say("stages: the pipeline up to %s", stage)
        ds = pipeline.build_from_config(config, config.train_split, training=True,
                                        schema=job.schema, until=stage)
        if stage != "batch":
            ds = ds.repeat().batch(batch)  # count whole batches of elements, like the model
        iterators[stage] = iter(ds)
        # Past the fill of a shuffle buffer: up to an epoch's batches, as the job runs.
        _bounded(lambda it=iterators[stage]: next(it),
                 options.warmup + min(job.steps_per_epoch, 200), options.seconds)
    steps = options.steps
    seconds = options.seconds / STAGE_ROUNDS
    rounds = {stage: [] for stage in pipeline.STAGES}
    for _ in range(STAGE_ROUNDS):
        for stage, iterator in iterators.items():
            start = time.perf_counter()
            done = _bounded(lambda it=iterator: next(it), steps, seconds)
            rounds[stage].append(1000 * (time.perf_counter() - start) / done)
    times, previous = {}, 0.0
    for stage in pipeline.STAGES:
        per_batch_ms = statistics.median(rounds[stage])
        times[stage] = max(per_batch_ms - previous, 0.0)
        previous = max(per_batch_ms, previous)
    return times


def _memory() -> dict:
    import resource

    import tensorflow as tf

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    memory = {"peak_host_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "host_total_mb": total, "host_allocator": hostmem.describe()}
    for i, _ in enumerate(tf.config.list_physical_devices("GPU")):
        info = tf.config.experimental.get_memory_info(f"GPU:{i}")
        memory[f"gpu{i}_peak_mb"] = info["peak"] / 2**20
    return memory
