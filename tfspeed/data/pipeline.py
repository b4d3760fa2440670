"""Pipeline builder: converted TFRecord shards -> a ``tf.data.Dataset`` of (inputs, labels).

The order is the one the TF performance guide and big_vision settle on; each step says why
it sits where it does. Everything depends on the schema the converter wrote, never on
guessing the records' layout.
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfspeed.config import DataConfig
from tfspeed.data import cache, ops
from tfspeed.data import schema as schema_lib
from tfspeed.data.cache import cache_path  # noqa: F401 -- part of this module's API
from tfspeed.data.reader import (  # noqa: F401 -- part of this module's API
    corruption_error,
    corruption_report,
    reset_corruption_report,
    shard_reader,
    user_error,
)
from tfspeed.errors import UsageError

AUTOTUNE = tf.data.AUTOTUNE
# Stages a pipeline can be cut after (``until=``), in pipeline order; "batch" is the whole.
STAGES = ("read", "decode", "cache", "augment", "batch")
_PARSE_BATCH = 256  # records per vectorised parse_example call
SERVICE_TRANSFER_BATCH = 64  # records per tf.data service transfer


def build(
    data_dir: str,
    split: str,
    batch_size: int,
    *,
    training: bool = False,
    input_context: tf.distribute.InputContext | None = None,
    **options,
) -> tf.data.Dataset:
    """Builds the input pipeline for one split of a converted dataset.

    Args:
      data_dir: a directory written by ``scripts/to_tfrecord.py``.
      split: split name, e.g. ``"train"``.
      batch_size: global batch size (per-replica batches are derived from ``input_context``).
      training: shuffle, augment, repeat forever and drop the last partial batch.
      input_context: from ``strategy.distribute_datasets_from_function``; shards the input.
      **options: any other ``DataConfig`` field (``image_size``, ``cache``, ``augment``, ...).

    Returns:
      A dataset of ``(inputs, labels)`` batches.
    """
    config = DataConfig(data_dir=data_dir, batch_size=batch_size, **options).validate()
    return build_from_config(config, split, training=training, input_context=input_context)


def build_from_config(
    config: DataConfig,
    split: str,
    *,
    training: bool,
    input_context: tf.distribute.InputContext | None = None,
    schema: schema_lib.Schema | None = None,
    until: str | None = None,
) -> tf.data.Dataset:
    """Like ``build`` but from a ``DataConfig`` (and optionally an already-read schema).

    ``until`` (one of ``STAGES``) returns the pipeline cut after that stage, so
    ``tfspeed.diagnose`` can time each stage's share.
    """
    if until is not None and until not in STAGES:
        raise ValueError(f"until={until!r} is not one of {STAGES}")
    schema = schema or schema_lib.read(config.data_dir)
    num_records = schema.split(split).num_records
    if num_records == 0:
        raise UsageError(f"split {split!r} of {config.data_dir} is empty; reconvert with more data")
    shuffle = training and config.shuffle
    deterministic = config.deterministic or not shuffle
    batch_size = config.batch_size
    num_pipelines, pipeline_id = 1, 0
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(config.batch_size)
        num_pipelines, pipeline_id = (
            input_context.num_input_pipelines,
            input_context.input_pipeline_id,
        )
    _check_input_fits(schema, config)

    if config.data_service and training and until is None:
        return _through_service(config, schema, split, batch_size, shuffle, deterministic,
                                num_pipelines, pipeline_id)
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic)
    if until == "read":
        return ds
    ds = _parse_and_decode(ds, schema, config, deterministic)
    if until == "decode":
        return ds
    # Cache after the deterministic decode: decoding is paid once, augmentation stays random.
    ds = cache.apply(ds, schema, config, split, num_pipelines, pipeline_id,
                     _num_records(schema, config, split, num_pipelines, pipeline_id))
    if until == "cache":
        return ds
    if shuffle:
        buffer = min(config.shuffle_buffer, num_records)
        ds = ds.shuffle(buffer, seed=config.seed, reshuffle_each_iteration=True)
    if training:
        ds = ds.repeat()  # before batch: batches span epoch ends, no short batch mid-run
        ds = _augment(ds, config, deterministic)
    if until == "augment":
        return ds
    return _batched(ds, schema, config, batch_size, training, deterministic)


def _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
             remote=False):
    """The read stage: shard files -> their serialized records, losses accounted."""
    files, expected = _files(schema, config, split, num_pipelines, pipeline_id)
    shard_by_file = len(files) < len(schema.split(split).shards)
    ds = tf.data.Dataset.from_tensor_slices((files, expected))
    if shuffle:
        # File order first: cheap, and it decorrelates records the converter put in one shard.
        ds = ds.shuffle(len(files), seed=config.seed, reshuffle_each_iteration=True)
    # Parallel interleave: reads several shards at once, hiding per-file latency.
    ds = ds.interleave(
        shard_reader(config, schema.parse_spec(), remote=remote),
        cycle_length=min(len(files), 16),
        num_parallel_calls=AUTOTUNE,
        deterministic=deterministic,
    )
    if num_pipelines > 1 and not shard_by_file:
        ds = ds.shard(num_pipelines, pipeline_id)  # fewer files than pipelines: shard records
    return ds


def _files(schema, config, split, num_pipelines, pipeline_id):
    """This pipeline's shard files and their record counts.

    Sharded by file when every pipeline gets at least one (no pipeline reads bytes it
    drops). Chosen here in Python rather than with ``Dataset.shard``: under the tf.data
    service's dynamic sharding a ``shard`` op sees each worker's part of the files, not all.
    """
    files = schema.shard_paths(config.data_dir, split)
    expected = [s.num_records for s in schema.split(split).shards]
    if num_pipelines > 1 and len(files) >= num_pipelines:
        return files[pipeline_id::num_pipelines], expected[pipeline_id::num_pipelines]
    return files, expected


def _num_records(schema, config, split, num_pipelines, pipeline_id) -> int:
    """How many records this pipeline reads in one pass, as ``schema.json`` counts them."""
    files, expected = _files(schema, config, split, num_pipelines, pipeline_id)
    if num_pipelines > 1 and len(files) == len(schema.split(split).shards):
        return len(range(pipeline_id, sum(expected), num_pipelines))  # ``Dataset.shard``
    return sum(expected)


def sharding(num_files: int, num_pipelines: int) -> str:
    """How ``num_pipelines`` input pipelines split a split of ``num_files`` shard files."""
    if num_pipelines <= 1:
        return "none (one input pipeline)"
    if num_files >= num_pipelines:
        return f"by file ({num_files} shard files over {num_pipelines} input pipelines)"
    return (f"by record ({num_files} shard file(s) < {num_pipelines} input pipelines: each "
            "reads every file and keeps every n-th record)")


def _batched(ds, schema, config, batch_size, training, deterministic):
    """Batch, batch-level ops and prefetch: always in the training process."""
    # drop_remainder for training: static batch shapes (XLA, replicas) and equal-sized steps.
    ds = ds.batch(batch_size, drop_remainder=training, num_parallel_calls=AUTOTUNE,
                  deterministic=deterministic)
    ds = ds.map(_finalize(schema, config), num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    ds = ds.prefetch(AUTOTUNE)  # overlap the producer with the training step
    return ds.with_options(_options(config, deterministic))


def _through_service(config, schema, split, batch_size, shuffle, deterministic,
                     num_pipelines=1, pipeline_id=0):
    """Training input with read -> parse -> decode -> shuffle -> augment on tf.data service
    workers, and count -> repeat -> batch -> finalize -> prefetch here.

    Why this cut: the remote part is where the CPU goes (decoding, augmenting); batching
    stays here so that batches span epoch ends (``repeat`` before ``batch``) and this process
    can count the records of each epoch: an epoch is one service job, and dynamic sharding
    delivers a record at most once, so what is missing at the end of an epoch was lost with
    a worker. Each remote epoch is finite; ``repeat`` asks the service for the next one.
    ``cache`` is not applied: a worker sees only part of an epoch (a cache would hold that
    part) and each epoch is a new job.
    """
    from tfspeed.data import service

    files, counts = _files(schema, config, split, num_pipelines, pipeline_id)
    if num_pipelines > 1 and len(files) == len(schema.split(split).shards):
        raise UsageError(
            f"--data_service with {num_pipelines} training workers needs at least one shard "
            f"file per worker, and split {split!r} has {len(files)}: reconvert with "
            f"--shards={num_pipelines} or more")
    # Each training worker has its own jobs over its own files: every record once per epoch
    # over all workers, and each worker can count what it should have received.
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
                  remote=True)
    ds = _parse_and_decode(ds, schema, config, deterministic)
    if shuffle:
        buffer = min(config.shuffle_buffer, sum(counts))
        ds = ds.shuffle(buffer, seed=config.seed, reshuffle_each_iteration=True)
    ds = _augment(ds, config, deterministic, remote=True)
    # Records travel in groups: one RPC per record caps a worker at ~3,000 records/s here,
    # groups of 64 move ~30,000/s (benchmarks/scaling.py; measured on the digits).
    ds = ds.batch(SERVICE_TRANSFER_BATCH)
    remote = service.distribute(ds, config.data_service, config.data_service_sharding)
    expected = sum(counts)

    def epoch(_):
        return _count_epoch(remote.unbatch(), split, expected, config)

    # Two epochs in flight: the service tells a consumer that an epoch (a job) has ended
    # only at its next heartbeat, ~1 s after the last record; meanwhile the next epoch's
    # records flow. Each epoch still delivers every record at most once. A deterministic
    # pipeline takes epochs one after the other.
    in_flight = 1 if deterministic else 2
    ds = tf.data.Dataset.range(2**62).interleave(
        epoch, cycle_length=in_flight, block_length=1, num_parallel_calls=in_flight,
        deterministic=deterministic)
    return _batched(ds, schema, config, batch_size, True, deterministic)


def _count_epoch(ds, split, expected, config):
    """Passes ``ds`` through, and at its end tells ``service.record_epoch`` how many came."""
    from tfspeed.data import service

    def account(delivered):
        service.record_epoch(split, int(delivered), expected, config.data_service_sharding,
                             config.data_service)
        return True

    def count(n, element):
        element, is_end = element
        done = tf.cond(is_end, lambda: tf.py_function(account, [n], tf.bool),
                       lambda: tf.constant(True))
        with tf.control_dependencies([done]):
            return n + 1, (tf.nest.map_structure(tf.identity, element), is_end)

    sentinel = tf.nest.map_structure(
        lambda spec: tf.zeros([d or 0 for d in spec.shape], spec.dtype), ds.element_spec)
    ds = ds.map(lambda e: (e, False)).concatenate(
        tf.data.Dataset.from_tensors((sentinel, True)))
    ds = ds.scan(tf.constant(0, tf.int64), count)
    return ds.filter(lambda e, is_end: tf.logical_not(is_end)).map(lambda e, _: e)


def input_shape(schema: schema_lib.Schema, config: DataConfig) -> tuple[int, ...]:
    """The shape of one model input (no batch dimension) that the pipeline produces."""
    feature = schema.input_feature
    if feature.is_image and config.image_size:
        return (config.image_size, config.image_size, feature.shape[-1])
    return tuple(feature.shape)


def _check_input_fits(schema: schema_lib.Schema, config: DataConfig) -> None:
    feature = schema.input_feature
    if feature.is_image and None in feature.shape[:2] and not config.image_size:
        raise UsageError(
            f"images in {config.data_dir} have varying sizes; pass --image_size=N to resize them "
            "(or reconvert with --image_max_side)"
        )


def _parse_and_decode(ds, schema, config, deterministic):
    """Parses records into {"inputs", "label"} and runs the deterministic ops."""
    spec = schema.parse_spec()
    feature = schema.input_feature
    decode_ops = [ops.make_decode(feature)]
    if feature.is_image and config.image_size and feature.shape[:2] != (
        config.image_size,
        config.image_size,
    ):
        decode_ops.append(ops.make_resize(config.image_size))
    decode = ops.compose(decode_ops)

    def select(parsed):
        return {"inputs": parsed[schema.inputs], "label": parsed[schema.label]}

    mode = config.parse
    if mode == "auto":
        mode = "single" if feature.is_image else "batched"
    if mode == "batched" and not feature.is_image:
        # Vectorised: one parse_example per 256 records; decode_raw also runs batched.
        ds = ds.batch(_PARSE_BATCH)
        ds = ds.map(
            lambda r: decode(select(tf.io.parse_example(r, spec))),
            num_parallel_calls=AUTOTUNE,
            deterministic=deterministic,
        )
        return ds.unbatch()
    if mode == "batched":
        # Images: parse vectorised, then decode one image at a time (decoders are per image).
        ds = ds.batch(_PARSE_BATCH).map(
            lambda r: select(tf.io.parse_example(r, spec)),
            num_parallel_calls=AUTOTUNE,
            deterministic=deterministic,
        )
        ds = ds.unbatch()
        return ds.map(decode, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    return ds.map(
        lambda r: decode(select(tf.io.parse_single_example(r, spec))),
        num_parallel_calls=AUTOTUNE,
        deterministic=deterministic,
    )


def _augment(ds, config, deterministic, remote=False):
    if not config.augment:
        return ds
    table = ops.OPS
    augment = ops.compose_random([table[name][1]() for name in config.augment])
    # Stateless randomness keyed by (seed, element index): reproducible under parallel maps.
    # On service workers the index restarts with every epoch (a job) and on every worker,
    # so the key there takes a fresh random draw instead of the seed: the same record gets
    # different augmentations in different epochs (the service's order is not reproducible
    # anyway).
    ds = ds.enumerate()

    def key(i):
        if remote:
            return tf.stack([tf.random.uniform([], maxval=2**62, dtype=tf.int64), i])
        return tf.stack([tf.cast(config.seed, tf.int64), i])

    return ds.map(lambda i, e: augment(e, key(i)), num_parallel_calls=AUTOTUNE,
                  deterministic=deterministic)


def _finalize(schema, config):
    """Batch-level ops (cheaper than per element), then the (inputs, labels) tuple Keras takes."""
    feature = schema.input_feature
    stats = schema.stats.get(schema.inputs)
    if feature.dtype == "uint8":
        batch_op = ops.make_normalize()
    elif stats:
        batch_op = ops.make_standardize(stats["mean"], stats["std"])
    else:
        batch_op = ops.make_normalize(scale=1.0)

    num_classes = schema.num_classes
    message = (f"tfspeed: labels outside the {num_classes} classes of "
               f"{os.path.join(config.data_dir, schema_lib.SCHEMA_FILE)} (expected 0.."
               f"{num_classes - 1}): reconvert the dataset, its records and schema disagree")

    def finalize(batch):
        batch = batch_op(batch)
        labels = tf.cast(batch["label"], tf.int32)
        # A label the classifier has no output for would fail deep inside the loss.
        check = tf.debugging.assert_less(labels, num_classes, message=message)
        with tf.control_dependencies([check, tf.debugging.assert_non_negative(
                labels, message=message)]):
            return tf.identity(batch["inputs"]), tf.identity(labels)

    return finalize


def _options(config: DataConfig, deterministic: bool) -> tf.data.Options:
    options = tf.data.Options()
    # Non-deterministic order lets parallel stages hand over whichever element is ready first.
    options.deterministic = deterministic
    if config.ram_budget_mb:
        options.autotune.ram_budget = config.ram_budget_mb * 2**20
    # We shard explicitly above; tf.distribute must not shard a second time.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.experimental_optimization.map_parallelization = True
    # The read stage's corruption accounting is a py_function; saving an iterator must
    # not fail on it (it holds no state a checkpoint needs: the pipeline is rebuilt).
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return options
