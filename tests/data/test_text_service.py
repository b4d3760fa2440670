"""Token records through the tf.data service: a real dispatcher and two real worker
processes on 127.0.0.1 read, parse and shuffle the records into per-sequence examples;
this process buckets or packs them. Every sequence arrives intact, each epoch is counted,
replicas get equal shapes, and the driver trains on it."""

import collections
import math

import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tests.test_data_service import Server
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.data import pipeline
from tfspeed.data import schema as schema_lib
from tfspeed.data import service_client as service

MAX_LENGTH = 256
BATCH = 16


@pytest.fixture(scope="session")
def corpora(tmp_path_factory):
    """Python's json and logging sources, converted by the real converter (whole files of
    up to 256 tokens: two buckets, [120, 256], at 16 sequences a batch)."""
    from tfspeed.convert import convert
    from tfspeed.convert.sources import TextOptions

    root = tmp_path_factory.mktemp("text_service")
    options = TextOptions(tokenizer="bpe:1000", max_length=MAX_LENGTH, long="split")
    dirs = {task: str(root / task) for task in ("classification", "lm")}
    for task, out in dirs.items():
        convert("pystdlib:json,logging", out, task=task, text=options)
    return dirs


@pytest.fixture(scope="module")
def cluster():
    """A dispatcher and two workers (``python -m tfspeed.data_service``) on 127.0.0.1."""
    dispatcher = Server("dispatcher", "--port=0")
    workers = Server.workers(dispatcher, count=2)
    yield dispatcher, workers
    for server in [*workers, dispatcher]:
        server.stop()


def _reference(data_dir, split, lm):
    """The split's sequences, read straight from the shards: ``(tokens, label)`` keys."""
    schema = schema_lib.read(data_dir)
    out = collections.Counter()
    for path in schema.shard_paths(data_dir, split):
        for record in tf.data.TFRecordDataset(path):
            features = tf.train.Example.FromString(record.numpy()).features.feature
            tokens = tuple(features["tokens"].int64_list.value)
            if lm:
                out[(tokens[:-1], tokens[1:])] += 1
            else:
                out[(tokens, int(features["label"].int64_list.value[0]))] += 1
    return out


def _sequences(x, y, lm):
    """The sequences of one batch (a packed row holds several), keyed as ``_reference``."""
    tokens, segments = x["tokens"].numpy(), x["segment_ids"].numpy()
    labels, weight = y["label"].numpy(), y["weight"].numpy()
    for row in range(tokens.shape[0]):
        for segment in np.unique(segments[row][segments[row] > 0]):
            mask = segments[row] == segment
            np.testing.assert_array_equal(x["positions"].numpy()[row][mask],
                                          np.arange(mask.sum()))
            if lm:
                yield tuple(tokens[row][mask].tolist()), tuple(labels[row][mask].tolist())
            else:
                assert weight[row, segment - 1] == 1.0
                yield tuple(tokens[row][mask].tolist()), int(labels[row, segment - 1])


def _config(data_dir, address, mode, sharding="dynamic", **extra):
    return DataConfig(data_dir=data_dir, batch_size=BATCH, batching=mode, cache="none",
                      data_service=address, data_service_sharding=sharding,
                      **extra).validate()


@pytest.mark.parametrize("task, mode", [("classification", "bucket"), ("lm", "pack")])
def test_batches_hold_every_sequence_intact_and_each_epoch_is_counted(cluster, corpora, task,
                                                                      mode):
    lm, data_dir = task == "lm", corpora[task]
    reference = _reference(data_dir, "train", lm)
    schema = schema_lib.read(data_dir)
    batching = pipeline.model_free_batching(  # what build resolves
        DataConfig(data_dir=data_dir, batch_size=BATCH, batching=mode), schema)
    service.reset_report()
    ds = tfspeed.data.build(data_dir, "train", BATCH, training=True, batching=mode,
                            cache="none", data_service=cluster[0].address)
    missing, widths = set(reference), set()
    # Until every sequence came and the service said that an epoch ended (a heartbeat,
    # about a second after its last record); meanwhile the next epoch flows.
    for step, (x, y) in enumerate(ds):
        widths.add(tuple(x["tokens"].shape))
        for sequence in _sequences(x, y, lm):
            assert sequence in reference, "a sequence changed on its way through the service"
            missing.discard(sequence)
        if not missing and "train" in service.report():
            break
        assert step < 40 * sum(reference.values()) // BATCH, f"{len(missing)} never arrive"
    if mode == "pack":
        assert widths == {(batching.rows_per_batch, MAX_LENGTH)}
    else:
        assert {w for _, w in widths} <= set(batching.boundaries)
        assert len(batching.boundaries) >= 2
    counts = service.report()["train"]
    assert counts["epochs"] >= 1, counts  # the first epoch ended: all arrived
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    assert counts["delivered"] == counts["expected"] == counts["epochs"] * sum(reference.values())


@pytest.mark.parametrize("task", ["classification", "lm"])
def test_one_epoch_from_the_service_is_the_split_exactly_once(cluster, corpora, task):
    """The per-sequence examples the service delivers (before batching): epochs one after
    the other (deterministic), so the first N are the first epoch, dynamically sharded
    over two workers."""
    lm, data_dir = task == "lm", corpora[task]
    reference = _reference(data_dir, "train", lm)
    n = sum(reference.values())
    config = _config(data_dir, cluster[0].address, "pack", deterministic=True)
    schema = schema_lib.read(data_dir)
    steps = pipeline.plan.plan_steps(config, schema, "train", True)
    examples = pipeline._tokens_through_service(config, schema, "train", steps, True, True)
    assert examples.element_spec["tokens"] == tf.TensorSpec([None], tf.int32)
    first = collections.Counter()
    for example in examples.take(n).as_numpy_iterator():
        label = example["label"]
        first[(tuple(example["tokens"].tolist()),
               tuple(label.tolist()) if lm else int(label))] += 1
    assert first == reference


def test_sharding_off_gives_each_worker_the_whole_epoch(cluster, corpora):
    data_dir = corpora["classification"]
    records = schema_lib.read(data_dir).split("train").num_records
    service.reset_report()
    config = _config(data_dir, cluster[0].address, "bucket", sharding="off", deterministic=True)
    ds = pipeline.build_from_config(config, "train", training=True)
    sequences = 0
    for x, _ in ds:
        sequences += int((x["segment_ids"].numpy()[:, 0] > 0).sum())
        if sequences > 3 * records and "train" in service.report():  # 2 copies of epoch 1
            break
    counts = service.report()["train"]
    assert counts["epochs"] >= 1
    assert counts["delivered"] == len(cluster[1]) * counts["expected"]
    assert counts["lost"] == 0


def test_file_sharding_splits_the_files_between_a_fixed_worker_list(corpora, tmp_path):
    data_dir = corpora["lm"]
    reference = _reference(data_dir, "train", lm=True)
    with Server.fixed_list(tmp_path) as dispatcher:
        service.reset_report()
        ds = tfspeed.data.build(data_dir, "train", BATCH, training=True, batching="pack",
                                cache="none", data_service=dispatcher.address,
                                data_service_sharding="file")
        missing = set(reference)
        for step, (x, y) in enumerate(ds):
            missing -= set(_sequences(x, y, lm=True))
            if not missing and "train" in service.report():
                break
            assert step < 2000, f"{len(missing)} sequences never arrive"
    counts = service.report()["train"]
    assert counts["epochs"] >= 1 and counts["lost"] == 0 and counts["duplicated"] == 0


@pytest.mark.parametrize("mode", ["pack"])
def test_mirrored_replicas_get_equal_static_shares(cluster, corpora, mode):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    config = _config(corpora["classification"], cluster[0].address, mode)
    ds = strategy.distribute_datasets_from_function(
        lambda ctx: pipeline.build_from_config(config, "train", training=True,
                                               input_context=ctx))
    for step, (x, y) in enumerate(ds):
        shapes = [tuple(t.shape) for t in strategy.experimental_local_results(x["tokens"])]
        assert len(shapes) == 2 and shapes[0] == shapes[1] and shapes[0][0] > 0
        labels = [tuple(t.shape) for t in strategy.experimental_local_results(y["label"])]
        assert labels[0] == labels[1]
        if step == 5:
            break


def test_driver_trains_a_transformer_on_the_service_and_reports_its_counts(cluster, corpora,
                                                                          tmp_path):
    from tfspeed.training.run import run

    service.reset_report()
    data_dir = corpora["classification"]
    config = Config(
        data=DataConfig(data_dir=data_dir, batch_size=8, batching="pack", cache="none",
                        data_service=cluster[0].address, eval_split="validation"),
        model=ModelConfig(name="transformer", width=16, depth=1, heads=2),
        runtime=RuntimeConfig(precision="float32", xla="off", intra_op_threads=0),
        train=TrainConfig(train_steps=48, steps_per_execution=4, learning_rate=0.01,
                          log_every=8),
        model_dir=str(tmp_path),
    ).validate()
    report = run(config)
    assert report["optimizer_updates"] == 48
    assert all(math.isfinite(v) for v in report["train_metrics"].values()
               if isinstance(v, float))
    assert math.isfinite(report["eval_loss"])
    assert report["input"]["batching"]["mode"] == "pack"
    assert "tf.data service" in report["input_sharding"]
    served = report["data_service"]
    assert served["address"] == cluster[0].address and served["sharding"] == "dynamic"
    counts = served["splits"]["train"]
    records = schema_lib.read(data_dir).split("train").num_records
    # 48 packed batches of 8 rows x 256 tokens: more than an epoch of this split.
    assert counts["epochs"] >= 1, counts
    assert counts["lost"] == 0 and counts["duplicated"] == 0
    assert counts["delivered"] == counts["expected"] == counts["epochs"] * records
