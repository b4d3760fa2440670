"""Frozen configuration, split by concern, validated once.

``tfspeed.config.flags`` turns absl flags into a ``Config``; library code receives only the
slice it needs (``DataConfig`` for the pipeline, ``TrainConfig`` for the trainer, ...).
Cross-field checks live in ``validate`` methods and raise ``UsageError`` naming the flags.
"""

from __future__ import annotations

import dataclasses
import json

from tfspeed.errors import UsageError

CACHE_MODES = ("auto", "none", "memory", "disk")
INPUT_PLACEMENTS = ("auto", "host", "device")
IMAGE_DTYPES = ("float32", "uint8")
PARSE_MODES = ("auto", "batched", "single")
ON_CORRUPT_MODES = ("skip", "fail")
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
PRECISIONS = ("auto", "measure", "float32", "mixed_float16", "mixed_bfloat16")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How to read a converted dataset.

    Attributes:
      data_dir: directory holding ``schema.json`` and the TFRecord shards.
      batch_size: the global batch (summed over replicas) of one step.
      image_size: resize images to this square side; 0 keeps the stored size (then all
        images must already have the same size).
      cache: ``auto``, ``none``, ``memory`` (decoded records held in RAM) or ``disk`` (a cache
        file in ``cache_dir`` whose name hashes the source and settings, so a stale one is
        never reused). ``auto`` estimates the cached split from ``schema.json`` and keeps it in
        memory if it fits ``ram_budget_mb``, else on disk (none for a single pass); an
        explicit ``memory`` that cannot fit is refused (``tfspeed.data.plan``).
      cache_dir: where ``disk`` caches go; default ``<data_dir>/cache``.
      shuffle: shuffle training data (files and records); off gives a fixed order.
      shuffle_buffer: records in the shuffle buffer (capped at the split size).
      augment: random augmentations for training, names from ``tfspeed.data.ops.AUGMENTATIONS``.
      deterministic: fixed element order even with parallel maps (slower); also implied
        by ``shuffle=False``.
      seed: seed for file/record shuffling and augmentation.
      parse: ``batched`` parses records in groups with one ``parse_example`` (vectorised),
        ``single`` one record at a time; ``auto`` is batched (measured faster in
        ``benchmarks/input_pipeline.py``). A bad payload costs that record alone either way.
      ram_budget_mb: the RAM input data may take: the memory cache (and the in-graph input)
        must fit it, and it caps tf.data's autotuned buffers; 0 = half of the memory
        available at start.
      image_dtype: ``float32`` batches in [0, 1], or ``uint8`` as stored (4× fewer bytes to
        move; the model or the training step then scales them).
      input_placement: where the training step gets its batches: ``host`` (a tf.data
        pipeline), ``device`` (the decoded split held as tensors on the training device,
        batches gathered inside the compiled step: no tf.data round trip), or ``auto``
        (device when the decoded split fits ``ram_budget_mb`` and no tf.data service or
        random_resized_crop needs the pipeline; ``tfspeed.data.ingraph``).
      input_threads: threads tf.data's parallel stages may use (a private thread pool);
        0: TensorFlow's default (one per core). Fewer leave cores to the training step on a
        CPU host; ``tfspeed.tune`` measures whether that pays.
      train_split / eval_split: split names.
      prepare_source: if ``data_dir`` holds no finished conversion, convert this converter
        ``--source`` into it first (the demo job uses ``digits``).
      on_corrupt: what reading a damaged shard does. TF cannot skip one bad record inside a
        file, so the rest of that shard is lost for the epoch either way; ``skip`` warns once
        per shard per epoch with the records lost and counts them
        (``tfspeed.data.pipeline.corruption_report()``), ``fail`` stops with an error naming
        the shard. Both name the fix: ``python -m tfspeed.verify DATA_DIR --repair``.
      data_service: ``grpc://HOST:PORT`` of a tf.data service dispatcher: training input is
        read, decoded and augmented on its workers (``tfspeed.data.service_client``); '' for local.
      data_service_sharding: ``dynamic`` (each record at most once per epoch, workers take
        files as they go), ``file`` (fixed share per worker; the dispatcher needs the worker
        list) or ``off`` (every worker produces the whole epoch).
    """

    data_dir: str
    batch_size: int = 128
    image_size: int = 0
    cache: str = "auto"
    cache_dir: str = ""
    shuffle: bool = True
    shuffle_buffer: int = 10_000
    augment: tuple[str, ...] = ()
    deterministic: bool = False
    seed: int = 0
    parse: str = "auto"
    ram_budget_mb: int = 0
    image_dtype: str = "float32"
    input_placement: str = "auto"
    input_threads: int = 0
    train_split: str = "train"
    eval_split: str = "validation"
    prepare_source: str = ""
    on_corrupt: str = "skip"
    data_service: str = ""
    data_service_sharding: str = "dynamic"

    def validate(self) -> DataConfig:
        from tfspeed.data.ops import AUGMENTATIONS  # ops import TF; keep config import light

        if not self.data_dir:
            raise UsageError("--data_dir is required: a directory made by scripts/to_tfrecord.py")
        _positive("batch_size", self.batch_size)
        _non_negative("image_size", self.image_size)
        _non_negative("ram_budget_mb", self.ram_budget_mb)
        _non_negative("input_threads", self.input_threads)
        _positive("shuffle_buffer", self.shuffle_buffer)
        _choice("cache", self.cache, CACHE_MODES)
        _choice("parse", self.parse, PARSE_MODES)
        _choice("image_dtype", self.image_dtype, IMAGE_DTYPES)
        _choice("input_placement", self.input_placement, INPUT_PLACEMENTS)
        _choice("on_corrupt", self.on_corrupt, ON_CORRUPT_MODES)
        for name in self.augment:
            _choice("augment", name, AUGMENTATIONS)
        if self.data_service:
            from tfspeed.data import service_client as service

            service.parse_address(self.data_service)
            _choice("data_service_sharding", self.data_service_sharding, service.SHARDING_MODES)
        return self


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to build.

    Attributes:
      name: a key of ``tfspeed.training.models.MODELS``, or ``package.module:function`` for your
        own ``function(input_shape, num_outputs) -> keras.Model``.
      width: base width (units or filters); 0 takes the model's default.
      dropout: dropout rate before the classifier.
      remat: recompute activations in the backward pass instead of keeping them
        (less memory, more compute).
    """

    name: str = "cnn"
    width: int = 0
    dropout: float = 0.0
    remat: bool = False

    def validate(self) -> ModelConfig:
        from tfspeed.training.models import MODELS

        if ":" in self.name:  # the user's own: checked when it is imported and called
            module, _, function = self.name.partition(":")
            if not module or not function:
                raise UsageError(f"--model={self.name} is not package.module:function")
        elif self.name not in MODELS:
            raise UsageError(f"--model={self.name!r} is not one of: {', '.join(MODELS)}, nor "
                             "your own as package.module:function")
        _non_negative("width", self.width)
        if not 0 <= self.dropout < 1:
            raise UsageError(f"--dropout={self.dropout} must be in [0, 1)")
        return self


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the step runs: strategy, precision and XLA.

    Attributes:
      strategy: ``auto``, ``default``, ``one_device``, ``mirrored`` or ``multi_worker``
        (MultiWorkerMirroredStrategy over the cluster in ``TF_CONFIG``; start local dry runs
        with ``python -m tfspeed.launch``).
      cpu_replicas: split the CPU into this many logical devices (0: do not split), so
        MirroredStrategy can run on a CPU-only machine.
      precision: ``auto`` (from the hardware; where bfloat16 is native on a CPU, measured on
        the model), ``measure`` (always time float32 against the hardware's mixed policy on
        the model, bfloat16 where it has none), ``float32``, ``mixed_float16`` or
        ``mixed_bfloat16``.
      xla: ``auto``, ``on`` or ``off``: XLA-compile the per-replica forward+backward.
      intra_op_threads: threads one op may split its work over; 0: TF's default (one per
        core); -1 (``tfspeed.runtime.threads.AUTO``): one for a tiny model's step, else the default.
    """

    strategy: str = "default"
    cpu_replicas: int = 0
    precision: str = "float32"
    xla: str = "off"
    intra_op_threads: int = 0

    def validate(self) -> RuntimeConfig:
        _choice("strategy", self.strategy, STRATEGIES)
        _choice("precision", self.precision, PRECISIONS)
        _choice("xla", self.xla, ("auto", "on", "off"))
        _non_negative("cpu_replicas", self.cpu_replicas)
        if self.intra_op_threads < -1:
            raise UsageError(f"--intra_op_threads={self.intra_op_threads} must be >= 0 "
                             "(0: one per core) or 'auto'")
        return self


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop.

    Attributes:
      epochs: passes over the train split (ignored when ``train_steps`` > 0).
      train_steps: total optimizer updates; 0 means ``epochs`` full passes.
      learning_rate: peak learning rate (before ``scale_lr_with_batch``).
      optimizer: ``adam``, ``adamw`` or ``sgd`` (SGD with Nesterov momentum 0.9).
      lr_schedule: ``constant`` or ``cosine`` (decay to 0 over the run), counted in updates.
      warmup_steps: linear warm-up updates from 0 to the peak rate.
      scale_lr_with_batch: multiply the rate by effective batch / 256 (linear scaling rule).
      steps_per_execution: micro-steps run inside one ``tf.function`` call; 0 = auto-tune.
      grad_accum_steps: micro-batches per optimizer update.
      checkpoint_every: updates between checkpoints (0: only at the end).
      keep_checkpoints: how many recent checkpoints to keep.
      eval_steps: cap on evaluation batches; 0 evaluates the whole split.
      log_every: micro-steps between loss/throughput logs (each log syncs with the device).
      profile_steps: ``(start, end)`` micro-steps to capture with the TensorBoard profiler;
        empty for none.
      loss: a Keras loss name or ``package.module:function`` (one value per example); ''
        for the task's default (``tfspeed.training.objectives``).
      metrics: Keras metric names or ``package.module:function``s; () for the default.
    """

    epochs: int = 1
    train_steps: int = 0
    learning_rate: float = 1e-3
    optimizer: str = "adam"
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    scale_lr_with_batch: bool = False
    steps_per_execution: int = 1
    grad_accum_steps: int = 1
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    eval_steps: int = 0
    log_every: int = 50
    profile_steps: tuple[int, ...] = ()
    loss: str = ""
    metrics: tuple[str, ...] = ()

    def validate(self) -> TrainConfig:
        _positive("epochs", self.epochs)
        _non_negative("train_steps", self.train_steps)
        _non_negative("eval_steps", self.eval_steps)
        _non_negative("steps_per_execution", self.steps_per_execution)
        _positive("grad_accum_steps", self.grad_accum_steps)
        _non_negative("warmup_steps", self.warmup_steps)
        _non_negative("checkpoint_every", self.checkpoint_every)
        _positive("keep_checkpoints", self.keep_checkpoints)
        _choice("lr_schedule", self.lr_schedule, ("constant", "cosine"))
        if self.profile_steps and (len(self.profile_steps) != 2 or not
                                   1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise UsageError(f"--profile_steps={','.join(map(str, self.profile_steps))} must be "
                             "START,END with 1 <= START <= END (e.g. 10,20)")
        _positive("log_every", self.log_every)
        if not self.learning_rate > 0:
            raise UsageError(f"--learning_rate={self.learning_rate} must be > 0")
        _choice("optimizer", self.optimizer, ("adam", "adamw", "sgd"))
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole experiment: one frozen value built from flags (or by hand in Python)."""

    data: DataConfig
    model: ModelConfig = ModelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    train: TrainConfig = TrainConfig()
    model_dir: str = "runs/default"

    def validate(self) -> Config:
        """Checks each part and the rules that span parts; returns self."""
        self.data.validate()
        self.model.validate()
        self.runtime.validate()
        self.train.validate()
        if not self.model_dir:
            raise UsageError("--model_dir is required: where checkpoints, logs and report.json go")
        return self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"--{flag}={value!r} is not one of: {', '.join(allowed)}")


def _positive(flag: str, value: int) -> None:
    if not value > 0:
        raise UsageError(f"--{flag}={value} must be > 0")


def _non_negative(flag: str, value: int) -> None:
    if value < 0:
        raise UsageError(f"--{flag}={value} must be >= 0")
