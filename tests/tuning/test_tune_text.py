"""tfspeed.tune on token records: batching and --tokens_per_batch, chosen by measurement."""

import contextlib
import io
import json

import pytest

from tfspeed.tuning import measurements as ms
from tfspeed.tuning import predict
from tfspeed.tuning.tune import run as run_tune

# Twice tests/test_tune.py's: measuring batches three ways and times a transformer's step
# (XLA off and on) before any run verifies; 60 s left none on a busy 2-core machine.
TUNE_BUDGET_S = 75


def _text_measurements():
    step = ms.StepTiming(overhead_s=1e-3, step_s=8e-3, cpu_per_step_s=8e-3, steps_timed=10)
    return ms.Measurements(
        batch_size=16, cores=2, steps_per_epoch=20, size_mb=0.5, ram_budget_mb=1000.0,
        ram_budget_source="test", device_ok=False, image_storage="",
        input={ms.COLD: ms.InputTiming(cpu_s=20e-6, wall_s=20e-6)},
        step={ms.StepKey("float32", "off"): step},
        stages=ms.InputStages(read=20e-6, decode=0.0, after_cache=None),
        parses=("batched",), caches=("none",), objectives={},
        text={"held_tokens": 4096, "mean_length": 200.0, "max_length": 256, "batch_size": 16,
              "tokens_per_batch": [4096, 2048, 8192],
              "batching": {"pad": {"expected_padding": 0.4, "input_cpu_per_token": 1e-7},
                           "bucket": {"expected_padding": 0.1, "input_cpu_per_token": 1e-7},
                           "pack": {"expected_padding": 0.0, "input_cpu_per_token": 2e-7}}})


def test_token_candidates_rank_by_real_tokens_and_keep_their_json():
    m = _text_measurements()
    ranked = predict.rank(m)
    assert {r["candidate"].batching for r in ranked} == {"pad", "bucket", "pack"}
    assert {r["candidate"].tokens_per_batch for r in ranked
            if r["candidate"].batching == "pack"} == {2048, 4096, 8192}
    best = ranked[0]
    # The step costs the same per computed token: the least padding learns the most.
    assert best["candidate"].batching == "pack"
    pad = next(r for r in ranked if r["candidate"].batching == "pad")
    assert best["real_tokens_per_sec"] > pad["real_tokens_per_sec"] / (1 - 0.4) * 0.9
    assert "batching" in best["candidate"].flags() and "batching=pack" in best[
        "candidate"].label()
    assert ms.Measurements.from_json(json.loads(json.dumps(m.to_json()))) == m
    # An image or table job's candidates carry no token knobs, as before.
    plain = predict.Candidate("host", "none", "batched", 0, "float32", "off", 1)
    assert "batching" not in plain.flags() and "batching" not in plain.label()


@pytest.fixture(scope="module")
def tuned_text(tmp_path_factory, text_dirs):
    from absl.testing import flagsaver

    from tfspeed.config import flags as tfspeed_flags

    root = tmp_path_factory.mktemp("tune_text")
    data = text_dirs["classification"]  # the session's small corpus (max_length 64)
    flagfile = root / "job.flags"
    flagfile.write_text(f"--data_dir={data}\n--model=transformer\n--width=16\n--depth=1\n"
                        "--heads=2\n--batching=pad\n--batch_size=16\n--precision=float32\n"
                        "--eval_split=\n")
    args = [f"--flagfile={flagfile}", f"--model_dir={root / 'run'}"]
    stdout = io.StringIO()
    with flagsaver.flagsaver(), contextlib.redirect_stdout(stdout):
        tfspeed_flags.parse(["tfspeed.tune", *args])
        config = tfspeed_flags.to_config()
        run_tune(config, args, budget_s=TUNE_BUDGET_S, tune_dir=str(root / "run" / "tune"),
                 verify_n=1)
    return root, stdout.getvalue()


def test_a_text_tune_lists_batchings_and_records_real_tokens(tuned_text):
    root, stdout = tuned_text
    result = json.loads((root / "run" / "tune" / "tune.json").read_text())
    assert set(result["batching_candidates"]) == {"pad", "bucket", "pack"}
    assert {r["flags"]["batching"] for r in result["candidates"]} == {"pad", "bucket", "pack"}
    assert result["measurements"]["text"]["batching"]["pad"]["expected_padding"] > 0.1
    # The chosen batching's measured real tokens/s, from a real run of the driver.
    assert result["real_tokens_per_sec"] > 0 and result["batching"] in ("pad", "bucket",
                                                                        "pack")
    verified = [r for r in result["candidates"] if "measured" in r]
    assert verified and all(r["measured"]["real_tokens_per_sec"] > 0 for r in verified)
    lines = (root / "run" / "tune" / "tuned.flags").read_text().splitlines()
    changed = result["tuned_flags"]["changed"]
    for name, value in changed.items():
        at = lines.index(f"--{name}={value}")
        assert lines[at - 1].startswith("# ") and len(lines[at - 1]) > 10
    if "batching" in changed:
        assert result["batching"] == changed["batching"]
    assert "chosen:" in stdout
