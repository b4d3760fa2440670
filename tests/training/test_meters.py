"""Throughput figures: warm-up (tracing, profiled calls, the tuner's probes) stays out."""

import time

import pytest

from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.training import report as report_lib
from tfspeed.training.meters import ThroughputMeter
from tfspeed.training.run import run


def _run(data_dir, model_dir, **train):
    return run(Config(
        data=DataConfig(data_dir=data_dir, batch_size=32, input_placement="host"),
        model=ModelConfig(name="mlp", width=16),
        runtime=RuntimeConfig(precision="float32"),
        train=TrainConfig(**{"log_every": 100, **train}),
        model_dir=str(model_dir),
    ).validate())


def test_the_meter_leaves_excluded_steps_out_of_the_median():
    meter = ThroughputMeter(32)
    time.sleep(0.05)
    meter.exclude(16)  # a slow call that traced
    meter.tick(20, 36)
    summary = meter.summary()
    assert summary["steps_measured"] == 20 and summary["steps_excluded"] == 16
    assert not summary["too_few_steps"]
    # The 50 ms of the excluded call are in no window: the median is the ticked window's.
    assert summary["step_time_ms"] == pytest.approx(1000 * meter.windows[0][1] / 20)


def test_too_few_measured_steps_are_flagged_not_passed_off_as_a_median():
    meter = ThroughputMeter(32)
    meter.exclude(16)
    meter.tick(ThroughputMeter.MIN_STEPS - 1, 16 + ThroughputMeter.MIN_STEPS - 1)
    summary = meter.summary()
    assert summary["too_few_steps"] and summary["steps_measured"] == ThroughputMeter.MIN_STEPS - 1
    line = report_lib.summary_lines({"optimizer_updates": 1, **summary})[1]
    assert line.startswith(f"throughput: too few steps measured "
                           f"({ThroughputMeter.MIN_STEPS - 1}) for a median; 16 warm-up steps")
    assert "median over" not in line


def test_a_window_of_warm_up_only_logs_no_speed():
    meter = ThroughputMeter(32)
    meter.exclude(8)
    assert meter.tick(0, 8) == {} and meter.windows == []
    assert meter.summary()["too_few_steps"]


@pytest.mark.parametrize("steps_per_execution", [16, "auto"])  # auto: too short to probe: 16
def test_a_short_run_times_only_the_calls_after_the_trace(digits_dir, tmp_path,
                                                          steps_per_execution):
    """One log window for the whole run: before, it held the call that traced, and a
    3-epoch digits run reported 3.5x the step time of a 30-epoch one."""
    report = _run(digits_dir, tmp_path, train_steps=40, steps_per_execution=steps_per_execution)
    assert report["steps_excluded"] == 1  # the first call, of one step: it traced
    assert report["steps_measured"] == 39
    assert not report["too_few_steps"]
    assert report["step_time_ms"] > 0 and report["seconds_measured"] > 0


def test_a_run_too_short_for_a_median_says_so(digits_dir, tmp_path, capsys):
    report = _run(digits_dir, tmp_path, train_steps=5, steps_per_execution=16)
    assert (report["steps_excluded"], report["steps_measured"]) == (1, 4)
    assert report["too_few_steps"]
    assert report["batch_examples_per_sec"] > 0  # a figure for tools, flagged, over all steps
    assert "throughput: too few steps measured (4) for a median" in capsys.readouterr().out


def test_the_tuners_probes_and_the_profile_window_are_not_timed(digits_dir, tmp_path):
    report = _run(digits_dir, tmp_path, train_steps=400, steps_per_execution="auto",
                  profile_steps=(380, 381))
    probe = report["steps_per_execution"]["probe_steps"]  # the probe traced the function
    assert probe > 0
    # The window and one step on each side ran traced, one per call.
    assert report["steps_excluded"] == 4
    assert report["steps_measured"] == 400 - probe - 4


def test_token_windows_give_a_whole_run_rate_without_the_warm_up():
    meter = ThroughputMeter(4)
    meter.exclude(1, tokens=(100, 400, 4))  # the call that traced
    meter.close(3, tokens=(300, 1200, 12))
    meter.close(2, tokens=(200, 400, 8))
    summary = meter.summary()
    assert summary["real_tokens_measured"] == 500  # the warm-up's 100 left out
    assert summary["seconds_measured"] == sum(seconds for _, seconds, _ in meter.windows)
    assert summary["padding_fraction"] == pytest.approx(1 - 600 / 2000)  # every step's
    assert summary["real_tokens"] == 600
    assert summary["seconds_excluded"] == meter.excluded[0][1] > 0


def test_one_warm_up_step_is_said_in_the_singular():
    meter = ThroughputMeter(32)
    meter.exclude(1)
    meter.tick(12, 13)
    line = report_lib.summary_lines({"optimizer_updates": 13, **meter.summary()})[1]
    assert line.endswith("(median over 12 steps; 1 warm-up step left out)")
