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

from tfspeed.config import is_auto
from tfspeed.tuning.measurements import Measurements
from tfspeed.tuning.predict import Candidate, predict

VERIFY_SECONDS = 3.0  # of timed steady-state steps per verification run
MIN_BUDGET_S = 20.0  # TF's start in two processes, the first measurements, one short run
SETUP_S = 4.0  # a run's own setup: the model, the pipeline, tracing
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
             cold_rate: float) -> RunPlan:
    """A run long enough for ~``VERIFY_SECONDS`` of steady state at ``rate`` examples/s,
    after one epoch at ``cold_rate`` where a cache must fill first."""
    batch = config.data.batch_size
    spe = c.steps_per_execution if c else config.train.steps_per_execution
    n = 1 if is_auto(spe) else max(spe, 1)  # auto: its own timing starts at 1
    timed = max(int(VERIFY_SECONDS * rate / batch), 8 * n, 24)
    timed = -(-timed // n) * n
    fills = (c.input_placement == "host" and c.cache != "none") if c else (
        config.data.input_placement != "device" and config.data.cache != "none")
    log_every = max(n, timed // 8 // n * n)  # ~8 windows for the median
    fill = m.steps_per_epoch if fills else 2 * log_every  # else two windows to settle
    return RunPlan(micro_steps=fill + timed, log_every=log_every,
                   seconds=SETUP_S + fill * batch / cold_rate + timed * batch / rate)


def verify(config, c: Candidate | None, run_dir: str, plan: RunPlan) -> dict:
    """A short real run of the driver with ``c`` (None: the user's flags as they are).

    Returns:
      Steady-state examples/s from its meter (the median window, after a cache has filled),
      the run's seconds, input wait, objectives and ``resolved`` settings.
    """
    import gc
    import shutil

    import keras

    from tfspeed.training.run import run as train_run

    shutil.rmtree(run_dir, ignore_errors=True)  # a run left there would be resumed, not timed
    knobs = knob_values(c) if c else {}
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
    tokens = {"real_tokens_per_sec": report["real_tokens_per_sec"],
              "padding_fraction": report["padding_fraction"],
              "compiled_functions": report.get("compiled_functions")
              } if "real_tokens_per_sec" in report else {}
    # Token batches: sequences/s, what every batching delivers alike (rows/s would favour
    # padding); the candidates' own order is by real tokens/s, the same up to the mean length.
    return {"examples_per_sec": report["sequences_per_sec"] if tokens
            else report["examples_per_sec"], **tokens,
            "seconds": round(seconds, 2), "micro_steps": plan.micro_steps,
            "expected_seconds": round(plan.seconds, 1),
            "input_wait_pct": report.get("input_wait_pct"), "resolved": _resolved(report),
            "objectives": report.get("objectives")}


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


def to_verify(ranked: list[dict], n: int) -> list[dict]:
    """The ``n`` candidates to run: the best predicted of each input setup (placement and
    cache: where predictions tie, which one wins is what the runs are for), best first."""
    groups, firsts = set(), []
    for r in ranked:
        c = r["candidate"]
        key = (c.input_placement, c.cache, c.batching)  # batching: "" unless token records
        if key not in groups:
            groups.add(key)
            firsts.append(r)
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
        self.slowest = min(r["examples_per_sec"] for r in ranked)
        self.runs = 0

    def check(self, entry: dict, name: str) -> bool:
        """One run of ``entry``, if the budget allows it; False where it did not."""
        c = entry["candidate"]
        rate = entry.get("examples_per_sec") or self.slowest  # yours: assume the slowest
        cold = (predict(dataclasses.replace(c, input_placement="host", cache="none"), self.m)
                ["examples_per_sec"] if c else self.slowest)
        plan = plan_run(self.config, c, self.m, rate, min(cold, rate))
        if not self.budget.allows(plan.seconds, f"verifying {name}"):
            return False
        self.runs += 1
        say("verifying %s: a short run (~%.0f s)", name, plan.seconds)
        entry["measured"] = verify(self.config, c, os.path.join(self.work, f"run{self.runs}"),
                                   plan)
        self.budget.observe(plan.seconds, entry["measured"]["seconds"])
        say("%s: %.1f examples/s measured in %.0f s", name,
            entry["measured"]["examples_per_sec"], entry["measured"]["seconds"])
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
            user["predicted"] = predict(mine, self.m)["examples_per_sec"] if mine and (
                mine.step_key in self.m.step) and (not mine.batching or mine.batching in (
                    self.m.text or {}).get("batching", {})) else None
        for entry in to_verify(ranked, n):
            self.check(entry, entry["candidate"].label())
        return user

    def second_round(self, verified: list[dict], user: dict) -> None:
        """Again, fastest first, the user's flags too, as time allows: on a shared machine
        one run can be unlucky (and a process's first runs are slower); each keeps its
        best, with both rounds' figures."""
        again = sorted(verified, key=lambda r: -r["measured"]["examples_per_sec"])
        for entry in [*again[:1], user, *again[1:]] if "measured" in user else again:
            first = entry["measured"]
            label = entry["candidate"].label() if entry["candidate"] else "your flags"
            if not self.check(entry, "a second round of " + label):
                continue
            entry["measured"]["rounds"] = sorted([first["examples_per_sec"],
                                                  entry["measured"]["examples_per_sec"]])
            if first["examples_per_sec"] > entry["measured"]["examples_per_sec"]:
                entry["measured"] = {**first, "rounds": entry["measured"]["rounds"]}


def choose(verified: list[dict], user: dict) -> tuple[dict, bool]:
    """The winner among the verified runs, and whether the user's flags stay.

    Within the noise of the best, the candidate that changes the fewest flags. The user's
    flags stay when they are as fast, or when they already resolve to the chosen settings
    (two runs of one configuration differ only by noise); then they keep the better of the
    two runs' figures.
    """
    best = max(r["measured"]["examples_per_sec"] for r in verified)
    resolved = user.get("measured", {}).get("resolved", {})
    close = [r for r in verified if r["measured"]["examples_per_sec"] >= (1 - NOISE) * best]
    chosen = min(close, key=lambda r: (changes(r["candidate"], resolved),
                                       -r["measured"]["examples_per_sec"]))
    same = not changes(chosen["candidate"], resolved)
    keep_user = "measured" in user and (
        user["measured"]["examples_per_sec"] >= (1 - NOISE) * best or same)
    if keep_user:
        user["measured"]["examples_per_sec"] = max(user["measured"]["examples_per_sec"],
                                                   chosen["measured"]["examples_per_sec"]
                                                   if same else 0)
    return chosen, keep_user
