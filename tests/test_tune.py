"""python -m tfspeed.tune: the prediction model, the candidate space, and one real tune."""

import contextlib
import dataclasses
import io
import json
import os
import sys

import pytest

from tests import forked
from tests.conftest import REPO
from tfspeed.tuning import measurements as ms
from tfspeed.tuning import output, predict, verify
from tfspeed.tuning.tune import run as run_tune

C = predict.Candidate


def _measurements(**over):
    m = ms.Measurements(
        batch_size=100, cores=2, steps_per_epoch=50, size_mb=1.0, ram_budget_mb=1000.0,
        ram_budget_source="test", device_ok=True, image_storage="",
        input={ms.InputKey("none", "batched"): ms.InputTiming(cpu_s=40e-6, wall_s=40e-6),
               ms.InputKey("memory"): ms.InputTiming(cpu_s=4e-6, wall_s=4e-6)},
        step={ms.StepKey("float32", "off"): ms.StepTiming(
            overhead_s=1e-3, step_s=2e-3, cpu_per_step_s=2e-3, steps_timed=25)},
        stages=ms.InputStages(read=10e-6, decode=30e-6, after_cache=4e-6),
        parses=("batched",), caches=("none", "memory"), objectives={}, device_step_ratio=1.0)
    return dataclasses.replace(m, **over)


def test_measurements_keep_their_json_layout():
    m = _measurements()
    layout = m.to_json()
    assert layout["input"]["cold/batched"]["cpu_s"] == 40e-6
    assert set(layout["input"]) == {"cold/batched", "memory"}
    assert layout["step"]["float32/off"]["overhead_s"] == 1e-3
    assert layout["stages"] == {"read": 10e-6, "decode": 30e-6, "after_cache": 4e-6}
    assert "device_step" not in layout
    assert ms.Measurements.from_json(json.loads(json.dumps(layout))) == m


def test_a_step_bound_job_is_predicted_at_the_step_with_its_call_overhead():
    m = _measurements()
    p = predict.predict(C("device", "none", "batched", 0, "float32", "off", 4), m)
    # w = 2 ms + 1 ms / 4; nothing else runs: 100 / 2.25 ms.
    assert p["bound"] == "step" and p["batch_examples_per_sec"] == pytest.approx(100 / 2.25e-3)


def test_input_and_step_share_the_cores_on_a_cpu_host():
    m = _measurements()
    cold = predict.predict(C("host", "none", "batched", 0, "float32", "off", 1), m)
    # i = 100 x 40 µs = 4 ms CPU; u = 2 ms; (u + i) / 2 cores = 3 ms > w = 3 ms (2 + 1): tie
    # broken to the larger term; with threads=1 the input alone takes 4 ms per batch.
    assert cold["batch_examples_per_sec"] == pytest.approx(100 / 3e-3)
    capped = predict.predict(C("host", "none", "batched", 1, "float32", "off", 1), m)
    assert capped["bound"] == "input" and capped["batch_examples_per_sec"] == pytest.approx(100 / 4e-3)
    warm = predict.predict(C("host", "memory", "batched", 0, "float32", "off", 8), m)
    # i = 0.4 ms: the step (2.125 ms) bounds it, not (2 + 0.4) / 2.
    assert warm["bound"] == "step" and warm["batch_examples_per_sec"] == pytest.approx(100 / 2.125e-3)


def test_candidates_cover_the_feasible_knobs_only():
    m = _measurements(device_ok=False, parses=("batched", "single"))
    found = predict.candidates(m)
    assert {c.input_placement for c in found} == {"host"}
    # parse varies only where records are parsed every epoch; spe: 1 and the cost model's N.
    assert {(c.cache, c.parse) for c in found} == {("none", "batched"), ("none", "single"),
                                                   ("memory", "batched")}
    # 1 ms per call, 2 ms per step: 32 steps keep the overhead under 2% (25 would do).
    assert {c.steps_per_execution for c in found} == {1, 32}
    assert {c.input_threads for c in found} == {0, 1}
    assert len(found) == 3 * 2 * 2


def test_verification_covers_each_input_setup_before_variants_of_one():
    m = _measurements()
    picked = [r["candidate"] for r in verify.to_verify(predict.rank(m), 3)]
    assert {(c.input_placement, c.cache) for c in picked} == {("device", "none"),
                                                              ("host", "memory"),
                                                              ("host", "none")}


def test_where_predictions_tie_fewer_input_threads_rank_first():
    m = _measurements()
    warm = [r for r in predict.rank(m) if r["candidate"].cache == "memory"
            and r["candidate"].steps_per_execution == 32]
    # The step bounds both thread counts (i = 0.4 ms per batch): a tie, one thread first.
    assert warm[0]["batch_examples_per_sec"] == warm[1]["batch_examples_per_sec"]
    assert [r["candidate"].input_threads for r in warm] == [1, 0]
    # Decoding every epoch, the input bounds one thread: all cores rank first.
    cold = [r["candidate"].input_threads for r in predict.rank(m)
            if r["candidate"].cache == "none" and r["candidate"].input_placement == "host"
            and r["candidate"].steps_per_execution == 32]
    assert cold == [0, 1]
    picked = [r["candidate"] for r in verify.to_verify(predict.rank(m), 3)]
    assert C("host", "memory", "batched", 1, "float32", "off", 32) in picked


def test_a_verification_run_fills_a_cache_first_and_times_about_three_seconds():
    from tfspeed.config import Config, DataConfig, TrainConfig

    m = _measurements()
    config = Config(data=DataConfig(data_dir="d", batch_size=100), train=TrainConfig())
    cached = verify.plan_run(config, C("host", "memory", "batched", 0, "float32", "off", 8), m,
                           rate=20_000, cold_rate=5_000)
    # 3 s at 20k examples/s = 600 steps after the 50-step epoch that fills the cache, whose
    # 5,000 examples run at the cold rate: 4 s setup + 1 s + 3 s.
    assert cached.micro_steps == 50 + 600 and cached.log_every == 72
    assert cached.seconds == pytest.approx(4 + 1 + 3)
    in_step = verify.plan_run(config, C("device", "none", "batched", 0, "float32", "off", 8), m,
                            rate=20_000, cold_rate=20_000)
    assert in_step.micro_steps == 2 * 72 + 600  # two windows to settle, no epoch to fill


def test_the_budget_scales_estimates_by_how_late_runs_were_and_keeps_a_reserve():
    budget = verify.Budget(60, reserve=2)
    assert budget.allows(50, "a run")
    budget.observe(expected=5, took=10)  # the first run took twice its estimate
    budget.observe(expected=10, took=5)  # an early one does not lower the factor
    assert budget.slowdown == 2
    assert not budget.allows(30, "a second run")  # 60 s: not in 58 - epsilon
    assert budget.skipped == ["a second run (~60 s; 60 s left)"]
    assert budget.allows(28, "a shorter run")


# The budget is a ceiling, not the fixture's length: the tune's work here (the user's flags
# and one candidate, two rounds each) ends in ~40 s on an idle machine. Measuring alone
# takes ~19 s idle, ~30 s beside three busy processes, and took 72 s in a loaded CI run,
# where a budget of 60 s then left no time to verify anything (the budget's one-line
# error, which `test_a_budget_too_short_is_one_line` covers).
TUNE_BUDGET_S = 150


@pytest.fixture(scope="module")
def tuned(regression_dir, user_objectives, tmp_path_factory):
    """One real tune of a small MLP regression job with the user's own loss, as a user runs
    it (measuring in its child process, verifying here)."""
    from absl.testing import flagsaver

    from tfspeed.config import flags as tfspeed_flags

    root = tmp_path_factory.mktemp("tune")
    flagfile = root / "job.flags"
    flagfile.write_text(f"--data_dir={regression_dir}\n--model=mlp\n--width=16\n"
                        "--batch_size=20\n--epochs=5\n--cache=none\n--input_placement=host\n"
                        f"--precision=float32\n--loss={user_objectives}:halved_mse\n"
                        f"--metrics=mae,{user_objectives}:doubled_mae\n")
    args = [f"--flagfile={flagfile}", f"--model_dir={root / 'run'}"]
    stdout = io.StringIO()
    with flagsaver.flagsaver(), contextlib.redirect_stdout(stdout):
        tfspeed_flags.parse(["tfspeed.tune", *args])
        config = tfspeed_flags.to_config()
        run_tune(config, args, budget_s=TUNE_BUDGET_S, tune_dir=str(root / "run" / "tune"),
                 verify_n=1)
    return root, stdout.getvalue()


def test_a_tune_writes_flags_that_nest_the_original_and_train(tuned, regression_dir):
    root, stdout = tuned
    lines = (root / "run" / "tune" / "tuned.flags").read_text().splitlines()
    assert lines[0].startswith("# python -m tfspeed.tune: ")
    assert lines[1] == f"--flagfile={root / 'job.flags'}"
    assert lines[2] == f"--model_dir={root / 'run'}"
    result = json.loads((root / "run" / "tune" / "tune.json").read_text())
    changed = result["tuned_flags"]["changed"]
    # The data dir came from the nested flagfile: pinned, absolute, before the changes.
    assert lines[3].startswith("# paths resolved from ")
    assert lines[4] == f"--data_dir={os.path.abspath(regression_dir)}"
    flags = [line for line in lines[5:] if not line.startswith("#")]
    assert flags == [f"--{k}={v}" for k, v in changed.items()]
    # Each changed flag comes after a comment giving its reason.
    assert all(lines[lines.index(f) - 1].startswith("# ") for f in flags)
    assert "train with: python -m tfspeed.train --flagfile=" in stdout
    # The driver reads the tuned flags as they are, with the changed values applied.
    from absl.testing import flagsaver

    from tfspeed.config import flags as tfspeed_flags

    with flagsaver.flagsaver():
        tfspeed_flags.parse(["tfspeed.train",
                             f"--flagfile={root / 'run' / 'tune' / 'tuned.flags'}"])
        config = tfspeed_flags.to_config()
    assert config.model.name == "mlp" and config.model_dir == str(root / "run")
    for name, value in changed.items():
        section = (config.runtime if name in ("precision", "xla") else
                   config.train if name == "steps_per_execution" else config.data)
        assert str(getattr(section, name)) == str(value)


def test_a_tune_records_every_candidate_and_the_verified_ones(tuned):
    root, stdout = tuned
    result = json.loads((root / "run" / "tune" / "tune.json").read_text())
    m = result["measurements"]
    assert m["input"]["cold/batched"]["cpu_s"] > 0 and m["size_mb"] > 0
    assert set(m["step"]) >= {"float32/off"}
    labels = {r["label"] for r in result["candidates"]}
    assert len(labels) == len(result["candidates"]) >= 4
    verified = [r for r in result["candidates"] if "measured" in r]
    assert len(verified) == 1
    # The timed steps and the verifying run trained the job's own loss and metrics.
    assert m["objectives"]["loss"] == "tfspeed_user_objectives:halved_mse"
    assert m["objectives"]["task"] == "regression"
    assert verified[0]["measured"]["objectives"]["loss"] == "tfspeed_user_objectives:halved_mse"
    assert verified[0]["measured"]["objectives"]["metrics"] == ["mae", "doubled_mae"]
    assert all(r["measured"]["batch_examples_per_sec"] > 0 for r in verified)
    assert result["user"]["resolved"]["input_placement"] == "host"
    assert result["user"]["resolved"]["cache"] == "none"
    assert result["seconds"] <= TUNE_BUDGET_S + 15  # the budget, and the last run it allowed
    assert os.path.getsize(root / "run" / "tune" / "tune.png") > 1000
    assert "your flags" in stdout and "chosen:" in stdout


def test_tuned_flags_train_the_same_job_from_any_directory(tmp_path, monkeypatch):
    """A tune run with relative paths (the flagfile, and the data dir inside it) writes
    flags that resolve to the same job from another working directory."""
    from absl.testing import flagsaver

    from tfspeed.config import flags as tfspeed_flags

    (tmp_path / "project" / "pipelines").mkdir(parents=True)
    (tmp_path / "project" / "pipelines" / "job.flags").write_text(
        "--data_dir=data/photos\n--model=mlp\n--batch_size=8\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "project")
    args = ["--flagfile=pipelines/job.flags", "--model_dir=runs/p"]
    with flagsaver.flagsaver():
        tfspeed_flags.parse(["tfspeed.tune", *args])
        config = tfspeed_flags.to_config()
    user = {"measured": {"batch_examples_per_sec": 100.0, "resolved": {}}}
    output.write_flags(str(tmp_path / "tuned.flags"), args, config, None, user, None)
    monkeypatch.chdir(tmp_path / "elsewhere")
    with flagsaver.flagsaver():
        tfspeed_flags.parse(["tfspeed.train", f"--flagfile={tmp_path / 'tuned.flags'}"])
        moved = tfspeed_flags.to_config()
    assert moved.data.data_dir == str(tmp_path / "project" / "data" / "photos")
    assert moved.model_dir == str(tmp_path / "project" / "runs" / "p")
    assert (moved.model.name, moved.data.batch_size) == ("mlp", 8)


def test_a_budget_too_short_is_one_line(tabular_dir, tmp_path):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    done = forked.run(
        [sys.executable, "-m", "tfspeed.tune", f"--data_dir={tabular_dir}", "--model=mlp",
         f"--model_dir={tmp_path}", "--budget_s=5"],
        cwd=REPO, env=env, timeout=240)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --budget_s=5 is too short: measuring and one verifying run take at least "
        "~20 s; give --budget_s=20 or more (default 90)")
