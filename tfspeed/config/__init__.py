"""The experiment's configuration: frozen dataclasses, split by concern, validated once.

These dataclasses hold the only defaults and help texts of tfspeed. The command-line flags
are defined from them (``tfspeed.config.flags``), and ``tfspeed.fit`` builds the same
``TrainConfig`` and ``RuntimeConfig``: a ``Config()`` in Python, the command line without
flags and ``tfspeed.fit`` without keywords run the same job.

``auto`` is a value of its own (``AUTO``), never 0 or -1: a setting that tfspeed resolves
by measuring or from the hardware holds the string ``"auto"`` until it is resolved, and the
resolved value is written to ``report.json`` beside it.

Library code receives only the slice it needs (``DataConfig`` for the pipeline,
``TrainConfig`` for the loop, ...). Cross-field checks live in ``validate`` methods and
raise a one-line ``UsageError`` naming the flags. Importing this package imports no
TensorFlow.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Literal

from tfspeed.errors import UsageError

AUTO = "auto"
Auto = Literal["auto"]

CACHE_MODES = ("auto", "none", "memory", "disk")
INPUT_PLACEMENTS = ("auto", "host", "device")
IMAGE_DTYPES = ("auto", "float32", "uint8")
PARSE_MODES = ("auto", "batched", "single")
ON_CORRUPT_MODES = ("skip", "fail")
DATA_SERVICE_SHARDING = ("off", "dynamic", "file")
# The augmentations' names; tfspeed.data.ops holds their code (and checks it has each).
AUGMENTATIONS = ("flip", "crop", "random_resized_crop")
# The built-in models' names; tfspeed.training.models holds their builders.
MODELS = ("mlp", "cnn", "resnet50", "mobilenetv2", "transformer")
# How variable-length token records become batches (tfspeed.data.sequences), in the order
# they are printed in; --batching takes auto too (tfspeed.probes.costs predicts the choice).
BATCHING_MODES = ("pad", "bucket", "pack")
BATCHINGS = (AUTO, *BATCHING_MODES)
# Text longer than a row can hold (tfspeed.data.long_texts applies it). The converter and the
# driver share these defaults: a text is split into pieces, each its own sequence, and no
# sequence is longer than MAX_LENGTH_CAP tokens unless --max_length asks for more (one
# 2 MB text became a single record of 349,527 tokens, and its batches exhausted memory).
LONG_POLICIES = ("truncate", "split", "skip")
LONG_DEFAULT = "split"
MAX_LENGTH_CAP = 1024
STRATEGIES = ("auto", "default", "one_device", "mirrored", "multi_worker")
PRECISIONS = ("auto", "measure", "float32", "mixed_float16", "mixed_bfloat16")
XLA_MODES = ("auto", "on", "off")
OPTIMIZERS = ("adam", "adamw", "sgd")
LR_SCHEDULES = ("constant", "cosine")


def option(default, help: str, *, choices: tuple = (), flag: str = ""):  # noqa: A002
    """A config field: its default, its help text, its allowed values and its flag name
    (the field's own name unless given)."""
    return dataclasses.field(default=default,
                             metadata={"help": help, "choices": choices, "flag": flag})


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """How to read a converted dataset (``tfspeed.data``)."""

    data_dir: str = option(
        "", "Converted dataset: a directory made by scripts/to_tfrecord.py (holds schema.json).")
    batch_size: int = option(128, "The global batch of one step (summed over replicas; the "
                                  "micro-batch when accumulating).")
    image_size: int = option(0, "Resize images to this square side; 0 keeps the stored size "
                                "(then all images must have one size).")
    cache: str = option(
        "auto", "Cache decoded records: memory (in RAM), disk (a file under --cache_dir whose "
                "name hashes the data and settings), none; auto: in RAM if the split fits "
                "--ram_budget_mb, else on disk (none when read once).", choices=CACHE_MODES)
    cache_dir: str = option("", "Directory for --cache=disk (default DATA_DIR/cache).")
    shuffle: bool = option(True, "Shuffle training files and records (off: a fixed order).")
    shuffle_buffer: int = option(10_000, "Records in the shuffle buffer (capped at the split).")
    augment: tuple[str, ...] = option(
        (), "Training augmentations: flip, crop, random_resized_crop (decodes only the crop of "
            "a JPEG; needs --image_size).", choices=AUGMENTATIONS)
    deterministic: bool = option(
        False, "Fixed element order even with parallel maps (slower input); also implied by "
               "--noshuffle.")
    seed: int = option(0, "Seed for shuffling, augmentation and initialisation.")
    parse: str = option("auto", "Parse records in groups with one vectorised parse_example "
                                "(batched) or one by one (single); auto: batched.",
                        choices=PARSE_MODES)
    ram_budget_mb: int = option(
        0, "RAM the input may take (memory cache, in-step input, tf.data buffers); 0: half of "
           "the memory available at start.")
    image_dtype: str = option(
        "auto", "Images as float32 in [0, 1], or uint8 as stored (the step scales them: 4x "
                "fewer bytes to move to the device); auto: uint8 where tfspeed runs the step "
                "(train, tune, diagnose), float32 from tfspeed.data.build.",
        choices=IMAGE_DTYPES)
    input_placement: str = option(
        "auto", "Where the step gets its batches: host (tf.data), device (the decoded split held "
                "in the step, batches gathered inside it); auto: device if it fits "
                "--ram_budget_mb and nothing needs tf.data.", choices=INPUT_PLACEMENTS)
    input_threads: int = option(0, "Threads for tf.data's parallel stages; 0: one per core.")
    train_split: str = option("train", "Split to train on.")
    eval_split: str = option("validation", "Split to evaluate on ('' for none).")
    prepare_source: str = option(
        "", "If --data_dir holds no finished conversion, convert this scripts/to_tfrecord.py "
            "--source into it first (e.g. 'digits').")
    on_corrupt: str = option("skip", "A damaged shard: skip (report the records lost and go "
                                     "on) or fail (stop).", choices=ON_CORRUPT_MODES)
    data_service: str = option(
        "", "grpc://HOST:PORT of a tf.data service dispatcher (python -m tfspeed.data_service): "
            "read, decode and augment on its workers; '' reads locally.")
    batching: str = option(
        "auto", "Token records (text): pad (each batch to its longest, the TF guide's "
                "padded_batch), bucket (batches of similar lengths, each padded to its bucket's "
                "boundary: one compiled shape per bucket), pack (whole sequences first-fit into "
                "rows of --max_length, with segment ids); auto: the mode predicted to cost "
                "least per real token for this data and model, timed where bucket and pack come "
                "close (docs/text.md; report.json says why).",
        choices=BATCHINGS)
    tokens_per_batch: int = option(
        0, "Token budget of one global batch for bucket and pack: a bucket of length L takes "
           "tokens_per_batch // L sequences, pack takes tokens_per_batch // --max_length rows; "
           "0: --batch_size sequences of the train split's mean length, and a classifier's "
           "buckets --batch_size texts each.")
    max_length: int = option(
        0, "Longest sequence a batch holds (pack's row length, the last bucket's boundary); "
           "0: the conversion's --max_length, else the train split's longest, rounded up to a "
           "multiple of 8.")
    long: str = option(LONG_DEFAULT, "Token records longer than --max_length: truncate, split "
                                     "into pieces, or skip (counted in report.json).",
                       choices=LONG_POLICIES)
    data_service_sharding: str = option(
        "dynamic", "How service workers split an epoch: dynamic (each record at most once), "
                   "file (a fixed share; the dispatcher needs --worker_addresses) or off (each "
                   "worker the whole epoch).", choices=DATA_SERVICE_SHARDING)

    def validate(self) -> DataConfig:
        if not self.data_dir:
            raise UsageError("--data_dir is required: a directory made by scripts/to_tfrecord.py")
        _positive("batch_size", self.batch_size)
        _non_negative("image_size", self.image_size)
        _non_negative("ram_budget_mb", self.ram_budget_mb)
        _non_negative("input_threads", self.input_threads)
        _non_negative("tokens_per_batch", self.tokens_per_batch)
        if self.max_length == 1 or self.max_length < 0:
            raise UsageError(f"--max_length={self.max_length} must be 0 (from the data) or >= 2: "
                             "a sequence needs a token and the one after it")
        _positive("shuffle_buffer", self.shuffle_buffer)
        _check_choices(self)
        if self.data_service:
            _check_address(self.data_service)
        return self


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to build (``tfspeed.training.models``)."""

    name: str = option(
        "cnn", "mlp, cnn, resnet50, mobilenetv2, transformer (text), or your own as "
               "package.module:function (function(input_shape, num_outputs) -> keras.Model, "
               "importable from the working directory or PYTHONPATH).", flag="model")
    width: int = option(0, "Model base width (units, filters, or the transformer's model "
                           "width); 0 takes the model's default.")
    depth: int = option(0, "Transformer blocks; 0: the model's default (2).")
    heads: int = option(0, "Transformer attention heads (a divisor of --width); 0 takes the "
                           "model's default (4).")
    dropout: float = option(0.0, "Dropout rate before the classifier.")
    remat: bool = option(False, "Recompute activations in the backward pass: less memory, "
                                "more compute.")

    def validate(self) -> ModelConfig:
        if ":" in self.name:  # the user's own: checked when it is imported and called
            module, _, function = self.name.partition(":")
            if not module or not function:
                raise UsageError(f"--model={self.name} is not package.module:function")
        elif self.name not in MODELS:
            raise UsageError(f"--model={self.name!r} is not one of: {', '.join(MODELS)}, nor "
                             "your own as package.module:function")
        _non_negative("width", self.width)
        _non_negative("depth", self.depth)
        _non_negative("heads", self.heads)
        if not 0 <= self.dropout < 1:
            raise UsageError(f"--dropout={self.dropout} must be in [0, 1)")
        return self


@dataclasses.dataclass(frozen=True)
class RuntimeConfig:
    """Where and how the step runs (``tfspeed.runtime``)."""

    strategy: str = option(
        "auto", "tf.distribute strategy; auto: multi_worker under a TF_CONFIG cluster, mirrored "
                "over more than one GPU, else default.", choices=STRATEGIES)
    cpu_replicas: int = option(
        0, "Split the CPU into N logical devices (MirroredStrategy on a CPU machine); 0: none.")
    precision: str = option(
        "auto", "Keras precision policy; auto: from the hardware (timed on the model where "
                "bfloat16 is native on a CPU); measure: always time float32 against the mixed "
                "policy on the model.", choices=PRECISIONS)
    xla: str = option("auto", "XLA-compile the per-replica step; auto: on for GPU/TPU and for "
                              "packed token batches (one static shape), else off on CPU.",
                      choices=XLA_MODES)
    intra_op_threads: int | Auto = option(
        AUTO, "Threads one op may split its work over: N, 0 for TF's default (one per core), or "
              "auto (one for a tiny model's step on a CPU host, else the default).")

    def validate(self) -> RuntimeConfig:
        _check_choices(self)
        _non_negative("cpu_replicas", self.cpu_replicas)
        _count_or_auto("intra_op_threads", self.intra_op_threads, minimum=0,
                       rest=" (0: one per core) or 'auto'")
        return self


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The optimisation loop (``tfspeed.training``)."""

    epochs: int = option(1, "Passes over the train split (ignored when --train_steps > 0).")
    train_steps: int = option(0, "Total optimizer updates; 0: --epochs full passes.")
    learning_rate: float = option(1e-3, "Peak learning rate (before --scale_lr_with_batch).")
    optimizer: str = option("adam", "adam, adamw or sgd (Nesterov momentum 0.9).",
                            choices=OPTIMIZERS)
    lr_schedule: str = option("constant", "constant, or cosine decay to 0 over the run; counted "
                                          "in optimizer updates.", choices=LR_SCHEDULES)
    warmup_steps: int = option(0, "Linear warm-up updates from 0 to the peak rate.")
    scale_lr_with_batch: bool = option(
        False, "Scale the rate by batch_size x grad_accum_steps / 256 (linear scaling rule).")
    steps_per_execution: int | Auto = option(
        AUTO, "Micro-steps per compiled call (cuts Python overhead), or auto: timed while "
              "training, the smallest power of two whose call overhead is <= 2% of a call.")
    grad_accum_steps: int = option(1, "Micro-batches of --batch_size per optimizer update.")
    checkpoint_every: int | Auto = option(
        AUTO, "Updates between checkpoints; auto: every --checkpoint_seconds of training (a "
              "killed run loses about that), checked at log points; 0: only at the end.")
    checkpoint_seconds: float = option(
        60.0, "With --checkpoint_every=auto: seconds of training between checkpoints.")
    keep_checkpoints: int = option(3, "Recent checkpoints kept.")
    eval_steps: int = option(0, "Cap on evaluation batches; 0: the whole split.")
    eval_every_epochs: int = option(
        0, "Also evaluate after every N passes over the train split (0: only at the end); each "
           "evaluation goes to report.json's eval_history and TensorBoard, its time left out "
           "of the throughput.")
    log_every: int = option(50, "Micro-steps between logged loss and throughput (each log "
                                "syncs with the device).")
    profile_steps: tuple[int, ...] = option(
        (), "START,END: capture these micro-steps with the TensorBoard profiler.")
    loss: str = option("", "A Keras loss name or package.module:function (one loss per "
                           "example); '': by task, sparse_categorical_crossentropy or mse.")
    metrics: tuple[str, ...] = option(
        (), "Keras metric names or package.module:function (means of per-example values); "
            "default by task: accuracy or mae.")

    def validate(self) -> TrainConfig:
        _positive("epochs", self.epochs)
        _non_negative("train_steps", self.train_steps)
        _non_negative("eval_steps", self.eval_steps)
        _non_negative("eval_every_epochs", self.eval_every_epochs)
        _count_or_auto("steps_per_execution", self.steps_per_execution, minimum=1)
        _positive("grad_accum_steps", self.grad_accum_steps)
        _non_negative("warmup_steps", self.warmup_steps)
        _count_or_auto("checkpoint_every", self.checkpoint_every, minimum=0,
                       rest=" (0: only at the end) or 'auto'")
        _positive("keep_checkpoints", self.keep_checkpoints)
        if not self.checkpoint_seconds > 0:
            raise UsageError(f"--checkpoint_seconds={self.checkpoint_seconds} must be > 0")
        _check_choices(self)
        if self.profile_steps and (len(self.profile_steps) != 2 or not
                                   1 <= self.profile_steps[0] <= self.profile_steps[1]):
            raise UsageError(f"--profile_steps={','.join(map(str, self.profile_steps))} must be "
                             "START,END with 1 <= START <= END (e.g. 10,20)")
        _positive("log_every", self.log_every)
        if not self.learning_rate > 0:
            raise UsageError(f"--learning_rate={self.learning_rate} must be > 0")
        return self


@dataclasses.dataclass(frozen=True)
class Config:
    """The whole experiment: one frozen value built from flags, by ``tfspeed.fit`` or by hand."""

    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    train: TrainConfig = TrainConfig()
    model_dir: str = option("", "Where logs, checkpoints, the model and report.json go.")

    def validate(self) -> Config:
        """Checks each part and the rules that span parts; returns self."""
        self.data.validate()
        self.model.validate()
        self.runtime.validate()
        self.train.validate()
        if not self.model_dir:
            raise UsageError("--model_dir is required: where checkpoints, logs and report.json go")
        if self.train.eval_every_epochs and not self.data.eval_split:
            raise UsageError(f"--eval_every_epochs={self.train.eval_every_epochs} evaluates on "
                             "--eval_split, which is empty; name a split (--eval_split="
                             "validation) or drop --eval_every_epochs")
        return self

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=2)


SECTIONS = {"data": DataConfig, "model": ModelConfig, "runtime": RuntimeConfig,
            "train": TrainConfig}


def is_auto(value) -> bool:
    """Whether a setting is still ``auto`` (to be resolved)."""
    return isinstance(value, str) and value == AUTO


def flag_name(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or field.name


def _check_choices(section) -> None:
    """Every field with a list of allowed values holds one (each item, for a tuple)."""
    for field in dataclasses.fields(section):
        allowed = field.metadata.get("choices")
        if not allowed:
            continue
        value = getattr(section, field.name)
        for item in value if isinstance(value, tuple) else (value,):
            _choice(flag_name(field), item, allowed)


def _count_or_auto(flag: str, value, minimum: int, rest: str = " (or 'auto')") -> None:
    if is_auto(value):
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"--{flag}={value!r} must be a number or 'auto'")
    if value < minimum:
        raise UsageError(f"--{flag}={value} must be >= {minimum}{rest}")


def _check_address(address: str) -> None:
    """``grpc://HOST:PORT`` (the dispatcher); the client checks that it answers."""
    from urllib.parse import urlsplit

    url = urlsplit(address if "://" in address else f"grpc://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != "grpc" or not url.hostname or not port or url.path not in ("", "/"):
        raise UsageError(f"--data_service={address!r} is not a dispatcher address; use "
                         "grpc://HOST:PORT (e.g. grpc://127.0.0.1:5050)")


def _choice(flag: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise UsageError(f"--{flag}={value!r} is not one of: {', '.join(allowed)}")


def _positive(flag: str, value: int) -> None:
    if not value > 0:
        raise UsageError(f"--{flag}={value} must be > 0")


def _non_negative(flag: str, value: int) -> None:
    if value < 0:
        raise UsageError(f"--{flag}={value} must be >= 0")
