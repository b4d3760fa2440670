"""tune on text: token candidates (batching x tokens_per_batch) ranked by predicted real tokens/s, and their JSON. (A real text tune runs in about a minute on 2 cores; it is left out of the suite for its time.)"""

import json

from tfspeed.tuning import measurements as ms
from tfspeed.tuning import predict

# Twice tests/test_tune.py's: measuring batches three ways and times a transformer's step
# (XLA off and on) before any run verifies; 60 s left none on a busy 2-core machine.


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
