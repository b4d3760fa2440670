"""One plan (tfspeed.plan): every auto resolved from what is known, with its reason and
its source; the model-free pipeline resolves as the driver does; and the batching is decided
in that one module."""

import re
from pathlib import Path

import pytest

from tfspeed import plan
from tfspeed.config import BATCHING_MODES
from tfspeed.errors import UsageError
from tfspeed.probes.costs import AUTO_MARGIN, BATCHING_MARGIN
from tfspeed.runtime import Hardware

REPO = Path(__file__).resolve().parents[1]
CPU = Hardware(cpu_flags=frozenset({"avx2"}))
CPU_BF16 = Hardware(cpu_flags=frozenset({"avx512_bf16"}))


@pytest.mark.parametrize("requested, accelerator, batching, on, source", [
    ("on", False, "bucket", True, "given"),
    ("off", True, "pack", False, "given"),
    ("auto", True, "bucket", True, "predicted"),  # an accelerator: every shape
    ("auto", False, "pack", True, "predicted"),  # one static shape, one compile
    ("auto", False, "bucket", False, "predicted"),  # a compile per bucket
    ("auto", False, None, False, "predicted"),  # images
])
def test_xla_from_the_flag_the_hardware_and_the_batching(requested, accelerator, batching,
                                                         on, source):
    decided = plan.xla(requested, accelerator, batching)
    assert (decided.value, decided.source) == (on, source)
    assert decided.reason.startswith("--xla=" if source == "given" else "auto: ")


def test_the_modes_that_compile_follow_the_same_rule():
    assert plan.compiled_modes("auto", False, compiles_every_step=True) == BATCHING_MODES
    assert plan.compiled_modes("on", True, False) == BATCHING_MODES
    assert plan.compiled_modes("auto", False, False) == ("pack",)  # TensorFlow on a CPU
    assert plan.compiled_modes("off", False, False) == ()
    assert plan.batching_modes(False) == ("pad", "bucket")


def _never(*_):
    raise AssertionError("not to be called")


def test_a_given_batching_is_neither_recalled_nor_timed():
    decided, measured = plan.batching("bucket", {}, True, recall=_never, probe=_never)
    assert decided == plan.Decision("bucket", "--batching=bucket", "given") and measured == {}


def test_auto_batching_reuses_the_first_runs_decision():
    first = {"mode": "pack", "reason": "auto: pack, measured", "measured": {"pack": {}}}
    decided, measured = plan.batching("auto", {}, True, recall=lambda: first, probe=_never)
    assert (decided.value, decided.source) == ("pack", "reused")
    assert decided.reason == "auto: pack, measured; reused from the first run"
    assert measured == {"pack": {}}


def test_auto_batching_predicts_where_the_costs_are_far_apart():
    costs = {"pad": 3.0, "bucket": 1.0, "pack": BATCHING_MARGIN + 0.1}
    decided, measured = plan.batching("auto", costs, True, recall=lambda: None, probe=_never)
    assert (decided.value, decided.source, measured) == ("bucket", "predicted", {})
    assert decided.reason.startswith("auto: bucket, the least compute per real token")
    assert f"not timed: predicted {BATCHING_MARGIN + 0.1:.2f}x apart" in decided.reason


def test_auto_batching_times_a_close_call_and_takes_the_faster():
    costs = {"pad": 3.0, "bucket": 1.0, "pack": 1.2}
    probe = lambda: {"rates": {"bucket": 900.0, "pack": 1000.0}, "steps": 16}  # noqa: E731
    decided, measured = plan.batching("auto", costs, True, probe=probe)
    assert (decided.value, decided.source) == ("pack", "measured")  # not the predicted bucket
    assert decided.reason.startswith("auto: pack, the more real tokens/s measured over 16")
    assert measured == {"bucket": {"real_tokens_per_sec": 900.0, "batches": 16},
                        "pack": {"real_tokens_per_sec": 1000.0, "batches": 16}}
    skipped, _ = plan.batching("auto", costs, True, probe=lambda: {"skipped": "a short run"})
    assert (skipped.value, skipped.source) == ("bucket", "predicted")
    assert skipped.reason.endswith("; not timed: a short run")
    untimed, _ = plan.batching("auto", costs, True)  # no probe here: the prediction
    assert untimed == plan.predict_batching(costs, True)


def test_auto_never_packs_for_a_model_without_segment_ids():
    costs = {"pad": 2.0, "bucket": 1.0, "pack": 0.1}
    decided, _ = plan.batching("auto", costs, False, probe=_never)
    assert decided.value == "bucket" and "pack left out" in decided.reason
    # Bucketing has to save AUTO_MARGIN over padding each batch to its longest.
    close = {"pad": 1.0, "bucket": 1.0 - AUTO_MARGIN / 2, "pack": 0.1}
    assert plan.batching("auto", close, False)[0].value == "pad"


def test_precision_from_the_hardware_and_whether_to_time_it():
    auto = plan.precision("auto", CPU_BF16)
    assert (auto.value, auto.source) == ("mixed_bfloat16", "predicted")
    assert plan.precision_to_measure("auto", auto.reason)  # a CPU's bf16 is timed
    plain = plan.precision("auto", CPU)
    assert plain.value == "float32" and not plan.precision_to_measure("auto", plain.reason)
    gpu = plan.precision("auto", Hardware(gpus=((8, 0),)))
    assert gpu.value == "mixed_bfloat16" and not plan.precision_to_measure("auto", gpu.reason)
    assert plan.precision("measure", CPU).value == "mixed_bfloat16"
    assert plan.precision_to_measure("measure", "")
    assert plan.precision("float32", CPU_BF16) == plan.Decision(
        "float32", "--precision=float32", "given")
    with pytest.raises(UsageError, match="mixed_float16 needs a GPU"):
        plan.precision("mixed_float16", CPU)


def test_steps_per_execution_from_the_trainers_tuning():
    assert plan.steps_per_execution(4, {"value": 4}).source == "given"
    measured = {"value": 8, "auto": True, "call_overhead_ms": 1.0, "step_ms": 2.0,
                "probe_steps": 33, "rule": "smallest power of two"}
    assert plan.steps_per_execution("auto", measured).source == "measured"
    reused = plan.steps_per_execution("auto", {**measured, "reused": "from the first run"})
    assert (reused.value, reused.source) == (8, "reused")
    short = plan.steps_per_execution("auto", {"value": 16, "probe": "none: too few"})
    assert (short.value, short.source) == (16, "predicted")


def test_steps_per_call_and_placement_are_the_plans_rules():
    # The smallest power of two whose call overhead is at most 2 % of the call.
    assert plan.steps_per_call(plan.CallCost(4e-4, 7e-4), cap=50) == 32
    assert plan.steps_per_call(plan.CallCost(4e-4, 7e-4), cap=20) == 20  # one epoch at most
    assert plan.unmeasured_steps_per_call(5) == 5 and plan.unmeasured_steps_per_call(99) == 16
    fits = plan.placement("auto", "train", 6.3, 1000.0, "half the RAM", "")
    assert (fits.value, fits.source) == ("device", "predicted")
    assert "~6.3 MB, the budget is 1,000 MB (half the RAM): held in the step" in fits.reason
    big = plan.placement("auto", "train", 2000.0, 1000.0, "--ram_budget_mb", "")
    assert big.value == "host" and big.reason.endswith(": tf.data")
    served = plan.placement("auto", "train", 1.0, 1000.0, "", "--data_service reads elsewhere")
    assert served == plan.Decision("host", "auto: --data_service reads elsewhere", "predicted")
    assert plan.placement("host", "train", 1.0, 1e3, "", "").source == "given"
    with pytest.raises(UsageError, match="cannot hold the input in the step: tokens; use "
                                         "--input_placement=host or auto"):
        plan.placement("device", "train", 1.0, 1e3, "", "tokens")


def test_the_cache_is_the_plans_rule():
    read_once = plan.cache("auto", "validation", 7.0, 1.0, "--ram_budget_mb=1", True)
    assert read_once == plan.Decision(
        "none", "auto: 'validation' is read once, a cache cannot pay", "predicted")
    fits = plan.cache("auto", "train", 7.0, 100.0, "half the RAM", False)
    assert fits.value == "memory" and fits.reason == (
        "auto: 'train' cached takes ~7 MB, the budget is 100 MB (half the RAM): in memory")
    big = plan.cache("auto", "train", 7.0, 1.0, "--ram_budget_mb=1", False)
    assert big.value == "disk" and big.reason.endswith(": on disk, under --cache_dir")
    assert plan.cache("none", "train", 7.0, 1.0, "", False) == plan.Decision(
        "none", "--cache=none", "given")
    assert plan.cache("memory", "train", 7.0, 100.0, "", True).value == "memory"
    with pytest.raises(UsageError, match=r"--cache=memory cannot hold the data: 'train' cached "
                                         r"takes ~7 MB, the budget is 1 MB \(x\); use --cache=disk"):
        plan.cache("memory", "train", 7.0, 1.0, "x", False)


def test_the_steps_per_call_placement_and_cache_rules_are_written_once():
    rules = re.compile(r"overhead\s*>\s*\w*OVERHEAD|estimate_mb\s*[<>]=?\s*budget_mb")
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "tfspeed").rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if rules.search(line) and path != REPO / "tfspeed" / "plan.py"]
    assert not found, found
    assert len(rules.findall((REPO / "tfspeed" / "plan.py").read_text())) == 3


def test_the_plan_keeps_one_decision_a_name_and_reports_each():
    decided = plan.Plan().with_(xla=plan.xla("auto", False, "pack"))
    decided = decided.with_(xla=plan.xla("off", False), batching=plan.Decision("pad", "r", "given"))
    assert decided.value("xla") is False and decided.value("missing", 3) == 3
    assert decided.to_json() == {
        "xla": {"value": False, "reason": "--xla=off", "source": "given"},
        "batching": {"value": "pad", "reason": "r", "source": "given"}}
    inputs = plan.of_input(
        type("Data", (), {"input_placement": "auto", "cache": "disk"}),
        {"placement": {"where": "host", "reason": "auto: too big"},
         "cache": {"train": {"mode": "disk", "reason": "--cache=disk"}}})
    assert inputs.get("input_placement").source == "predicted"
    assert inputs.get("cache.train") == plan.Decision("disk", "--cache=disk", "given")


def test_the_model_free_pipeline_resolves_as_the_driver_does(text_dirs, tmp_path):
    """tfspeed.data.build's auto (no model to ask) and the driver's, for a model tfspeed
    does not know, on the same data: the same batching. Before, the pipeline resolved
    without the runtime (every shape taken as compiled), the driver with it: 2 buckets
    against 3 on this split."""
    import dataclasses

    import tfspeed.data
    from tfspeed import runtime
    from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
    from tfspeed.data import pipeline
    from tfspeed.data import schema as schema_lib
    from tfspeed.training import job

    data_dir = text_dirs["classification"]
    config = Config(data=DataConfig(data_dir=data_dir, batch_size=16, shuffle=False),
                    model=ModelConfig(name="my_models:classifier"),  # a user's: not loaded
                    runtime=RuntimeConfig(strategy="default", precision="float32"),
                    train=TrainConfig(epochs=1), model_dir=str(tmp_path)).validate()
    schema = schema_lib.read(data_dir)
    driver = job.resolve_batching(config, runtime.setup(config.runtime), schema)
    alone = pipeline.model_free_batching(config.data, schema)
    same = ("mode", "max_length", "tokens_per_batch", "batch_size", "boundaries",
            "bucket_batch_sizes", "max_segments", "expected_padding", "free_shapes")
    assert {k: getattr(alone, k) for k in same} == {k: getattr(driver, k) for k in same}
    assert alone.mode != "pack" and alone.source == driver.source == "predicted"
    # What tfspeed.data.build yields is that batching's.
    widths = {int(x["tokens"].shape[1]) for x, _ in tfspeed.data.build(
        data_dir, "train", 16, training=True, shuffle=False).take(8)}
    if driver.mode == "bucket":
        assert widths <= set(driver.boundaries)
    forced = pipeline.model_free_batching(dataclasses.replace(config.data, batching="pack"),
                                          schema)
    assert forced.mode == "pack" and forced.source == "given"


def test_the_plan_imports_no_tensorflow():
    """Flags are resolved into a plan before TensorFlow starts (tune and diagnose predict
    with it)."""
    import subprocess
    import sys

    code = "import sys, tfspeed.plan; print('tensorflow' in sys.modules, 'keras' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


# Comparing --batching (or XLA's packed-rows rule) with auto anywhere but tfspeed/plan.py is
# a second decider: the walk of the batching decision touches one module.
_DECIDES_BATCHING = re.compile(r"(batching|\bmode)\W*(==|!=)\s*(\"auto\"|AUTO)"
                               r"|is_auto\([^)]*batching|(\"auto\"|AUTO)\s*(==|!=)\W*\w*batching")
_XLA_FOR_PACK = re.compile(r"xla.*[=!]=.*\"pack\"|\"pack\".*xla\W*[=!]=")


def test_the_batching_and_xla_for_pack_are_decided_in_one_module():
    found = []
    for path in sorted((REPO / "tfspeed").rglob("*.py")):
        if path == REPO / "tfspeed" / "plan.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _DECIDES_BATCHING.search(line) or _XLA_FOR_PACK.search(line):
                found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "decided outside tfspeed/plan.py:\n" + "\n".join(found)
    # The rule the test looks for is there (it would find the old deciders).
    assert _DECIDES_BATCHING.search('if config.data.batching == "auto":')
    assert _DECIDES_BATCHING.search("is_auto(self.config.data.batching)")
    assert _DECIDES_BATCHING.search('    if mode == "auto":')
    assert _XLA_FOR_PACK.search('if config.xla != "auto" or runtime.plan.xla or batching != "pack":')
    assert _XLA_FOR_PACK.search('if mode == "pack" or c.xla == "off" or')
    assert _XLA_FOR_PACK.search('return ("pack",) if config.runtime.xla == "auto" else ()')
