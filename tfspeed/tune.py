"""``python -m tfspeed.tune --flagfile=X.flags [--budget_s=90]``: the input-and-step settings
of a training job, chosen by measurement and proven by short real runs.

``tf.data.AUTOTUNE`` sizes parallelism and buffers; it does not decide whether or where to
cache, whether the split should sit in the step, how many steps a call runs or at which
precision. This does, in three phases (the README's "Let tfspeed choose" explains the model):

1. **Measure**, in CPU time per element rather than wall time, since on a CPU host the input
   stages and the step share the cores: the pipeline cold (decoding every epoch, with each
   parse mode) and warm (from the memory cache), its read and decode stages alone, the
   decoded size of the split; and the step alone on a held batch, for every precision and
   XLA setting: a call's fixed overhead, a step's wall time and the CPU it keeps busy.
2. **Predict** every candidate's steady-state examples/s (``predict``): per batch the step
   takes ``w = s + c / N`` of wall time and ``u`` CPU-seconds, the input ``i`` CPU-seconds
   (0 in the step), so ``T = max(w, i / threads, (u + i) / cores)``.
3. **Verify** the best few, and the user's own flags, with short runs of the real driver;
   the fastest measured wins. ``tuned.flags`` nests the original flagfile and adds only the
   flags that changed, each with the measured reason; ``tune.json`` holds every candidate.

Image storage is the one knob it never turns itself: where reconverting would pay, it
prints the command with the predicted gain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import json
import os
import statistics
import time

from absl import app, flags, logging

from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.util.cli import main_entry

_BUDGET_S = flags.DEFINE_float("budget_s", 90.0, "Seconds the whole tune may take.")
_TUNE_DIR = flags.DEFINE_string("tune_dir", "", "Where tuned.flags, tune.json and tune.png "
                                "go; default MODEL_DIR/tune.")
_VERIFY = flags.DEFINE_integer("verify", 3, "Best predicted candidates to verify by real runs.")
_MEASURE_TO = flags.DEFINE_string("measure_to", "", "Internal: only measure, into this JSON.")
_DEADLINE = flags.DEFINE_float("deadline", 0.0, "Internal: with --measure_to, the Unix time "
                               "by which measuring ends (TF's start in the child counts).")

VERIFY_SECONDS = 3.0  # of timed steady-state steps per verification run
MIN_BUDGET_S = 20.0  # TF's start in two processes, the first measurements, one short run
MEASURE_SHARE = 0.55  # of the budget, at most, for measuring
FINISH_S = 2.0  # kept back for writing tuned.flags, tune.json and the chart
NOISE = 0.03  # runs closer than this to the fastest count as equally fast


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of every knob."""

    input_placement: str  # host, device
    cache: str  # none, memory, disk (host only)
    parse: str  # batched, single
    input_threads: int  # 0: one per core
    precision: str
    xla: str  # on, off
    steps_per_execution: int

    def flags(self) -> dict[str, str]:
        return {k: str(v) for k, v in dataclasses.asdict(self).items()}

    def label(self) -> str:
        where = ("in-step" if self.input_placement == "device" else
                 f"tf.data cache={self.cache}" + (f" parse={self.parse}" if self.cache == "none"
                                                  else "") +
                 (f" threads={self.input_threads}" if self.input_threads else ""))
        return f"{where}, {self.precision}, xla={self.xla}, spe={self.steps_per_execution}"


class Budget:
    """The deadline, and what was left out for lack of time.

    Estimates of a run's seconds are scaled by how much longer the runs so far took than
    estimated (``observe``): a slow model or a busy machine shortens the plan, not the
    deadline.
    """

    def __init__(self, seconds: float, reserve: float = 0.0, already: float = 0.0):
        self.start = time.perf_counter() - already  # ``already`` spent before this
        self.seconds = seconds
        self.reserve = reserve
        self.slowdown = 1.0
        self.skipped: list[str] = []

    def used(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.used()

    def observe(self, expected: float, took: float) -> None:
        self.slowdown = max(self.slowdown, took / max(expected, 1e-3))

    def allows(self, seconds: float, what: str) -> bool:
        seconds *= self.slowdown
        if self.left() - self.reserve >= seconds:
            return True
        self.skipped.append(f"{what} (~{seconds:.0f} s; {max(self.left(), 0):.0f} s left)")
        return False


# ------------------------------------------------------------------ the model (pure)


def predict(c: Candidate, m: dict) -> dict:
    """Steady-state examples/s of ``c`` from the measurements ``m`` (see the module doc).

    Returns the prediction with its parts: wall ``w`` and CPU ``u`` of the step per batch,
    the input's CPU ``i`` per batch, and which term bounds the time ``T``.
    """
    batch, cores = m["batch_size"], m["cores"]
    step = m["step"][f"{c.precision}/{c.xla}"]
    scale = m["device_step_ratio"] if c.input_placement == "device" else 1.0
    w = scale * (step["step_s"] + step["overhead_s"] / c.steps_per_execution)
    u = scale * step["cpu_per_step_s"]
    if c.input_placement == "device":
        i = 0.0
    else:
        per_element = (m["input"][f"cold/{c.parse}"] if c.cache == "none"
                       else m["input"][c.cache])
        i = batch * per_element["cpu_s"]
    threads = min(c.input_threads or cores, cores)
    terms = {"step": w, "input": i / threads, "cores": (u + i) / cores}
    bound = max(terms, key=terms.get)
    return {"examples_per_sec": batch / terms[bound], "bound": bound,
            "step_ms": 1000 * w, "step_cpu_ms": 1000 * u, "input_cpu_ms": 1000 * i}


def candidates(m: dict) -> list[Candidate]:
    """Every combination of the knobs the measurements cover (infeasible ones left out)."""
    out = []
    steps = {key: spe_choices(value, m["steps_per_epoch"]) for key, value in m["step"].items()}
    threads = sorted({0, *([m["cores"] - 1] if m["cores"] > 1 else [])})
    inputs = [("device", "none", "batched", 0)] if m["device_ok"] else []
    for cache in m["caches"]:
        parses = m["parses"] if cache == "none" else ["batched"]
        inputs += [("host", cache, p, t) for p in parses for t in threads]
    for (where, cache, parse, t), key in itertools.product(inputs, m["step"]):
        precision, xla = key.split("/")
        for n in steps[key]:
            out.append(Candidate(where, cache, parse, t, precision, xla, n))
    return out


def rank(m: dict) -> list[dict]:
    """Every candidate with its prediction, fastest first. Where predictions tie (the step or
    the cores bound both), fewer tf.data threads come first: threads the input does not need
    only wake up and preempt a step that keeps every core busy. The benchmark's grids measured
    one thread 1.02-1.3x faster than all cores with a cached input on each of its three
    workloads."""
    def key(r):
        c = r["candidate"]
        return -r["examples_per_sec"], min(c.input_threads or m["cores"], m["cores"])

    return sorted(({"candidate": c, **predict(c, m)} for c in candidates(m)), key=key)


def spe_choices(step: dict, per_epoch: int) -> list[int]:
    """1, and the cost model's N (``autotune.steps_per_execution``) when it is more."""
    from tfspeed.tuning import autotune

    n = autotune.steps_per_execution(
        autotune.CallCost(step["overhead_s"], max(step["step_s"], 1e-9)), max(per_epoch, 1))
    return sorted({1, n})


# ------------------------------------------------------------------ measuring


def measure(config, budget: Budget, probe_dir: str) -> dict:
    """Phase 1: the input's CPU per element, the split's size, the step alone."""
    import tensorflow as tf

    from tfspeed import runtime, train
    from tfspeed.data import ingraph, job_input, plan

    host = _variant(config, input_placement="host", cache="none", precision="float32",
                    model_dir=probe_dir)
    with train.data_errors(config.data.data_dir):
        job = train.prepare(host)
    try:
        if job.runtime.num_workers > 1:
            raise UsageError("tfspeed.tune tunes one process's job: run it without TF_CONFIG "
                             "(the tuned flags then apply to every worker)")
        data, schema = job.train_data_config, job.schema
        split = data.train_split
        cores = len(os.sched_getaffinity(0))
        size_mb = schema.split(split).num_records * plan.record_bytes(data, schema, split) / 2**20
        budget_mb, budget_source = plan.ram_budget_mb(data)
        try:
            device_ok = ingraph.choose("device", data, schema, split).where == "device"
        except UsageError:
            device_ok = False
        device_ok = device_ok and size_mb <= budget_mb
        m = {"batch_size": data.batch_size, "cores": cores, "steps_per_epoch":
             job.steps_per_epoch, "size_mb": size_mb, "ram_budget_mb": budget_mb,
             "ram_budget_source": budget_source, "device_ok": device_ok,
             "image_storage": _storage(schema), "input": {}, "step": {}, "stages": {}}
        with train.data_errors(config.data.data_dir):
            _measure_input(m, job, budget, size_mb <= budget_mb)
        hw_precision = runtime.resolve(dataclasses.replace(config.runtime, precision="auto"),
                                       runtime.detect_hardware()).precision
        # The hardware's own choice first (always: the model needs one step measured),
        # then the others as time allows, XLA last (compiling costs most).
        precisions = sorted({"float32", hw_precision}, key=lambda p: p != hw_precision)
        gpu = bool(tf.config.list_logical_devices("GPU"))
        xlas = ["on"] if gpu else ["off", "on"]  # on a GPU XLA is the measured default
        held = _held_batches(job)
        probes, cost = {}, 0.0
        for xla, precision in itertools.product(xlas, precisions):
            if cost and not budget.allows(cost * (2 if xla == "on" else 1),
                                          f"the step at {precision}, xla={xla}"):
                continue
            start = time.perf_counter()
            probes[f"{precision}/{xla}"] = _probe(job, held, precision, xla)
            cost = cost or 2 * (time.perf_counter() - start)  # building, then timing
        first = next(iter(probes))
        load_s = size_mb / 50 + m["input"]["cold/batched"]["wall_s"] * job.num_train
        if device_ok and budget.allows(cost / 2 + load_s, "the step with the split held in it"):
            # The split held in the step, gathered and augmented there: the same model and
            # precision as the first, timed in the same rounds as the others.
            in_step = ingraph.load(data, schema, split, global_batch_size=data.batch_size,
                                   device=job_input.device())
            probes["device"] = _probe(job, in_step, *first.split("/"))
        elif device_ok:
            m["device_ok"] = False
        _time_interleaved(probes.values())
    finally:
        job.release()
    m["step"] = {key: probe.figures() for key, probe in probes.items() if key != "device"}
    m["objectives"] = probes[first].engine.objectives.report  # what the timed steps trained
    m["device_step_ratio"] = 1.0
    if "device" in probes:
        m["device_step"] = probes["device"].figures()
        m["device_step_ratio"] = m["device_step"]["step_s"] / m["step"][first]["step_s"]
    return m


def measure_apart(flag_args: list[str], budget: Budget, tune_dir: str) -> dict:
    """``measure`` in a process of its own. Its pipelines, engines and thread pools would
    otherwise stay in this one and slow the verification runs down (measured: the digits
    job at 9.9k examples/s here after measuring, 13.9k in a fresh process)."""
    import subprocess
    import sys

    path = os.path.join(tune_dir, "measurements.json")
    args = [a for a in flag_args if not a.startswith(("--budget_s", "--measure_to", "--deadline"))]
    share = max(MEASURE_SHARE * budget.left(), 1)  # the rest is for the runs that verify
    done = subprocess.run([sys.executable, "-m", "tfspeed.tune", *args,
                           f"--budget_s={share:.1f}", f"--deadline={time.time() + share:.3f}",
                           f"--measure_to={path}"],
                          capture_output=True, text=True)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    if done.returncode == 2 and errors:
        raise UsageError(errors[-1].removeprefix("error: "))
    if done.returncode:
        raise RuntimeError(f"measuring failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    with open(path) as f:
        m = json.load(f)
    os.remove(path)
    budget.skipped += m.pop("skipped")
    return m


def _variant(config, model_dir: str | None = None, **knobs):
    """``config`` with the named data, runtime and train knobs replaced."""
    data = {k: v for k, v in knobs.items() if k in ("input_placement", "cache", "parse",
                                                     "input_threads")}
    rt = {k: v for k, v in knobs.items() if k in ("precision", "xla")}
    tr = {k: v for k, v in knobs.items() if k in ("steps_per_execution", "train_steps",
                                                   "log_every", "checkpoint_every", "epochs")}
    out = dataclasses.replace(
        config, data=dataclasses.replace(config.data, **data),
        runtime=dataclasses.replace(config.runtime, **rt),
        train=dataclasses.replace(config.train, **tr))
    if model_dir:
        out = dataclasses.replace(out, model_dir=model_dir)
    return out.validate()


def _storage(schema) -> str:
    feature = schema.input_feature
    return feature.encoding if feature.is_image or feature.encoding == "raw" else ""


def _measure_input(m: dict, job, budget: Budget, fits: bool) -> None:
    """CPU-seconds per element of the pipeline cold (each parse mode), warm, and by stage."""
    from tfspeed.data import pipeline

    base = dataclasses.replace(job.train_data_config, cache="none", parse="batched",
                               input_threads=0)
    schema, split = job.schema, base.train_split
    records, batch = schema.split(split).num_records, base.batch_size

    def timed(cfg, until=None, warmup=2, seconds=1.0):
        ds = pipeline.build_from_config(cfg, split, training=True, schema=schema, until=until)
        if until not in (None, "batch"):
            ds = ds.repeat().batch(batch)
        return _cpu_per_element(iter(ds), batch, warmup, seconds)

    m["input"]["cold/batched"] = timed(base)
    cold_s = m["input"]["cold/batched"]["wall_s"] * records
    m["parses"] = ["batched"]
    if schema.input_feature.is_image and budget.allows(3, "the per-record parse"):
        m["input"]["cold/single"] = timed(dataclasses.replace(base, parse="single"))
        m["parses"].append("single")
    m["stages"]["read"] = timed(base, "read", seconds=0.5)["cpu_s"]
    m["stages"]["decode"] = max(timed(base, "decode", seconds=0.5)["cpu_s"]
                                - m["stages"]["read"], 0.0)
    m["caches"] = ["none"]
    fill = job.steps_per_epoch + 2  # the first epoch fills the cache
    cached = "memory" if fits else "disk"
    if budget.allows(cold_s + 3, f"the {cached} cache (filling it takes an epoch)"):
        m["input"][cached] = timed(dataclasses.replace(base, cache=cached), warmup=fill)
        m["caches"].append(cached)
    m["stages"]["after_cache"] = m["input"].get(cached, {}).get("cpu_s")


def _cpu_per_element(iterator, batch: int, warmup: int, seconds: float = 1.0) -> dict:
    """CPU- and wall-seconds per element over at least ``seconds`` (after ``warmup``)."""
    for _ in range(warmup):
        next(iterator)
    cpu, wall, n = time.process_time(), time.perf_counter(), 0
    while n < 8 or time.perf_counter() - wall < seconds:
        next(iterator)
        n += 1
    elements = n * batch
    return {"cpu_s": (time.process_time() - cpu) / elements,
            "wall_s": (time.perf_counter() - wall) / elements}


def _held_batches(job):
    """One real batch, repeated: the step alone, with no input work."""
    import tensorflow as tf

    from tfspeed.data import pipeline

    plain = dataclasses.replace(job.train_data_config, shuffle=False, augment=(), cache="none")
    held = next(iter(pipeline.build_from_config(plain, plain.train_split, training=True,
                                                schema=job.schema)))
    return iter(job.runtime.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(held).repeat()))


@dataclasses.dataclass
class _Probe:
    """One precision/XLA setting's engine, ready to time: calls of ``n`` steps (~50 ms)."""

    engine: object
    source: object
    n: int
    overhead: float
    walls: list
    cpus: list

    def call(self) -> None:
        cpu, start = time.process_time(), time.perf_counter()
        self.engine.train(self.source, self.n)["loss"].numpy()
        self.walls.append(time.perf_counter() - start)
        self.cpus.append(time.process_time() - cpu)

    def figures(self) -> dict:
        """The fastest call: on a shared machine noise only ever adds time."""
        fastest = min(range(len(self.walls)), key=self.walls.__getitem__)
        return {"overhead_s": self.overhead,
                "step_s": max(self.walls[fastest] - self.overhead, 1e-7) / self.n,
                "cpu_per_step_s": self.cpus[fastest] / self.n, "steps_timed": self.n}


def _probe(job, source, precision: str, xla: str) -> _Probe:
    """Builds the model and engine at ``precision``/``xla``, traces it, and measures a call's
    fixed overhead (calls of 0 steps)."""
    from tfspeed import train

    engine, _ = train.engine_at(job.config, job.runtime, job.schema, job.input_shape,
                                job.preprocess, precision, xla=xla == "on")
    engine.train(source, 1)["loss"].numpy()  # traces
    start = time.perf_counter()
    engine.train(source, 1)["loss"].numpy()
    one = time.perf_counter() - start
    empty = []
    for _ in range(5):
        start = time.perf_counter()
        engine.train(source, 0)
        empty.append(time.perf_counter() - start)
    overhead = statistics.median(empty)
    n = int(min(max(round(0.05 / max(one - overhead, 1e-6)), 1), 512))
    return _Probe(engine, source, n, overhead, [], [])


def _time_interleaved(probes, rounds: int = 3) -> None:
    """Each probe's calls, taking turns: the machine's noise spreads over all of them, and
    the first measured is not the one a busy moment hits."""
    probes = list(probes)
    for _ in range(rounds):
        for probe in probes:
            probe.call()


# ------------------------------------------------------------------ verifying


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How long one verification run is: micro-steps, and the seconds expected."""

    micro_steps: int
    log_every: int
    seconds: float


SETUP_S = 4.0  # a run's own setup: the model, the pipeline, tracing


def plan_run(config, c: Candidate | None, m: dict, rate: float, cold_rate: float) -> RunPlan:
    """A run long enough for ~``VERIFY_SECONDS`` of steady state at ``rate`` examples/s,
    after one epoch at ``cold_rate`` where a cache must fill first."""
    batch = config.data.batch_size
    spe = c.steps_per_execution if c else config.train.steps_per_execution
    n = max(spe, 1)
    timed = max(int(VERIFY_SECONDS * rate / batch), 8 * n, 24)
    timed = -(-timed // n) * n
    fills = (c.input_placement == "host" and c.cache != "none") if c else (
        config.data.input_placement != "device" and config.data.cache != "none")
    log_every = max(n, timed // 8 // n * n)  # ~8 windows for the median
    fill = m["steps_per_epoch"] if fills else 2 * log_every  # else two windows to settle
    return RunPlan(micro_steps=fill + timed, log_every=log_every,
                   seconds=SETUP_S + fill * batch / cold_rate + timed * batch / rate)


def verify(config, c: Candidate | None, run_dir: str, plan: RunPlan) -> dict:
    """A short real run of the driver with ``c`` (None: the user's flags as they are);
    steady-state examples/s from its meter: the median window, after a cache has filled."""
    import gc
    import shutil

    import keras

    from tfspeed import train

    shutil.rmtree(run_dir, ignore_errors=True)  # a run left there would be resumed, not timed
    knobs = knob_values(c) if c else {}
    accum = config.train.grad_accum_steps
    variant = _variant(config, model_dir=run_dir, **knobs,
                       train_steps=-(-plan.micro_steps // accum), epochs=1, checkpoint_every=0,
                       log_every=plan.log_every)
    variant = dataclasses.replace(
        variant, data=dataclasses.replace(variant.data, eval_split=""),
        train=dataclasses.replace(variant.train, profile_steps=())).validate()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        report = train.run(variant)
    seconds = time.perf_counter() - start
    # A run leaves its model, compiled steps and pipelines behind in Keras' global state and
    # in reference cycles: twelve runs of one digits job in one process slowed from 19k to
    # 15.5k examples/s without this, and held 17-19k with it.
    keras.backend.clear_session()
    gc.collect()
    return {"examples_per_sec": report["examples_per_sec"],
            "seconds": round(seconds, 2), "micro_steps": plan.micro_steps,
            "expected_seconds": round(plan.seconds, 1),
            "input_wait_pct": report.get("input_wait_pct"), "resolved": _resolved(report),
            "objectives": report.get("objectives")}


def knob_values(c: Candidate) -> dict:
    return dataclasses.asdict(c)


def _resolved(report: dict) -> dict:
    """What the driver settled on in a run (its ``auto`` choices resolved)."""
    split = report["config"]["data"]["train_split"]
    where = report["input"]["placement"]["where"]
    return {"input_placement": where,
            "cache": report["input"]["cache"].get(split, {}).get("mode", "none"),
            "parse": report["config"]["data"]["parse"].replace("auto", "batched"),
            "input_threads": report["config"]["data"].get("input_threads", 0),
            "precision": report["runtime"]["precision"],
            "xla": "on" if report["runtime"]["xla"] else "off",
            "steps_per_execution": report["steps_per_execution"].get("value", 1)}


def as_candidate(resolved: dict) -> Candidate | None:
    """The candidate a run's resolved settings amount to (None if it is none of them)."""
    try:
        return Candidate(**{f.name: resolved[f.name] for f in dataclasses.fields(Candidate)})
    except (KeyError, TypeError):
        return None


# ------------------------------------------------------------------ the whole tune


def run(config, flag_args: list[str], budget_s: float, tune_dir: str, verify_n: int,
        budget: Budget | None = None) -> dict:
    """Measures (in a child process given ``flag_args``), predicts, verifies; writes
    tuned.flags, tune.json and tune.png into ``tune_dir``. ``budget`` may have started
    earlier (the command's own start counts)."""
    import shutil

    budget = budget or Budget(budget_s, reserve=FINISH_S)
    os.makedirs(tune_dir, exist_ok=True)
    work = os.path.join(tune_dir, "work")
    shutil.rmtree(work, ignore_errors=True)
    m = measure_apart(flag_args, budget, tune_dir)
    ranked = rank(m)
    slowest = min(r["examples_per_sec"] for r in ranked)
    runs = 0

    def check(entry, name) -> bool:
        nonlocal runs
        c = entry["candidate"]
        rate = entry.get("examples_per_sec") or slowest  # yours: assume the slowest
        cold = (predict(dataclasses.replace(c, input_placement="host", cache="none"), m)
                ["examples_per_sec"] if c else slowest)
        plan = plan_run(config, c, m, rate, min(cold, rate))
        if not budget.allows(plan.seconds, f"verifying {name}"):
            return False
        runs += 1
        entry["measured"] = verify(config, c, os.path.join(work, f"run{runs}"), plan)
        budget.observe(plan.seconds, entry["measured"]["seconds"])
        return True

    user = {"candidate": None}
    if check(user, "your flags"):
        mine = as_candidate(user["measured"]["resolved"])
        user["predicted"] = predict(mine, m)["examples_per_sec"] if mine and (
            f"{mine.precision}/{mine.xla}" in m["step"]) else None
    for entry in _to_verify(ranked, verify_n):
        check(entry, entry["candidate"].label())
    verified = [r for r in ranked if "measured" in r]
    if not verified:
        raise UsageError(f"--budget_s={budget_s:g} left no time to verify a candidate "
                         f"(measuring took {budget.used():.0f} s); raise it")
    # A second round, fastest first, the user's flags too, as time allows: on a shared
    # machine one run can be unlucky (and a process's first runs are slower); each keeps
    # its best.
    again = sorted(verified, key=lambda r: -r["measured"]["examples_per_sec"])
    for entry in [*again[:1], user, *again[1:]] if "measured" in user else again:
        first = entry["measured"]
        if check(entry, "a second round of " + (entry["candidate"].label() if entry["candidate"]
                                                 else "your flags")):
            entry["measured"]["rounds"] = sorted([first["examples_per_sec"],
                                                  entry["measured"]["examples_per_sec"]])
            if first["examples_per_sec"] > entry["measured"]["examples_per_sec"]:
                entry["measured"] = {**first, "rounds": entry["measured"]["rounds"]}
    best = max(r["measured"]["examples_per_sec"] for r in verified)
    resolved = user.get("measured", {}).get("resolved", {})
    # Within the noise of the best, the candidate that changes the fewest flags.
    close = [r for r in verified if r["measured"]["examples_per_sec"] >= (1 - NOISE) * best]
    chosen = min(close, key=lambda r: (_changes(r["candidate"], resolved),
                                       -r["measured"]["examples_per_sec"]))
    # Yours stay when they are as fast, or when they already resolve to the chosen settings
    # (two runs of one configuration differ only by noise).
    keep_user = "measured" in user and (
        user["measured"]["examples_per_sec"] >= (1 - NOISE) * best
        or not _changes(chosen["candidate"], resolved))
    if keep_user:
        user["measured"]["examples_per_sec"] = max(user["measured"]["examples_per_sec"],
                                                   chosen["measured"]["examples_per_sec"]
                                                   if not _changes(chosen["candidate"],
                                                                   resolved) else 0)
    result = _result(m, ranked, chosen, user, budget, keep_user)
    result["reconvert"] = recommend_storage(config, m, chosen)
    result["tuned_flags"] = write_flags(os.path.join(tune_dir, "tuned.flags"), flag_args,
                                        config, None if keep_user else chosen, user, m)
    shutil.rmtree(work, ignore_errors=True)
    with open(os.path.join(tune_dir, "tune.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    result["chart"] = _chart(result, os.path.join(tune_dir, "tune.png"))
    for line in report_lines(result):
        print(line)
    return result


def _to_verify(ranked: list[dict], n: int) -> list[dict]:
    """The ``n`` candidates to run: the best predicted of each input setup (placement and
    cache: where predictions tie, which one wins is what the runs are for), best first."""
    groups, firsts = set(), []
    for r in ranked:
        c = r["candidate"]
        key = (c.input_placement, c.cache)
        if key not in groups:
            groups.add(key)
            firsts.append(r)
    rest = [r for r in ranked if r not in firsts]
    seen, out = set(), []
    for r in firsts + rest:  # then the next best, one per distinct input setup
        c = r["candidate"]
        key = (c.input_placement, c.cache, c.parse, c.input_threads)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out[:n]


def _changes(c: Candidate, resolved: dict) -> int:
    return sum(str(v) != str(resolved.get(k)) for k, v in dataclasses.asdict(c).items())


def _result(m, ranked, chosen, user, budget, keep_user: bool) -> dict:
    def row(r):
        return {"flags": r["candidate"].flags(), "label": r["candidate"].label(),
                "predicted": round(r["examples_per_sec"], 1), "bound": r["bound"],
                "step_ms": round(r["step_ms"], 3), "input_cpu_ms": round(r["input_cpu_ms"], 3),
                **({"measured": r["measured"]} if "measured" in r else {})}

    best = user if keep_user else chosen
    measured = best["measured"]["examples_per_sec"]
    predicted = best.get("predicted") if keep_user else chosen["examples_per_sec"]
    return {
        "measurements": m,
        "candidates": [row(r) for r in ranked],
        "chosen": {"label": "your flags", **user} if keep_user else row(chosen),
        "kept_your_flags": keep_user,
        "examples_per_sec": measured,
        "predicted": predicted,
        "prediction_error": abs(predicted - measured) / measured if predicted else None,
        "user": user.get("measured"),
        "user_predicted": user.get("predicted"),
        "vs_user": measured / user["measured"]["examples_per_sec"] if "measured" in user
        else None,
        "skipped": budget.skipped,
        "seconds": round(budget.used(), 1),
        "budget_s": budget.seconds,
    }


def recommend_storage(config, m: dict, chosen: dict) -> dict | None:
    """Raw storage at the training size, where images are decoded every epoch: the command
    and its predicted gain (never run here)."""
    from tfspeed.data import schema as schema_lib

    if m["image_storage"] not in ("jpeg", "png") or not config.data.image_size:
        return None
    schema = schema_lib.read(config.data.data_dir)
    cold = m["input"]["cold/batched"]["cpu_s"]
    raw = max(cold - m["stages"]["decode"], 0.0)  # decoding gone; reading 150 KB is ~free
    c = dataclasses.replace(chosen["candidate"], input_placement="host", cache="none",
                            parse="batched")
    now = predict(c, m)["examples_per_sec"]
    after = predict(c, {**m, "input": {**m["input"], "cold/batched": {"cpu_s": raw}}})
    size = config.data.image_size
    return {
        "command": f"python scripts/to_tfrecord.py --source={schema.source} "
                   f"--output={config.data.data_dir.rstrip('/')}-{size}px "
                   f"--image_size={size} --image_format=raw",
        "predicted_gain_uncached": after["examples_per_sec"] / now,
        "when": "every epoch without a cache; with one, only the first epoch",
    }


def write_flags(path: str, flag_args: list[str], config, chosen: dict | None, user: dict,
                m: dict) -> dict:
    """``tuned.flags``: the original flags, then each changed flag with its reason."""
    resolved = (user.get("measured") or {}).get("resolved", {})
    changed = {}
    if chosen is not None:
        c = chosen["candidate"]
        given = {"input_placement": config.data.input_placement, "cache": config.data.cache,
                 "parse": config.data.parse, "input_threads": config.data.input_threads,
                 "precision": config.runtime.precision, "xla": config.runtime.xla,
                 "steps_per_execution": config.train.steps_per_execution or "auto"}
        for name, value in dataclasses.asdict(c).items():
            if c.input_placement == "device" and name in ("cache", "parse", "input_threads"):
                continue  # the split is read once, into the step
            if name == "parse" and c.cache != "none":
                continue  # parsing happens once, before the cache
            now = resolved.get(name, given[name]) if given[name] in ("auto", 0) else given[name]
            if str(now) != str(value):
                changed[name] = value
    measured = (chosen or user)["measured"]["examples_per_sec"]
    head = f"# python -m tfspeed.tune: {measured:,.0f} examples/s measured with these flags"
    if chosen is None:
        head += "; no candidate beat the original flags, nothing changed"
    elif "measured" in user:
        head += (f", {measured / user['measured']['examples_per_sec']:.2f}x the original's "
                 f"{user['measured']['examples_per_sec']:,.0f} (predicted "
                 f"{chosen['examples_per_sec']:,.0f})")
    lines = [head, *(_absolute(a) for a in flag_args if a.startswith("--") and not
                     a.startswith(("--budget_s", "--tune_dir", "--verify", "--measure_to")))]
    # A nested flagfile's own relative paths resolve from where the tune ran: pin them, so
    # the tuned flags train the same job from any directory.
    given = {a[2:].partition("=")[0] for a in flag_args}
    pinned = [f"--{name}={value}" for name, value in _resolved_paths(config)
              if name not in given]
    if pinned:
        lines += [f"# paths resolved from {os.getcwd()}, so these flags work from anywhere",
                  *pinned]
    for name, value in changed.items():
        lines.append(f"# {reason(name, str(value), chosen['candidate'], m)}")
        lines.append(f"--{name}={value}")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)
    return {"path": path, "changed": changed}


_PATH_FLAGS = ("flagfile", "data_dir", "model_dir")


def _absolute(arg: str) -> str:
    """``--flag=path`` with the path made absolute, for the flags that name paths."""
    name, _, value = arg[2:].partition("=")
    if name in _PATH_FLAGS and value:
        return f"--{name}={os.path.abspath(value)}"
    if name == "prepare_source" and value:
        return f"--{name}={_absolute_source(value)}"
    return arg


def _absolute_source(spec: str) -> str:
    """``KIND:PATH`` with PATH absolute (``digits``, ``tfds:NAME`` as they are)."""
    kind, sep, path = spec.partition(":")
    return f"{kind}:{os.path.abspath(path)}" if sep and kind != "tfds" else spec


def _resolved_paths(config) -> list[tuple[str, str]]:
    """The job's paths, absolute: what its flags (nested flagfiles too) resolved to here."""
    paths = [("data_dir", os.path.abspath(config.data.data_dir)),
             ("model_dir", os.path.abspath(config.model_dir))]
    if config.data.prepare_source:
        paths.append(("prepare_source", _absolute_source(config.data.prepare_source)))
    return paths


def reason(name: str, value: str, c: Candidate, m: dict) -> str:
    """One line of measured figures behind one changed flag."""
    step = m["step"]
    cold = m["input"]["cold/batched"]["cpu_s"] * m["batch_size"] * 1000
    if name == "input_placement" and value == "device":
        return (f"the decoded split ({m['size_mb']:,.1f} MB) fits the {m['ram_budget_mb']:,.0f}"
                f" MB budget; held in the step it needs no input work, through tf.data it "
                f"costs {cold:.2f} CPU-ms per batch decoded")
    if name == "input_placement":
        return "tf.data measured faster than holding the split in the step"
    if name == "cache" and value == "none":
        return (f"decoding costs {cold:.2f} CPU-ms per batch: a cache measured no faster "
                "(its fill and per-element bookkeeping cost as much)")
    if name == "cache":
        warm = m["input"].get(value, {}).get("cpu_s", 0) * m["batch_size"] * 1000
        return (f"input costs {cold:.2f} CPU-ms per batch decoded, {warm:.2f} from the "
                f"{value} cache; the split takes {m['size_mb']:,.1f} MB of "
                f"{m['ram_budget_mb']:,.0f}")
    if name == "parse":
        single = m["input"]["cold/single"]["cpu_s"] * m["batch_size"] * 1000
        return f"parsing costs {cold:.2f} CPU-ms per batch batched, {single:.2f} one by one"
    if name == "input_threads":
        return (f"input capped at {value} of {m['cores']} cores measured faster: the step "
                "keeps the rest")
    key = f"{c.precision}/{c.xla}"
    figures = ", ".join(f"{k}: {1000 * v['step_s']:.2f} ms" for k, v in step.items())
    if name in ("precision", "xla"):
        return f"the step alone per precision/xla: {figures}"
    s = step[key]
    return (f"a call costs {1000 * s['overhead_s']:.2f} ms besides its steps of "
            f"{1000 * s['step_s']:.3f} ms: {value} steps per call keep that under 2%")


def report_lines(result: dict) -> list[str]:
    m = result["measurements"]
    lines = [f"tfspeed tune ({result['seconds']:.0f} s of a {result['budget_s']:.0f} s "
             f"budget, {m['cores']} cores, batch {m['batch_size']})",
             f"  input: {1e6 * m['input']['cold/batched']['cpu_s']:.1f} CPU-µs per example "
             "decoded" + "".join(f", {1e6 * m['input'][k]['cpu_s']:.1f} from the {k} cache"
                                  for k in ("memory", "disk") if k in m["input"]) +
             f"; split {m['size_mb']:,.1f} MB decoded",
             "  step alone: " + ", ".join(f"{k} {1000 * v['step_s']:.2f} ms + "
                                          f"{1000 * v['overhead_s']:.2f} ms per call"
                                          for k, v in m["step"].items()),
             f"  {'candidate':<58} {'predicted':>10} {'measured':>10}"]
    shown = [r for r in result["candidates"] if "measured" in r]
    if result["user"]:
        lines.append(f"  {'your flags':<58} {'':>10} "
                     f"{result['user']['examples_per_sec']:>10,.0f}")
    for r in shown:
        mark = "*" if r["label"] == result["chosen"]["label"] else " "
        lines.append(f" {mark}{r['label']:<58} {r['predicted']:>10,.0f} "
                     f"{r['measured']['examples_per_sec']:>10,.0f}")
    vs = f", {result['vs_user']:.2f}x your flags" if result["vs_user"] else ""
    lines.append(f"chosen: {result['chosen']['label']}{vs} (prediction error "
                 f"{100 * result['prediction_error']:.0f}%)")
    if result["reconvert"]:
        r = result["reconvert"]
        lines.append(f"reconvert (not done; {r['when']}): {r['command']}  [predicted "
                     f"{r['predicted_gain_uncached']:.2f}x uncached]")
    for s in result["skipped"]:
        lines.append(f"skipped for lack of time: {s}")
    lines.append(f"train with: python -m tfspeed.train --flagfile={result['tuned_flags']['path']}")
    return lines


def _chart(result: dict, path: str) -> str:
    """Predicted against measured examples/s of the verified candidates."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in result["candidates"] if "measured" in r]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.5 * len(shown)))
    y = range(len(shown))
    ax.barh([i + 0.2 for i in y], [r["predicted"] for r in shown], 0.4, label="predicted")
    ax.barh([i - 0.2 for i in y], [r["measured"]["examples_per_sec"] for r in shown], 0.4,
            label="measured")
    if result["user"]:
        ax.axvline(result["user"]["examples_per_sec"], color="k", ls="--", label="your flags")
    ax.set_yticks(list(y), [r["label"] for r in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("examples/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    if _VERIFY.value < 1:
        raise UsageError(f"--verify={_VERIFY.value} must be >= 1")
    if _BUDGET_S.value < MIN_BUDGET_S and not _MEASURE_TO.value:
        raise UsageError(f"--budget_s={_BUDGET_S.value:g} is too short: measuring and one "
                         f"verifying run take at least ~{MIN_BUDGET_S:.0f} s; give "
                         f"--budget_s={MIN_BUDGET_S:.0f} or more (default 90)")
    if _MEASURE_TO.value:
        budget = Budget(_DEADLINE.value - time.time() if _DEADLINE.value else _BUDGET_S.value)
    else:  # the command's start (Python, TensorFlow's import) counts too
        budget = Budget(_BUDGET_S.value, reserve=FINISH_S, already=_process_age())
    config = tfspeed_flags.to_config()
    tune_dir = _TUNE_DIR.value or os.path.join(config.model_dir, "tune")
    if _MEASURE_TO.value:
        m = measure(config, budget, os.path.join(tune_dir, "work", "probe"))
        with open(_MEASURE_TO.value, "w") as f:
            json.dump({**m, "skipped": budget.skipped}, f)
        return
    run(config, list(_ARGS), _BUDGET_S.value, tune_dir, _VERIFY.value, budget)


def _process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where unknown)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0


_ARGS: list[str] = []


def _parse(argv: list[str]) -> list[str]:
    _ARGS[:] = argv[1:]
    return tfspeed_flags.parse(argv)


def run_main() -> None:
    main_entry(lambda: app.run(main, flags_parser=_parse))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    run_main()
