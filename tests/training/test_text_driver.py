"""The driver on token records (Python's json and logging sources, converted by the real
converter): the transformer trains under each batching mode for classification and lm,
resumes exactly, and trains mirrored over two CPU replicas; report.json says how it batched."""

import dataclasses
import math
import os
import shutil

import pytest
import tensorflow as tf

from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.errors import UsageError
from tfspeed.training.run import run


@pytest.fixture(scope="session")
def corpora(text_dirs):
    return text_dirs


def _config(data_dir, model_dir, *, batching="auto", steps=6, strategy="default", replicas=0,
            model="transformer", every=0, eval_split="validation"):
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=8, batching=batching, cache="memory",
                        shuffle=False, eval_split=eval_split),
        model=ModelConfig(name=model, width=16, depth=1, heads=2),
        runtime=RuntimeConfig(strategy=strategy, cpu_replicas=replicas, precision="float32",
                              xla="off", intra_op_threads=0),
        train=TrainConfig(train_steps=steps, steps_per_execution=1, learning_rate=0.01,
                          log_every=2, checkpoint_every=every),
        model_dir=str(model_dir),
    ).validate()


@pytest.mark.parametrize("task, batching", [("classification", "pad"), ("lm", "bucket"),
                                            ("classification", "pack"), ("lm", "pack")])
def test_each_batching_trains_and_reports(corpora, tmp_path, task, batching):
    report = run(_config(corpora[task], tmp_path, batching=batching))
    assert report["optimizer_updates"] == 6
    assert all(math.isfinite(v) for v in report["train_metrics"].values()
               if isinstance(v, float))
    chosen = report["input"]["batching"]
    assert chosen["mode"] == batching and chosen["max_length"] == 64
    assert report["plan"]["batching"] == {"value": batching, "reason": f"--batching={batching}",
                                          "source": "given"}
    # By default --batch_size sequences of the mean length, at least one row of T.
    assert chosen["tokens_per_batch"] == max(round(8 * chosen["mean_length"]), 64)
    assert "expected_padding" in chosen
    assert report["input"]["placement"]["where"] == "host"
    dataset = report["dataset"]
    assert dataset["task"] == task and dataset["vocab_size"] == 300
    assert dataset["tokens"]["tokens"] > 0 and "lengths" not in dataset["tokens"]


def test_auto_takes_the_mode_of_least_predicted_compute(corpora, tmp_path):
    report = run(_config(corpora["classification"], tmp_path, steps=2))
    batching = report["input"]["batching"]
    costs = batching["costs"]
    assert batching["mode"] == min(("bucket", "pack"), key=costs.get)
    assert batching["reason"].startswith(f"auto: {batching['mode']}")
    assert f"pack {costs['pack']:.2f}" in batching["reason"]
    # Two steps leave no room to time the modes: the reason says so, and nothing was.
    assert "; not timed: " in batching["reason"] and batching["measured"] == {}
    # report.json's plan holds every auto, each with its value, reason and source.
    plan = report["plan"]
    assert plan["batching"] == {"value": batching["mode"], "reason": batching["reason"],
                                "source": "predicted"}
    assert plan["precision"]["source"] == "given" and plan["xla"]["source"] == "given"
    assert plan["cache.train"] == {"value": "memory", "reason": "--cache=memory",
                                   "source": "given"}
    assert plan["steps_per_execution"]["source"] == "given"
    assert plan["strategy"]["source"] == "given"
    assert plan["input_placement"]["value"] == "host"
    # The transformer's K (width 16, depth 1, 2 heads): its attention is counted.
    assert batching["attention_length"] == pytest.approx(12 * 16 * 16 / (2 * 16 + 19 * 2))


def test_auto_times_bucket_and_pack_where_the_run_is_long_enough(short_texts, tmp_path):
    """Where neither mode is predicted clearly cheaper (within probes.costs.BATCHING_MARGIN) and
    a long run has room for it, auto trains fresh copies of the job's model on the same
    number of each mode's real batches and takes the one with more real tokens/s; the
    batching is then that mode's own, and report.json's ``measured`` says what was timed."""
    from tfspeed import runtime
    from tfspeed.data import schema as schema_lib
    from tfspeed.probes import autotune
    from tfspeed.probes.costs import BATCHING_MARGIN
    from tfspeed.training import job

    config = _config(short_texts, tmp_path, steps=100_000)
    # Rows of 64 (longer docstrings split): bucket 2.1 and pack 2.5 units of work per real
    # token predicted for this model (uncompiled), a call the cost model cannot make alone.
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, max_length=64))
    rt = runtime.setup(config.runtime)
    schema = schema_lib.read(short_texts)
    predicted = job.resolve_batching(config, rt, schema)
    costs = predicted.costs
    assert max(costs["bucket"], costs["pack"]) < BATCHING_MARGIN * min(
        costs["bucket"], costs["pack"]), costs  # a close call on this split
    chosen = job.measure_batching(config, rt, schema)
    assert chosen.source == "measured" and predicted.source == "predicted"
    rates = {m: f["real_tokens_per_sec"] for m, f in chosen.measured.items()}
    assert set(rates) == {"bucket", "pack"} and min(rates.values()) > 0, chosen.measured
    bucket = job.resolve_batching(dataclasses.replace(config, data=dataclasses.replace(
        config.data, batching="bucket")), rt, schema)
    # A run this long times every bucket about twice.
    steps = max(2 * autotune.PROBE_N, 2 * len(bucket.boundaries))
    assert {f["batches"] for f in chosen.measured.values()} == {steps}
    assert chosen.mode == max(rates, key=rates.get)
    assert chosen.reason.startswith(f"auto: {chosen.mode}, the more real tokens/s measured")
    forced = job.resolve_batching(dataclasses.replace(config, data=dataclasses.replace(
        config.data, batching=chosen.mode)), rt, schema)
    assert dataclasses.replace(chosen, reason=forced.reason, measured={},
                               source=forced.source) == forced


def _checkpoint_files(model_dir):
    return sorted(os.listdir(os.path.join(model_dir, "checkpoints")))


def test_pack_resumes_exactly(corpora, tmp_path):
    data = corpora["lm"]
    straight = run(_config(data, tmp_path / "straight", batching="pack", steps=10, every=3,
                           eval_split=""))
    # A run stopped at 6 updates (its last checkpoint), then rerun to the total of 10.
    cut = tmp_path / "cut"
    run(_config(data, cut, batching="pack", steps=6, every=3, eval_split=""))
    resumed = run(_config(data, cut, batching="pack", steps=10, every=3, eval_split=""))
    assert resumed["resumed_from_update"] == 6
    assert resumed["weights_sha256"] == straight["weights_sha256"]
    # And one killed between checkpoints (after ckpt-9, before the final one) finishes alike.
    killed = tmp_path / "killed"
    shutil.copytree(tmp_path / "straight", killed)
    for name in os.listdir(killed / "checkpoints"):
        if name.startswith("ckpt-10."):
            os.remove(killed / "checkpoints" / name)
    prefix = str(killed / "checkpoints" / "ckpt-")
    kept = [prefix + n for n in ("3", "6", "9")
            if os.path.exists(f"{prefix}{n}.index")]
    tf.compat.v1.train.update_checkpoint_state(str(killed / "checkpoints"), kept[-1],
                                               all_model_checkpoint_paths=kept)
    again = run(_config(data, killed, batching="pack", steps=10, every=3, eval_split=""))
    assert again["resumed_from_update"] == 9
    assert again["weights_sha256"] == straight["weights_sha256"]


@pytest.mark.parametrize("batching", ["bucket"])
def test_mirrored_trains(corpora, tmp_path, batching):
    report = run(_config(corpora["classification"], tmp_path, batching=batching,
                         strategy="mirrored", replicas=2))
    assert report["optimizer_updates"] == 6 and report["runtime"]["num_replicas"] == 2
    assert all(math.isfinite(v) for v in report["train_metrics"].values()
               if isinstance(v, float))


def test_an_image_model_on_text_is_refused_in_one_line(corpora, tmp_path):
    with pytest.raises(UsageError, match="does not take token records"):
        run(_config(corpora["classification"], tmp_path, model="mlp", steps=1))


@pytest.mark.parametrize("batching", ["bucket", "pack"])
def test_an_epoch_of_text_is_one_pass_over_its_tokens(corpora, tmp_path, batching):
    """--epochs counts passes over the split's tokens, not --batch_size records: a batch is a
    token budget under bucket and pack."""
    from tfspeed.data import schema as schema_lib
    from tfspeed.data import text

    config = _config(corpora["classification"], tmp_path, batching=batching, steps=0)
    config = dataclasses.replace(  # a budget of 1024 tokens: twice --batch_size x --max_length
        config, data=dataclasses.replace(config.data, tokens_per_batch=1024),
        train=dataclasses.replace(config.train, epochs=1))
    report = run(config)
    schema = schema_lib.read(corpora["classification"])
    chosen = text.Batching(**{**report["input"]["batching"],
                              "boundaries": tuple(report["input"]["batching"]["boundaries"]),
                              "bucket_batch_sizes": tuple(
                                  report["input"]["batching"]["bucket_batch_sizes"])})
    expected = text.batches_per_epoch(chosen, schema, "train")
    assert report["optimizer_updates"] == expected
    tokens = schema.split("train").text["tokens"]
    computed = expected * chosen.tokens_per_batch
    # One pass: the tokens trained on are the split's, less a last partial batch per bucket.
    assert 0.6 * tokens <= computed <= 1.2 * tokens, (computed, tokens)
    assert report["optimizer_updates"] < 0.6 * (schema.split("train").num_records // 8)


def _sgd_run(data_dir, model_dir, *, rows, accumulate=1, replicas=0, steps=6):
    config = _config(data_dir, model_dir, batching="pack", steps=steps,
                     strategy="mirrored" if replicas else "default", replicas=replicas,
                     eval_split="")
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, tokens_per_batch=rows * 64,
                                         deterministic=True),
        train=dataclasses.replace(config.train, optimizer="sgd", learning_rate=0.1,
                                  grad_accum_steps=accumulate),
        runtime=dataclasses.replace(config.runtime, xla="auto"))
    report = run(config.validate())
    import keras

    return report, keras.models.load_model(os.path.join(model_dir, "model.keras")).get_weights()


@pytest.mark.parametrize("task", ["classification", "lm"])
def test_sgd_through_the_pipeline_mirrored_and_accumulated_equals_one_big_batch(corpora,
                                                                               tmp_path, task):
    """The job's real path (pack -> per-replica halves -> engine) under two replicas and
    two micro-batches an update trains exactly as one replica on batches twice as large:
    packing's row stream does not depend on the batch, and the loss is exact per real token
    (lm) or sequence, however they fall over micro-batches and replicas. Packed rows of 64
    tokens: XLA on (auto), per replica."""
    import numpy as np

    data = corpora[task]
    split, split_weights = _sgd_run(data, tmp_path / "split", rows=4, accumulate=2,
                                    replicas=2)
    whole, whole_weights = _sgd_run(data, tmp_path / "whole", rows=8)
    assert split["runtime"]["num_replicas"] == 2 and split["runtime"]["xla"]
    assert split["optimizer_updates"] == whole["optimizer_updates"] == 6
    for got, want in zip(split_weights, whole_weights, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
    # The control: an update of half the rows moves the weights elsewhere.
    _, half = _sgd_run(data, tmp_path / "half", rows=4)
    assert max(float(np.abs(a - b).max()) for a, b in zip(half, whole_weights, strict=True)) \
        > 1e-3


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_xla_compiles_the_step_once_per_shape(short_texts, tmp_path, mode):
    """XLA compiles per input shape, under one trace: the report's compiled_programs (1)
    cannot tell. XLA's own dump counts the step's compiled modules: at most one per bucket,
    however many batches of each, and one for packed rows (a strided slice whose start came
    from the data once made XLA compile the step again for every batch)."""
    import json
    import subprocess
    import sys

    from tests.conftest import REPO, XLA_FLAGS

    dump, run_dir = tmp_path / "xla", tmp_path / "run"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3",
           "XLA_FLAGS": f"{XLA_FLAGS} --xla_dump_to={dump} "
                        "--xla_dump_hlo_module_re=.*forward_backward.*"}
    done = subprocess.run(
        [sys.executable, "-m", "tfspeed.train", f"--data_dir={short_texts}",
         f"--model_dir={run_dir}", "--model=transformer", "--width=16", "--depth=1",
         "--heads=2", f"--batching={mode}", "--xla=on", "--max_length=96",
         "--batch_size=16", "--train_steps=12", "--eval_split=", "--steps_per_execution=1"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    buckets = report["input"]["batching"]["boundaries"]
    # XLA's modules by the traced function they compile (``module_N.<function>.M...``).
    functions = {}
    for path in dump.glob("*forward_backward*before_optimizations.txt"):
        module, function = path.name.split(".")[:2]
        functions.setdefault(function, set()).add(module)
    assert report["compiled_programs"] == 1  # one trace, whatever the shapes
    # On a host with native bfloat16 (or oneDNN forced on) the precision probe ran first:
    # one fresh engine per policy, each compiled for its one held batch, and the report
    # counts them. The run's own step is the function traced last.
    probes = report["probe_compiled_programs"].get("precision", 0)
    assert len(functions) == 1 + probes, sorted(functions)
    assert all(len(functions[f]) == 1 for f in sorted(functions, key=_trace_id)[:-1])
    compiled = functions[max(functions, key=_trace_id)]
    if mode == "pack":
        assert len(compiled) == 1, sorted(compiled)
    else:
        assert 2 <= len(compiled) <= len(buckets), (sorted(compiled), buckets)


def _trace_id(function: str) -> int:
    """``a_inference__replica_forward_backward_2661__`` -> 2661: TF numbers traces in order."""
    return int(function.rstrip("_").rsplit("_", 1)[1])
