"""The transformer on real text: sentences of the Python language reference
(``pydoc_data.topics``), words mapped to ids by a vocabulary built here."""

import re
from collections import Counter
from pydoc_data.topics import topics

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfspeed.training.transformer import (
    accumulated_gradients,
    build_transformer,
    correct_sum,
    perplexity,
    weighted_loss_sum,
)

VOCAB = 400  # 0: padding, 1: unknown word
TOPICS = ("if", "while", "for", "try", "class", "assignment")  # classification labels
WORD = re.compile(r"[a-z]+|[0-9]+|[^\sa-z0-9]")
SMALL = {"width": 32, "depth": 2, "heads": 4, "max_length": 96}


def prose_sentences(names, vocab_size: int) -> list[tuple[list[int], int]]:
    """(word ids, index in ``names``) of each prose sentence of at least 4 words in the
    language reference's topics ``names``: ids of the ``vocab_size - 2`` commonest words,
    1 for any other (0: padding)."""
    words = Counter(w for text in topics.values() for w in WORD.findall(text.lower()))
    vocab = {w: i + 2 for i, (w, _) in enumerate(words.most_common(vocab_size - 2))}
    found = []
    for label, name in enumerate(names):
        prose = " ".join(line.strip() for line in topics[name].splitlines()
                         if line.strip() and not line.startswith(" ") and "::=" not in line)
        for sentence in re.split(r"(?<=\.)\s+", prose):
            ids = [vocab.get(w, 1) for w in WORD.findall(sentence.lower())]
            if len(ids) >= 4:
                found.append((ids, label))
    return found


@pytest.fixture(scope="module")
def sentences():
    """(ids, topic index) of each prose sentence of TOPICS, 4 to 30 words long."""
    found = [(ids, label) for ids, label in prose_sentences(TOPICS, VOCAB) if len(ids) <= 30]
    assert len(found) > 40 and len({n for _, n in found}) == len(TOPICS)
    return found


def make_batch(rows, length, task, max_segments=3):
    """rows: per row, the (ids, label) sequences packed into it in order. For lm a sequence
    of n ids gives n - 1 tokens, each labelled with the next id."""
    shape = (len(rows), length)
    tokens, segments, positions = (np.zeros(shape, np.int32) for _ in range(3))
    lm_label, lm_weight = np.zeros(shape, np.int32), np.zeros(shape, np.float32)
    cls_label = np.zeros((len(rows), max_segments), np.int32)
    cls_weight = np.zeros((len(rows), max_segments), np.float32)
    for b, row in enumerate(rows):
        start = 0
        for s, (ids, label) in enumerate(row):
            inputs = ids[:-1] if task == "lm" else ids
            end = start + len(inputs)
            assert end <= length, "the row overflows"
            tokens[b, start:end], segments[b, start:end] = inputs, s + 1
            positions[b, start:end] = np.arange(len(inputs))
            if task == "lm":
                lm_label[b, start:end], lm_weight[b, start:end] = ids[1:], 1.0
            cls_label[b, s], cls_weight[b, s] = label, 1.0
            start = end
    x = {"tokens": tokens, "segment_ids": segments, "positions": positions}
    y = ({"label": lm_label, "weight": lm_weight} if task == "lm"
         else {"label": cls_label, "weight": cls_weight})
    return ({k: tf.constant(v) for k, v in x.items()}, {k: tf.constant(v) for k, v in y.items()})


def model_for(task, **overrides):
    keras.utils.set_random_seed(0)
    outputs = VOCAB if task == "lm" else len(TOPICS)
    return build_transformer(VOCAB, outputs, task, **{**SMALL, **overrides})


def segment_spans(x):
    """Per segment id, its (start, end) in row 0."""
    ids = x["segment_ids"].numpy()[0]
    return {s: (int(np.argmax(ids == s)), int(np.sum(ids == s))) for s in set(ids) - {0}}


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_packed_sequences_give_the_outputs_they_give_alone(sentences, task):
    model = model_for(task)
    chosen = [sentences[0], sentences[7], sentences[20]]
    assert len({len(ids) for ids, _ in chosen}) == 3, "lengths should differ"
    packed_x, _ = make_batch([chosen], 64, task)
    packed = model(packed_x).numpy()[0]
    for s, (start, count) in segment_spans(packed_x).items():
        alone_x, _ = make_batch([[chosen[s - 1]]], 32, task)
        alone = model(alone_x).numpy()[0]
        if task == "lm":
            np.testing.assert_allclose(packed[start:start + count], alone[:count], atol=1e-5)
        else:
            np.testing.assert_allclose(packed[s - 1], alone[0], atol=1e-5)


def test_lm_is_causal(sentences):
    model = model_for("lm")
    ids, label = sentences[3]
    changed = ids[:6] + [(i + 5) % VOCAB for i in ids[6:]]  # words after position 5
    before = model(make_batch([[(ids, label)]], 32, "lm")[0]).numpy()[0]
    after = model(make_batch([[(changed, label)]], 32, "lm")[0]).numpy()[0]
    np.testing.assert_allclose(after[:6], before[:6], atol=1e-5)  # tokens 0..5 unchanged
    assert np.abs(after[6:len(ids) - 1] - before[6:len(ids) - 1]).max() > 1e-3


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_real_outputs_do_not_depend_on_padding_length(sentences, task):
    model = model_for(task)
    rows = [[sentences[1], sentences[2]], [sentences[30]]]
    short_x, short_y = make_batch(rows, 56, task)
    long_x, _ = make_batch(rows, 96, task)
    short, long = model(short_x).numpy(), model(long_x).numpy()
    if task == "lm":
        real = short_y["weight"].numpy() > 0
        np.testing.assert_allclose(long[:, :56][real], short[real], atol=1e-5)
    else:
        np.testing.assert_allclose(long, short, atol=1e-5)


def naive_mean_of_means(model, batches):
    """What a per-micro-batch mean gives: wrong when micro-batches hold different counts."""
    grads = [accumulated_gradients(model, [batch])[0] for batch in batches]
    return [tf.add_n(list(g)) / len(batches) for g in zip(*grads, strict=True)]


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_accumulation_with_global_weighting_equals_one_big_batch(sentences, task):
    model = model_for(task, dropout=0.0)
    micro_rows = [  # three micro-batches of two rows, with very different real counts
        [[sentences[0]], [sentences[1]]],
        [[sentences[2], sentences[3], sentences[4]], [sentences[5], sentences[6]]],
        [[sentences[7]], []],
    ]
    micro = [make_batch(rows, 64, task) for rows in micro_rows]
    counts = [float(tf.reduce_sum(y["weight"])) for _, y in micro]
    assert len(set(counts)) == 3, counts
    big = make_batch([row for rows in micro_rows for row in rows], 64, task)

    with tf.GradientTape() as tape:
        loss_sum, total = weighted_loss_sum(big[1], model(big[0], training=True))
        big_loss = loss_sum / total
    big_grads = tape.gradient(big_loss, model.trainable_variables)
    grads, loss = accumulated_gradients(model, micro)

    np.testing.assert_allclose(float(loss), float(big_loss), rtol=1e-6)
    for g, expected in zip(grads, big_grads, strict=True):
        np.testing.assert_allclose(g.numpy(), tf.convert_to_tensor(expected).numpy(), atol=1e-5)
    naive = naive_mean_of_means(model, micro)
    worst = max(float(tf.reduce_max(tf.abs(n - g))) for n, g in zip(naive, grads, strict=True))
    assert worst > 1e-3, "micro-batch means should differ here, or the test proves nothing"


def test_lm_trains_on_real_text(sentences):
    model = model_for("lm")
    x, y = make_batch([[sentences[i], sentences[i + 1]] for i in range(0, 8, 2)], 64, "lm")
    optimizer = keras.optimizers.Adam(1e-2)

    def step():  # eager: tracing a graph costs more than these few steps
        with tf.GradientTape() as tape:
            loss_sum, total = weighted_loss_sum(y, model(x, training=True))
            loss = loss_sum / total
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    losses = [float(step()) for _ in range(5)]
    assert losses[0] == pytest.approx(np.log(VOCAB), rel=0.1)  # near uniform at start
    assert losses[-1] < losses[0] - 1.0, losses
    loss_sum, total = weighted_loss_sum(y, model(x))
    correct, total_c = correct_sum(y, model(x))
    assert float(total) == float(total_c) == float(tf.reduce_sum(y["weight"]))
    assert 0.0 < float(correct / total_c) <= 1.0
    assert float(perplexity(loss_sum, total)) == pytest.approx(np.exp(float(loss_sum / total)))


def test_metrics_count_real_elements_only(sentences):
    x, y = make_batch([[sentences[0], sentences[1]], [sentences[2]]], 64, "classification")
    one_hot = tf.one_hot(y["label"], len(TOPICS)) * 10.0  # right where weighted
    logits = tf.concat([one_hot, tf.zeros([2, 13, len(TOPICS)])], axis=1)  # 16 segments
    correct, total = correct_sum(y, logits)
    assert (float(correct), float(total)) == (3.0, 3.0)
    wrong = -logits  # every real sequence wrong; absent ones carry weight 0
    assert float(correct_sum(y, wrong)[0]) == 0.0
    loss_sum, _ = weighted_loss_sum(y, logits)
    assert 0.0 < float(loss_sum) < 3 * 1e-3


def test_parameter_count_matches_the_architecture():
    w, v, depth, max_length = 64, 8000, 2, 512
    model = build_transformer(v, v, "lm", width=w, depth=depth, heads=4, max_length=max_length)
    block = 2 * 2 * w + 4 * (w * w + w) + (w * 4 * w + 4 * w) + (4 * w * w + w)
    expected = v * w + max_length * w + depth * block + 2 * w + (w * v + v)
    assert model.count_params() == expected == 1_164_864


@pytest.fixture
def mixed_bfloat16():
    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_mixed_bfloat16_keeps_logits_and_loss_float32(sentences, task, mixed_bfloat16):
    model = model_for(task)
    assert model.get_layer("block0_mlp_in").compute_dtype == "bfloat16"
    x, y = make_batch([[sentences[0], sentences[1]], [sentences[9]]], 48, task)
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss_sum, total = weighted_loss_sum(y, logits)
        loss = loss_sum / total
    grads = tape.gradient(loss, model.trainable_variables)
    assert logits.dtype == tf.float32 and loss.dtype == tf.float32
    assert np.isfinite(logits.numpy()).all() and np.isfinite(float(loss_sum))
    assert all(np.isfinite(tf.convert_to_tensor(g).numpy()).all() for g in grads)


def test_xla_step_matches_eager_and_runs_in_mixed_bfloat16(sentences, mixed_bfloat16):
    """The compiled forward+backward (what the engine's xla=True compiles), for lm (causal and
    segment masks); depth 1 because XLA compiles slowly on CPU."""
    keras.mixed_precision.set_global_policy("float32")
    model = model_for("lm", depth=1)
    x, y = make_batch([[sentences[4], sentences[5]], [sentences[11]]], 48, "lm")

    def loss_and_grads(x, y):
        with tf.GradientTape() as tape:
            loss_sum, total = weighted_loss_sum(y, model(x))
            loss = loss_sum / total
        return loss, tape.gradient(loss, model.trainable_variables)

    eager_loss, eager_grads = loss_and_grads(x, y)
    xla_loss, xla_grads = tf.function(loss_and_grads, jit_compile=True)(x, y)
    assert float(xla_loss) == pytest.approx(float(eager_loss), rel=1e-5)
    for g, expected in zip(xla_grads, eager_grads, strict=True):
        np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(),
                                   tf.convert_to_tensor(expected).numpy(), atol=1e-5)

    keras.mixed_precision.set_global_policy("mixed_bfloat16")
    mixed = model_for("lm", depth=1)
    mixed.set_weights(model.get_weights())
    logits = tf.function(lambda x: mixed(x), jit_compile=True)(x)  # forward: compiles fast
    assert logits.dtype == tf.float32 and np.isfinite(logits.numpy()).all()
    loss_sum, total = weighted_loss_sum(y, logits)
    assert float(loss_sum / total) == pytest.approx(float(eager_loss), rel=0.05)  # bf16 rounding


def test_rejects_inconsistent_arguments():
    with pytest.raises(ValueError, match="must equal vocab_size"):
        build_transformer(100, 7, "lm")
    with pytest.raises(ValueError, match="must divide width"):
        build_transformer(100, 7, "classification", width=30, heads=4)
    with pytest.raises(ValueError, match="not one of"):
        build_transformer(100, 7, "regression")


def _examples(sentences, task):
    """The sentences as the converter's records parse, then ``sequences.to_examples``."""
    from tfspeed.data import sequences

    texts = [ids if task == "classification" else [1, *ids, 1] for ids, _ in sentences]
    tokens = tf.RaggedTensor.from_row_lengths(np.concatenate(texts).astype(np.int64),
                                              [len(t) for t in texts])
    labels = tf.constant([label for _, label in sentences], tf.int64)
    records = tf.data.Dataset.from_tensor_slices({"tokens": tokens, "label": labels})
    return sequences.to_examples(records, task)


def _sgd_steps(model, updates, lr=0.5):
    """Plain SGD on each update's exact weighted-mean gradient; returns the weights."""
    keras.utils.set_random_seed(0)
    start = [v.numpy() for v in model.trainable_variables]
    for batches in updates:
        grads, _ = accumulated_gradients(model, batches)
        for v, g in zip(model.trainable_variables, grads, strict=True):
            v.assign_sub(lr * g)
    end = [v.numpy() for v in model.trainable_variables]
    for v, s in zip(model.trainable_variables, start, strict=True):
        v.assign(s)
    return end


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_sequences_packed_by_the_pipeline_train_as_they_do_alone(sentences, task):
    """``sequences.pack``'s real rows (several sentences a row, positions restarting, lm
    labels shifted inside each sentence) give the losses, gradients and SGD updates that
    each sentence gives alone in a batch of its own: no attention, pooling or next-token
    label crosses a segment boundary."""
    from tfspeed.data import sequences

    model = model_for(task, max_segments=8)
    chosen = sentences[:24]
    examples = _examples(chosen, task)
    packed = list(sequences.pack(examples, 64, 4, max_segments=8, long="split",
                                 drop_remainder=False))
    assert max(int(x["segment_ids"].numpy().max()) for x, _ in packed) >= 3  # really packed
    assert len(packed) * 4 < len(chosen)
    alone = list(sequences.pad(examples, 1))
    assert len(alone) == len(chosen)

    def totals(batches):
        sums = [weighted_loss_sum(y, model(x)) for x, y in batches]
        return sum(float(s) for s, _ in sums), sum(float(w) for _, w in sums)

    (packed_loss, packed_weight), (alone_loss, alone_weight) = totals(packed), totals(alone)
    assert packed_weight == alone_weight
    np.testing.assert_allclose(packed_loss, alone_loss, rtol=1e-5)
    # Two SGD updates, each over half of the sentences, packed and alone.
    halves = [sequences.pack(_examples(part, task), 64, 4, max_segments=8,
                             drop_remainder=False) for part in (chosen[:12], chosen[12:])]
    singles = [sequences.pad(_examples(part, task), 1) for part in (chosen[:12], chosen[12:])]
    for got, want in zip(_sgd_steps(model, [list(h) for h in halves]),
                         _sgd_steps(model, [list(s) for s in singles]), strict=True):
        np.testing.assert_allclose(got, want, atol=1e-5)
