"""Phase 1 of ``tfspeed.tune``: measuring the input and the step, in CPU time per element
rather than wall time, since on a CPU host the input stages and the step share the cores.

The pipeline cold (decoding every epoch, with each parse mode) and warm (from the memory
cache), its read and decode stages alone, the decoded size of the split; and the step alone
on a held batch, for every precision and XLA setting: a call's fixed overhead, a step's wall
time and the CPU it keeps busy. ``measure_apart`` runs it all in a child process.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import statistics
import time

import numpy as np

from tfspeed.errors import UsageError
from tfspeed.tuning.measurements import (
    COLD,
    InputKey,
    InputStages,
    InputTiming,
    Measurements,
    StepKey,
    StepTiming,
)
from tfspeed.tuning.verify import Budget, say, variant

MEASURE_SHARE = 0.55  # of the budget, at most, for measuring
ROUNDS = 3  # interleaved timed calls of each step setting
# An XLA probe's time over the first probe's: the transformer's took 1.0-1.2x (compiling
# one shape) on 2 cores; the estimate was 2x (with the first probe's doubled), which left
# XLA unmeasured at the default budget.
XLA_COST = 1.5


def measure_apart(flag_args: list[str], budget: Budget, tune_dir: str) -> Measurements:
    """``measure`` in a process of its own (``python -m tfspeed.tune --measure_to``).

    Its pipelines, engines and thread pools would otherwise stay in this one and slow the
    verification runs down (measured once on 2 cores, not benchmarked). What the child
    skipped for lack of time is added to ``budget.skipped``.
    """
    import subprocess
    import sys

    path = os.path.join(tune_dir, "measurements.json")
    args = [a for a in flag_args if not a.startswith(("--budget_s", "--measure_to", "--deadline"))]
    share = max(MEASURE_SHARE * budget.left(), 1)  # the rest is for the runs that verify
    say("measuring in a child process (%.0f s of the %.0f s left)", share, budget.left())
    child = subprocess.Popen([sys.executable, "-m", "tfspeed.tune", *args,
                              f"--budget_s={share:.1f}", f"--deadline={time.time() + share:.3f}",
                              f"--measure_to={path}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in child.stdout:  # its progress lines as they come; the rest for an error
        lines.append(line)
        if "] tune: " in line:
            sys.stderr.write(line)
            sys.stderr.flush()
    returncode = child.wait()
    errors = [line.strip() for line in lines if line.startswith("error: ")]
    if returncode == 2 and errors:
        raise UsageError(errors[-1].removeprefix("error: "))
    if returncode:
        raise RuntimeError(f"measuring failed (exit {returncode}):\n{''.join(lines)[-3000:]}")
    with open(path) as f:
        found = json.load(f)
    os.remove(path)
    budget.skipped += found.pop("skipped")
    return Measurements.from_json(found)


def measure_into(path: str, config, budget: Budget, probe_dir: str) -> None:
    """The child's side of ``measure_apart``: ``measure``, then its JSON (with what was
    skipped) into ``path``."""
    m = measure(config, budget, probe_dir)
    with open(path, "w") as f:
        json.dump({**m.to_json(), "skipped": budget.skipped}, f)


def measure(config, budget: Budget, probe_dir: str) -> Measurements:
    """Phase 1: the input's CPU per element, the split's size, the step alone."""
    from tfspeed.data import ingraph, plan
    from tfspeed.data import text as text_lib
    from tfspeed.training import job as job_lib

    host = variant(config, input_placement="host", cache="none", precision="float32",
                   model_dir=probe_dir)
    say("measuring (%.0f s at most): preparing the job", budget.left())
    with job_lib.data_errors(config.data.data_dir):
        job = job_lib.prepare(host)
    try:
        if job.runtime.num_workers > 1:
            raise UsageError("tfspeed.tune tunes one process's job: run it without TF_CONFIG "
                             "(the tuned flags then apply to every worker)")
        data, schema = job.train_data_config, job.schema
        split = data.train_split
        size_mb = schema.split(split).num_records * plan.record_bytes(data, schema, split) / 2**20
        ram_mb, ram_source = plan.ram_budget_mb(data)
        try:
            device_ok = ingraph.choose("device", data, schema, split).where == "device"
        except UsageError:
            device_ok = False
        device_ok = device_ok and size_mb <= ram_mb
        tokens = text_lib.is_text(schema)
        with job_lib.data_errors(config.data.data_dir):
            held = _held_batch(job)  # the step is timed on it, each setting alike
            inputs = (_measure_text_input(job, budget, held) if tokens else
                      _measure_input(job, budget, size_mb <= ram_mb))
        device_ok = device_ok and not tokens  # token batches vary in shape: tf.data only
        steps, device_step = _measure_steps(config, job, budget, size_mb, inputs,
                                            device_ok, held)
    finally:
        job.release()
    step = {key: probe.figures() for key, probe in steps.items()}
    say("measured in %.0f s: the step alone %s", budget.used(), ", ".join(
        f"{k} {1000 * v.step_s:.1f} ms" for k, v in step.items()))
    first = next(iter(steps))
    in_step = device_step.figures() if device_step else None
    return Measurements(
        batch_size=data.batch_size, cores=len(os.sched_getaffinity(0)),
        steps_per_epoch=job.steps_per_epoch, size_mb=size_mb, ram_budget_mb=ram_mb,
        ram_budget_source=ram_source, device_ok=device_ok and in_step is not None,
        image_storage=_storage(schema), input=inputs.timings,
        step=step, stages=inputs.stages, parses=inputs.parses, caches=inputs.caches,
        objectives=steps[first].engine.objectives.report,  # what the timed steps trained
        device_step_ratio=in_step.step_s / step[first].step_s if in_step else 1.0,
        device_step=in_step, setup_s=round(steps[first].build_s, 2), text=inputs.text)


def _storage(schema) -> str:
    feature = schema.input_feature
    return feature.encoding if feature.is_image or feature.encoding == "raw" else ""


# ------------------------------------------------------------------ the input


@dataclasses.dataclass(frozen=True)
class _InputFindings:
    timings: dict[InputKey, InputTiming]
    stages: InputStages
    parses: tuple[str, ...]
    caches: tuple[str, ...]
    text: dict | None = None  # token records: ``Measurements.text``


TOKEN_BUDGETS = (1.0, 0.5, 2.0)  # --tokens_per_batch candidates, times the job's own
TEXT_INPUT_SECONDS = 0.3  # timed per batching, after one batch (a packing window's fill)


def _measure_text_input(job, budget: Budget, held) -> _InputFindings:
    """CPU-seconds per computed token of the token pipeline batched each way the model can
    take (pack only where it takes segment ids; the job's own way first, the others as the
    budget allows), each timed whole: ``pipeline.STAGES``' cuts end in per-sequence
    elements of varying length that batch only as the text branch batches them. With the
    job's resolved figures (``job.batching``): each batching's expected padding and
    predicted work per real token, and the work of ``held``, the batch the step is timed
    on, in the same units."""
    import numpy as np

    from tfspeed import plan as plan_lib
    from tfspeed.data import long_texts, pipeline
    from tfspeed.data import text as text_lib
    from tfspeed.probes import costs
    from tfspeed.training import models

    data, resolved = job.train_data_config, job.batching
    split = data.train_split
    modes = list(plan_lib.batching_modes(models.takes_segments(job.config.model.name)))
    modes.sort(key=lambda mode: mode != resolved.mode)
    mean = resolved.mean_length
    pieces = long_texts.piece_counts(text_lib.length_counts(job.schema, split),
                                     resolved.max_length, resolved.long)
    split_tokens = int(pieces @ np.arange(len(pieces)))  # what one pass computes, unpadded
    per_bucket = text_lib.bucket_size(data, job.schema, resolved.replicas)
    budgets = sorted({t for t in (int(f * resolved.tokens_per_batch) for f in TOKEN_BUDGETS)
                      if resolved.max_length <= t <= split_tokens},
                     key=lambda t: t != resolved.tokens_per_batch)
    figures, cold = {}, None
    for mode in modes:
        if figures and not budget.allows(1 + TEXT_INPUT_SECONDS,
                                         f"the input batched by {mode}"):
            continue
        say("timing the input batched by %s", mode)
        cfg = dataclasses.replace(data, batching=mode, cache="none")
        if not (mode == "bucket" and per_bucket):  # a classifier's buckets: its texts
            cfg = dataclasses.replace(cfg, tokens_per_batch=resolved.tokens_per_batch)
        ds = pipeline.build_from_config(cfg, split, training=True, schema=job.schema)
        cpu_s, wall_s, computed = _time_token_batches(iter(ds), TEXT_INPUT_SECONDS)
        figures[mode] = {"expected_padding": resolved.expected_padding[mode],
                         "input_cpu_per_token": cpu_s / computed}
        if cold is None:  # the job's own, per sequence: the report's fields stay meaningful
            cold = InputTiming(cpu_s=cpu_s / computed * mean, wall_s=wall_s / computed * mean)
    rows, width = (int(n) for n in np.shape(held[0]["segment_ids"]))
    k = resolved.attention_length or float("inf")
    text = {"held_tokens": rows * width, "held_width": width,
            # per-token units of work (1 + w / K per position of a row of w: attention over
            # every position, padding's too), as ``costs`` counts them per real token
            "held_units": rows * width * (1 + width / k),
            "mean_length": mean, "max_length": resolved.max_length,
            "batch_size": data.batch_size, "tokens_per_batch": budgets, "batching": figures,
            "expected_padding": resolved.expected_padding,
            # The work alone: the job's ``costs`` also fold in XLA's gain and compiles where
            # a mode compiles, which the steps timed at each XLA setting measure here.
            "costs": costs.predicted_costs(pieces, resolved.expected_padding,
                                           resolved.max_length, resolved.attention_length),
            "attention_length": resolved.attention_length,
            "job": {"batching": resolved.mode, "tokens_per_batch": resolved.tokens_per_batch},
            "bucket_size": per_bucket}
    return _InputFindings({COLD: cold}, InputStages(cold.cpu_s, 0.0, None), ("batched",),
                          ("none",), text)


def _time_token_batches(iterator, seconds: float) -> tuple[float, float, int]:
    """CPU- and wall-seconds over at least ``seconds`` (and 4 batches) of token batches,
    after one, and the tokens they computed (padding included)."""
    next(iterator)
    cpu, wall, n, computed = time.process_time(), time.perf_counter(), 0, 0
    while n < 4 or time.perf_counter() - wall < seconds:
        x, _ = next(iterator)
        computed += int(x["segment_ids"].shape[0] * x["segment_ids"].shape[1])
        n += 1
    return time.process_time() - cpu, time.perf_counter() - wall, computed


def _measure_input(job, budget: Budget, fits: bool) -> _InputFindings:
    """CPU-seconds per element of the pipeline cold (each parse mode), warm, and by stage."""
    from tfspeed.data import pipeline

    base = dataclasses.replace(job.train_data_config, cache="none", parse="batched",
                               input_threads=0)
    schema, split = job.schema, base.train_split
    records, batch = schema.split(split).num_records, base.batch_size

    def timed(cfg, until=None, warmup=2, seconds=1.0) -> InputTiming:
        ds = pipeline.build_from_config(cfg, split, training=True, schema=schema, until=until)
        if until not in (None, "batch"):
            ds = ds.repeat().batch(batch)
        return _cpu_per_element(iter(ds), batch, warmup, seconds)

    timings = {COLD: timed(base)}
    parses, caches = ["batched"], ["none"]
    if schema.input_feature.is_image and budget.allows(3, "the per-record parse"):
        timings[InputKey("none", "single")] = timed(dataclasses.replace(base, parse="single"))
        parses.append("single")
    read = timed(base, "read", seconds=0.5).cpu_s
    decode = max(timed(base, "decode", seconds=0.5).cpu_s - read, 0.0)
    fill = job.steps_per_epoch + 2  # the first epoch fills the cache
    cached = "memory" if fits else "disk"
    cold_s = timings[COLD].wall_s * records
    if budget.allows(cold_s + 3, f"the {cached} cache (filling it takes an epoch)"):
        timings[InputKey(cached)] = timed(dataclasses.replace(base, cache=cached), warmup=fill)
        caches.append(cached)
    warm = timings.get(InputKey(cached))
    return _InputFindings(timings, InputStages(read, decode, warm.cpu_s if warm else None),
                          tuple(parses), tuple(caches))


def _cpu_per_element(iterator, batch: int, warmup: int, seconds: float = 1.0) -> InputTiming:
    """CPU- and wall-seconds per element over at least ``seconds`` (after ``warmup``)."""
    for _ in range(warmup):
        next(iterator)
    cpu, wall, n = time.process_time(), time.perf_counter(), 0
    while n < 8 or time.perf_counter() - wall < seconds:
        next(iterator)
        n += 1
    elements = n * batch
    return InputTiming(cpu_s=(time.process_time() - cpu) / elements,
                       wall_s=(time.perf_counter() - wall) / elements)


# ------------------------------------------------------------------ the step


def _measure_steps(config, job, budget: Budget, size_mb: float, inputs: _InputFindings,
                   device_ok: bool, held) -> tuple[dict[StepKey, _Probe], _Probe | None]:
    """The step alone at each precision and XLA setting the budget allows, and (where the
    split may be held in the step) the step with it, all timed in interleaved rounds.

    Returns:
      The probes by setting, the first being the hardware's own choice; and the in-step
      probe, or None where it was not measured.
    """
    import tensorflow as tf

    from tfspeed import runtime
    from tfspeed.data import ingraph, job_input

    hw_precision = runtime.resolve(dataclasses.replace(config.runtime, precision="auto"),
                                   runtime.detect_hardware()).precision
    # The hardware's own choice first (always: the model needs one step measured),
    # then the others as time allows, XLA last (compiling costs most).
    precisions = sorted({"float32", hw_precision}, key=lambda p: p != hw_precision)
    gpu = bool(tf.config.list_logical_devices("GPU"))
    xlas = ["on"] if gpu else ["off", "on"]  # on a GPU XLA is the measured default
    held = _repeated(job, held)
    # Where the driver would probe the precision (``auto`` choosing a mixed policy on a CPU,
    # or ``measure``), both policies are timed here even past the deadline: the runs that
    # verify then take the policy these timings choose (``verify.measured_precision``)
    # instead of probing again, which builds and traces two models, one more than here.
    probed = config.runtime.precision in ("auto", "measure") and hw_precision != "float32"
    probes, cost = {}, 0.0
    for xla, precision in itertools.product(xlas, precisions):
        needed = probed and xla == xlas[0]
        if cost and not needed and not budget.allows(cost * (XLA_COST if xla == "on" else 1),
                                                     f"the step at {precision}, xla={xla}"):
            continue
        say("building and tracing the step at %s, xla=%s", precision, xla)
        start = time.perf_counter()
        probe = probes[StepKey(precision, xla)] = _probe(job, held, precision, xla)
        probe.build_s = time.perf_counter() - start
        cost = cost or probe.build_s + ROUNDS * probe.call_s  # then its timed rounds
    first = next(iter(probes))
    in_step = None
    load_s = size_mb / 50 + inputs.timings[COLD].wall_s * job.num_train
    if device_ok and budget.allows(cost + load_s, "the step with the split held in it"):
        # The split held in the step, gathered and augmented there: the same model and
        # precision as the first, timed in the same rounds as the others.
        data = job.train_data_config
        source = ingraph.load(data, job.schema, data.train_split,
                              global_batch_size=data.batch_size, device=job_input.device())
        in_step = _probe(job, source, first.precision, first.xla)
    timed = [*probes.values(), *([in_step] if in_step else [])]
    say("timing %d step settings in turn", len(timed))
    _time_interleaved(timed)
    return probes, in_step


def _held_batch(job):
    """One real batch of the job's training input (as its token batching batches it)."""
    from tfspeed.data import pipeline

    plain = dataclasses.replace(job.train_data_config, shuffle=False, augment=(), cache="none")
    return next(iter(pipeline.build_from_config(plain, plain.train_split, training=True,
                                                schema=job.schema, batching=job.batching)))


def _repeated(job, held):
    """``held`` repeated, distributed: the step alone, with no input work."""
    import tensorflow as tf

    # Nothing to tune in a batch repeated, and an autotuned iterator that lived through the
    # probes took 6-40 s to delete (its destructor waits for tf.data's model thread, asleep
    # in Model::OptimizeLoop for a period that doubles while the iterator lives).
    options = tf.data.Options()
    options.autotune.enabled = False
    return iter(job.runtime.distribute(
        tf.data.Dataset.from_tensors(held).repeat().with_options(options)))


@dataclasses.dataclass
class _Probe:
    """One precision/XLA setting's engine, ready to time: calls of ``n`` steps (~50 ms)."""

    engine: object
    source: object
    n: int
    overhead: float
    walls: list
    cpus: list
    call_s: float = 0.0  # a timed call's seconds, as sized
    build_s: float = 0.0  # building, tracing and sizing it

    def call(self) -> None:
        cpu, start = time.process_time(), time.perf_counter()
        np.asarray(self.engine.train(self.source, self.n)["loss"])
        self.walls.append(time.perf_counter() - start)
        self.cpus.append(time.process_time() - cpu)

    def figures(self) -> StepTiming:
        """The fastest call: on a shared machine noise only ever adds time."""
        fastest = min(range(len(self.walls)), key=self.walls.__getitem__)
        return StepTiming(overhead_s=self.overhead,
                          step_s=max(self.walls[fastest] - self.overhead, 1e-7) / self.n,
                          cpu_per_step_s=self.cpus[fastest] / self.n, steps_timed=self.n)


def _probe(job, source, precision: str, xla: str) -> _Probe:
    """Builds the model and engine at ``precision``/``xla``, traces it, and measures a call's
    fixed overhead (calls of 0 steps)."""
    from tfspeed.training import job as job_lib

    engine, _ = job_lib.engine_at(job.config, job.runtime, job.schema, job.input_shape,
                                  job.preprocess, precision, xla=xla == "on")
    np.asarray(engine.train(source, 1)["loss"])  # traces
    start = time.perf_counter()
    np.asarray(engine.train(source, 1)["loss"])
    one = time.perf_counter() - start
    empty = []
    for _ in range(5):
        start = time.perf_counter()
        engine.train(source, 0)
        empty.append(time.perf_counter() - start)
    overhead = statistics.median(empty)
    n = int(min(max(round(0.05 / max(one - overhead, 1e-6)), 1), 512))
    return _Probe(engine, source, n, overhead, [], [], overhead + n * max(one - overhead, 0.0))


def _time_interleaved(probes, rounds: int = ROUNDS) -> None:
    """Each probe's calls, taking turns: the machine's noise spreads over all of them, and
    the first measured is not the one a busy moment hits."""
    probes = list(probes)
    for _ in range(rounds):
        for probe in probes:
            probe.call()
