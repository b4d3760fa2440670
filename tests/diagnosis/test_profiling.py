"""Profiler capture in the driver: step markers, an in-process summary, failures not fatal."""

import glob
import re

import pytest
import tensorflow as tf

from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.probes import profiling
from tfspeed.training.run import run


def _config(data_dir, model_dir, placement="host", **train):
    train = {"train_steps": 16, "steps_per_execution": 4, "log_every": 4, **train}
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=32, input_placement=placement),
        model=ModelConfig(name="mlp", width=16),
        runtime=RuntimeConfig(precision="float32"),
        train=TrainConfig(**train),
        model_dir=str(model_dir),
    ).validate()


def _xplanes(model_dir):
    return glob.glob(str(model_dir / "logs" / "plugins" / "profile" / "*" / "*.xplane.pb"))


@pytest.mark.parametrize("placement, steps_per_execution, window, train_steps", [
    ("device", 8, (6, 8), 24),    # starts inside a call, ends at its edge; held in the step
    ("host", 8, (9, 12), 24),     # starts at a call's edge, ends inside the next; tf.data
    ("device", 8, (6, 19), 32),   # starts and ends inside calls, spans several
    ("host", 8, (6, 19), 32),
    ("auto", "auto", (10, 15), 30),    # --steps_per_execution=auto chose 16: 1-16 was one call
])
def test_the_profile_holds_the_requested_window_whatever_the_calls(
        digits_dir, tmp_path, placement, steps_per_execution, window, train_steps):
    start, end = window
    report = run(_config(digits_dir, tmp_path, placement, train_steps=train_steps,
                         steps_per_execution=steps_per_execution, log_every=100,
                         profile_steps=window))
    assert report["optimizer_updates"] == train_steps
    xplanes = _xplanes(tmp_path)
    assert len(xplanes) == 1
    # Every step of the window ran inside its own step marker, and only those.
    assert profiling.step_markers(xplanes[0]) == list(range(start, end + 1))
    profile = report["profile"]
    assert profile["window"] == profile["captured"] == [start, end]
    assert profile["calls"].startswith("cut at the window's edges")
    assert "reason" not in profile
    assert profile["steps"] == end - start + 1  # xprof analysed every step of the window
    assert profile["step_time_ms"] > 0
    if placement == "host":  # each step waits (a little) for tf.data's next batch
        assert profile["input_wait_pct"] > 0
    else:  # held in the step, the batch is gathered in the graph: nothing to wait for
        assert profile["input_wait_pct"] == 0
        # xprof never blames the input; on a loaded machine it may call 3% of host time
        # between the window's one-step calls ('All Others') "POTENTIALLY input-bound".
        conclusion = profile["conclusion"]
        assert conclusion.startswith("Your program is NOT input-bound") or (
            conclusion.startswith("Your program is POTENTIALLY input-bound")
            and "'All Others' time" in conclusion), conclusion
    lines = profiling.summary_lines(profile)
    assert lines[0] == (f"profile of steps {start}-{end}: calls cut at the window's edges: "
                        "each step of the window ran as its own traced call")
    assert lines[1].startswith(f"  xprof ({end - start + 1} steps): ")


def test_profile_steps_write_a_profile_with_step_analysis(digits_dir, tmp_path):
    report = run(_config(digits_dir, tmp_path, profile_steps=(5, 12)))
    assert len(_xplanes(tmp_path)) == 1
    profile = report["profile"]
    assert profile["steps"] == 8, profile  # xprof found the step markers
    assert 0 < profile["input_wait_pct"] <= 100  # tf.data: the wait for a batch is seen
    # xprof's verdict, whole ("NOT input-bound" also contains "input-bound"); POTENTIALLY
    # is its word where "All Others" time (Python, I/O) is high, as on a loaded host.
    assert re.match(r"Your program is (NOT|POTENTIALLY|MODERATELY|HIGHLY) input-bound because",
                    profile["conclusion"]), profile["conclusion"]
    assert profile["slowest_input_stages"] and profile["top_ops"]
    assert all(op["type"] != "IDLE" for op in profile["top_ops"])
    assert report["optimizer_updates"] == 16
    # The summary is what xprof makes of the file on disk, read again from scratch.
    assert profiling.summarize(str(tmp_path / "logs"))["steps"] == profile["steps"]


def test_a_run_that_ends_before_the_window_says_so(digits_dir, tmp_path):
    report = run(_config(digits_dir, tmp_path, train_steps=8, profile_steps=(10, 12)))
    assert report["optimizer_updates"] == 8
    assert _xplanes(tmp_path) == []
    assert report["profile"] == {"window": [10, 12], "captured": [],
                                 "reason": "the run ended at step 8, before the window"}
    assert profiling.summary_lines(report["profile"]) == [
        "profile: nothing captured (the run ended at step 8, before the window)"]


def test_a_profiler_failure_does_not_stop_training(digits_dir, tmp_path):
    tf.profiler.experimental.start(str(tmp_path / "someone_else"))  # ours cannot start now
    try:
        report = run(_config(digits_dir, tmp_path / "run", profile_steps=(2, 6)))
    finally:
        tf.profiler.experimental.stop()
    assert report["optimizer_updates"] == 16
    assert report["profile"]["captured"] == []
    assert report["profile"]["reason"].startswith("the profiler failed: _start: ")
    assert profiling.summary_lines(report["profile"])[0].startswith(
        "profile: the profiler failed")


def test_summary_lines_read_plainly():
    summary = {"window": [5, 13], "captured": [5, 13],
               "calls": "cut at the window's edges: each step of the window ran as its own "
                        "traced call",
               "steps": 9, "step_time_ms": 10.0, "input_wait_ms": 7.5, "input_wait_pct": 75.0,
               "conclusion": "Your program is HIGHLY input-bound because ...",
               "slowest_input_stages": [{"stage": "Iterator::Root::Map", "self_time_ms": 5.0,
                                         "share_pct": 80.0}],
               "top_ops": [{"op": "MatMul", "type": "MatMul", "self_time_us": 3.0,
                            "share_pct": 40.0}]}
    lines = profiling.summary_lines(summary)
    assert lines[0] == ("profile of steps 5-13: calls cut at the window's edges: each step of "
                        "the window ran as its own traced call")
    assert lines[1] == "  xprof (9 steps): 10.0 ms/step, 7.5 ms (75%) waiting for input"
    assert "HIGHLY input-bound" in lines[2] and "Iterator::Root::Map: 80%" in lines[3]
    assert profiling.summary_lines({}) == ["profile: nothing captured"]


def test_the_meter_keeps_tracing_its_scalar_write_out_of_the_next_window(tmp_path):
    import time

    from tfspeed.training.meters import ThroughputMeter

    meter = ThroughputMeter(32, str(tmp_path))
    start = time.perf_counter()
    meter.tick(10, 10)  # the first write traces its function (tens of ms)
    first_end = time.perf_counter()
    meter.tick(10, 20)  # the same names: no tracing
    second_end = time.perf_counter()
    window = meter.windows[1][1]
    # The second window starts after the first write, not before it.
    assert window <= second_end - first_end < window + 0.5 * (first_end - start)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1
