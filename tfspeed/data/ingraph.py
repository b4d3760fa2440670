"""In-graph input: a decoded training split held as tensors, batches drawn inside the step.

When the decoded split fits the memory budget, a step needs no ``tf.data`` round trip at
all: the records live in a variable on the training device and each replica gathers its
part of the global batch inside the compiled step (the fastest small-data training runs,
such as airbench's CIFAR-10, keep the dataset on the GPU this way).

Same semantics as the ``tf.data`` path (``pipeline.build``):
  * the records in the order the unshuffled pipeline yields them; with shuffling, epoch e
    visits them in a pseudo-random permutation of (seed, e) (``index_shuffle``): every
    record once per epoch, the same seed the same order;
  * batches span epoch ends (as ``repeat`` before ``batch``);
  * augmentation keyed by (seed, element index), as the pipeline keys it;
  * replica r of R takes examples [r * b, (r + 1) * b) of the global batch, as a
    distributed dataset hands consecutive per-replica batches to replicas.
The position is a function of the micro-step alone, so a resumed run continues exactly
where the checkpoint's step says, with no iterator state to save.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from tfspeed.config import DataConfig
from tfspeed.data import pipeline, plan


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the training input comes from, and why.

    Attributes:
      where: ``device`` (in-graph) or ``host`` (a tf.data pipeline).
      estimate_mb: the decoded train split's size.
      budget_mb: the memory it may take.
      reason: one sentence.
    """

    where: str
    reason: str
    estimate_mb: float = 0.0  # 0: not estimated
    budget_mb: float = 0.0

    def to_json(self) -> dict:
        """For report.json's ``input.placement``."""
        return dataclasses.asdict(self)


def choose(requested: str, config: DataConfig, schema, split: str) -> Placement:
    """Resolves ``--input_placement`` (``auto``, ``host`` or ``device``) by the plan's rule
    (``tfspeed.plan.placement``) on this split's decoded size and what needs the pipeline:
    the tf.data service, or an augmentation that decodes (random_resized_crop works on the
    encoded images)."""
    from tfspeed import plan as plan_lib

    records = schema.split(split).num_records
    estimate_mb = records * plan.record_bytes(config, schema, split) / 2**20
    budget_mb, source = plan.ram_budget_mb(config)
    decided = plan_lib.placement(requested, split, estimate_mb, budget_mb, source,
                                 _blocker(config, schema))
    return Placement(decided.value, decided.reason, estimate_mb, budget_mb)


def is_in_step(source) -> bool:
    """Whether a job's train input is held in the step (``InGraphInput`` on TensorFlow,
    ``ingraph_jax.InStepArrays`` on JAX) rather than an iterator of batches."""
    return bool(getattr(source, "in_step", False))


def _blocker(config: DataConfig, schema=None) -> str:
    from tfspeed.runtime import backends

    if not backends.current().augment_in_step and config.augment:
        return ("on the JAX backend augmentations run in tf.data (the in-step gather holds "
                "the stored records only)")
    if schema is not None and not schema.named_inputs and (
            schema.input_feature.encoding == "tokens"):
        return ("token records are batched by length (padded, bucketed or packed) by tf.data "
                "on the host; the in-step gather takes fixed-size records")
    if config.data_service:
        return "--data_service reads on other hosts"
    if "random_resized_crop" in config.augment:
        return "--augment=random_resized_crop decodes the stored images each epoch"
    return ""


class InGraphInput:
    """The training split as tensors; ``replica_batch(step)`` inside the compiled step.

    Args:
      inputs: the decoded inputs, one row per record (uint8 images or float features), or
        a dict of them (several named inputs).
      labels: int32 labels.
      global_batch_size: examples per micro-step over all replicas.
      seed: the data seed (permutations and augmentation keys).
      shuffle: a new permutation every epoch (else the stored order, every epoch).
      augment: ``(element, seed) -> element`` on one record, or None.
      device: where the tensors live (None: TF's default, the host for a CPU job).
    """

    in_step = True  # see is_in_step

    def __init__(self, inputs: np.ndarray, labels: np.ndarray, *, global_batch_size: int,
                 seed: int = 0, shuffle: bool = True, augment=None, device: str | None = None):
        self.num_records = len(labels)
        self.global_batch_size = global_batch_size
        self.seed, self.shuffle, self.augment = seed, shuffle, augment
        # Plain variables outside any strategy scope: one copy, read by every replica (a
        # gather runs where its variable lives; only the batch is copied).
        with tf.device(device) if device else _nothing():
            self.inputs = tf.nest.map_structure(
                lambda array: tf.Variable(array, trainable=False, name="ingraph_inputs"), inputs)
            self.labels = tf.Variable(labels, trainable=False, name="ingraph_labels")

    def replica_batch(self, step: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """This replica's ``(x, y)`` of micro-step ``step`` (in replica context)."""
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        per_replica = self.global_batch_size // replicas
        first = (tf.cast(step, tf.int64) * self.global_batch_size
                 + tf.cast(context.replica_id_in_sync_group, tf.int64) * per_replica)
        positions = first + tf.range(per_replica, dtype=tf.int64)  # in the endless stream
        rows = self.rows(positions)
        x = tf.nest.map_structure(lambda inputs: tf.gather(inputs, rows), self.inputs)
        y = tf.gather(self.labels, rows)
        if self.augment is not None:
            x = self._augmented(x, y, positions)
        return x, y

    def rows(self, positions: tf.Tensor) -> tf.Tensor:
        """The record at each position of the endless stream of epochs."""
        n = self.num_records
        epoch, offset = positions // n, positions % n
        if not self.shuffle:
            return offset
        # One permutation per epoch: seed (data seed, epoch, 0). The raw op: the Python
        # wrapper pads a batch of seeds along the wrong axis in TF 2.21.
        seeds = tf.stack([tf.fill(tf.shape(epoch), tf.cast(self.seed, tf.int64)), epoch,
                          tf.zeros_like(epoch)], 1)
        return tf.raw_ops.RandomIndexShuffle(index=offset, seed=seeds,
                                             max_index=tf.constant(n - 1, tf.int64))

    def _augmented(self, x, y, positions):
        keys = tf.stack([tf.fill(tf.shape(positions), tf.cast(self.seed, tf.int64)),
                         positions], 1)

        def one(args):
            image, label, key = args
            return self.augment({"inputs": image, "label": label}, key)["inputs"]

        return tf.map_fn(one, (x, y, keys), fn_output_signature=tf.TensorSpec(
            x.shape[1:], x.dtype))


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def load(config: DataConfig, schema, split: str, training: bool = True, *,
         global_batch_size: int, device: str | None = None, devices=None):
    """Decodes ``split`` once through the pipeline (unshuffled, in its stored order) and
    holds it in-graph.

    Args:
      config: the data settings. Images are held as uint8: scale them in the step (the
        engine's ``preprocess``).
      schema: the dataset's schema.
      split: the split to hold.
      training: shuffle and augment as ``config`` says (else neither).
      global_batch_size: examples per micro-step over all replicas.
      device: where to keep the tensors (TensorFlow).
      devices: the JAX engine's devices: an ``ingraph_jax.InStepArrays`` on them instead.
    """
    if schema.input_feature.dtype == "uint8":
        config = dataclasses.replace(config, image_dtype="uint8")  # 4× less memory than float
    steps = plan.plan_steps(config, schema, split, training)
    plain = dataclasses.replace(config, shuffle=False, deterministic=True, cache="none",
                                augment=(), data_service="")
    ds = pipeline.build_from_config(plain, split, training=False, schema=schema,
                                    until="decode")
    inputs, labels = [], []
    for group in ds.batch(1024).as_numpy_iterator():
        inputs.append(group["inputs"])
        labels.append(group["label"])
    inputs = (np.concatenate(inputs) if not isinstance(inputs[0], dict) else
              {name: np.concatenate([group[name] for group in inputs]) for name in inputs[0]})
    if devices is not None:
        from tfspeed.data.ingraph_jax import InStepArrays

        return InStepArrays(inputs, np.concatenate(labels), global_batch_size=global_batch_size,
                            seed=config.seed, shuffle=training and config.shuffle,
                            devices=devices)
    return InGraphInput(inputs, np.concatenate(labels),
                        global_batch_size=global_batch_size, seed=config.seed,
                        shuffle=training and config.shuffle,
                        augment=steps.augment if training else None, device=device)
