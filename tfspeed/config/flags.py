"""All absl flags of the training driver, and their conversion into a validated ``Config``.

Library code never reads flags: ``to_config()`` is the only bridge.
"""

from __future__ import annotations

import os
import sys

from absl import flags

from tfspeed import config as config_lib
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.errors import UsageError

# Data.
_DATA_DIR = flags.DEFINE_string("data_dir", None, "Converted dataset (holds schema.json).")
_PREPARE_SOURCE = flags.DEFINE_string(
    "prepare_source", "", "If --data_dir holds no finished conversion, convert this "
    "scripts/to_tfrecord.py --source into it first (e.g. 'digits').")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 128, "Global batch size of one step.")
_IMAGE_SIZE = flags.DEFINE_integer("image_size", 0, "Resize images to this square side; 0 keeps them.")
_CACHE = flags.DEFINE_enum(
    "cache", "auto", ["auto", "none", "memory", "disk"],
    "Cache decoded records: in RAM, in a file under --cache_dir, or not; auto: in RAM if the "
    "split fits --ram_budget_mb, else on disk (none when read once).")
_CACHE_DIR = flags.DEFINE_string("cache_dir", "", "Directory for --cache=disk (default DATA_DIR/cache).")
_SHUFFLE = flags.DEFINE_boolean("shuffle", True, "Shuffle training files and records.")
_SHUFFLE_BUFFER = flags.DEFINE_integer("shuffle_buffer", 10_000, "Records in the shuffle buffer.")
_AUGMENT = flags.DEFINE_list(
    "augment", [], "Training augmentations: flip, crop, random_resized_crop (decodes only the "
    "crop of a JPEG; needs --image_size).")
_DETERMINISTIC = flags.DEFINE_boolean(
    "deterministic", False, "Fixed element order and seeded everything (slower input).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed for shuffling, augmentation and initialisation.")
_PARSE = flags.DEFINE_enum("parse", "auto", ["auto", "batched", "single"],
                           "Parse records in batches (vectorised) or one by one.")
_RAM_BUDGET_MB = flags.DEFINE_integer(
    "ram_budget_mb", 0, "RAM the input data may take (memory cache, in-graph input, tf.data "
    "buffers); 0: half of the memory available at start.")
_INPUT_PLACEMENT = flags.DEFINE_enum(
    "input_placement", "auto", ["auto", "host", "device"],
    "Where the step gets its batches: host (tf.data), device (the decoded split held in-graph, "
    "batches gathered inside the compiled step); auto: device if it fits --ram_budget_mb.")
_INPUT_THREADS = flags.DEFINE_integer(
    "input_threads", 0, "Threads for tf.data's parallel stages; 0: one per core (TF's default).")
_ON_CORRUPT = flags.DEFINE_enum(
    "on_corrupt", "skip", ["skip", "fail"],
    "A damaged shard: skip (report the records lost and go on) or fail (stop).")
_DATA_SERVICE = flags.DEFINE_string(
    "data_service", "", "grpc://HOST:PORT of a tf.data service dispatcher (python -m "
    "tfspeed.data_service): read, decode and augment on its workers; '' reads locally.")
_DATA_SERVICE_SHARDING = flags.DEFINE_enum(
    "data_service_sharding", "dynamic", ["off", "dynamic", "file"],
    "How service workers split an epoch: dynamic (each record at most once), file (fixed "
    "share; dispatcher needs --worker_addresses) or off (each worker the whole epoch).")
_TRAIN_SPLIT = flags.DEFINE_string("train_split", "train", "Split to train on.")
_EVAL_SPLIT = flags.DEFINE_string("eval_split", "validation", "Split to evaluate on ('' for none).")

# Model.
_MODEL = flags.DEFINE_string(
    "model", "cnn", "mlp, cnn, resnet50, mobilenetv2, or your own as package.module:function "
    "(function(input_shape, num_outputs) -> keras.Model, importable from the working "
    "directory or PYTHONPATH).")
_LOSS = flags.DEFINE_string(
    "loss", "", "A Keras loss name or package.module:function (one loss per example); default "
    "by task: sparse_categorical_crossentropy or mse.")
_METRICS = flags.DEFINE_list(
    "metrics", [], "Keras metric names or package.module:function (means of per-example "
    "values); default by task: accuracy or mae.")
_WIDTH = flags.DEFINE_integer("width", 0, "Model base width; 0 takes the model's default.")
_DROPOUT = flags.DEFINE_float("dropout", 0.0, "Dropout before the classifier.")
_REMAT = flags.DEFINE_boolean(
    "remat", False, "Recompute activations in the backward pass: less memory, more compute.")

# Runtime.
_STRATEGY = flags.DEFINE_enum(
    "strategy", "auto", ["auto", "default", "one_device", "mirrored", "multi_worker"],
    "tf.distribute strategy; auto: multi_worker under a TF_CONFIG cluster, mirrored over "
    ">1 GPU, else default.")
_CPU_REPLICAS = flags.DEFINE_integer(
    "cpu_replicas", 0, "Split the CPU into N logical devices (exercise MirroredStrategy on CPU).")
_PRECISION = flags.DEFINE_enum(
    "precision", "auto", list(config_lib.PRECISIONS),
    "Keras precision policy; auto picks from the hardware (timed on the model where bfloat16 "
    "is native on a CPU); measure always times float32 against the mixed policy.")
_XLA = flags.DEFINE_enum("xla", "auto", ["auto", "on", "off"],
                         "XLA-compile the per-replica step; auto: on for GPU/TPU, off on CPU.")
_INTRA_OP_THREADS = flags.DEFINE_string(
    "intra_op_threads", "auto",
    "Threads one op may split its work over: N, 0 for TF's default (one per core), or auto "
    "(one for a tiny model's step on a CPU host, where handing work between cores costs "
    "more than it saves; else the default).")

# Training.
_MODEL_DIR = flags.DEFINE_string("model_dir", None, "Where logs, checkpoints, the model and report.json go.")
_EPOCHS = flags.DEFINE_integer("epochs", 1, "Passes over the train split.")
_TRAIN_STEPS = flags.DEFINE_integer("train_steps", 0, "Total optimizer updates (overrides --epochs).")
_LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-3, "Base learning rate.")
_OPTIMIZER = flags.DEFINE_enum("optimizer", "adam", ["adam", "adamw", "sgd"], "Optimizer.")
_LR_SCHEDULE = flags.DEFINE_enum("lr_schedule", "constant", ["constant", "cosine"],
                                 "Learning-rate schedule, counted in optimizer updates.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", 0, "Linear warm-up updates.")
_SCALE_LR = flags.DEFINE_boolean(
    "scale_lr_with_batch", False, "Scale the rate by batch_size x grad_accum_steps / 256.")
_STEPS_PER_EXECUTION = flags.DEFINE_string(
    "steps_per_execution", "1", "Steps per tf.function call (cuts Python overhead), or 'auto'.")
_GRAD_ACCUM = flags.DEFINE_integer(
    "grad_accum_steps", 1, "Micro-batches of --batch_size per optimizer update.")
_CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 0,
                                         "Updates between checkpoints (0: only at the end).")
_KEEP_CHECKPOINTS = flags.DEFINE_integer("keep_checkpoints", 3, "Recent checkpoints kept.")
_EVAL_STEPS = flags.DEFINE_integer("eval_steps", 0, "Cap on evaluation batches; 0: the whole split.")
_LOG_EVERY = flags.DEFINE_integer("log_every", 50, "Steps between throughput measurements.")
_PROFILE_STEPS = flags.DEFINE_list(
    "profile_steps", [], "START,END: capture these steps with the TensorBoard profiler.")

# Diagnose (python -m tfspeed.diagnose).
_DIAGNOSE_STEPS = flags.DEFINE_integer("diagnose_steps", 40, "Steps timed per measurement.")
_DIAGNOSE_WARMUP = flags.DEFINE_integer("diagnose_warmup", 10, "Untimed steps before each.")


def parse(argv: list[str]) -> list[str]:
    """Parses ``argv`` into the flags; a flag error becomes one line and exit status 2."""
    try:
        _check_flagfile_loops(argv)
        return flags.FLAGS(argv)
    except flags.Error as e:
        message = " ".join(str(e).split())
        print(f"error: {message} (see --helpfull)", file=sys.stderr)
        sys.exit(2)


def _check_flagfile_loops(argv: list[str], chain: tuple[str, ...] = ()) -> None:
    """absl only warns about a flagfile that includes itself (and goes on without it)."""
    for arg in argv:
        if not arg.startswith("--flagfile="):
            continue
        path = os.path.abspath(arg.split("=", 1)[1])
        if path in chain:
            loop = " -> ".join(os.path.relpath(p) for p in (*chain, path))
            raise flags.Error(f"flagfile loop {loop}: remove one of these --flagfile lines")
        try:
            with open(path) as f:
                nested = [line.strip() for line in f]
        except OSError:
            continue  # absl reports the unreadable file itself
        _check_flagfile_loops(nested, (*chain, path))


def to_config() -> Config:
    """Builds and validates the experiment config from the parsed flags."""
    if not _DATA_DIR.value:
        raise UsageError("--data_dir is required: a directory made by scripts/to_tfrecord.py")
    if not _MODEL_DIR.value:
        raise UsageError("--model_dir is required: where logs, checkpoints and report.json go")
    data = DataConfig(
        data_dir=_DATA_DIR.value,
        batch_size=_BATCH_SIZE.value,
        image_size=_IMAGE_SIZE.value,
        cache=_CACHE.value,
        cache_dir=_CACHE_DIR.value,
        shuffle=_SHUFFLE.value,
        shuffle_buffer=_SHUFFLE_BUFFER.value,
        augment=tuple(_AUGMENT.value),
        deterministic=_DETERMINISTIC.value,
        seed=_SEED.value,
        parse=_PARSE.value,
        ram_budget_mb=_RAM_BUDGET_MB.value,
        input_placement=_INPUT_PLACEMENT.value,
        input_threads=_INPUT_THREADS.value,
        train_split=_TRAIN_SPLIT.value,
        eval_split=_EVAL_SPLIT.value,
        prepare_source=_PREPARE_SOURCE.value,
        on_corrupt=_ON_CORRUPT.value,
        data_service=_DATA_SERVICE.value,
        data_service_sharding=_DATA_SERVICE_SHARDING.value,
    )
    model = ModelConfig(name=_MODEL.value, width=_WIDTH.value, dropout=_DROPOUT.value,
                        remat=_REMAT.value)
    runtime = RuntimeConfig(strategy=_STRATEGY.value, cpu_replicas=_CPU_REPLICAS.value,
                            precision=_PRECISION.value, xla=_XLA.value,
                            intra_op_threads=_intra_op_threads(_INTRA_OP_THREADS.value))
    train = TrainConfig(
        epochs=_EPOCHS.value,
        train_steps=_TRAIN_STEPS.value,
        learning_rate=_LEARNING_RATE.value,
        optimizer=_OPTIMIZER.value,
        lr_schedule=_LR_SCHEDULE.value,
        warmup_steps=_WARMUP_STEPS.value,
        scale_lr_with_batch=_SCALE_LR.value,
        steps_per_execution=_steps_per_execution(_STEPS_PER_EXECUTION.value),
        grad_accum_steps=_GRAD_ACCUM.value,
        checkpoint_every=_CHECKPOINT_EVERY.value,
        keep_checkpoints=_KEEP_CHECKPOINTS.value,
        eval_steps=_EVAL_STEPS.value,
        log_every=_LOG_EVERY.value,
        profile_steps=_int_list("profile_steps", _PROFILE_STEPS.value),
        loss=_LOSS.value,
        metrics=tuple(_METRICS.value),
    )
    return Config(data=data, model=model, runtime=runtime, train=train,
                  model_dir=_MODEL_DIR.value).validate()


def _int_list(flag: str, values: list[str]) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in values)
    except ValueError:
        raise UsageError(f"--{flag}={','.join(values)} must be integers, e.g. 10,20") from None


def _steps_per_execution(value: str) -> int:
    """'auto' -> 0 (tuned while training); otherwise a positive integer."""
    return _count_or_auto("steps_per_execution", value, auto=0, minimum=1)


def _intra_op_threads(value: str) -> int:
    """'auto' -> ``threads.AUTO``; otherwise a non-negative integer (0: TF's default)."""
    from tfspeed.runtime import threads

    return _count_or_auto("intra_op_threads", value, auto=threads.AUTO, minimum=0,
                          rest=" (0: one per core) or 'auto'")


def _count_or_auto(flag: str, value: str, auto: int, minimum: int,
                   rest: str = " (or 'auto')") -> int:
    if value == "auto":
        return auto
    try:
        count = int(value)
    except ValueError:
        raise UsageError(f"--{flag}={value!r} must be a number or 'auto'") from None
    if count < minimum:
        raise UsageError(f"--{flag}={count} must be >= {minimum}{rest}")
    return count


def diagnose_options() -> tuple[int, int]:
    """(steps, warmup) for ``tfspeed.diagnose``."""
    if _DIAGNOSE_STEPS.value < 1 or _DIAGNOSE_WARMUP.value < 0:
        raise UsageError(f"--diagnose_steps={_DIAGNOSE_STEPS.value} must be >= 1 and "
                         f"--diagnose_warmup={_DIAGNOSE_WARMUP.value} >= 0")
    return _DIAGNOSE_STEPS.value, _DIAGNOSE_WARMUP.value
