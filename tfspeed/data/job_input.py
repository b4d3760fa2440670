"""A training job's input: per split, where the data comes from and how it is cached.

The driver (``tfspeed.train``) and ``tfspeed.diagnose`` share this. It resolves, once and
with a reason each: the cache of every split (``plan.plan_cache``, from how often the split
is read), the dtype images travel in, and whether the training split is held in-graph
(``ingraph.choose``) or read through a tf.data pipeline.
"""

from __future__ import annotations

import dataclasses

import tensorflow as tf
from absl import logging

from tfspeed.config import Config
from tfspeed.data import images as images_lib
from tfspeed.data import ingraph, pipeline, plan


@dataclasses.dataclass
class JobInput:
    """What a job trains and evaluates on.

    Attributes:
      train: a distributed, endlessly repeating dataset, or an ``InGraphInput``.
      eval: a distributed finite dataset, or None.
      configs: per split, the DataConfig as its pipeline runs (cache resolved).
      preprocess: ``x -> x`` for the compiled step (uint8 images to [0, 1]), or None.
      report: the choices and their reasons, for report.json.
    """

    train: object
    eval: object | None
    configs: dict
    preprocess: object
    report: dict
    batching: object = None  # token records: the resolved ``text.Batching``


def build(config: Config, schema, runtime, num_train: int, steps_per_epoch: int,
          batching=None) -> JobInput:
    """Resolves and builds the input of ``config`` for ``runtime`` (``tfspeed.runtime.
    Runtime``: its strategy's per-worker pipelines, or global batches for its devices).

    Args:
      num_train: records in the train split.
      steps_per_epoch: batches in one pass over it (token data: a batch holds a token budget).
      batching: token data: the job's resolved ``text.Batching`` (every split batched so).
    """
    data, train = config.data, config.train
    images = schema.input_feature.dtype == "uint8"
    # Images travel as uint8 and are scaled to [0, 1] inside the compiled step: the pipeline
    # (and on an accelerator the host-to-device copy) moves 4× fewer bytes than float32.
    # Only an explicit --image_dtype=float32 sends floats (diagnose then says what it costs).
    dtype = ("float32" if data.image_dtype == "float32" else "uint8") if images else "float32"
    base = dataclasses.replace(data, image_dtype=dtype)
    if batching is not None:
        base = dataclasses.replace(base, batching=batching.mode, max_length=batching.max_length,
                                   tokens_per_batch=batching.tokens_per_batch)
        logging.info("--batching=%s: %s (%s)", data.batching, batching.mode, batching.reason)
    micro_steps = (train.train_steps * train.grad_accum_steps if train.train_steps else
                   train.epochs * steps_per_epoch)
    placement = ingraph.choose(data.input_placement, base, schema, data.train_split)
    passes = {data.train_split: -(-micro_steps // max(steps_per_epoch, 1))}
    if data.eval_split:
        passes[data.eval_split] = 1  # evaluated once, at the end
    if images and placement.where == "device":
        dtype = "uint8"  # the held split is uint8 whatever was asked (4x less memory)
    configs, report = {}, {"image_dtype": dtype if images else None,
                           "placement": placement.to_json(), "cache": {}}
    if batching is not None:
        report["batching"] = batching.to_json()
    for split, reads in passes.items():
        in_graph = split == data.train_split and placement.where == "device"
        if in_graph:
            reads = 1  # read once, into the graph
        cache = plan.plan_steps(base, schema, split, split == data.train_split, reads).cache
        if in_graph:
            cache = dataclasses.replace(cache, mode="none", reason="held in-graph: no cache")
        configs[split] = dataclasses.replace(base, cache=cache.mode)
        report["cache"][split] = cache.to_json()
        if data.cache == "auto":
            logging.info("--cache=auto for %r: %s (%s)", split, cache.mode, cache.reason)
    logging.info("--input_placement=%s: %s (%s)", data.input_placement, placement.where,
                 placement.reason)
    eval_sequences = _eval_sequences(train.eval_steps, batching)
    if eval_sequences:
        report["eval_sequences"] = eval_sequences

    def dataset(split, training):
        return runtime.distribute_from_function(
            lambda ctx: pipeline.build_from_config(
                configs[split], split, training=training, input_context=ctx, schema=schema,
                batching=batching, take_sequences=None if training else eval_sequences))

    if placement.where == "device":
        train_input = ingraph.load(configs[data.train_split], schema, data.train_split,
                                   global_batch_size=data.batch_size, device=device(),
                                   devices=runtime.devices or None)
    else:
        train_input = dataset(data.train_split, True)
    return JobInput(train=train_input,
                    eval=dataset(data.eval_split, False) if data.eval_split else None,
                    configs=configs,
                    preprocess=images_lib.scale if images and dtype == "uint8" else None,
                    report=report, batching=batching)


def _eval_sequences(eval_steps: int, batching) -> int | None:
    """``--eval_steps`` on token data: the first sequences of the split that that many
    batches hold on average, batched as usual. The first N batches would not do: bucketing
    emits the buckets of short sequences first, so a capped evaluation would lean to them."""
    if not eval_steps or batching is None:
        return None
    if batching.mode == "pad":
        return eval_steps * batching.batch_size
    return max(1, int(eval_steps * batching.expected_weight("classification")))


def device() -> str:
    """Where in-graph data lives: the first GPU, else the host."""
    return "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
