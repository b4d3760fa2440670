"""The text pipeline on a real corpus (Python's json and logging sources, converted by the
real converter): every batching mode keeps the batch contract, the promised static shapes
and padding, sees every token once per epoch, is seeded, and splits evenly over replicas."""

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tests.conftest import REPO, token_records
from tfspeed.config import BATCHING_MODES, DataConfig
from tfspeed.data import buckets, pipeline, text
from tfspeed.data import schema as schema_lib
from tfspeed.probes import costs

MAX_LENGTH = 256


def _convert(out, *extra):
    subprocess.run([sys.executable, str(REPO / "scripts" / "to_tfrecord.py"),
                    "--source=pystdlib:json,logging",
                    f"--output={out}", "--tokenizer=bpe:500", f"--max_length={MAX_LENGTH}",
                    "--long=split", *extra], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    return _convert(tmp_path_factory.mktemp("text") / "cls")


@pytest.fixture(scope="session")
def lm_dir(tmp_path_factory):
    return _convert(tmp_path_factory.mktemp("text") / "lm", "--task=lm")


def _token_counts(batches, vocab):
    counts = np.zeros(vocab, np.int64)
    for x, _ in batches:
        real = x["segment_ids"].numpy() > 0
        np.add.at(counts, x["tokens"].numpy()[real], 1)
    return counts


def _reference_counts(data_dir, split, vocab, lm):
    """Token ids of the split's records, read straight from the shards (no batching)."""
    schema = schema_lib.read(data_dir)
    counts = np.zeros(vocab, np.int64)
    for path in schema.shard_paths(data_dir, split):
        for record in tf.data.TFRecordDataset(path):
            example = tf.train.Example.FromString(record.numpy())
            tokens = np.asarray(example.features.feature["tokens"].int64_list.value)
            np.add.at(counts, tokens[:-1] if lm else tokens, 1)
    return counts


def _check_contract(x, y, lm):
    assert set(x) == {"tokens", "segment_ids", "positions"} and set(y) == {"label", "weight"}
    for value in x.values():
        assert value.dtype == tf.int32 and value.shape == x["tokens"].shape
    assert y["label"].dtype == tf.int32 and y["weight"].dtype == tf.float32
    b, t = x["tokens"].shape
    assert y["label"].shape[0] == b and (y["label"].shape[1] == t if lm else True)
    real = x["segment_ids"].numpy() > 0
    assert (x["tokens"].numpy()[~real] == 0).all() and (x["positions"].numpy()[~real] == 0).all()
    if lm:
        np.testing.assert_array_equal(y["weight"].numpy() > 0, real)


@pytest.mark.parametrize("lm", [False, True], ids=["classification", "lm"])
@pytest.mark.parametrize("mode", ["pad", "bucket", "pack"])
def test_each_mode_keeps_the_contract_and_its_shapes(text_dir, lm_dir, mode, lm):
    data_dir = lm_dir if lm else text_dir
    schema = schema_lib.read(data_dir)
    config = DataConfig(data_dir=data_dir, batch_size=16, batching=mode)
    batching = pipeline.model_free_batching(config, schema)  # what build resolves
    ds = tfspeed.data.build(data_dir, "train", 16, training=True, batching=mode)
    widths = set()
    for x, y in ds.take(12):
        _check_contract(x, y, lm)
        widths.add(x["tokens"].shape[1])
        if mode == "pack":
            assert x["tokens"].shape == (batching.rows_per_batch, MAX_LENGTH)
            assert ds.element_spec[0]["tokens"].shape == (batching.rows_per_batch, MAX_LENGTH)
        if mode == "pad":
            assert x["tokens"].shape[0] == 16
    if mode == "bucket":
        assert widths <= set(batching.boundaries) and len(batching.boundaries) >= 2


def _padding(batches):
    real = computed = 0
    for x, _ in batches:
        segments = x["segment_ids"].numpy()
        real, computed = real + (segments > 0).sum(), computed + segments.size
    return 1 - real / computed, real


@pytest.mark.parametrize("mode, most", [("pack", 0.03), ("bucket", 0.10)])
def test_padding_over_an_epoch_of_tokens(text_dir, mode, most):
    tokens = schema_lib.read(text_dir).split("train").text["tokens"]
    ds = tfspeed.data.build(text_dir, "train", 16, training=True, batching=mode)
    seen, batches = 0, []
    for batch in ds:
        batches.append(batch)
        seen += int((batch[0]["segment_ids"].numpy() > 0).sum())
        if seen >= tokens:
            break
    padding, _ = _padding(batches)
    assert padding <= most, f"{mode}: {padding:.1%} padding"


@pytest.mark.parametrize("lm", [False, True], ids=["classification", "lm"])
@pytest.mark.parametrize("mode", ["pad", "bucket", "pack"])
def test_an_epoch_sees_every_token_once_and_eval_drops_nothing(text_dir, lm_dir, mode, lm):
    data_dir = lm_dir if lm else text_dir
    vocab = schema_lib.read(data_dir).text["tokenizer"]["vocab_size"]
    # max_length 48 < the conversion's 256: pack and the other modes split the long ones.
    ds = tfspeed.data.build(data_dir, "validation", 16, batching=mode, max_length=48,
                            long="split")
    batches = list(ds)
    np.testing.assert_array_equal(_token_counts(batches, vocab),
                                  _reference_counts(data_dir, "validation", vocab, lm))
    rows = {x["tokens"].shape[0] for x, _ in batches}
    if mode != "bucket":
        assert len(rows) == 1  # the last batch is filled with empty rows, not short
    assert all(x["tokens"].shape[1] <= 48 for x, _ in batches)
    again = list(tfspeed.data.build(data_dir, "validation", 16, batching=mode, max_length=48))
    for (a, _), (b, _) in zip(batches, again, strict=True):  # finite and in a fixed order
        np.testing.assert_array_equal(a["tokens"], b["tokens"])


def test_training_is_seeded(text_dir):
    def first(seed):
        ds = tfspeed.data.build(text_dir, "train", 16, training=True, batching="pack",
                                seed=seed, deterministic=True)
        return [x["tokens"].numpy() for x, _ in ds.take(3)]

    a, b, c = first(1), first(1), first(2)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert any(not np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_auto_takes_the_least_predicted_compute_and_cites_it(text_dir):
    schema = schema_lib.read(text_dir)
    # Batches of 8: every bucket holds two batches a pass, and this split has 358 texts.
    config = DataConfig(data_dir=text_dir, batch_size=8)
    plain = text.resolve(config, schema)  # a model of unknown attention: padding alone counts
    padding = plain.expected_padding
    # The corpus mixes 3-line helpers with whole classes: bucketing pays.
    assert plain.mode == "bucket" and padding["bucket"] <= text.BUCKET_PADDING_TARGET
    assert plain.costs["bucket"] == pytest.approx(1 / (1 - padding["bucket"]), rel=0.02)
    assert all(f"{m} {plain.costs[m]:.2f}" in plain.reason for m in ("pad", "bucket", "pack"))
    # A model that keeps packed sequences apart: the cheaper of bucket and pack, counting
    # the attention over each row's width (K small: attention dominates, short rows win).
    dear = text.resolve(config, schema, True, attention_length=32.0)
    cheap = text.resolve(config, schema, True, attention_length=1e9)
    for resolved in (dear, cheap):
        assert resolved.mode == min(("bucket", "pack"), key=resolved.costs.get)
    assert dear.costs["pack"] == pytest.approx(
        (1 + MAX_LENGTH / 32) / (1 - padding["pack"]), rel=1e-3)
    assert cheap.costs["pack"] < cheap.costs["bucket"] and cheap.mode == "pack"
    assert cheap.max_length == MAX_LENGTH and cheap.max_segments == MAX_LENGTH // 8
    assert padding["pack"] < 0.05


def test_a_compiled_mode_pays_its_compiles_and_runs_its_steps_faster(text_dir):
    """TensorFlow on a CPU compiles packed rows alone (--xla=auto): pack's predicted cost
    counts the compile as a share of the run and XLA's faster steps; bucket's is as before."""
    schema = schema_lib.read(text_dir)
    config = DataConfig(data_dir=text_dir, batch_size=32)
    plain = text.resolve(config, schema, True, attention_length=241.0, compiled=())
    short, long = (text.resolve(config, schema, True, attention_length=241.0,
                                compiled=("pack",), run_steps=steps) for steps in (40, 4000))
    for run, steps in ((short, 40), (long, 4000)):
        assert run.costs["bucket"] == plain.costs["bucket"]
        gain = costs.xla_gain(run.tokens_per_batch, schema.task)
        assert run.costs["pack"] == pytest.approx(
            plain.costs["pack"] * (1 + costs.COMPILE_BATCHES / steps) / gain, rel=1e-3)
        assert run.mode == min(("bucket", "pack"), key=run.costs.get)
    assert long.costs["pack"] < plain.costs["pack"] < short.costs["pack"]


def test_max_length_comes_from_the_longest_sequence_of_every_split():
    assert text.resolve_max_length(41) == 48
    assert text.resolve_max_length(41, requested=32) == 32
    assert text.resolve_max_length(300, requested=512) == 304  # no row wider than the data
    assert text.resolve_max_length(10**6) == text.MAX_LENGTH_CAP  # the converter's cap too


def test_memory_cache_holds_the_examples_and_changes_no_batch(text_dir):
    from tfspeed.data import plan

    schema = schema_lib.read(text_dir)
    config = DataConfig(data_dir=text_dir, batch_size=16, cache="memory")
    estimate = plan.plan_cache(config, schema, "train", True).estimate_mb
    tokens = schema.split("train").text["tokens"]
    assert tokens * 4 / 2**20 <= estimate < tokens * 8 / 2**20  # int32 examples, not bytes

    def batches(cache):  # the first epoch: after it, an uncached read reshuffles its files
        ds = tfspeed.data.build(text_dir, "train", 16, training=True, batching="bucket",
                                cache=cache, seed=3, deterministic=True)
        return [x["tokens"].numpy() for x, _ in ds.take(8)]

    for a, b in zip(batches("memory"), batches("none"), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["pad", "bucket", "pack"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_mirrored_replicas_get_equal_static_shares(text_dir, mode, training):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    config = DataConfig(data_dir=text_dir, batch_size=16, batching=mode)
    split = "train" if training else "validation"
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: tfspeed.data.build_from_config(config, split, training=training,
                                                   input_context=ctx))
    steps = 0
    for x, y in ds:
        shapes = [tuple(t.shape) for t in strategy.experimental_local_results(x["tokens"])]
        assert len(shapes) == 2 and shapes[0] == shapes[1] and shapes[0][0] > 0
        labels = [tuple(t.shape) for t in strategy.experimental_local_results(y["label"])]
        assert labels[0] == labels[1]
        steps += 1
        if steps == 6:
            break
    assert steps >= 2


def test_placement_is_the_host_for_text_and_device_is_refused(text_dir):
    from tfspeed.data import ingraph
    from tfspeed.errors import UsageError

    schema = schema_lib.read(text_dir)
    config = DataConfig(data_dir=text_dir, batch_size=16)
    placement = ingraph.choose("auto", config, schema, "train")
    assert placement.where == "host" and "token records" in placement.reason
    with pytest.raises(UsageError, match="token records"):
        ingraph.choose("device", config, schema, "train")


def test_auto_buckets_short_texts_for_the_transformer(short_texts):
    """Docstrings of ~20 tokens packed into rows of the longest one would each attend over
    hundreds of positions: auto buckets them (it once packed them, at 0.6x the speed)."""
    from tfspeed.training import transformer

    schema = schema_lib.read(short_texts)
    k = transformer.attention_length(64, 2, 4)  # the built-in transformer's defaults
    # 16 texts a bucketed batch: on this small split (1,167 texts) a bucket must hold 32 of
    # them a pass, so the long tail shares wide buckets (at 64 texts a batch, 71% padding).
    resolved = text.resolve(DataConfig(data_dir=short_texts, batch_size=16), schema, True,
                            attention_length=k)
    assert resolved.mode == "bucket", resolved.reason
    assert resolved.costs["pack"] > 1.15 * resolved.costs["bucket"], resolved.costs
    assert resolved.expected_padding["pack"] < resolved.expected_padding["bucket"]
    assert resolved.mean_length < 40


@pytest.mark.parametrize("corpus", ["code", "short prose"])
def test_buckets_cost_nothing_where_no_shape_compiles(corpus, text_dir, short_texts):
    """TensorFlow without XLA traces the step once for every width: there the job buckets at
    the least padding (up to FREE_BUCKETS, on multiples of FREE_MULTIPLE). Where each shape
    compiles, or where that is not known (``tfspeed.data.build`` for a user's step), the
    fewest buckets under the target. The batches pad exactly as predicted: evaluation fills
    a bucket's short last batch only to whole replica shares there (here one)."""
    data_dir = text_dir if corpus == "code" else short_texts
    schema = schema_lib.read(data_dir)
    config = DataConfig(data_dir=data_dir, batch_size=8, batching="bucket")
    free = text.resolve(config, schema, True, compiled=("pack",))  # TF on a CPU, --xla=auto
    unknown = text.resolve(config, schema, True)
    compiled = text.resolve(config, schema, True, compiled=BATCHING_MODES, run_steps=1000)
    assert len(free.boundaries) <= text.FREE_BUCKETS
    assert all(b % text.FREE_MULTIPLE == 0 for b in free.boundaries[:-1])
    assert len(unknown.boundaries) <= text.MAX_BUCKETS >= len(compiled.boundaries)
    assert free.expected_padding["bucket"] < unknown.expected_padding["bucket"]
    assert free.boundaries[-1] == unknown.boundaries[-1]  # every split's longest fits
    assert measured_padding(config, schema, free) == pytest.approx(
        free.expected_padding["bucket"], abs=0.005)


def measured_padding(config, schema, batching) -> float:
    """The padding fraction of one pass of the train split's evaluation batches."""
    real = computed = 0
    for x, _ in pipeline.build_from_config(config, "train", training=False, schema=schema,
                                           batching=batching):
        real += int(np.sum(x["segment_ids"].numpy() > 0))
        computed += x["tokens"].numpy().size
    return 1 - real / computed


@pytest.mark.parametrize("corpus", ["code", "short prose"])
def test_one_pass_of_bucketed_batches_trains_nearly_every_text(corpus, text_dir, short_texts):
    """group_by_window emits full batches only: a bucket whose batch takes more texts than a
    pass holds keeps them back while the other buckets' batches fill the epoch. With 32
    buckets chosen for the least padding, one pass on pystdlib's code trained 62% of its
    texts. Every bucket now holds at least MIN_BUCKET_BATCHES batches a pass, and the job's
    epoch of batches (the default shuffled training input) holds most texts."""
    data_dir = text_dir if corpus == "code" else short_texts
    schema = schema_lib.read(data_dir)
    # A classifier's bucketed batch holds --batch_size texts: at the default 128 the code
    # corpus holds under 3 batches a pass, and whole batches cannot hold most of it.
    config = DataConfig(data_dir=data_dir, batching="bucket", batch_size=32)
    batching = text.resolve(config, schema, True, compiled=("pack",))  # TF on a CPU
    texts = {r["tokens"].tobytes() for r in token_records(data_dir)}
    seen = set()
    ds = pipeline.build_from_config(config, "train", training=True, schema=schema,
                                    batching=batching)
    for x, _ in ds.take(text.batches_per_epoch(batching, schema, "train")):
        for row, segments in zip(x["tokens"].numpy(), x["segment_ids"].numpy(), strict=True):
            seen.add(row[segments > 0].astype(np.int64).tobytes())
    # Each bucket's remainder still waits (under a batch of it): on these small splits
    # 94% (code) and 86% (short prose) of the texts, against 63% and 53% before.
    share = len(seen & texts) / len(texts)
    assert share >= 0.8, (share, batching.boundaries, batching.bucket_batch_sizes)
    counts = text.length_counts(schema, "train")
    lower = 0
    for boundary, size in zip(batching.boundaries, batching.bucket_batch_sizes, strict=True):
        assert counts[lower + 1: boundary + 1].sum() >= text.MIN_BUCKET_BATCHES * size
        lower = boundary


def test_classification_buckets_hold_batch_size_texts_and_lm_buckets_a_token_budget(
        text_dir, lm_dir, short_texts):
    """A token budget put 169 short texts into one update and 8 long ones into another, so
    under Adam a short text had a fifth of a long one's say: after one pass over pystdlib's
    code tfspeed's bucket reached 0.70 accuracy against 0.80 for bucket_by_sequence_length's
    32 texts a bucket. A classifier's loss is a mean over texts: each bucketed training
    batch now holds --batch_size of them, whatever its width. A language model's loss is a
    mean over tokens: its buckets keep the token budget, as does a --tokens_per_batch given.
    (Buckets wider than buckets.WIDE_BATCH budgets take fewer texts: see the next test.)"""
    for data_dir in (text_dir, short_texts):
        schema = schema_lib.read(data_dir)
        config = DataConfig(data_dir=data_dir, batch_size=16, batching="bucket")
        batching = text.resolve(config, schema, True, compiled=("pack",))
        sizes = dict(zip(batching.boundaries, batching.bucket_batch_sizes, strict=True))
        narrow = [w for w in sizes if 16 * w <= buckets.WIDE_BATCH * batching.tokens_per_batch]
        assert len(narrow) > 2 and all(sizes[w] == 16 for w in narrow), sizes
        assert batching.expected_weight("classification") == 16
        widths = set()
        ds = pipeline.build_from_config(config, "train", training=True, schema=schema,
                                        batching=batching)
        for x, y in ds.take(text.batches_per_epoch(batching, schema, "train")):
            rows = sizes[x["tokens"].shape[1]]
            assert x["tokens"].shape[0] == rows and float(np.sum(y["weight"])) == rows
            widths.add(x["tokens"].shape[1])
        assert len(widths & set(narrow)) > 2, widths
        budget = text.resolve(dataclasses.replace(config, tokens_per_batch=2048), schema, True,
                              compiled=("pack",))
        assert len(set(budget.bucket_batch_sizes)) > 1, budget.bucket_batch_sizes
    lm = text.resolve(DataConfig(data_dir=lm_dir, batch_size=16, batching="bucket"),
                      schema_lib.read(lm_dir), True, compiled=("pack",))
    assert len(set(lm.bucket_batch_sizes)) > 1, lm.bucket_batch_sizes


def test_a_long_tail_of_short_texts_keeps_narrow_buckets_in_smaller_batches(short_texts):
    """At 32 texts in every bucket, the few long docstrings of this split (p90 77 tokens, a
    few hundreds) could not fill two batches a pass in narrow buckets, so they shared one
    bucket up to 792 tokens: 50% of the computed tokens were padding (pydocs in the
    benchmark: 18%, most in batches of 32 x 512 tokens). A bucket now takes at most
    WIDE_BATCH token budgets (at least a quarter of --batch_size texts), so the tail keeps
    buckets of its own; the padding predicted is what one pass of batches measures."""
    schema = schema_lib.read(short_texts)
    config = DataConfig(data_dir=short_texts, batch_size=32, batching="bucket")
    batching = text.resolve(config, schema, True, compiled=("pack",))  # TF on a CPU
    budget = batching.tokens_per_batch
    for width, size in zip(batching.boundaries, batching.bucket_batch_sizes, strict=True):
        least = 32 // buckets.WIDE_BATCH
        assert size in (32, least) or size * width <= buckets.WIDE_BATCH * budget, (width, size)
        assert size >= least
    assert batching.bucket_batch_sizes[-1] < 32
    assert batching.expected_padding["bucket"] < 0.3, batching.expected_padding
    assert sum(w > 100 for w in batching.boundaries) >= 2, batching.boundaries
    assert measured_padding(config, schema, batching) == pytest.approx(
        batching.expected_padding["bucket"], abs=0.005)


def test_a_batch_larger_than_the_split_is_refused_in_its_own_unit(text_dir, lm_dir):
    """A classifier's bucketed batch is --batch_size texts, a language model's a token
    budget: each is checked against the split in its own unit, with one line."""
    from tfspeed.errors import UsageError
    from tfspeed.training.job import _check_text_batch

    schema = schema_lib.read(text_dir)
    texts = schema.split("train").num_records
    config = DataConfig(data_dir=text_dir, batch_size=texts + 2, batching="bucket")
    batching = text.resolve(config, schema, True, compiled=("pack",))
    with pytest.raises(UsageError, match=rf"--batch_size={texts + 2} is larger than the "
                                         rf"{texts} sequences of split 'train'"):
        _check_text_batch(batching, schema, "train")
    _check_text_batch(text.resolve(dataclasses.replace(config, batch_size=16), schema, True),
                      schema, "train")
    lm = schema_lib.read(lm_dir)
    tokens = lm.split("train").text["tokens"]
    big = text.resolve(DataConfig(data_dir=lm_dir, batching="bucket",
                                  tokens_per_batch=tokens + 8), lm, True)
    with pytest.raises(UsageError, match=rf"a batch of {tokens + 8} tokens .* is more than "
                                         rf"the {tokens} tokens of split 'train'"):
        _check_text_batch(big, lm, "train")
