"""Phase 3 of ``tfspeed.tune``: the budget, and short real runs of the driver that verify the
best predicted candidates and the user's own flags; the fastest measured wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time

from absl import logging

from tfspeed import plan as plan_lib
from tfspeed.config import is_auto
from tfspeed.plan import pinned_batching
from tfspeed.probes import autotune
from tfspeed.tuning.measurements import Measurements
from tfspeed.tuning.predict import (
    Candidate,
    examples_per_batch,
    predict,
    rate,
    rate_key,
    rate_unit,
    spe_choices,
)

VERIFY_SECONDS = 3.0  # of timed steady-state steps per verification run
# Timed micro-steps per run, at least: 8 windows for the meter's median. Token batches take
# fewer: a transformer's step (0.1-0.5 s on 2 cores) makes 24 of them several times
# VERIFY_SECONDS, and bucketed rows vary from step to step anyway.
MIN_TIMED_STEPS = 24
MIN_TIMED_TOKEN_STEPS = 16
# Where the budget is short a run is cut down to fit, to this many timed micro-steps at the
# least (the text job's transformer, ~0.7-1.4 s a step on 2 busy cores, once spent a 90 s
# budget on measuring and one run of 20 steps, and skipped every candidate).
FEWEST_TIMED_STEPS = 4
MIN_BUDGET_S = 20.0  # TF's start in two processes, the first measurements, one short run
SETUP_S = 4.0  # a run's own setup: the model, the pipeline, tracing (or ``m.setup_s``)
NOISE = 0.03  # runs closer than this to the fastest count as equally fast
_DATA_KNOBS = ("input_placement", "cache", "parse", "input_threads", "batching",
               "tokens_per_batch")
_RUNTIME_KNOBS = ("precision", "xla")
_TRAIN_KNOBS = ("steps_per_execution", "train_steps", "log_every", "checkpoint_every", "epochs")


def say(message: str, *args) -> None:
    """A progress line (absl INFO, ``tune: ...``): the tune's phases take tens of seconds."""
    logging.info("tune: " + message, *args)


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

    def affords(self, then: float = 0.0) -> float:
        """Seconds of an estimate (before ``slowdown``) that fit what is left, less
        ``then`` more to come after it."""
        return max(self.left() - self.reserve - then, 0.0) / self.slowdown

    def allows(self, seconds: float, what: str) -> bool:
        seconds *= self.slowdown
        if self.left() - self.reserve >= seconds:
            return True
        self.skipped.append(f"{what} (~{seconds:.0f} s; {max(self.left(), 0):.0f} s left)")
        say("skipped for lack of time: %s", self.skipped[-1])
        return False


def variant(config, model_dir: str | None = None, **knobs):
    """``config`` with the named data, runtime and train knobs replaced, validated."""
    def picked(names):
        return {k: v for k, v in knobs.items() if k in names}

    out = dataclasses.replace(
        config, data=dataclasses.replace(config.data, **picked(_DATA_KNOBS)),
        runtime=dataclasses.replace(config.runtime, **picked(_RUNTIME_KNOBS)),
        train=dataclasses.replace(config.train, **picked(_TRAIN_KNOBS)))
    if model_dir:
        out = dataclasses.replace(out, model_dir=model_dir)
    return out.validate()


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """How long one verification run is: micro-steps, and the seconds expected."""

    micro_steps: int
    log_every: int
    seconds: float


def plan_run(config, c: Candidate | None, m: Measurements, rate: float,
             cold_rate: float, spe: int | None = None,
             max_seconds: float = float("inf")) -> RunPlan:
    """A run long enough for ~``VERIFY_SECONDS`` of steady state at ``rate`` (``predict.rate``),
    after one epoch at ``cold_rate`` where a cache must fill first; with fewer timed steps
    (``FEWEST_TIMED_STEPS`` at the least) where that would take over ``max_seconds``.

    Token batches hold the sequences their batching puts in one (``examples_per_batch``),
    and never wait for a cache to fill: a token pipeline's input costs about 1% of the
    transformer's step or less (``tune.json``'s measurements), cached or not.

    Args:
      spe: the run's steps per call where the tune sets it (``auto_spe``); None: ``c``'s,
        or for the user's flags theirs.
    """
    batch = examples_per_batch(c, m)
    spe = spe or (c.steps_per_execution if c else config.train.steps_per_execution)
    n = 1 if is_auto(spe) else max(spe, 1)  # auto: its own timing starts at 1
    least = MIN_TIMED_TOKEN_STEPS if m.text else MIN_TIMED_STEPS
    timed = max(int(VERIFY_SECONDS * rate / batch), 8 * n, least)
    fewest = -(-FEWEST_TIMED_STEPS // n) * n  # whole calls
    fills = not m.text and ((c.input_placement == "host" and c.cache != "none") if c else (
        config.data.input_placement != "device" and config.data.cache != "none"))
    setup = max(SETUP_S, m.setup_s)
    timed = -(-timed // n) * n
    while True:
        log_every = max(n, timed // 8 // n * n)  # ~8 windows for the median
        fill = m.steps_per_epoch if fills else 2 * log_every  # else two windows to settle
        plan = RunPlan(micro_steps=fill + timed, log_every=log_every,
                       seconds=setup + fill * batch / cold_rate + timed * batch / rate)
        if plan.seconds <= max_seconds or timed <= fewest:
            return plan
        timed = max(fewest, timed * 3 // 4 // n * n)  # whole calls, fewer each time


def measured_precision(m: Measurements) -> dict:
    """``{"precision": policy}``: what the driver's ``--precision=auto`` probe would choose
    (``plan.measured_precision``, its rule and margin) from the tune's own timings of the
    step in float32 and in the hardware's mixed policy; {} where one was not measured.

    A run of the user's flags given this does not probe again: the probe builds and traces
    the model twice, which took 27 s of a 90 s budget for the text job's transformer on 2
    busy cores, and measured other figures than the tune had (one measurement, read by
    both, cannot disagree with itself)."""
    xla = "off" if any(k.xla == "off" for k in m.step) else "on"
    timed = {k.precision: t.step_s for k, t in m.step.items() if k.xla == xla}
    mixed = [p for p in timed if p != "float32"]
    if "float32" not in timed or not mixed:
        return {}
    return {"precision": plan_lib.measured_precision(mixed[0], timed).value}


def auto_spe(m: Measurements) -> int:
    """The steps per call that ``--steps_per_execution=auto`` picks after its probe (the
    cost model's N from the step measured first): what the user's flags are timed at where
    a verifying run is too short for the driver's probe, which would otherwise take 16
    steps per call unmeasured (the first call is left out as warm-up: 16 of a 20-step run).
    """
    return max(spe_choices(next(iter(m.step.values())), m.steps_per_epoch))


def verify(config, c: Candidate | None, run_dir: str, plan: RunPlan,
           pinned: dict | None = None, mean_length: float = 0.0) -> dict:
    """A short real run of the driver with ``c`` (None: the user's flags as they are, but
    for the knobs ``pinned``: see ``Verifier.plan``).

    Args:
      mean_length: token batches: the split's mean sequence length (``sequences_per_sec`` is
        then the measured real tokens/s over it).

    Returns:
      Steady-state ``batch_examples_per_sec`` (token batches: ``sequences_per_sec``) from
      its meter (the median window, after a cache has filled;
      token batches: over all its measured windows), the run's seconds, input wait,
      objectives and ``resolved`` settings.
    """
    import gc
    import shutil

    import keras

    from tfspeed.training.run import run as train_run

    shutil.rmtree(run_dir, ignore_errors=True)  # a run left there would be resumed, not timed
    knobs = {**(knob_values(c) if c else {}), **(pinned or {})}
    accum = config.train.grad_accum_steps
    run_config = variant(config, model_dir=run_dir, **knobs,
                         train_steps=-(-plan.micro_steps // accum), epochs=1,
                         checkpoint_every=0, log_every=plan.log_every)
    run_config = dataclasses.replace(
        run_config, data=dataclasses.replace(run_config.data, eval_split=""),
        train=dataclasses.replace(run_config.train, profile_steps=())).validate()
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        report = train_run(run_config)
    seconds = time.perf_counter() - start
    # A run leaves its model, compiled steps and pipelines behind in Keras' global state and
    # in reference cycles: repeated runs of one digits job in one process slowed down without
    # this, and held their speed with it (measured once on 2 cores, not benchmarked).
    keras.backend.clear_session()
    gc.collect()
    speed = (_token_figures(report, mean_length) if "real_tokens_per_sec" in report
             else {"batch_examples_per_sec": report["batch_examples_per_sec"]})
    return {**speed,
            "seconds": round(seconds, 2), "micro_steps": plan.micro_steps,
            "expected_seconds": round(plan.seconds, 1),
            "input_wait_pct": report.get("input_wait_pct"), "resolved": _resolved(report),
            "objectives": report.get("objectives")}


def _token_figures(report: dict, mean_length: float) -> dict:
    """A token run's speed: real tokens over the seconds of all its measured windows, and
    as ``sequences_per_sec`` the sequences of the mean length that makes (rows/s would
    favour padding). Not the meter's median window: bucketed windows of a few steps each
    hold one width, and a narrow bucket's window holds many short sequences, a wide one's
    few long ones; on pystdlib (mean 255 tokens) the median window's sequences/s came to
    424 real tokens per sequence, halving bucket's figure against pack's (same real
    tokens/s), in the run of the user's flags at the default budget."""
    measured = report.get("real_tokens_measured") or 0
    seconds = report.get("seconds_measured") or 0
    real = measured / seconds if measured and seconds else report["real_tokens_per_sec"]
    return {"sequences_per_sec": real / mean_length if mean_length else
            report["sequences_per_sec"],
            "real_tokens_per_sec": real, "padding_fraction": report["padding_fraction"],
            "median_window_sequences_per_sec": report["sequences_per_sec"],
            "compiled_programs": report.get("compiled_programs")}


def given_knobs(config) -> dict:
    """The tuned knobs as the user's flags set them (``auto`` or 0 where left to choose)."""
    return {"input_placement": config.data.input_placement, "cache": config.data.cache,
            "parse": config.data.parse, "input_threads": config.data.input_threads,
            "precision": config.runtime.precision, "xla": config.runtime.xla,
            "steps_per_execution": config.train.steps_per_execution,
            "batching": config.data.batching, "tokens_per_batch": config.data.tokens_per_batch}


def user_rate(config, ranked: list[dict], m: Measurements) -> float:
    """The speed (``predict.rate``) to plan the run of the user's flags by: the slowest prediction among the
    candidates their settings allow (any value where ``auto``; token batches at the batching
    the job resolved), or among all where none matches."""
    given = given_knobs(config)
    job = (m.text or {}).get("job")
    if job:
        given = {**given, **job}

    def allowed(c: Candidate) -> bool:
        return all(is_auto(given[k]) or str(given[k]) == str(v)
                   for k, v in knob_values(c).items()
                   if not (k == "tokens_per_batch" and c.batching == "pad"))

    mine = [rate(r) for r in ranked if allowed(r["candidate"])]
    return min(mine or [rate(r) for r in ranked])


def knob_values(c: Candidate) -> dict:
    """``c``'s knobs to set (the token knobs only where they apply)."""
    return {k: v for k, v in dataclasses.asdict(c).items()
            if v or k not in ("batching", "tokens_per_batch")}


def _resolved(report: dict) -> dict:
    """What the driver settled on in a run (its ``auto`` choices resolved)."""
    split = report["config"]["data"]["train_split"]
    where = report["input"]["placement"]["where"]
    batching = report["input"].get("batching")  # token records
    tokens = {"batching": batching["mode"], "tokens_per_batch": batching["tokens_per_batch"]
              } if batching else {}
    return {**tokens, "input_placement": where,
            "cache": report["input"]["cache"].get(split, {}).get("mode", "none"),
            "parse": report["config"]["data"]["parse"].replace("auto", "batched"),
            "input_threads": report["config"]["data"].get("input_threads", 0),
            "precision": report["runtime"]["precision"],
            "xla": "on" if report["runtime"]["xla"] else "off",
            "steps_per_execution": report["steps_per_execution"].get("value", 1)}


def as_candidate(resolved: dict) -> Candidate | None:
    """The candidate a run's resolved settings amount to (None if it is none of them)."""
    try:
        return Candidate(**{f.name: resolved[f.name] if f.default is dataclasses.MISSING
                            else resolved.get(f.name, f.default)
                            for f in dataclasses.fields(Candidate)})
    except (KeyError, TypeError):
        return None


def to_verify(ranked: list[dict], n: int, yours: dict | None = None) -> list[dict]:
    """The ``n`` candidates to run: the best predicted of each input setup (placement and
    cache: where predictions tie, which one wins is what the runs are for), best first.

    Token batches: the batching that the run of the user's flags (``yours``, its resolved
    settings) already measured comes after the other batchings, and a candidate that is
    that run again (no knob changed) is not run.
    """
    mine = (yours or {}).get("batching")
    ranked = [r for r in ranked if not (mine and changes(r["candidate"], yours) == 0)]
    groups, firsts = set(), []
    for r in ranked:
        c = r["candidate"]
        key = (c.input_placement, c.cache, c.batching)  # batching: "" unless token records
        if key not in groups:
            groups.add(key)
            firsts.append(r)
    firsts.sort(key=lambda r: bool(mine) and r["candidate"].batching == mine)  # stable
    rest = [r for r in ranked if r not in firsts]
    seen, out = set(), []
    for r in firsts + rest:  # then the next best, one per distinct input setup
        c = r["candidate"]
        key = (c.input_placement, c.cache, c.parse, c.input_threads, c.batching,
               c.tokens_per_batch)
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out[:n]


def changes(c: Candidate, resolved: dict) -> int:
    """How many of ``c``'s knobs differ from the ``resolved`` settings of a run."""
    return sum(str(v) != str(resolved.get(k)) for k, v in knob_values(c).items()
               if not (k == "tokens_per_batch" and c.batching == "pad"))


# ------------------------------------------------------------------ the runs


class Verifier:
    """Runs entries (``{"candidate": Candidate | None, ...}``) as the budget allows, each into
    its own directory under ``work``; a run's figures go to ``entry["measured"]``."""

    def __init__(self, config, m: Measurements, ranked: list[dict], budget: Budget, work: str):
        self.config, self.m, self.budget, self.work = config, m, budget, work
        self.yours = user_rate(config, ranked, m)
        self.runs = 0

    def plan(self, entry: dict, then: float = 0.0) -> tuple[RunPlan, dict]:
        """The run of ``entry``, cut to what the budget has left (less ``then``) and, for
        the user's flags, the knobs it is given where their ``auto`` would decide
        otherwise in a short run than in the job, or would measure again what the tune
        measured: the job's resolved token batching (``--batching=auto`` weighs compiles
        against the run's length: a 3-step run bucketed what the job packed), the
        precision the tune's own step timings choose (``measured_precision``), and the
        steps per call of ``auto_spe`` where the run is too short for the driver's
        probe."""
        c = entry["candidate"]
        speed = rate(entry) if c else self.yours
        cold = (rate(predict(dataclasses.replace(c, input_placement="host", cache="none"),
                             self.m)) if c else self.yours)
        fits = self.budget.affords(then)
        plan, pinned = plan_run(self.config, c, self.m, speed, min(cold, speed),
                                max_seconds=fits), {}
        job = (self.m.text or {}).get("job")
        if c is None and job:
            pinned.update(pinned_batching(self.config.data.batching, job["batching"]))
        if c is None and self.config.runtime.precision in ("auto", "measure"):
            pinned.update(measured_precision(self.m))
        if c is None and is_auto(self.config.train.steps_per_execution) and not (
                autotune.probe_fits(plan.micro_steps)):
            pinned["steps_per_execution"] = auto_spe(self.m)
            plan = plan_run(self.config, c, self.m, speed, min(cold, speed),
                            spe=pinned["steps_per_execution"], max_seconds=fits)
        return plan, pinned

    def check(self, entry: dict, name: str, then: float = 0.0) -> bool:
        """One run of ``entry``, if the budget allows it and ``then`` seconds more; False
        where it did not."""
        c = entry["candidate"]
        plan, pinned = self.plan(entry, then)
        if not self.budget.allows(plan.seconds + then, f"verifying {name}"):
            return False
        self.runs += 1
        say("verifying %s: a short run (~%.0f s)", name, plan.seconds)
        entry["measured"] = verify(self.config, c, os.path.join(self.work, f"run{self.runs}"),
                                   plan, pinned, (self.m.text or {}).get("mean_length", 0.0))
        self.budget.observe(plan.seconds, entry["measured"]["seconds"])
        say("%s: %.1f %s measured in %.0f s", name, rate(entry["measured"]),
            rate_unit(entry["measured"]), entry["measured"]["seconds"])
        return True

    def first_round(self, ranked: list[dict], n: int) -> dict:
        """The user's flags, then the ``n`` chosen by ``to_verify``.

        Returns:
          The user's entry: with ``measured`` where it ran, and the cost model's
          ``predicted`` examples/s for the settings it resolved to (None if none).
        """
        user = {"candidate": None}
        if self.check(user, "your flags"):
            mine = as_candidate(user["measured"]["resolved"])
            user["predicted"] = rate(predict(mine, self.m)) if mine and (
                mine.step_key in self.m.step) and (not mine.batching or mine.batching in (
                    self.m.text or {}).get("batching", {})) else None
        for entry in to_verify(ranked, n, user.get("measured", {}).get("resolved")):
            self.check(entry, entry["candidate"].label())
        return user

    def second_round(self, verified: list[dict], user: dict) -> None:
        """Again, fastest first, the user's flags too, as time allows: on a shared machine
        one run can be unlucky (and a process's first runs are slower); each keeps its
        best, with both rounds' figures."""
        again = sorted(verified, key=lambda r: -rate(r["measured"]))
        if "measured" not in user:
            for entry in again:
                self._again(entry)
            return
        # The fastest runs again only where your flags can too: one of the two alone with
        # a second chance would be favoured (each keeps its best).
        if self._again(again[0], then=self.plan(user)[0].seconds):
            self._again(user)
        for entry in again[1:]:
            self._again(entry)

    def _again(self, entry: dict, then: float = 0.0) -> bool:
        first = entry["measured"]
        label = entry["candidate"].label() if entry["candidate"] else "your flags"
        if not self.check(entry, "a second round of " + label +
                          (", then of your flags" if then else ""), then):
            return False
        entry["measured"]["rounds"] = sorted([rate(first),
                                              rate(entry["measured"])])
        if rate(first) > rate(entry["measured"]):
            entry["measured"] = {**first, "rounds": entry["measured"]["rounds"]}
        return True


def choose(verified: list[dict], user: dict) -> tuple[dict, bool]:
    """The winner among the verified runs, and whether the user's flags stay.

    Within the noise of the best, the candidate that changes the fewest flags. The user's
    flags stay when they are as fast, or when they already resolve to the chosen settings
    (two runs of one configuration differ only by noise); then they keep the better of the
    two runs' figures.
    """
    best = max(rate(r["measured"]) for r in verified)
    resolved = user.get("measured", {}).get("resolved", {})
    close = [r for r in verified if rate(r["measured"]) >= (1 - NOISE) * best]
    chosen = min(close, key=lambda r: (changes(r["candidate"], resolved),
                                       -rate(r["measured"])))
    same = not changes(chosen["candidate"], resolved)
    keep_user = "measured" in user and (
        rate(user["measured"]) >= (1 - NOISE) * best or same)
    if keep_user:
        user["measured"][rate_key(user["measured"])] = max(rate(user["measured"]),
                                                   rate(chosen["measured"])
                                                   if same else 0)
    return chosen, keep_user
