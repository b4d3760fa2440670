"""The engine on token batches: exact with a variable number of real tokens.

Real text (prose sentences of the Python language reference, ``pydoc_data.topics``) mapped
to ids by a vocabulary built here, the small transformer of ``tfspeed.training.transformer``,
plain SGD with a learning rate of 1 (so a weight difference is a gradient difference), and
``transformer.accumulated_gradients`` as the reference: the gradient of the global weighted
mean, which a mean of micro-batch means is not.
"""


import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.training.test_transformer import make_batch as packed_batch
from tests.training.test_transformer import prose_sentences
from tfspeed.config import RuntimeConfig, TrainConfig
from tfspeed.errors import UsageError
from tfspeed.runtime import Runtime, detect_hardware, mirrored_strategy, resolve
from tfspeed.training import objectives, report, trainer, transformer
from tfspeed.training.backends.tensorflow import TensorFlowEngine as Engine
from tfspeed.training.engine import EngineOptions
from tfspeed.training.meters import ThroughputMeter

VOCAB, CLASSES, LENGTH, ROWS = 300, 4, 40, 2  # ROWS: rows per micro-batch (1 per replica)
TOPICS = ("if", "while", "for", "try")
SMALL = {"width": 16, "depth": 1, "heads": 2, "max_length": LENGTH, "max_segments": 3}
# Micro-batches of ROWS rows, each row the sentences packed into it (indices into SENTENCES):
# 5, 1 and 5 sentences, one row with none, so the real tokens differ between micro-batches
# and between the replicas of one micro-batch.
PACKING = [[[0, 1], [2]], [[3], []], [[4, 5, 6], [7, 8]]]


@pytest.fixture(scope="module")
def sentences():
    """(ids, topic) of prose sentences of TOPICS, cut to their first 4 to 12 words (so 3
    fit a row)."""
    found = [(ids[:4 + i % 9], label)  # lengths vary: 4 to 12
             for i, (ids, label) in enumerate(prose_sentences(TOPICS, VOCAB))]
    assert len(found) >= 12 and len({label for _, label in found}) > 1
    return found[::2][:12]  # every other one: labels of more than one topic early on


def make_batch(rows, task, length=LENGTH):
    """rows: per row, its (ids, label) sequences, packed in order (the transformer tests'
    packing), as numpy arrays."""
    x, y = packed_batch(rows, length, task, SMALL["max_segments"])
    return ({k: v.numpy() for k, v in x.items()}, {k: v.numpy() for k, v in y.items()})


def micro_batches(sentences, task, packing=PACKING, length=LENGTH):
    """numpy (x, y) per micro-batch of ``packing``."""
    return [make_batch([[sentences[i] for i in row] for row in rows], task, length)
            for rows in packing]


def as_tensors(batch):
    return tf.nest.map_structure(tf.constant, batch)


def concatenated(batches):
    return tf.nest.map_structure(lambda *parts: np.concatenate(parts), *batches)


def build_model(task):
    keras.utils.set_random_seed(0)
    outputs = VOCAB if task == "lm" else CLASSES
    return transformer.build_transformer(VOCAB, outputs, task, **SMALL)


def strategy_named(name):
    if name == "default":
        return tf.distribute.get_strategy()
    return mirrored_strategy(tuple(d.name for d in tf.config.list_logical_devices("CPU")[:2]))


def make_engine(task, strategy_name="default", initial=None, **options):
    strategy = strategy_named(strategy_name)
    with strategy.scope():
        model = build_model(task)
        optimizer = keras.optimizers.SGD(1.0)
    if initial is not None:
        model.set_weights(initial)
    goals = objectives.resolve("", None, task, model, sequences=True)
    assert goals.weighted
    return Engine(model, optimizer, strategy, goals.loss, EngineOptions(**options),
                  global_batch_size=ROWS, metrics=goals.metrics, weighted=goals.weighted)


def iterator(engine, batches):
    """The micro-batches in order, ROWS rows each (one row per replica when mirrored)."""
    ds = tf.data.Dataset.from_tensor_slices(concatenated(batches)).batch(ROWS, drop_remainder=True)
    return iter(engine.strategy.experimental_distribute_dataset(ds.repeat()))


def reference(model, updates):
    """Weights after plain SGD(1.0) updates, each the exact gradient of the weighted mean
    over its micro-batches (and the first update's loss)."""
    first_loss = None
    for batches in updates:
        grads, loss = transformer.accumulated_gradients(model, map(as_tensors, batches))
        first_loss = float(loss) if first_loss is None else first_loss
        for v, g in zip(model.trainable_variables, grads, strict=True):
            v.assign_sub(g)
    return [v.numpy() for v in model.trainable_variables], first_loss


def naive(model, batches):
    """Weights after one update from the mean of the micro-batches' own means: what an
    engine normalising each micro-batch by its own count would do."""
    means = [transformer.accumulated_gradients(model, [as_tensors(b)])[0] for b in batches]
    return [v.numpy() - np.mean([m[i] for m in means], axis=0)
            for i, v in enumerate(model.trainable_variables)]


def weights(engine):
    out = []
    for v in engine.model.trainable_variables:
        copies = [c.numpy() for c in getattr(v.value, "values", [v.value])]
        for copy in copies[1:]:
            np.testing.assert_array_equal(copy, copies[0])  # every replica holds the same
        out.append(copies[0])
    return out


def max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("task", ["lm", "classification"])
@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_accumulated_update_equals_the_big_batch(sentences, task, strategy):
    batches = micro_batches(sentences, task)
    real = [int(np.sum(y["weight"])) for _, y in batches]
    assert len(set(real)) == len(real), f"micro-batches should differ in weight: {real}"
    model = build_model(task)
    initial = model.get_weights()
    expected, expected_loss = reference(model, [batches])
    model.set_weights(initial)
    control = naive(model, batches)

    engine = make_engine(task, strategy, initial, grad_accum_steps=3, steps_per_execution=3)
    out = engine.train(iterator(engine, batches))

    assert int(out["updates"]) == 1 and int(out["skipped"]) == 0
    # Measured max abs diff (SGD, rate 1): <= 3e-8 for every case.
    assert max_diff(weights(engine), expected) < 1e-5
    # The control: normalising each micro-batch by its own weight moves the weights by a
    # clearly different amount (measured 2e-3 to 4e-2), which this test would catch.
    assert max_diff(control, expected) > 1e-3
    # The reported loss is sum / sum over the update, and so is the accuracy.
    assert float(out["loss"]) == pytest.approx(expected_loss, rel=1e-5)
    model.set_weights(initial)
    correct = sum(float(transformer.correct_sum(as_tensors(y), model(as_tensors(x)))[0])
                  for x, y in batches)
    assert float(out["accuracy"]) == pytest.approx(correct / sum(real), rel=1e-5)


@pytest.mark.parametrize("task", ["lm", "classification"])
def test_mirrored_equals_one_device_with_unequal_tokens_per_replica(sentences, task):
    # One micro-batch of 2 rows, K=1: replica 0 gets 3 sentences, replica 1 one.
    batches = micro_batches(sentences, task, packing=[[[9, 10, 11], [0]]])
    per_row = np.sum(batches[0][1]["weight"], axis=1)
    assert per_row[0] > 2 * per_row[1]
    model = build_model(task)
    initial = model.get_weights()
    expected, _ = reference(model, [batches])
    runs = {}
    for strategy in ("default", "mirrored"):
        engine = make_engine(task, strategy, initial)
        engine.train(iterator(engine, batches))
        runs[strategy] = weights(engine)
        assert max_diff(runs[strategy], expected) < 1e-5, strategy  # measured <= 3e-8
    assert max_diff(runs["mirrored"], runs["default"]) < 1e-5
    # A mean of the two replicas' own means would have differed.
    model.set_weights(initial)
    halves = [(tf.nest.map_structure(lambda a, r=r: a[r:r + 1], batches[0])) for r in range(2)]
    assert max_diff(naive(model, halves), expected) > 1e-3


def test_xla_steps_per_execution_and_loss_scale_stay_exact(sentences):
    """Two updates of K=3, three calls of 2 micro-steps (one call spans the update
    boundary), per-replica XLA and loss scaling, on 2 replicas."""
    task = "lm"
    first = micro_batches(sentences, task)
    second = micro_batches(sentences, task, packing=[[[9], [10, 11]], [[0, 4], [1]],
                                                     [[], [2, 3]]])
    model = build_model(task)
    initial = model.get_weights()
    expected, _ = reference(model, [first, second])
    engine = make_engine(task, "mirrored", initial, grad_accum_steps=3, steps_per_execution=2,
                         xla=True, loss_scale=True)
    it = iterator(engine, first + second)
    outs = [engine.train(it) for _ in range(3)]
    assert int(outs[-1]["updates"]) == 2 and int(outs[-1]["skipped"]) == 0
    assert engine._forward_backward.experimental_get_tracing_count() == 2  # XLA, per replica
    assert max_diff(weights(engine), expected) < 1e-5  # measured 4e-8


@pytest.mark.parametrize("restore_into", ["mirrored", "default"])
def test_a_checkpoint_mid_update_resumes_it_exactly(sentences, tmp_path, restore_into):
    """Saved after 2 of 3 micro-batches: the weight sum so far must come back with the
    gradient sums, or the update is divided by the last micro-batch's weight only."""
    task = "classification"
    batches = micro_batches(sentences, task)
    model = build_model(task)
    initial = model.get_weights()
    expected, _ = reference(model, [batches])
    first = make_engine(task, "mirrored", initial, grad_accum_steps=3)
    it = iterator(first, batches)
    first.train(it), first.train(it)
    path = tf.train.Checkpoint(**first.checkpoint_items).write(str(tmp_path / "ckpt"))

    second = make_engine(task, restore_into, initial, grad_accum_steps=3)
    tf.train.Checkpoint(**second.checkpoint_items).read(path).assert_consumed()
    assert float(second._state.weight_sum.read_value()) == sum(
        float(np.sum(y["weight"])) for _, y in batches[:2])
    second.train(iterator(second, batches[2:]))
    assert int(second.optimizer.iterations.numpy()) == 1
    assert max_diff(weights(second), expected) < 1e-5


def test_an_update_without_real_elements_is_skipped(sentences):
    task = "classification"
    empty, full = micro_batches(sentences, task, packing=[[[], []], [[0], [1, 2]]])
    model = build_model(task)
    initial = model.get_weights()
    expected, _ = reference(model, [[full]])
    engine = make_engine(task, "mirrored", initial, steps_per_execution=2)
    out = engine.train(iterator(engine, [empty, full]))
    # The empty update changed nothing (SGD would have applied a zero gradient; a momentum
    # or Adam step would have moved the weights): only the full one was applied.
    assert int(out["skipped"]) == 1 and int(out["updates"]) == 1
    assert max_diff(weights(engine), expected) < 1e-5


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_evaluate_divides_by_the_weight_of_the_whole_split(sentences, strategy):
    task = "lm"
    batches = micro_batches(sentences, task)
    model = build_model(task)
    _, expected_loss = transformer.accumulated_gradients(model, map(as_tensors, batches))
    engine = make_engine(task, strategy, model.get_weights())
    ds = tf.data.Dataset.from_tensor_slices(concatenated(batches)).batch(ROWS)
    result = engine.evaluate(engine.strategy.experimental_distribute_dataset(ds))
    assert result["loss"] == pytest.approx(float(expected_loss), rel=1e-5)


def test_real_and_computed_tokens_are_counted_exactly(sentences):
    task = "lm"
    batches = micro_batches(sentences, task)
    engine = make_engine(task, "mirrored", steps_per_execution=3)
    out = engine.train(iterator(engine, batches))
    segments = np.concatenate([x["segment_ids"] for x, _ in batches])
    real = int(np.sum(segments > 0))
    lengths = sum(len(sentences[i][0]) - 1 for rows in PACKING for row in rows for i in row)
    assert int(out["real_tokens"]) == real == lengths
    assert int(out["computed_tokens"]) == 3 * ROWS * LENGTH
    assert int(out["sequences"]) == sum(len(row) for rows in PACKING for row in rows) == 9

    meter = ThroughputMeter(ROWS)
    meter.exclude(3, tokens=(real, 3 * ROWS * LENGTH, 9))  # warm-up: in the padding only
    for _ in range(ThroughputMeter.MIN_STEPS):
        meter.close(1, tokens=(real, 3 * ROWS * LENGTH, 9))
    summary = meter.summary()
    assert summary["padding_fraction"] == pytest.approx(1 - real / (3 * ROWS * LENGTH))
    assert summary["real_tokens_per_sec"] > 0 and summary["sequences_per_sec"] > 0
    line = report.summary_lines({"optimizer_updates": 1, **summary})[1]
    assert f"real tokens/s ({summary['padding_fraction']:.0%} padding)" in line
    assert "sequences/s" in line


def test_inputs_without_segment_ids_count_no_tokens():
    ds = tf.data.Dataset.from_tensors((np.zeros([ROWS, 4], np.float32), np.zeros([ROWS])))
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    other = Engine(plain, keras.optimizers.SGD(0.1), tf.distribute.get_strategy(),
                   lambda y, p: tf.reduce_sum(p, -1) * 0.0, global_batch_size=ROWS)
    out = other.train(iter(ds.repeat()))
    assert [int(out[k]) for k in ("real_tokens", "computed_tokens", "sequences")] == [0, 0, 0]


def test_each_static_shape_traces_the_step_once(sentences):
    """Buckets of 3 static lengths: 3 traces however often each comes back."""
    task = "lm"
    engine = make_engine(task)
    iterators = [iterator(engine, micro_batches(sentences, task, [[[0], [1]]], length))
                 for length in (16, 24, 32)]
    for it in iterators * 2:
        engine.train(it)
    assert engine.compiled_functions == 3


def test_objectives_for_token_data_are_weighted_and_named():
    lm, classifier = build_model("lm"), build_model("classification")
    goals = objectives.resolve("", None, "lm", lm, sequences=True)
    assert goals.weighted and goals.loss is transformer.weighted_sparse_ce
    assert goals.report["loss"] == "sparse_categorical_crossentropy (per real token)"
    assert goals.metrics == {"accuracy": transformer.weighted_correct}
    goals = objectives.resolve("", None, "classification", classifier, sequences=True)
    assert goals.report["loss"] == "sparse_categorical_crossentropy (per sequence)"

    def halved(targets, outputs):  # the user's own: weighted per-element losses
        return transformer.weighted_sparse_ce(targets, outputs) / 2

    assert objectives.resolve(halved, None, "lm", lm, sequences=True).loss is halved
    assert not objectives.resolve("", None, "classification", classifier).weighted
    for loss, task, sequences, message in [("mse", "lm", True, "token data trains with"),
                                           ("", "lm", False, "needs token data"),
                                           ("", "regression", True, "not 'regression'")]:
        with pytest.raises(UsageError, match=message):
            objectives.resolve(loss, None, task, lm, sequences=sequences)


def test_fit_reports_tokens_and_compiled_programs(sentences, tmp_path):
    """trainer.fit on a bucketed stream (lengths 16/24/32 interleaved): one dataset, so one
    trace; the report gets the token figures."""
    task = "lm"
    strategy = strategy_named("mirrored")
    packings = [[[[0], [1]]], [[[2, 3], [4]]], [[[5, 6], [7, 8]]]]
    datasets = [tf.data.Dataset.from_tensor_slices(concatenated(
        micro_batches(sentences, task, packing, length))).batch(ROWS, drop_remainder=True)
        for packing, length in zip(packings, (16, 24, 32), strict=True)]
    stream = tf.data.Dataset.choose_from_datasets(
        [d.repeat() for d in datasets], tf.data.Dataset.range(3).repeat())
    with strategy.scope():
        model = build_model(task)
    goals = objectives.resolve("", None, task, model, sequences=True)
    plan = resolve(RuntimeConfig(precision="float32", xla="off"), detect_hardware())
    config = TrainConfig(train_steps=24, optimizer="sgd", learning_rate=0.1, log_every=6,
                         steps_per_execution=3)
    result = trainer.fit(model, strategy.experimental_distribute_dataset(stream), None,
                         config, Runtime(strategy=strategy, plan=plan), steps_per_epoch=3,
                         eval_steps=None, global_batch_size=ROWS, model_dir=str(tmp_path),
                         objectives=goals)
    assert result.compiled_programs == 1
    assert result.optimizer_updates == 24
    real = sum(int(np.sum(make_batch([[sentences[i] for i in row] for row in p[0]], task,
                                     n)[0]["segment_ids"] > 0))
               for p, n in zip(packings, (16, 24, 32), strict=True))
    padding = 1 - real / (ROWS * (16 + 24 + 32))  # each bucket 8 times in 24 steps
    assert result.throughput["padding_fraction"] == pytest.approx(padding)
    assert result.throughput["real_tokens_per_sec"] > 0
    assert np.isfinite(result.train_metrics["loss"])
