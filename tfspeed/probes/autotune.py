"""Choices ``auto`` makes by measuring this model on this machine, not by assuming.

* ``steps_per_execution``: a call of the compiled loop costs a fixed overhead ``c`` (Python,
  dispatch, the host sync at its end) plus ``N`` steps of ``s`` each. Calls of 0 steps measure
  ``c`` directly (they train nothing), calls of 8 steps give ``s``; N is the smallest power of
  two whose overhead is at most ``plan.CALL_OVERHEAD`` of the call, capped at one epoch per
  call (the rule is ``tfspeed.plan.steps_per_call``; this module times it). A rule
  over a fitted cost model picks the same N in repeated runs, where "the fastest of a few
  noisy sweeps" did not.
* token batching: ``--batching=auto`` predicts bucket's and pack's work per real token
  (``tfspeed.probes.costs``); where neither is predicted clearly cheaper and the run is long
  enough, the same number of real batches of each, from the job's own pipeline, are timed
  on fresh copies of the job's model, and the faster in real tokens per second is taken.
* precision: where the hardware offers bfloat16 on a CPU (the first filter, in
  ``tfspeed.plan``), a few steps of this very model in float32 and in mixed_bfloat16 are
  timed here (``time_steps``), and ``tfspeed.plan.measured_precision`` decides.
  Small models often run faster in float32: the casts can cost more than the narrower math
  saves (``benchmarks/train_step.py`` records which policy auto chose for each model).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from tfspeed import plan

PROBE_SHARE = 0.05  # of a run, at most, spent probing: its steps (the batching probe: its real tokens)
PROBE_N = 8


def _probe_calls(remaining: int) -> int:
    """Timed calls of ``PROBE_N`` steps that ``PROBE_SHARE`` of ``remaining`` steps allow."""
    return (int(remaining * PROBE_SHARE) - 1) // PROBE_N


def probe_fits(remaining: int) -> bool:
    """Whether a run of ``remaining`` micro-steps is long enough for the probe of
    ``tune_steps_per_execution`` (shorter ones take ``plan.unmeasured_steps_per_call``)."""
    return _probe_calls(remaining) >= 2


def tune_steps_per_execution(run_call, remaining: int, per_epoch: int, agree=lambda v: v):
    """Probes and chooses N. ``run_call(n)`` trains n real steps and waits for them.

    Args:
      run_call: runs one call of ``n`` micro-steps, synchronously (n = 0: only the call).
      remaining: micro-steps left in the run (the probe takes at most ``PROBE_SHARE``).
      per_epoch: micro-steps in one epoch: the largest N considered.
      agree: averages a measurement over the workers of a multi-worker job, so that all
        choose the same N.

    Returns:
      ``(N, steps used, report)``.
    """
    cap = max(1, min(per_epoch, remaining))
    calls = min(4, _probe_calls(remaining))
    if calls < 2:
        n = plan.unmeasured_steps_per_call(cap)
        return n, 0, {"value": n, "auto": True, "probe": f"none: with {remaining} steps left "
                      f"{PROBE_SHARE:.0%} is too few to measure; {n} taken"}
    run_call(1)  # traces the function: kept out of the timings
    timings = {}
    for n, count in ((0, 10), (PROBE_N, calls)):
        seconds = []
        for _ in range(count):
            start = time.perf_counter()
            run_call(n)
            seconds.append(time.perf_counter() - start)
        timings[n] = agree(statistics.median(seconds))
    cost = plan.call_cost(timings[0], timings[PROBE_N], PROBE_N)
    n = plan.steps_per_call(cost, cap)
    used = 1 + calls * PROBE_N
    return n, used, {
        "value": n, "auto": True, "call_overhead_ms": round(1000 * cost.overhead, 3),
        "step_ms": round(1000 * cost.step, 3), "probe_steps": used,
        "rule": f"smallest power of two with the call overhead <= {plan.CALL_OVERHEAD:.0%} of "
                f"the call, at most one epoch ({per_epoch} steps)"}


def time_steps(engines: dict, batches, call_s: float = 0.05, rounds: int = 5,
               max_steps: int = 64, agree=lambda value: value, run_steps: int = 0,
               progress=None) -> dict[str, float]:
    """Seconds per step of each engine on ``batches`` (an in-graph source or an iterator).

    Each engine runs a warm-up call (it traces), then a call of 2 steps that sizes the timed
    calls: about ``call_s`` each (from 1 step for a slow model to ``max_steps`` for a tiny one,
    whose calls of a few steps would time mostly noise). Then the engines take turns
    (``rounds`` calls each), and each keeps its fastest call: interleaving spreads the
    noise of a shared machine over all of them, and the first one measured is not
    penalised. About ``2 * rounds * call_s`` per engine for a fast step. ``agree`` makes
    the call size the same on every worker of a multi-worker job (its calls hold
    collectives: a worker running other step counts would wait forever).

    Args:
      run_steps: the run's length in steps (0: unknown). The timed calls are then bounded to
        ``PROBE_SHARE`` of it: fewer rounds (at least one), so probing a large model does
        not take longer than training it.
      progress: ``fn(format, *args)`` told of each stage (``logging.info``), or None.
    """
    say = progress or (lambda *args: None)
    sizing = []
    for name, engine in engines.items():
        say("precision probe: first call in %s (traces the step)", name)
        np.asarray(engine.train(batches, 1)["loss"])
        start = time.perf_counter()
        np.asarray(engine.train(batches, 2)["loss"])
        sizing.append((time.perf_counter() - start) / 2)
    step_s = float(agree(min(sizing)))
    steps = int(min(max(call_s / max(step_s, 1e-6), 1), max_steps))
    rounds = probe_rounds(rounds, steps, len(engines), run_steps)
    best = {name: float("inf") for name in engines}
    for r in range(rounds):
        for name, engine in engines.items():
            start = time.perf_counter()
            np.asarray(engine.train(batches, steps)["loss"])
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
        say("precision probe: round %d/%d of %d steps each: %s", r + 1, rounds, steps,
            ", ".join(f"{name} {1000 * t:.2f} ms/step" for name, t in best.items()))
    return best


def probe_rounds(rounds: int, steps: int, engines: int, run_steps: int) -> int:
    """Rounds of timed calls that fit ``PROBE_SHARE`` of a run of ``run_steps`` steps (all
    of ``rounds`` when the run's length is unknown), at least one."""
    if run_steps <= 0:
        return rounds
    return max(1, min(rounds, int(PROBE_SHARE * run_steps / (steps * engines))))


def batching_probe_steps(buckets: int, batches: dict[str, float], run_passes: float) -> int:
    """Batches of each mode the batching probe runs a pass: every bucket about twice, fewer
    where that would take over ``PROBE_SHARE`` of the run, 0 where not even ``2 * PROBE_N``
    fit (nothing is timed then).

    The share is of the run's real tokens, which both modes train on alike: a mode's batch
    holds 1/``batches[mode]`` of a pass, and the probe runs a warm-up and a timed pass of each
    mode. So its size does not depend on which mode the cost model predicted.

    Args:
      buckets: the bucketed batching's buckets.
      batches: each mode's training batches in one pass over the train split.
      run_passes: the run's length in passes over the train split.
    """
    want = max(2 * PROBE_N, 2 * buckets)
    fit = int(PROBE_SHARE * run_passes / (2 * sum(1 / max(n, 1) for n in batches.values())))
    steps = min(want, fit)
    return steps if steps >= 2 * PROBE_N else 0


def time_batchings(runs: dict, steps: int, agree=lambda value: value,
                   progress=None) -> dict[str, float]:
    """Real tokens per second of each mode's ``engine`` on its own batches.

    Args:
      runs: ``mode: (engine, iterator, real_tokens)``: the iterator repeats the same
        ``steps`` batches, holding ``real_tokens`` real tokens (on this worker) in all.
      steps: batches a pass. Each mode first runs a pass untimed (it traces, and compiles
        every shape of the sample where shapes compile), then the modes take turns over two
        timed half passes, so that a shared machine's swings fall on both.
      agree: averages over the workers of a multi-worker job (seconds per real token).
    """
    say = progress or (lambda *args: None)
    for mode, (engine, iterator, _) in runs.items():
        say("batching probe: %s, a first pass of %d batches (traces the step)", mode, steps)
        np.asarray(engine.train(iterator, steps)["loss"])
    seconds = dict.fromkeys(runs, 0.0)
    for half in (steps // 2, steps - steps // 2):
        for mode, (engine, iterator, _) in runs.items():
            start = time.perf_counter()
            np.asarray(engine.train(iterator, half)["loss"])
            seconds[mode] += time.perf_counter() - start
    rates = {mode: 1.0 / agree(seconds[mode] / max(real, 1))
             for mode, (_, _, real) in runs.items()}
    say("batching probe: %s", ", ".join(f"{m} {r:,.0f} real tokens/s" for m, r in rates.items()))
    return rates
