"""What auto chooses from measurements: the rules, on given figures (no timing here)."""

import pytest

from tfspeed import plan
from tfspeed.probes import autotune


def test_steps_per_execution_is_the_smallest_power_of_two_with_a_small_overhead():
    # 0.4 ms per call, 0.7 ms per step (the digits MLP here): 0.4 / (0.02 x 0.7) = 28.6 -> 32.
    assert plan.steps_per_call(plan.CallCost(4e-4, 7e-4), cap=50) == 32
    # 0.5 ms per call, 5 ms per step (the digits CNN): 5 -> 8.
    assert plan.steps_per_call(plan.CallCost(5e-4, 5e-3), cap=50) == 8
    # Never more than one epoch per call, never less than 1.
    assert plan.steps_per_call(plan.CallCost(1e-2, 1e-5), cap=25) == 25
    assert plan.steps_per_call(plan.CallCost(0.0, 1.0), cap=25) == 1


def test_call_cost_from_an_empty_call_and_a_call_of_eight():
    cost = plan.call_cost(empty=4e-4, many=4e-4 + 8 * 7e-4, n=8)
    assert cost.overhead == pytest.approx(4e-4) and cost.step == pytest.approx(7e-4)
    assert plan.call_cost(empty=5e-4, many=4e-4, n=8).step > 0  # noise cannot go negative


def test_the_probe_takes_at_most_five_percent_of_the_run():
    calls = []

    def run_call(n):
        calls.append(n)

    n, used, report = autotune.tune_steps_per_execution(run_call, remaining=1000, per_epoch=50)
    assert used == sum(calls) <= 50 and 1 <= n <= 50
    assert report["probe_steps"] == used and calls.count(0) == 10  # free calls: overhead
    calls.clear()
    n, used, report = autotune.tune_steps_per_execution(run_call, remaining=200, per_epoch=50)
    assert (n, used, calls) == (16, 0, []) and report["probe"].startswith("none: with 200")


def test_precision_takes_bfloat16_only_when_it_is_clearly_faster():
    bf16 = "mixed_bfloat16"
    decided = plan.measured_precision(bf16, {"float32": 0.60e-3, bf16: 0.58e-3})
    choice, why = decided.value, decided.reason
    assert decided.source == "measured"
    assert choice == "float32" and why == (
        "auto: measured 0.60 ms/step in float32, 0.58 in mixed_bfloat16 for this model: "
        "bfloat16 is not 5% faster here, so float32 (exact) is kept")
    assert plan.measured_precision(bf16, {"float32": 0.56e-3, bf16: 0.60e-3}).value == "float32"
    assert plan.measured_precision(bf16, {"float32": 5.41e-3, bf16: 4.34e-3}).value == bf16


class _Steps:
    """Something with an engine's ``train(batches, n)``: ``n`` steps of ``step_s`` each,
    by the clock (TensorFlow is not needed to check how calls are sized and interleaved)."""

    def __init__(self, step_s, log):
        self.step_s, self.log = step_s, log

    def train(self, batches, n):
        import time

        self.log.append((self.step_s, n))
        time.sleep(self.step_s * n)
        return {"loss": _Value()}


class _Value:
    def numpy(self):
        return 0.0


# 0.2 ms steps: 50 ms is 500 of them, capped at 64, even when a loaded machine adds a
# millisecond to each sleep (1 ms steps were sized 52 under a full test run).
@pytest.mark.parametrize("step_s, steps", [(2e-4, 64), (0.12, 1)])
def test_precision_probe_calls_last_about_fifty_ms_and_take_turns(step_s, steps):
    log = []
    engines = {"float32": _Steps(step_s, log), "mixed_bfloat16": _Steps(step_s / 2, log)}
    seconds = autotune.time_steps(engines, None, call_s=0.05, rounds=3)
    timed = log[4:]  # after each engine's tracing call and its sizing call of 2
    assert [n for _, n in log[:4]] == [1, 2, 1, 2]
    # Sized by the faster engine: 50 ms of its steps, at most 64 (a tiny model), at least 1.
    assert {n for _, n in timed} == {steps}
    assert [s for s, _ in timed] == [step_s, step_s / 2] * 3  # interleaved, 3 rounds
    assert seconds["mixed_bfloat16"] < seconds["float32"]


def test_precision_probe_calls_have_the_size_all_workers_agree_on():
    # Multi-worker: each call holds collectives, so every worker must run the same steps.
    # Locally 1 ms steps would make calls of 50; the workers' mean, 25 ms, makes them 2.
    log = []
    engines = {"float32": _Steps(1e-3, log), "mixed_bfloat16": _Steps(1e-3, log)}
    autotune.time_steps(engines, None, call_s=0.05, rounds=1, agree=lambda step_s: 0.025)
    assert [n for _, n in log[4:]] == [2, 2]


def test_the_precision_probe_is_bounded_by_the_runs_length():
    # 5 rounds of 64-step calls for 2 engines = 640 steps: fine for a long run...
    assert autotune.probe_rounds(5, 64, 2, run_steps=100_000) == 5
    # ...but a 2,000-step run gets 5% of it (100 steps): 0 rounds of 128 steps -> at least 1.
    assert autotune.probe_rounds(5, 64, 2, run_steps=2_000) == 1
    assert autotune.probe_rounds(5, 8, 2, run_steps=1_000) == 3  # 50 // 16
    assert autotune.probe_rounds(5, 8, 2, run_steps=0) == 5  # the run's length is unknown


def _probe_share(steps: int, batches: dict, passes: float) -> float:
    """The share of a run's real tokens that a batching probe of ``steps`` batches of each
    mode (a warm-up and a timed pass) trains on: each mode's batch holds 1/batches of a pass."""
    return 2 * steps * sum(1 / n for n in batches.values()) / passes


def test_the_batching_probe_is_sized_by_the_runs_tokens_not_the_predicted_modes_steps():
    # pydocs, 42 passes: 21 buckets, 82 bucketed and 67 packed batches a pass. Counted in the
    # packed batches (pack predicted), the old gate shut out a probe that fits in bucketed ones;
    # the probe's share of the run is its share of real tokens, whichever mode was predicted.
    batches = {"bucket": 82, "pack": 67}
    steps = autotune.batching_probe_steps(21, batches, run_passes=42)
    assert 2 * autotune.PROBE_N <= steps <= 42
    assert _probe_share(steps, batches, 42) <= autotune.PROBE_SHARE
    assert _probe_share(steps + 1, batches, 42) > autotune.PROBE_SHARE  # as many as fit
    # A long run times every bucket twice, and no more.
    assert autotune.batching_probe_steps(21, batches, run_passes=1000) == 42
    assert autotune.batching_probe_steps(3, batches, run_passes=1000) == 2 * autotune.PROBE_N
    # Three passes hold no probe of even 16 batches a mode: 0, nothing timed.
    assert autotune.batching_probe_steps(21, batches, run_passes=3) == 0
    assert autotune.batching_probe_steps(21, {"bucket": 5000, "pack": 4000}, 3) == 42
