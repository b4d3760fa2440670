"""The driver's speed features end to end: equivalences that must hold from the command line,
resumption, schedules, remat, and the settings it must refuse."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.errors import UsageError
from tfspeed.training import models, optimizers
from tfspeed.training.run import run


def _config(data_dir, model_dir, *, batch=32, accum=1, steps=6, strategy="default",
            replicas=0, precision="float32", xla="off", spe=2, **train):
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=batch, shuffle=False, cache="memory"),
        model=ModelConfig(name="mlp", width=32),
        runtime=RuntimeConfig(strategy=strategy, cpu_replicas=replicas, precision=precision,
                              xla=xla, intra_op_threads=0),
        train=TrainConfig(train_steps=steps, grad_accum_steps=accum, steps_per_execution=spe,
                          learning_rate=0.01, log_every=4, **train),
        model_dir=str(model_dir),
    ).validate()


@pytest.fixture(scope="module")
def big_batch_report(digits_dir, tmp_path_factory):
    """The reference: 6 updates of batch 32, one device, float32, fixed order."""
    return run(_config(digits_dir, tmp_path_factory.mktemp("big")))


@pytest.mark.parametrize(
    "settings",
    [
        dict(batch=8, accum=4, spe=3),  # accumulation spans executions
        dict(batch=32, strategy="mirrored", replicas=2, spe=1),
        dict(batch=8, accum=4, strategy="mirrored", replicas=2, xla="on", spe=5),
    ],
    ids=["accum4", "mirrored2", "mirrored2-accum4-xla"],
)
def test_equivalent_runs_give_the_same_eval_loss(big_batch_report, digits_dir, tmp_path, settings):
    """batch 32 x 1 == batch 8 x 4 accumulated, on 1 or 2 replicas, with or without XLA."""
    report = run(_config(digits_dir, tmp_path, **settings))
    assert report["optimizer_updates"] == big_batch_report["optimizer_updates"] == 6
    assert report["micro_steps"] == 6 * settings.get("accum", 1)
    assert report["eval_loss"] == pytest.approx(big_batch_report["eval_loss"], abs=1e-4)
    assert report["runtime"]["num_replicas"] == (2 if settings.get("replicas") else 1)


# SGD's update is proportional to the gradient (Adam's is nearly invariant to its scale):
# a gradient summed where it should be averaged (over replicas or micro-batches) changes
# these weights by far more than this. Float32 sums in another order: a few ulps.
SGD_TOLERANCE = 1e-5


def _sgd_run(data_dir, model_dir, placement="host", **settings):
    """A driver run with SGD (Nesterov momentum 0.9); its report and final weights."""
    config = _config(data_dir, model_dir, optimizer="sgd", **settings)
    config = dataclasses.replace(config, data=dataclasses.replace(
        config.data, input_placement=placement))
    report = run(config)
    assert report["input"]["placement"]["where"] == placement
    return report, keras.models.load_model(model_dir / "model.keras").get_weights()


@pytest.fixture(scope="module")
def sgd_reference(digits_dir, tmp_path_factory):
    """6 SGD updates of batch 32, one device, tf.data input, float32, fixed order."""
    return _sgd_run(digits_dir, tmp_path_factory.mktemp("sgd"))


@pytest.mark.parametrize(
    "settings",
    [
        dict(batch=8, accum=4, spe=3),
        dict(strategy="mirrored", replicas=2, spe=1),
        dict(placement="device"),
        dict(batch=8, accum=4, strategy="mirrored", replicas=2, placement="device", spe=5),
    ],
    ids=["accum4", "mirrored2", "in-graph", "mirrored2-accum4-in-graph"],
)
def test_equivalent_sgd_runs_train_to_the_same_weights(sgd_reference, digits_dir, tmp_path,
                                                       settings):
    """batch 32 x 1 == batch 8 x 4 accumulated == 2 replicas == in-graph input, weight by
    weight, under an optimizer that would show a wrong gradient scale."""
    reference, expected = sgd_reference
    report, weights = _sgd_run(digits_dir, tmp_path, **settings)
    assert report["optimizer_updates"] == reference["optimizer_updates"] == 6
    assert report["runtime"]["num_replicas"] == (2 if settings.get("replicas") else 1)
    for got, want in zip(weights, expected, strict=True):
        np.testing.assert_allclose(got, want, atol=SGD_TOLERANCE, rtol=0)


def test_the_sgd_tolerance_catches_a_gradient_twice_too_large(sgd_reference, digits_dir,
                                                              tmp_path):
    """The control for the test above: with SGD a gradient summed over 2 replicas instead of
    averaged is the same run at twice the learning rate, and that is far outside it."""
    config = _config(digits_dir, tmp_path, optimizer="sgd")
    config = dataclasses.replace(
        config, data=dataclasses.replace(config.data, input_placement="host"),
        train=dataclasses.replace(config.train, learning_rate=0.02))
    run(config)
    doubled = keras.models.load_model(tmp_path / "model.keras").get_weights()
    gap = max(np.abs(a - b).max() for a, b in zip(doubled, sgd_reference[1], strict=True))
    assert gap > 100 * SGD_TOLERANCE


def test_report_records_each_choice_with_its_reason(big_batch_report):
    runtime = big_batch_report["runtime"]
    assert runtime["precision"] == "float32" and runtime["xla"] is False
    assert runtime["reasons"] == {"strategy": "--strategy=default",
                                  "precision": "--precision=float32", "xla": "--xla=off",
                                  "intra_op_threads": "--intra_op_threads=0: TF's default "
                                                      "(one per core)"}


def test_auto_settings_resolve_and_train(digits_dir, tmp_path):
    config = _config(digits_dir, tmp_path, steps=40, strategy="auto", precision="auto",
                     xla="auto", spe="auto")
    report = run(config)
    assert report["optimizer_updates"] == 40
    assert report["steps_per_execution"]["auto"] is True
    assert report["steps_per_execution"]["value"] in (1, 2, 4, 8, 16, 32, 64)
    assert report["runtime"]["reasons"]["precision"].startswith("auto")
    assert report["train_metrics"]["loss"] < 2.3  # below chance level for 10 classes
    # Images travel as uint8 by default; the step scales them.
    assert report["input"]["image_dtype"] == "uint8"


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(batch=16, accum=2, spe=3, strategy="mirrored", replicas=2)],
    ids=["default", "mirrored-accum2"],
)
def test_resume_continues_from_the_last_checkpoint(digits_dir, tmp_path, settings):
    k = settings.get("accum", 1)
    first = run(_config(digits_dir, tmp_path, steps=4, checkpoint_every=2, **settings))
    assert first["resumed_from_update"] == 0 and first["optimizer_updates"] == 4
    # Saved when an execution crosses a multiple of 2 updates (3 micro-steps per execution
    # with K=2 cross it at update 3), and at the end.
    expected = ["ckpt-2.index", "ckpt-4.index"] if k == 1 else ["ckpt-3.index", "ckpt-4.index"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("ckpt-*.index")) == expected
    second = run(_config(digits_dir, tmp_path, steps=7, checkpoint_every=2, **settings))
    assert second["resumed_from_update"] == 4
    assert second["optimizer_updates"] == 7 and second["micro_steps"] == 7 * k


def test_cosine_schedule_with_warmup_counts_updates():
    config = TrainConfig(learning_rate=0.1, lr_schedule="cosine", warmup_steps=10,
                         grad_accum_steps=4, scale_lr_with_batch=True)
    optimizer = optimizers.make_optimizer(config, total_updates=110, global_batch_size=64)
    schedule = optimizer._learning_rate
    peak = 0.1 * 64 * 4 / 256
    assert optimizers.peak_learning_rate(config, 64) == pytest.approx(peak)
    assert float(schedule(0)) == pytest.approx(0.0, abs=1e-7)
    assert float(schedule(10)) == pytest.approx(peak, rel=1e-5)
    assert float(schedule(60)) == pytest.approx(peak / 2, rel=1e-4)
    assert float(schedule(110)) == pytest.approx(0.0, abs=1e-6)


def test_constant_schedule_with_warmup():
    config = TrainConfig(learning_rate=0.2, warmup_steps=4)
    schedule = optimizers.make_optimizer(config, total_updates=100, global_batch_size=8)._learning_rate
    assert [round(float(schedule(s)), 6) for s in (0, 1, 3, 50)] == [0.05, 0.1, 0.2, 0.2]


def test_remat_gives_the_same_gradients_inside_tf_function():
    """Inside tf.function, where Keras' own RematScope fails on the TF backend."""
    x = tf.random.stateless_normal([16, 8, 8, 1], seed=[1, 2])
    y = tf.constant(np.arange(16) % 10)
    grads = []
    for remat in (False, True):
        keras.utils.set_random_seed(0)
        model = models.build(ModelConfig(name="cnn", width=8, remat=remat), (8, 8, 1), 10)

        @tf.function
        def gradients(model=model):
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y, logits, from_logits=True))
            return tape.gradient(loss, model.trainable_variables)

        grads.append([g.numpy() for g in gradients()])
    assert any(isinstance(layer, models.RematBlock) for layer in model.layers)
    for plain, recomputed in zip(*grads, strict=True):
        np.testing.assert_allclose(plain, recomputed, atol=1e-6)


def test_remat_run_trains_and_saves(digits_dir, tmp_path):
    config = _config(digits_dir, tmp_path, steps=4)
    config = dataclasses.replace(config, model=ModelConfig(name="cnn", width=8, remat=True))
    report = run(config)
    assert report["optimizer_updates"] == 4
    restored = keras.models.load_model(tmp_path / "model.keras")
    assert any(isinstance(layer, models.RematBlock) for layer in restored.layers)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(precision="mixed_float16"), "--precision=mixed_float16 needs a GPU"),
        (dict(batch=33, strategy="mirrored", replicas=2), "does not split evenly over 2"),
        (dict(batch=1024, accum=2, steps=0), "more than the train split holds"),
    ],
)
def test_impossible_settings_are_refused(digits_dir, tmp_path, change, message):
    with pytest.raises(UsageError, match=message):
        run(_config(digits_dir, tmp_path, **change))


def test_negative_and_malformed_values_are_refused(digits_dir, tmp_path):
    config = _config(digits_dir, tmp_path)
    with pytest.raises(UsageError, match="--grad_accum_steps=0 must be > 0"):
        dataclasses.replace(config, train=TrainConfig(grad_accum_steps=0)).validate()
    with pytest.raises(UsageError, match="--lr_schedule='linear'"):
        dataclasses.replace(config, train=TrainConfig(lr_schedule="linear")).validate()


@pytest.mark.parametrize("batch", [8, 16])
def test_mirrored_evaluation_of_an_uneven_split_equals_one_device(digits_dir, tmp_path, batch):
    """180 validation records in per-replica batches of 4 (or 8) make an odd number of them:
    the last step leaves replica 1 an empty batch, on which oneDNN's convolutions fail."""
    config = _config(digits_dir, tmp_path, batch=batch, steps=2, strategy="mirrored",
                     replicas=2, spe=1)
    report = run(dataclasses.replace(config, model=ModelConfig(name="cnn", width=8)))

    model = keras.models.load_model(tmp_path / "model.keras")
    batches = list(tfspeed.data.build(digits_dir, "validation", 64, cache="none"))
    logits = np.concatenate([model(x, training=False) for x, _ in batches])
    labels = np.concatenate([y for _, y in batches])
    assert len(labels) == 180 and -(-180 // (batch // 2)) % 2 == 1  # an odd count
    loss = np.mean(keras.losses.sparse_categorical_crossentropy(labels, logits,
                                                                from_logits=True))
    assert report["eval_loss"] == pytest.approx(float(loss), rel=1e-5)
    assert report["eval_accuracy"] == pytest.approx(np.mean(logits.argmax(1) == labels))


def test_eval_steps_caps_the_evaluated_batches(digits_dir, tmp_path):
    report = run(_config(digits_dir, tmp_path, steps=2, eval_steps=1))
    model = keras.models.load_model(tmp_path / "model.keras")
    x, y = next(iter(tfspeed.data.build(digits_dir, "validation", 32, cache="none")))
    correct = np.mean(np.argmax(model(x, training=False), 1) == y.numpy())
    assert report["eval_accuracy"] == pytest.approx(correct)  # the first batch of 32 alone


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(batch=16, accum=2, spe=3, strategy="mirrored", replicas=2)],
    ids=["default", "mirrored-accum2"],
)
def test_in_graph_input_gives_the_weights_of_the_tf_data_path(digits_dir, tmp_path, settings):
    """The same records in the same order (unshuffled), the same augmentation keys: the
    in-graph source and the pipeline train to the same weights."""
    weights = {}
    for placement in ("host", "device"):
        config = _config(digits_dir, tmp_path / placement, steps=8, **settings)
        data = dataclasses.replace(config.data, input_placement=placement, augment=("flip",))
        report = run(dataclasses.replace(config, data=data))
        assert report["input"]["placement"]["where"] == placement
        weights[placement] = keras.models.load_model(tmp_path / placement / "model.keras"
                                                     ).get_weights()
    for host, device in zip(weights["host"], weights["device"], strict=True):
        np.testing.assert_allclose(host, device, atol=1e-6, rtol=0)


def test_in_graph_epochs_visit_every_record_once_in_a_seeded_order(digits_dir):
    from tfspeed.data import ingraph
    from tfspeed.data import schema as schema_lib

    schema = schema_lib.read(digits_dir)
    config = tfspeed.data.DataConfig(data_dir=digits_dir, batch_size=32, seed=4)
    source = ingraph.load(config, schema, "train", global_batch_size=32)
    n = source.num_records
    rows = source.rows(tf.range(3 * n, dtype=tf.int64)).numpy().reshape(3, n)
    for epoch in rows:
        assert sorted(epoch) == list(range(n))  # every record once per epoch
    assert not np.array_equal(rows[0], rows[1])  # a new order each epoch
    again = ingraph.load(config, schema, "train", global_batch_size=32)
    np.testing.assert_array_equal(again.rows(tf.range(n, dtype=tf.int64)).numpy(), rows[0])
    # Unshuffled, the stored order is the pipeline's own (unshuffled) order.
    plain = ingraph.load(dataclasses.replace(config, shuffle=False), schema, "train",
                         global_batch_size=32)
    x, y = _all_batches(tfspeed.data.build(digits_dir, "train", 256, shuffle=False,
                                           image_dtype="uint8"))
    np.testing.assert_array_equal(plain.inputs.numpy(), x)
    np.testing.assert_array_equal(plain.labels.numpy(), y)


def _all_batches(ds):
    xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in ds), strict=True)
    return np.concatenate(xs), np.concatenate(ys)


def test_in_graph_placement_is_chosen_from_the_budget(digits_dir):
    from tfspeed.data import ingraph
    from tfspeed.data import schema as schema_lib

    schema = schema_lib.read(digits_dir)
    config = tfspeed.data.DataConfig(data_dir=digits_dir, image_size=64, ram_budget_mb=1)
    host = ingraph.choose("auto", config, schema, "train")  # 1617 x 64 x 64 = 6.3 MB
    assert host.where == "host" and host.reason.startswith("auto: the decoded 'train' split "
                                                           "takes ~6.3 MB, the budget is 1 MB")
    roomy = dataclasses.replace(config, ram_budget_mb=64)
    assert ingraph.choose("auto", roomy, schema, "train").where == "device"
    rrc = dataclasses.replace(roomy, augment=("random_resized_crop",))
    assert "random_resized_crop" in ingraph.choose("auto", rrc, schema, "train").reason
    with pytest.raises(UsageError, match="--input_placement=device cannot hold the input"):
        ingraph.choose("device", rrc, schema, "train")
