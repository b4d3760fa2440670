"""Pipeline builder: converted TFRecord shards -> a ``tf.data.Dataset`` of (inputs, labels).

The order is the one the TF performance guide and big_vision settle on; each step says why
it sits where it does. Everything depends on the schema the converter wrote, never on
guessing the records' layout. Per-record work is kept to one function call (the decode,
fused with the augmentations when nothing is cached in between): each per-record ``map``
costs a sizeable share of a small photo's decode (``benchmarks/decode_ops.py``, passthrough).
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from tfspeed.config import DataConfig
from tfspeed.data import cache, ops, plan, sequences, service_client, text
from tfspeed.data import schema as schema_lib
from tfspeed.data.cache import cache_path  # noqa: F401 -- part of this module's API
from tfspeed.data.inputs import check_input_fits, input_shape, is_image, warn_if_upscaled  # noqa: F401
from tfspeed.data.plan import CachePlan, plan_cache  # noqa: F401 -- part of this module's API
from tfspeed.data.reader import (  # noqa: F401 -- part of this module's API
    corruption_error,
    corruption_report,
    group_size,
    reset_corruption_report,
    shard_reader,
    user_error,
)
from tfspeed.data.sizing import input_sizes
from tfspeed.errors import UsageError
from tfspeed.util import system

AUTOTUNE = tf.data.AUTOTUNE
# Stages a pipeline can be cut after (``until=``), in pipeline order; "batch" is the whole.
STAGES = ("read", "decode", "cache", "augment", "batch")
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
      **options: any other ``DataConfig`` field (``image_size``, ``cache``, ``augment``,
        ``image_dtype``, ...). Text records take ``batching`` (``auto``, ``pad``,
        ``bucket``, ``pack``), ``max_length`` (tokens a row holds) and ``tokens_per_batch``
        (a token budget per batch; 0: ``batch_size`` texts a batch).

    Returns:
      A dataset of ``(inputs, labels)`` batches: images as float32 in [0, 1] (or uint8 with
      ``image_dtype="uint8"``, leaving the scaling to the model), tabular features
      standardised with the train split's statistics, labels int32. Text: inputs are the
      dict of ``tokens``, ``segment_ids`` and ``positions``, labels the dict of ``label``
      and ``weight``; the batching ``auto`` chose, and why, is logged and is
      ``model_free_batching(config, schema)`` (never pack: no model says it keeps packed
      sequences apart; pass ``batching="pack"`` for one that does). A finite split
      (``training=False``) declares its number of batches (``cardinality()``), from the
      record counts in ``schema.json``.
    """
    config = DataConfig(data_dir=data_dir, batch_size=batch_size, **options).validate()
    return build_from_config(config, split, training=training, input_context=input_context)


def model_free_batching(config: DataConfig, schema, replicas: int = 1) -> text.Batching:
    """Token records batched without a model to ask (``tfspeed.data.build``): what the
    driver resolves for a model tfspeed does not know (no segment ids, attention unknown)
    with ``--xla=auto`` on this backend and hardware, through the same ``tfspeed.plan``,
    for a run of unknown length. Its shapes compile where Keras' own ``fit``
    (``jit_compile="auto"``) compiles them too: on JAX and on an accelerator, not in
    TensorFlow on a CPU. Its ``auto`` never packs (packing mixes texts in a row for a model
    that ignores segment ids): pass ``batching="pack"`` for one that keeps them apart."""
    from absl import logging

    from tfspeed import plan as plan_lib
    from tfspeed import runtime

    hw = runtime.detect_hardware()
    xla = plan_lib.xla(plan_lib.AUTO, bool(hw.gpus or hw.tpus))
    compiled = plan_lib.compiled_modes(plan_lib.AUTO, xla.value,
                                       runtime.backends.current().compiles_every_step)
    batching = text.resolve(config, schema, replicas=replicas, compiled=compiled)
    logging.info("--batching=%s: %s (%s)", config.batching, batching.mode, batching.reason)
    return batching


def build_from_config(
    config: DataConfig,
    split: str,
    *,
    training: bool,
    input_context: tf.distribute.InputContext | None = None,
    schema: schema_lib.Schema | None = None,
    until: str | None = None,
    batching: text.Batching | None = None,
    take_sequences: int | None = None,
) -> tf.data.Dataset:
    """Like ``build`` but from a ``DataConfig`` (and optionally an already-read schema).

    ``until`` (one of ``STAGES``) returns the pipeline cut after that stage, so
    ``tfspeed.diagnose`` can time each stage's share. ``batching``: token records batched as
    the job resolved them (``text.resolve``, once per job); None: ``model_free_batching``.
    ``take_sequences``: token records, evaluation: only the split's first N sequences.
    """
    if until is not None and until not in STAGES:
        raise ValueError(f"until={until!r} is not one of {STAGES}")
    schema = schema or schema_lib.read(config.data_dir)
    num_records = schema.split(split).num_records
    if num_records == 0:
        raise UsageError(f"split {split!r} of {config.data_dir} is empty; reconvert with more data")
    check_input_fits(schema, config)
    warn_if_upscaled(schema, config, split)
    shuffle = training and config.shuffle
    deterministic = config.deterministic or not shuffle
    batch_size, num_pipelines, pipeline_id = config.batch_size, 1, 0
    if input_context is not None:
        batch_size = input_context.get_per_replica_batch_size(config.batch_size)
        num_pipelines, pipeline_id = (input_context.num_input_pipelines,
                                      input_context.input_pipeline_id)
    steps = plan.plan_steps(config, schema, split, training)
    if text.is_text(schema):
        replicas = input_context.num_replicas_in_sync if input_context else 1
        batching = batching or model_free_batching(config, schema, replicas)
        return _tokens(config, schema, split, training, steps, shuffle, deterministic,
                       num_pipelines, pipeline_id, replicas, batching, until, take_sequences)

    if config.data_service and training and until is None:
        return _through_service(config, schema, split, steps, batch_size, shuffle,
                                deterministic, num_pipelines, pipeline_id)
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
                  parse=until != "read")
    if until == "read":
        return ds
    if steps.decode_before_cache:
        # Deterministic work goes before the cache: decoding is paid once.
        ds = ds.map(steps.decode, num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    if until == "decode":
        return _decoded(ds, steps, deterministic)
    ds = cache.apply(ds, schema, config, split, num_pipelines, pipeline_id,
                     _num_records(schema, config, split, num_pipelines, pipeline_id),
                     steps.cache.mode)
    if until == "cache":
        return ds
    if shuffle:
        ds = ds.shuffle(steps.shuffle_buffer, seed=config.seed, reshuffle_each_iteration=True)
    if training:
        ds = ds.repeat()  # before batch: batches span epoch ends, no short batch mid-run
    ds = _after_cache(ds, config, steps, training, deterministic)
    if until == "augment":
        return ds
    ds = _batched(ds, config, steps, batch_size, training, deterministic)
    if training:
        return ds  # repeats forever: infinite cardinality already
    records = _num_records(schema, config, split, num_pipelines, pipeline_id)
    return declare_batches(ds, -(-records // batch_size))  # drop_remainder=False: ceil


def _tokens(config, schema, split, training, steps, shuffle, deterministic, num_pipelines,
            pipeline_id, replicas, batching, until=None, take_sequences=None):
    """The text pipeline: read -> examples -> cache -> shuffle -> repeat -> batch ->
    prefetch, batched as ``batching`` says (the figures the job and report use)."""
    longest = text.longest(text.length_counts(schema, split))
    if config.data_service and training and until is None:
        ds = _tokens_through_service(config, schema, split, steps, shuffle, deterministic,
                                     num_pipelines, pipeline_id)
        ds = text.batch(ds, batching, training=True, longest=longest,
                        num_pipelines=num_pipelines, local_replicas=replicas // num_pipelines,
                        deterministic=deterministic)
        return ds.prefetch(AUTOTUNE).with_options(_options(config, deterministic)).apply(
            tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
                  parse=until != "read")
    if until == "read":
        return ds
    # The int32 cast (and an lm's shift) before the cache: paid once, not every epoch; no
    # decoding here, the cache holds the token examples.
    ds = _map(ds, text.make_to_example(schema.task), deterministic)
    if until == "decode":
        return ds
    records = _num_records(schema, config, split, num_pipelines, pipeline_id)
    ds = cache.apply(ds, schema, config, split, num_pipelines, pipeline_id, records,
                     steps.cache.mode)
    if until == "cache":
        return ds
    if take_sequences and not training:  # a capped evaluation: the split's first sequences
        records = min(records, max(1, take_sequences // num_pipelines))
        ds = ds.take(records)
    if shuffle:  # sequences, before batching: buckets and packed rows mix the whole buffer
        ds = ds.shuffle(steps.shuffle_buffer, seed=config.seed, reshuffle_each_iteration=True)
    if training:
        ds = ds.repeat()  # before batching: no short batch (or bucket remainder) mid-run
    if until == "augment":
        return ds
    ds = text.batch(ds, batching, training=training, longest=longest,
                    num_pipelines=num_pipelines, local_replicas=replicas // num_pipelines,
                    deterministic=deterministic)
    ds = ds.prefetch(AUTOTUNE).with_options(_options(config, deterministic))
    if training:  # endless (packing's rebatch leaves tf.data unsure of it)
        return ds.apply(tf.data.experimental.assert_cardinality(tf.data.INFINITE_CARDINALITY))
    if batching.mode != "pad" or longest > batching.max_length:
        return ds  # a count only packing or bucketing tells
    batches = -(-records // (batching.batch_size // num_pipelines))
    return declare_batches(ds, batches * (replicas // num_pipelines))


def declare_batches(ds: tf.data.Dataset, num_batches: int) -> tf.data.Dataset:
    """``ds`` with ``cardinality() == num_batches``, so Keras knows how long a validation
    pass is (with an unknown one, ``fit`` ends each pass on OutOfRange and warns "Your input
    ran out of data; interrupting training").

    Not ``assert_cardinality``: with ``on_corrupt="skip"`` (the default) a damaged shard loses
    records (the reader counts and reports them), the pass has fewer batches than
    ``schema.json`` implies, and the assertion would then fail the run at the end of every
    pass with FailedPrecondition. Instead the batches are followed by a dataset that claims
    to be infinite but yields nothing (a filtered element, repeated: a repeat of an empty
    pass ends), and ``take`` cuts the declared count: a complete pass yields exactly its
    batches, a short one ends early, as the plain pipeline does. Per batch, not per record.
    """
    nothing = tf.data.Dataset.from_tensors(tf.nest.map_structure(
        lambda s: tf.zeros([d if d is not None else 0 for d in s.shape], s.dtype),
        ds.element_spec)).filter(lambda *_: False).repeat()
    return ds.concatenate(nothing).take(num_batches)


def _map(ds, fn, deterministic):
    return ds.map(fn, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
             parse=True, remote=False):
    """The read stage: shard files -> their records, parsed in groups, losses accounted."""
    files, expected = _files(schema, config, split, num_pipelines, pipeline_id)
    shard_by_file = len(files) < len(schema.split(split).shards)
    ds = tf.data.Dataset.from_tensor_slices((files, expected))
    if shuffle:
        # File order first: cheap, and it decorrelates records the converter put in one shard.
        ds = ds.shuffle(len(files), seed=config.seed, reshuffle_each_iteration=True)
    parse_group, parse_one = ops.make_group_parser(schema) if parse else (None, None)
    check = (ops.make_label_check(schema.num_classes, _label_message(schema, config))
             if parse and schema.task == "classification" else None)
    sizes = input_sizes(config.input_threads or system.cpus_available(), len(files),
                        plan.record_bytes(config, schema, split, encoded=True))
    reader = shard_reader(config, parse_group, parse_one, check=check, remote=remote,
                          per_record=config.parse == "single", group=sizes.group)
    # Parallel interleave: reads several shards at once, hiding per-file latency; as wide
    # and with as many threads as ``sizing.input_sizes`` says for this machine.
    if shuffle:  # groups through the interleave: its threads hand over groups, not records
        ds = ds.interleave(reader, cycle_length=sizes.cycle_length,
                           num_parallel_calls=sizes.read_threads,
                           deterministic=deterministic).unbatch()
    else:  # records taken from the files in turn, one by one: n workers reading 1/n of the
        # files each then make up the global batches one worker would read (tested)
        ds = ds.interleave(lambda *shard: reader(*shard).unbatch(),
                           cycle_length=sizes.cycle_length,
                           num_parallel_calls=sizes.read_threads, deterministic=deterministic)
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


def _after_cache(ds, config, steps, training, deterministic, remote=False):
    """What runs per element after the cache: decoding if it was not cached decoded, and
    the random augmentations, fused into one map (one function call per record)."""
    augment = steps.augment if training else None
    if augment is None:
        return _decoded(ds, steps, deterministic)
    decode = None if steps.decode_before_cache else steps.decode
    scale = ops.make_normalize() if steps.scale_in_map and not remote else None
    # Stateless randomness keyed by (seed, element index): reproducible under parallel maps.
    # On service workers the index restarts with every epoch (a job) and on every worker,
    # so the key there takes a fresh random draw instead of the seed: the same record gets
    # different augmentations in different epochs (the service's order is not reproducible
    # anyway).
    def key(i):
        if remote:
            return tf.stack([tf.random.uniform([], maxval=2**62, dtype=tf.int64), i])
        return tf.stack([tf.cast(config.seed, tf.int64), i])

    def apply(i, element):
        if decode is not None:
            element = decode(element)
        element = augment(element, key(i))
        return scale(element) if scale is not None else element

    return ds.enumerate().map(apply, num_parallel_calls=AUTOTUNE, deterministic=deterministic)


def _decoded(ds, steps, deterministic):
    """``ds`` decoded, if its decoding did not already run before the cache."""
    if steps.decode is None or steps.decode_before_cache:
        return ds
    decode = (ops.compose([steps.decode, ops.make_normalize()]) if steps.scale_in_map
              else steps.decode)
    return _map(ds, decode, deterministic)


def _batched(ds, config, steps, batch_size, training, deterministic):
    """Batch, batch-level ops and prefetch: always in the training process."""
    # drop_remainder for training: static batch shapes (XLA, replicas) and equal-sized steps.
    if steps.mapped_after_cache:
        # Right after a map, a plain batch fuses with it (map_and_batch): each record goes
        # into the batch while it is in the CPU cache: on photos, faster than a parallel batch,
        # which copies each record again later, on another thread (measured once on 2 cores,
        # not benchmarked).
        ds = ds.batch(batch_size, drop_remainder=training)
    else:  # records from a cache: copying them is the work, done in parallel
        ds = ds.batch(batch_size, drop_remainder=training, num_parallel_calls=AUTOTUNE,
                      deterministic=deterministic)
    ds = ds.map(_finalize(steps), num_parallel_calls=AUTOTUNE, deterministic=deterministic)
    ds = ds.prefetch(AUTOTUNE)  # overlap the producer with the training step
    return ds.with_options(_options(config, deterministic))


def _through_service(config, schema, split, steps, batch_size, shuffle, deterministic,
                     num_pipelines=1, pipeline_id=0):
    """Training input with read -> parse -> decode -> shuffle -> augment on tf.data service
    workers, and count -> repeat -> batch -> finalize -> prefetch here.

    Why this cut: the remote part is where the CPU goes (decoding, augmenting); batching
    stays here so that batches span epoch ends (``repeat`` before ``batch``) and this process
    can count the records of each epoch: an epoch is one service job, and dynamic sharding
    delivers a record at most once, so what is missing at the end of an epoch was lost with
    a worker. Each remote epoch is finite; ``repeat`` asks the service for the next one.
    ``cache`` is not applied: a worker sees only part of an epoch (a cache would hold that
    part) and each epoch is a new job. Images travel as uint8 (4× fewer bytes than float).
    """
    expected = _service_records(config, schema, split, num_pipelines, pipeline_id)
    remote_steps = dataclasses.replace(steps, decode=steps.decode_uint8,
                                       augment=steps.augment_uint8, scale_in_map=False)
    # uint8 arrives here, ungrouped: scaled per batch, batched in parallel.
    steps = dataclasses.replace(steps, normalize=steps.normalize or steps.scale_in_map,
                                mapped_after_cache=False)
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
                  remote=True)
    if remote_steps.decode_before_cache:
        ds = _map(ds, remote_steps.decode, deterministic)
    if shuffle:
        ds = ds.shuffle(steps.shuffle_buffer, seed=config.seed, reshuffle_each_iteration=True)
    ds = _after_cache(ds, config, remote_steps, True, deterministic, remote=True)
    # Records travel in groups: one RPC per record caps a worker far below what groups of 64
    # move (measured once on the digits, not benchmarked; benchmarks/scaling.py times the
    # service as built here).
    ds = service_client.serve(ds.batch(SERVICE_TRANSFER_BATCH), config, split, expected,
                              deterministic)
    return _batched(ds.unbatch(), config, steps, batch_size, True, deterministic)


def _tokens_through_service(config, schema, split, steps, shuffle, deterministic,
                            num_pipelines=1, pipeline_id=0):
    """Token records read -> parsed -> made examples -> shuffled on tf.data service workers;
    returns this process's endless dataset of per-sequence examples, for ``text.batch``.

    Why this cut: batching stays here, as for images, and more so: ``pack`` is a
    ``numpy_function`` (a Python call, which a service worker cannot run for this process),
    and every mode batches across epoch ends and splits each batch evenly over the
    replicas. Sequences travel in padded groups and are counted per group, like images;
    an epoch delivers each example at most once (dynamic sharding). No cache (see
    ``_through_service``). The service keeps no position a checkpoint could save: a
    resumed run starts a new epoch on the service (fast-forwarded by the trainer), not
    the exact next sequence; exact resume needs local reading (no ``--data_service``).
    """
    expected = _service_records(config, schema, split, num_pipelines, pipeline_id)
    ds = _records(config, schema, split, num_pipelines, pipeline_id, shuffle, deterministic,
                  remote=True)
    ds = _map(ds, text.make_to_example(schema.task), deterministic)
    if shuffle:  # sequences, as locally: buckets and packed rows then mix the whole buffer
        ds = ds.shuffle(steps.shuffle_buffer, seed=config.seed, reshuffle_each_iteration=True)
    ds = sequences.group(ds, SERVICE_TRANSFER_BATCH)
    groups = service_client.serve(ds, config, split, expected, deterministic)
    return sequences.ungroup(groups)


def _service_records(config, schema, split, num_pipelines, pipeline_id) -> int:
    """The records this training worker's service jobs hold per epoch (its own files)."""
    files, counts = _files(schema, config, split, num_pipelines, pipeline_id)
    if num_pipelines > 1 and len(files) == len(schema.split(split).shards):
        raise UsageError(
            f"--data_service with {num_pipelines} training workers needs at least one shard "
            f"file per worker, and split {split!r} has {len(files)}: reconvert with "
            f"--shards={num_pipelines} or more")
    # Each training worker has its own jobs over its own files: every record once per epoch
    # over all workers, and each worker can count what it should have received.
    return sum(counts)


def _label_message(schema, config) -> str:
    num_classes = schema.num_classes
    return (f"tfspeed: labels outside the {num_classes} classes of "
            f"{os.path.join(config.data_dir, schema_lib.SCHEMA_FILE)} (expected 0.."
            f"{num_classes - 1}): reconvert the dataset, its records and schema disagree")


def _finalize(steps):
    """Batch-level ops (cheaper than per element), then the (inputs, labels) tuple Keras takes."""

    def finalize(batch):
        if steps.normalize:
            batch = ops.make_normalize()(batch)
        return batch["inputs"], batch["label"]

    return finalize


def _options(config: DataConfig, deterministic: bool) -> tf.data.Options:
    options = tf.data.Options()
    # Non-deterministic order lets parallel stages hand over whichever element is ready first.
    options.deterministic = deterministic
    if config.ram_budget_mb:
        options.autotune.ram_budget = config.ram_budget_mb * 2**20
    if config.input_threads:
        options.threading.private_threadpool_size = config.input_threads
    # We shard explicitly above; tf.distribute must not shard a second time.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    options.experimental_optimization.map_parallelization = True
    # The read stage's corruption accounting is a py_function; saving an iterator must
    # not fail on it (it holds no state a checkpoint needs: the pipeline is rebuilt).
    options.experimental_external_state_policy = tf.data.experimental.ExternalStatePolicy.IGNORE
    return options
