"""tfspeed.data.sequences on real English text: the paragraphs of Python's language reference
(``pydoc_data.topics``), words mapped to ids by a small vocabulary built here."""

import collections
import itertools
import re
from pydoc_data.topics import topics

import numpy as np
import pytest
import tensorflow as tf

from tfspeed.data import buckets, sequences

BOS, EOS = 1, 2  # lm records hold them; 0 is the pad id


def _paragraphs() -> list[list[str]]:
    paragraphs = (p for key in sorted(topics) for p in re.split(r"\n\s*\n", topics[key]))
    return [words for p in paragraphs if (words := re.findall(r"\w+|[^\w\s]", p))]


WORDS = _paragraphs()
_FREQ = collections.Counter(w for words in WORDS for w in words)
VOCAB = {w: i + 3 for i, (w, _) in enumerate(sorted(_FREQ.items(), key=lambda x: (-x[1], x[0])))}
TEXTS = [[VOCAB[w] for w in words] for words in WORDS]  # ~2,600 paragraphs, 2..2,178 ids
LABELS = [len(t) % 4 for t in TEXTS]  # any deterministic class per text


def records(task: str = "classification", texts=None) -> tf.data.Dataset:
    """What the converter's records parse to: int64 ``tokens`` (and ``label``)."""
    texts = TEXTS if texts is None else texts
    if task == "lm":
        texts = [[BOS, *t, EOS] for t in texts]
    tokens = tf.RaggedTensor.from_row_lengths(
        np.concatenate(texts).astype(np.int64), [len(t) for t in texts])
    labels = tf.constant(LABELS[: len(texts)], tf.int64)
    return tf.data.Dataset.from_tensor_slices({"tokens": tokens, "label": labels})


def segments(ds, lm: bool = False):
    """Every (tokens, label) sequence in the batches of ``ds``, read back via segment_ids."""
    found = []
    for inputs, targets in ds.as_numpy_iterator():
        for r in range(inputs["tokens"].shape[0]):
            seg = inputs["segment_ids"][r]
            for s in range(1, seg.max() + 1):
                where = seg == s
                tokens = tuple(inputs["tokens"][r][where])
                label = (tuple(targets["label"][r][where]) if lm
                         else int(targets["label"][r][s - 1]))
                found.append((tokens, label))
    return found


def chunks(text, size):
    return [tuple(text[i:i + size]) for i in range(0, len(text), size)]


def counts_of(texts):
    return buckets.length_counts_of([len(t) for t in texts])


BOUNDARIES, EXPECTED = buckets.choose_boundaries(counts_of(TEXTS), 256, 24)


def build(mode, ds, **kwargs):
    if mode == "pad":
        return sequences.pad(ds, 64, **kwargs)
    if mode == "pad_fixed":
        return sequences.pad_fixed(ds, 64, 256, **kwargs)
    if mode == "bucket":
        return sequences.bucket(ds, BOUNDARIES, 4096, batch_multiple=2, **kwargs)
    return sequences.pack(ds, 256, 16, long="split", **kwargs)


def test_to_example_casts_and_shifts_eagerly_and_in_tf_data():
    record = {"tokens": tf.constant([BOS, 7, 8, EOS], tf.int64), "label": tf.constant(3, tf.int64)}
    lm = sequences.make_to_example("lm")(record)
    assert lm["tokens"].dtype == tf.int32
    assert lm["tokens"].numpy().tolist() == [BOS, 7, 8]
    assert lm["label"].numpy().tolist() == [7, 8, EOS]
    first = next(iter(sequences.to_examples(records("classification"), "classification")))
    assert first["tokens"].dtype == tf.int32 and first["label"].dtype == tf.int32
    assert first["tokens"].numpy().tolist() == TEXTS[0] and int(first["label"]) == LABELS[0]
    with pytest.raises(ValueError, match="task"):
        sequences.make_to_example("seq2seq")


@pytest.mark.parametrize("task", ["classification", "lm"])
@pytest.mark.parametrize("mode", ["pad", "pad_fixed", "bucket", "pack"])
def test_shapes_and_dtypes(mode, task):
    ds = build(mode, sequences.to_examples(records(task), task))
    inputs, targets = ds.element_spec
    fixed = {"pad": None, "pad_fixed": 256, "bucket": None, "pack": 256}[mode]
    for spec in inputs.values():
        assert spec.dtype == tf.int32 and spec.shape[1] == fixed
    assert targets["label"].dtype == tf.int32 and targets["weight"].dtype == tf.float32
    width = {"pad": 1, "pad_fixed": 1, "bucket": 1, "pack": 32}[mode]
    assert targets["label"].shape[1] == (fixed if task == "lm" else width)
    if mode in ("pad_fixed", "pack"):  # static B too: tf.distribute and XLA want it
        assert inputs["tokens"].shape[0] == (16 if mode == "pack" else 64)
    for inputs, targets in itertools.islice(ds, 12):
        b, t = inputs["tokens"].shape
        assert inputs["segment_ids"].shape == inputs["positions"].shape == (b, t)
        assert targets["label"].shape == targets["weight"].shape
        if mode == "bucket":
            assert t in BOUNDARIES and b % 2 == 0 and b * t <= 4096
        elif fixed:
            assert t == fixed


@pytest.mark.parametrize("mode", ["pad", "bucket", "pack"])
def test_every_sequence_once_and_padding(mode):
    """One epoch: nothing lost or duplicated (packing splits only rows too long), and the
    padding each mode computes."""
    examples = sequences.to_examples(records(), "classification")
    stats = sequences.TokenStats()
    longest = max(map(len, TEXTS))
    if mode == "bucket":  # the last bucket takes the longest text: nothing truncated
        boundaries, _ = buckets.choose_boundaries(counts_of(TEXTS), longest, 24)
        ds = sequences.bucket(examples, boundaries, 4096, drop_remainder=False)
    else:
        ds = build(mode, examples, drop_remainder=False)
    for inputs, _ in ds:
        stats.add_batch(inputs)
    found = collections.Counter(segments(ds))
    size = 256 if mode == "pack" else longest
    expected = collections.Counter((c, y) for t, y in zip(TEXTS, LABELS, strict=True)
                                   for c in chunks(t, size))
    assert found == expected
    assert stats.real_tokens == sum(map(len, TEXTS))
    if mode == "pack":
        assert stats.padding_fraction < 0.03
    elif mode == "bucket":
        assert stats.padding_fraction < 0.10
    else:
        assert stats.padding_fraction > 0.6  # the baseline: most of what it computes is padding


def test_pack_rows_segments_and_positions():
    stats = sequences.TokenStats()
    ds = sequences.pack(sequences.to_examples(records(), "classification"), 128, 8,
                        max_segments=12, long="split", stats=stats)
    rows = 0
    for inputs, targets in ds.as_numpy_iterator():
        for seg, pos, tok, label, weight in zip(inputs["segment_ids"], inputs["positions"],
                                                inputs["tokens"], targets["label"],
                                                targets["weight"], strict=True):
            rows += 1
            real = seg > 0
            n = int(real.sum())
            assert real[:n].all() and not real[n:].any()  # real tokens first, padding after
            assert (tok[~real] == 0).all() and (pos[~real] == 0).all()
            assert (tok[real] >= 3).all()
            assert (np.diff(seg[:n]) >= 0).all() and (np.diff(seg[:n]) <= 1).all()
            starts = np.flatnonzero(np.diff(seg[:n], prepend=0))
            assert (pos[starts] == 0).all()  # a new segment restarts at 0 ...
            inside = np.setdiff1d(np.arange(1, n), starts)
            assert (pos[inside] == pos[inside - 1] + 1).all()  # ... and counts up by one
            assert 1 <= seg.max() <= 12
            assert weight.tolist() == [1.0] * seg.max() + [0.0] * (12 - seg.max())
            assert (label[seg.max():] == 0).all()
    assert 0 <= stats.computed_tokens - rows * 128 < 8 * 128  # the last, short batch dropped
    assert stats.sequences == len(TEXTS)


def test_lm_targets_are_the_next_token_of_the_same_sequence():
    ds = sequences.pack(sequences.to_examples(records("lm"), "lm"), 256, 16, long="split",
                        drop_remainder=False)
    for inputs, targets in itertools.islice(ds.as_numpy_iterator(), 5):
        real = inputs["segment_ids"] > 0
        assert (targets["weight"] == real).all() and (targets["label"][~real] == 0).all()
    found = collections.Counter(segments(ds, lm=True))
    texts = [[BOS, *t, EOS] for t in TEXTS]
    expected = collections.Counter(
        pair for t in texts for pair in zip(chunks(t[:-1], 256), chunks(t[1:], 256), strict=True))
    assert found == expected  # every label is its token's successor, at piece ends too
    assert sum(len(t) * n for (t, _), n in found.items()) == sum(len(t) - 1 for t in texts)


def test_long_policies_are_applied_and_counted():
    texts = TEXTS[:400]
    over = [len(t) - 64 for t in texts if len(t) > 64]
    assert over  # the language reference has paragraphs longer than 64 words
    examples = sequences.to_examples(records(texts=texts), "classification")
    found = {}
    for long in sequences.LONG_POLICIES:
        stats = sequences.TokenStats()
        ds = sequences.pack(examples, 64, 4, long=long, stats=stats, drop_remainder=False)
        found[long] = collections.Counter(tokens for tokens, _ in segments(ds))
        assert stats.sequences == len(texts)
        assert stats.skipped == (len(over) if long == "skip" else 0)
        assert stats.truncated_tokens == (sum(over) if long == "truncate" else 0)
    assert found["truncate"] == collections.Counter(tuple(t[:64]) for t in texts)
    assert found["split"] == collections.Counter(c for t in texts for c in chunks(t, 64))
    assert found["skip"] == collections.Counter(tuple(t) for t in texts if len(t) <= 64)
    with pytest.raises(ValueError, match="long"):
        sequences.pack(examples, 64, 4, long="wrap")


def _padded_size(lengths, boundaries):
    return sum(next(b for b in boundaries if b >= min(n, boundaries[-1])) for n in lengths)


def test_choose_boundaries_is_optimal_and_predicts_padding():
    lengths = [min(len(t), 64) for t in TEXTS]
    boundaries, fraction = buckets.choose_boundaries(buckets.length_counts_of(lengths), 64, 3)
    assert boundaries[-1] == 64 and all(b % 8 == 0 for b in boundaries)
    best = min(_padded_size(lengths, [*c, 64])
               for c in itertools.combinations(range(8, 64, 8), 2))  # brute force
    assert _padded_size(lengths, boundaries) == best
    assert fraction == pytest.approx(1 - sum(lengths) / best)
    # Longer sequences count at the limit, as the long policy leaves them.
    uncut = buckets.length_counts_of([len(t) for t in TEXTS])
    assert buckets.choose_boundaries(uncut, 64, 3) == (boundaries, pytest.approx(fraction))
    fractions = [buckets.choose_boundaries(uncut, 256, k)[1] for k in (1, 4, 8, 16)]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] > 0.8
    assert buckets.choose_boundaries(buckets.length_counts_of([3, 5, 12]), 256, 4)[0] == [
        8, 16]  # covers the longest


def test_bucket_batch_sizes_and_measured_padding_matches_expected():
    assert buckets.bucket_batch_sizes([8, 24, 256], 1000, 4) == [124, 40, 4]
    assert buckets.bucket_batch_sizes([8, 24, 256], 1000) == [125, 41, 3]
    # Texts a bucket: batch_size, fewer where that is over WIDE_BATCH budgets, never under
    # batch_size // WIDE_BATCH; no budget: batch_size everywhere.
    assert buckets.bucket_batch_sizes([8, 128, 256, 512], 1000, 2, 32) == [32, 30, 14, 8]
    assert buckets.bucket_batch_sizes([8, 512], 0, 2, 32) == [32, 32]
    stats = sequences.TokenStats()
    ds = sequences.bucket(sequences.to_examples(records(), "classification"), BOUNDARIES, 4096,
                          drop_remainder=False)
    for inputs, _ in ds:
        stats.add_batch(inputs)
    clipped = [min(len(t), 256) for t in TEXTS]
    assert stats.real_tokens == sum(clipped)  # longer than the last bucket: truncated
    assert stats.padding_fraction == pytest.approx(EXPECTED, abs=1e-9)


def test_count_tokens_and_padding_fraction_of_a_batch():
    inputs = {"segment_ids": tf.constant([[1, 1, 2, 0], [1, 0, 0, 0]], tf.int32)}
    real, computed = sequences.count_tokens(inputs)
    assert (int(real), int(computed)) == (4, 8)
    assert float(sequences.padding_fraction(inputs)) == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_seeded_shuffle_gives_the_same_batches(mode):
    def first_batches(seed):
        ds = sequences.to_examples(records(), "classification").shuffle(4096, seed=seed)
        batches = itertools.islice(build(mode, ds).as_numpy_iterator(), 6)
        return [inputs["tokens"] for inputs, _ in batches]

    a, b, c = first_batches(1), first_batches(1), first_batches(2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(x.shape == y.shape and (x == y).all() for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_cached_shuffled_input_under_mirrored_strategy(mode):
    """The training order: records -> examples -> cache -> shuffle -> repeat -> batch, split
    over 2 replicas (2 logical CPUs, see conftest)."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    examples = sequences.to_examples(records(texts=TEXTS[:800]), "classification").cache()
    ds = build(mode, examples.shuffle(800, seed=3).repeat()).prefetch(2)
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    dist = strategy.experimental_distribute_dataset(ds.with_options(options))

    @tf.function
    def step(inputs, targets):
        def replica(inputs, targets):
            real = tf.reduce_sum(tf.sign(inputs["segment_ids"]))
            return real, tf.reduce_sum(targets["weight"]), tf.shape(inputs["tokens"])

        return strategy.run(replica, (inputs, targets))

    shapes = set()
    for inputs, targets in itertools.islice(dist, 60):  # more than one epoch
        real, weight, shape = step(inputs, targets)
        per_replica = [s.numpy().tolist() for s in strategy.experimental_local_results(shape)]
        assert per_replica[0] == per_replica[1]  # an even split
        assert all(r.numpy() > 0 for r in strategy.experimental_local_results(real))
        assert all(w.numpy() >= 1 for w in strategy.experimental_local_results(weight))
        shapes.add(tuple(per_replica[0]))
    if mode == "pack":
        assert shapes == {(8, 256)}
    else:
        assert {t for _, t in shapes} <= set(BOUNDARIES) and len(shapes) > 3
