"""tfspeed.diagnose on token records: the padding the job computes, the batching to try, and
a verdict that follows from the figures."""

import json
import os
import subprocess
import sys

import pytest

from tests import forked
from tests.conftest import REPO
from tfspeed import diagnose
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig

QUICK = diagnose.Options(steps=12, warmup=3, profile_steps=4)
TINY = {"name": "transformer", "width": 16, "depth": 1, "heads": 2}
# Far more steps than --diagnose_seconds lets each measurement run: only the time limit ends
# them (padded batches of long texts once kept diagnose silent for 400 s).
UNBOUNDED_STEPS = 100_000


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory) -> str:
    """Python's json, logging and http sources, BPE-tokenised, in pieces of up to 512
    tokens: lengths from a few tokens to 512, so padding each batch to its longest wastes
    ~38% (the schema's expected figure), well clear of the advice's 20% threshold."""
    out = tmp_path_factory.mktemp("stdlib") / "data"
    subprocess.run([sys.executable, str(REPO / "scripts" / "to_tfrecord.py"),
                    "--source=pystdlib:json,logging,http", f"--output={out}",
                    "--tokenizer=bpe:2000", "--max_length=512", "--long=split"],
                   check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def padded(stdlib_corpus, tmp_path_factory):
    """``python -m tfspeed.diagnose --batching=pad`` as a user runs it: (the process,
    diagnose.json)."""
    model_dir = tmp_path_factory.mktemp("padded")
    run = forked.run(
        [sys.executable, "-m", "tfspeed.diagnose", f"--data_dir={stdlib_corpus}",
         f"--model_dir={model_dir}", "--model=transformer", "--width=16", "--depth=1",
         "--heads=2", "--batch_size=8", "--eval_split=", "--batching=pad",
         "--precision=float32", "--steps_per_execution=1",
         f"--diagnose_steps={UNBOUNDED_STEPS}", "--diagnose_warmup=3", "--diagnose_seconds=1"],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO)},
        timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run, json.loads((model_dir / "diagnose" / "diagnose.json").read_text())


def _diagnose(data_dir, model_dir, batching):
    config = Config(
        data=DataConfig(data_dir=data_dir, batch_size=8, eval_split="", batching=batching),
        model=ModelConfig(**TINY), runtime=RuntimeConfig(precision="float32"),
        train=TrainConfig(steps_per_execution=1), model_dir=str(model_dir)).validate()
    result = diagnose.run(config, QUICK)
    with open(model_dir / "diagnose" / "diagnose.json") as f:
        return result, json.load(f)


def test_padded_batches_name_packing_as_the_fix(padded):
    run, written = padded
    assert written["padding_fraction"] > 0.2, written["tokens"]
    assert written["real_tokens_per_sec"] > 0 and written["unit"] == "sequences"
    assert written["tokens"]["real_tokens"] < written["tokens"]["computed_tokens"]
    assert written["batching"]["mode"] == "pad"
    # Token pipelines are timed whole: their stage cuts end in unbatchable sequences.
    assert list(written["stages_ms_per_batch"]) == ["read+batch"]
    advice = [s["advice"] for s in written["next_steps"]]
    padding = [a for a in advice if "of the tokens computed are padding" in a]
    costs = written["batching"]["costs"]
    best = min(("bucket", "pack"), key=costs.get)
    assert padding and f"--batching={best}" in padding[0], advice  # the larger gain first
    # Each mode is advised exactly when it is predicted 1.1x cheaper (compiles counted).
    for mode in ("bucket", "pack"):
        advised = any(f"--batching={mode}" in a for a in padding)
        assert advised == (costs["pad"] / costs[mode] >= 1.1), (mode, costs, advice)
    assert "sequences/s" in run.stdout and "real tokens/s" in run.stdout
    assert f"--batching={best}" in run.stdout and "predicted compute per real token" in run.stdout


def test_padded_batches_are_measured_within_the_time_limit_with_progress(padded):
    run, written = padded
    timed = written["steps_timed"]
    assert set(timed) == {"input_alone", "compute_alone", "together", "profile"}
    assert all(1 <= n < UNBOUNDED_STEPS for n in timed.values()), timed
    for figure in ("examples_per_sec", "ms_per_batch"):
        assert all(v > 0 for v in written[figure].values()), written[figure]
    # Each measurement says what it starts and what it found, on stderr as absl INFO lines.
    progress = [line for line in run.stderr.splitlines() if "diagnose: " in line]
    for what in ("input alone", "model alone", "together", "profile"):
        assert any(what in line for line in progress), progress


def test_packed_batches_have_little_padding_and_no_batching_advice(stdlib_corpus, tmp_path):
    _, written = _diagnose(stdlib_corpus, tmp_path, "pack")
    assert written["padding_fraction"] < 0.05, written["tokens"]
    batching = written["batching"]
    assert batching["mode"] == "pack"
    # Long code: packed rows of 512 cost about what buckets of its lengths do in attention
    # and padding; what decides is XLA's compile of the packed shape in a one-pass run. A
    # batching is advised exactly when it is predicted 1.1x cheaper.
    costs = batching["costs"]
    advised = [s["advice"] for s in written["next_steps"] if "--batching=" in s["advice"]]
    assert bool(advised) == (costs["pack"] >= 1.1 * min(costs["bucket"], costs["pad"])), (
        costs, advised)
    # The transformer's step is far heavier than its input, and the verdict says so; the
    # profile of that step (xprof's wait) once counted the one-step function's first
    # trace and called it input-bound.
    assert written["verdict"] == "compute-bound", written["why"]
    ms = written["ms_per_batch"]
    assert ms["compute_alone"] > 10 * ms["input_alone"], ms
    assert written["profile"]["input_wait_pct"] < 20, written["profile"]
    # Model alone and together count the sequences of the batches they trained on: a
    # step's sequences at the step's rate (one held batch's count once stood for all).
    per_step = {k: written["examples_per_sec"][k] * ms[k] / 1000
                for k in ("compute_alone", "together")}
    assert 0.5 < per_step["compute_alone"] / per_step["together"] < 2, per_step


def test_short_texts_in_long_packed_rows_name_their_attention_waste(short_texts, tmp_path):
    """Docstrings of ~20 tokens packed into rows as long as the longest (hundreds): under 10%
    padding, yet each token attends over the whole row. diagnose names that waste, and the
    batching that computes less, which padding figures alone would never show."""
    _, written = _diagnose(short_texts, tmp_path, "pack")
    batching = written["batching"]
    assert written["padding_fraction"] < 0.10 and batching["mode"] == "pack"
    # (2x with a token budget; a classifier's buckets of 8 texts must each fill twice a pass,
    # so on this small split the long tail shares wide buckets: 1.2x.)
    assert batching["costs"]["pack"] > 1.1 * batching["costs"]["bucket"], batching["costs"]
    advice = [s["advice"] for s in written["next_steps"] if "--batching=" in s["advice"]]
    assert advice and "--batching=bucket" in advice[0], advice
    assert f"each token attends over all {batching['max_length']} positions" in advice[0]


@pytest.mark.parametrize("given", ["measure", "float32"])
def test_precision_advice_never_goes_against_its_measurement(short_texts, tmp_path, given):
    """Real docstrings, the transformer: with --precision=measure the driver's probe times
    both policies and diagnose reads its figures; with float32 given, diagnose times the
    step in the mixed policy this hardware offers itself. Either way a policy is advised
    only where it measured faster, and the gain cites the measured ratio."""
    from tfspeed.diagnosis import precision
    from tfspeed.probes.costs import AUTO_MARGIN
    from tfspeed.runtime import detect_hardware, resolve

    config = Config(
        data=DataConfig(data_dir=short_texts, batch_size=8, eval_split="", batching="bucket"),
        model=ModelConfig(**TINY), runtime=RuntimeConfig(precision=given),
        train=TrainConfig(steps_per_execution=1), model_dir=str(tmp_path)).validate()
    result = diagnose.run(config, diagnose.Options(steps=4, warmup=1, profile_steps=2,
                                                   seconds=2.0))
    measured = result["precision"]
    source = precision.PROBE_SOURCE if given == "measure" else precision.OWN_SOURCE
    hardware = precision.alternative(resolve(RuntimeConfig(precision="float32"),
                                             detect_hardware()))
    if given == "measure" or hardware:  # float32 given on a host without bf16: nothing to time
        assert measured["source"] == source and len(measured["ms_per_step"]) == 2, measured
    ms = (measured or {}).get("ms_per_step", {})
    now = result["settings"]["precision"]
    advised = [s for s in result["next_steps"] if "--precision=" in s["advice"]]
    for step in advised:
        policy = step["advice"].split("--precision=")[1].split(":")[0]
        assert ms[policy] <= (1 - AUTO_MARGIN) * ms[now], (ms, step)
        assert step["expected_gain"] == f"{ms[now] / ms[policy]:.2f}x measured"
    faster = [p for p, t in ms.items() if p != now and t <= (1 - AUTO_MARGIN) * ms[now]]
    assert len(advised) == len(faster), (ms, advised)
