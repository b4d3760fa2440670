"""tfspeed.optimize(ds, model) on the Keras text tutorial's pipeline: texts padded to a fixed
length by TextVectorization, batched by length where the model gives the same numbers."""

import collections
import glob
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import paragraphs
from tfspeed.attach import lengths
from tfspeed.attach.optimize import optimize

LENGTH, BATCH, VOCAB, TEXTS = 128, 16, 3000, 320


@pytest.fixture(scope="module")
def corpus():
    """The language reference's paragraphs (real English, median ~23 words), a label each,
    and the tutorial's vectoriser padding every text to 128 ids."""
    texts = paragraphs()[:TEXTS]
    labels = [i % 3 for i in range(len(texts))]
    # Named: an auto-named one would number the next (text_vectorization_1), and the store's
    # key of test_optimize's vectoriser holds that number in its functions' argument names.
    vectorize = keras.layers.TextVectorization(max_tokens=VOCAB, output_sequence_length=LENGTH,
                                               name="tutorial_vectorize")
    vectorize.adapt(tf.constant(texts))
    return texts, labels, vectorize


def tutorial(corpus):
    """Texts batched, then vectorised: every batch (16, 128)."""
    texts, labels, vectorize = corpus
    ds = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(BATCH)
    return ds.map(lambda x, y: (vectorize(x), y), num_parallel_calls=tf.data.AUTOTUNE)


def examples(batches) -> collections.Counter:
    """Every example of an epoch: its ids less trailing padding, and its label."""
    out = collections.Counter()
    for x, y in batches:
        x, y = np.asarray(x), np.asarray(y)
        for row, n, label in zip(x, lengths.row_lengths(x), y, strict=True):
            out[(row[:n].tobytes(), int(label))] += 1
    return out


def compiled(model):
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def masked_gru(length=None):
    return compiled(keras.Sequential([
        keras.Input((length,), dtype="int64"), keras.layers.Embedding(VOCAB, 8, mask_zero=True),
        keras.layers.GRU(8), keras.layers.Dense(3)]))


def pooled(mask_zero: bool, length=LENGTH):
    """The tutorial's model: embedding, average pooling, dense; built for a fixed length."""
    ids = keras.Input((length,), dtype="int64")
    h = keras.layers.Embedding(VOCAB, 8, mask_zero=mask_zero, name="embed")(ids)
    h = keras.layers.GlobalAveragePooling1D()(h)
    return compiled(keras.Model(ids, keras.layers.Dense(3, name="head")(h)))


def per_example_loss(model, batches) -> dict:
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    out = collections.defaultdict(list)
    for x, y in batches:
        x, y = np.asarray(x), np.asarray(y)
        values = np.asarray(loss(y, model.predict_on_batch(x)))
        for row, n, label, value in zip(x, lengths.row_lengths(x), y, values, strict=True):
            out[(row[:n].tobytes(), int(label))].append(float(value))
    return {k: sorted(v) for k, v in out.items()}


def test_regrouped_batches_hold_every_example_once_each_trimmed_to_a_width(corpus):
    tokens = lengths.find(tutorial(corpus).element_spec)
    tokens.batch, tokens.widths = BATCH, [8, 16, 32, 64, LENGTH]
    regrouped = list(lengths.regroup(tutorial(corpus), tokens))
    assert examples(regrouped) == examples(tutorial(corpus))
    shapes = collections.Counter(np.shape(x)[1] for x, _ in regrouped)
    assert len(shapes) >= 3 and set(shapes) <= set(tokens.widths)
    assert all(len(y) <= BATCH for _, y in regrouped)
    # One partial batch at most per width; all the others full.
    assert sum(len(y) < BATCH for _, y in regrouped) <= len(shapes)
    for x, _ in regrouped:  # each batch is as wide as its longest row rounds up to
        longest = lengths.row_lengths(np.asarray(x)).max()
        assert np.shape(x)[1] == min(w for w in tokens.widths if w >= longest)


def test_the_widths_suit_the_lengths_and_never_cut_a_row(corpus):
    x = np.concatenate([np.asarray(b[0]) for b in tutorial(corpus)])
    found = lengths.row_lengths(x)
    widths = lengths.choose_widths(found, LENGTH)
    assert widths[-1] == LENGTH and len(widths) <= lengths.BUCKETS
    assert all(w % 8 == 0 for w in widths) and widths == sorted(set(widths))
    # Most of the padding goes: rows are padded to their width, not to 128.
    edges = np.asarray(widths)
    assert edges[np.searchsorted(edges, found)].mean() < 0.5 * LENGTH


def test_a_masking_model_trains_on_batches_by_length_with_the_same_loss_per_example(
        corpus, tmp_path):
    model = masked_gru()
    out, got = optimize(tutorial(corpus), model, cache_dir=str(tmp_path), quiet=True,
                        probe_seconds=0.4)
    report = out.tfspeed_report
    line = [c for c in report.changed if c.startswith("text batched by length")]
    assert line and "mean padded length 128 -> " in line[0], report.unchanged
    assert got is model and out.element_spec[0].shape.as_list() == [None, None]
    batches = list(out)
    assert len({np.shape(x)[1] for x, _ in batches}) >= 3
    assert examples(batches) == examples(tutorial(corpus))
    padded, by_length = per_example_loss(model, tutorial(corpus)), per_example_loss(got, batches)
    assert padded.keys() == by_length.keys()
    for key, values in padded.items():
        np.testing.assert_allclose(by_length[key], values, rtol=1e-5, atol=1e-7)
    got.fit(out, epochs=1, verbose=0)  # Keras trains on the shapes as they come
    # Timed once per store: a later run reads the figures kept beside it.
    assert glob.glob(os.path.join(report.store, "lengths-*.json"))
    again, _ = optimize(tutorial(corpus), masked_gru(), cache_dir=str(tmp_path), quiet=True)
    assert [c for c in again.tfspeed_report.changed if c.startswith("text batched")] == line


def test_a_model_built_for_the_fixed_length_is_rebuilt_on_its_own_layers(corpus):
    model = pooled(mask_zero=True)
    sample = [tuple(np.asarray(t) for t in b) for b in tutorial(corpus).take(4)]
    tokens = lengths.find(tutorial(corpus).element_spec)
    rebuilt = lengths.checked(model, sample, tokens)
    assert rebuilt is not model and rebuilt.input.shape == (None, None)
    for name in ("embed", "head"):
        assert rebuilt.get_layer(name) is model.get_layer(name)
    x, y = sample[0]
    n = lengths.row_lengths(x).max()
    np.testing.assert_allclose(rebuilt.predict_on_batch(x[:, :n]), model.predict_on_batch(x),
                               rtol=1e-5, atol=1e-7)
    # Compiled as the user's, with the user's optimizer: training it trains the user's model.
    assert rebuilt.optimizer is model.optimizer
    before = model.get_layer("head").kernel.numpy()
    rebuilt.train_on_batch(x[:, :n], y)
    assert not np.array_equal(model.get_layer("head").kernel.numpy(), before)
    assert int(model.optimizer.iterations.numpy()) == 1


@pytest.mark.parametrize("make_model, words", [
    (lambda: pooled(mask_zero=False), "the model's outputs change when padding is trimmed"),
    (lambda: compiled(keras.Sequential([
        keras.Input((LENGTH,), dtype="int64"), keras.layers.Embedding(VOCAB, 4),
        keras.layers.Flatten(), keras.layers.Dense(3)])), "the model takes only rows of 128"),
    (lambda: keras.Sequential([keras.Input((None,), dtype="int64"),
                               keras.layers.Embedding(VOCAB, 4, mask_zero=True),
                               keras.layers.GlobalAveragePooling1D()]), "the model is not compiled"),
])
def test_a_model_that_would_change_is_left_padded_with_its_line(
        corpus, tmp_path, capsys, make_model, words):
    given = make_model()
    out, got = optimize(tutorial(corpus), given, cache_dir=str(tmp_path))
    assert got is given and out.element_spec == tutorial(corpus).element_spec
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tfspeed.optimize")]
    assert len(said) == 1 and f"text not batched by length: {words}" in said[0]
    assert any(words in u for u in out.tfspeed_report.unchanged)


def test_a_model_that_ignores_padding_only_at_its_present_weights_is_left_padded(corpus):
    # Unmasked pooling whose embedding gives the padding id zeros, and a sum: the padding adds
    # nothing now, but would as soon as training moves that row. Perturbed weights show it.
    ids = keras.Input((None,), dtype="int64")
    embed = keras.layers.Embedding(VOCAB, 8)
    h = keras.layers.Lambda(lambda t: keras.ops.sum(t, axis=1))(embed(ids))
    model = compiled(keras.Model(ids, keras.layers.Dense(3)(h)))
    table = embed.embeddings.numpy()
    table[0] = 0.0
    embed.embeddings.assign(table)
    sample = [tuple(np.asarray(t) for t in b) for b in tutorial(corpus).take(2)]
    why = lengths.checked(model, sample, lengths.find(tutorial(corpus).element_spec))
    assert isinstance(why, str) and why.endswith("at perturbed weights"), why
    np.testing.assert_array_equal(embed.embeddings.numpy(), table)  # given back as it was


def test_the_check_compares_the_rows_trimming_shortens_even_beside_a_full_row(corpus):
    # The text tutorial on docstrings: most batches hold one text of 250 tokens or more, so
    # the batch trimmed to its longest row is the batch itself. The unmasked pooling model
    # then passed the check, trained on short rows and was validated on padded ones.
    texts, _, vectorize = corpus
    long_text = " ".join(texts)  # fills every one of the 128 positions
    sample = []
    for batch in tutorial(corpus).take(3):
        x, y = np.array(batch[0]), np.asarray(batch[1])
        x[0] = np.asarray(vectorize(tf.constant([long_text])))[0]
        assert lengths.row_lengths(x)[0] == LENGTH and lengths.row_lengths(x).min() < LENGTH
        sample.append((x, y))
    tokens = lengths.find(tutorial(corpus).element_spec)
    why = lengths.checked(pooled(mask_zero=False), sample, tokens)
    assert isinstance(why, str) and "does not mask padding" in why, why
    assert not isinstance(lengths.checked(pooled(mask_zero=True), sample, tokens), str)
    full = [(np.stack([vectorize(tf.constant([long_text]))[0]] * BATCH), y) for _, y in sample]
    why = lengths.checked(pooled(mask_zero=True), full, tokens)
    assert isinstance(why, str) and "no sampled row is shorter" in why, why


def test_the_padding_is_reported_without_a_model_and_padding_at_the_start_is_refused(
        corpus, tmp_path):
    out = optimize(tutorial(corpus), cache_dir=str(tmp_path), quiet=True)
    assert any("padded to 128" in u and "give the model" in u
               for u in out.tfspeed_report.unchanged)
    pre = tutorial(corpus).map(lambda x, y: (tf.reverse(x, [1]), y))  # pad_sequences' 'pre'
    out, _ = optimize(pre, masked_gru(), cache_dir=str(tmp_path), quiet=True)
    assert any("padded at the start" in u for u in out.tfspeed_report.unchanged)
    assert out.element_spec == pre.element_spec


def test_without_a_model_optimize_computes_none_of_the_text_pipeline(tmp_path):
    # A map that fails whenever an element is computed: optimize(ds) alone must only read
    # the pipeline (the padding line comes from its spec), not sample batches of it.
    ids = np.zeros((64, 32), np.int64)
    ids[:, :5] = 7

    def poisoned(x, y):
        with tf.control_dependencies([tf.debugging.Assert(tf.constant(False), ["computed"])]):
            return tf.identity(x), y

    ds = tf.data.Dataset.from_tensor_slices((ids, np.zeros(64, np.int64))).batch(8)
    out = optimize(ds.map(poisoned), cache_dir=str(tmp_path), quiet=True)
    assert any("padded to 32" in u and "give the model" in u
               for u in out.tfspeed_report.unchanged)


def test_unpadded_token_windows_are_not_called_padded(tmp_path, capsys):
    """Text generation's windows (every position a character of real text, no padding):
    nothing to trim, and the line says so without calling the rows padded."""
    text = " ".join(paragraphs()[:40])
    ids = np.array([1 + ord(c) % (VOCAB - 1) for c in text], np.int64)
    windows = ids[:(len(ids) // 65) * 65].reshape(-1, 65)
    ds = tf.data.Dataset.from_tensor_slices((windows[:, :-1], windows[:, -1] % 3)).batch(BATCH)
    out, got = optimize(ds, masked_gru(), cache_dir=str(tmp_path))
    (said,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tfspeed.optimize")]
    assert "text not batched by length: its rows fill most of their 64 positions" in said, said
    assert "padded" not in said, said
