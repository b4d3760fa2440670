"""Profiler capture in the driver: step markers, an in-process summary, failures not fatal."""

import glob

import tensorflow as tf

from tfspeed import profiling
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.train import run


def _config(data_dir, model_dir, **train):
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=32, input_placement="host"),
        model=ModelConfig(name="mlp", width=16),
        runtime=RuntimeConfig(precision="float32"),
        train=TrainConfig(train_steps=16, steps_per_execution=4, log_every=4, **train),
        model_dir=str(model_dir),
    ).validate()


def test_profile_steps_write_a_profile_with_step_analysis(digits_dir, tmp_path):
    report = run(_config(digits_dir, tmp_path, profile_steps=(5, 12)))
    xplanes = glob.glob(str(tmp_path / "logs" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    assert len(xplanes) == 1
    profile = report["profile"]
    assert profile["steps"] >= 4, profile  # xprof found the step markers
    assert profile["step_time_ms"] > 0
    assert 0 <= profile["input_wait_pct"] <= 100
    assert "input-bound" in profile["conclusion"]
    assert profile["slowest_input_stages"] and profile["top_ops"]
    assert all(op["type"] != "IDLE" for op in profile["top_ops"])
    assert report["optimizer_updates"] == 16
    # The summary is what xprof makes of the file on disk, read again from scratch.
    assert profiling.summarize(str(tmp_path / "logs"))["steps"] == profile["steps"]


def test_a_profiler_failure_does_not_stop_training(digits_dir, tmp_path):
    tf.profiler.experimental.start(str(tmp_path / "someone_else"))  # ours cannot start now
    try:
        report = run(_config(digits_dir, tmp_path / "run", profile_steps=(2, 6)))
    finally:
        tf.profiler.experimental.stop()
    assert report["optimizer_updates"] == 16
    assert report["profile"] == {}


def test_summary_lines_read_plainly():
    summary = {"steps": 9, "step_time_ms": 10.0, "input_wait_ms": 7.5, "input_wait_pct": 75.0,
               "conclusion": "Your program is HIGHLY input-bound because ...",
               "slowest_input_stages": [{"stage": "Iterator::Root::Map", "self_time_ms": 5.0,
                                         "share_pct": 80.0}],
               "top_ops": [{"op": "MatMul", "type": "MatMul", "self_time_us": 3.0,
                            "share_pct": 40.0}]}
    lines = profiling.summary_lines(summary)
    assert lines[0] == "profile (9 steps): 10.0 ms/step, 7.5 ms (75%) waiting for input"
    assert "HIGHLY input-bound" in lines[1] and "Iterator::Root::Map: 80%" in lines[2]
    assert profiling.summary_lines({}) == ["profile: nothing captured"]


def test_the_meter_keeps_tracing_its_scalar_write_out_of_the_next_window(tmp_path):
    import time

    from tfspeed.callbacks import ThroughputMeter

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
