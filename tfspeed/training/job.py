"""One job: everything a run sets up before its loop, built in one place.

``prepare(config)`` resolves the runtime, locks ``--model_dir``, converts demo data if asked,
builds the input, measures the precision where ``auto`` or ``measure`` asks, and builds the
model with its resolved objectives. ``build_model``, ``build_engine`` and ``engine_at`` are
the only way a model and its engine are made: training, the precision probe,
``tfspeed.tune`` and ``tfspeed.diagnose`` all go through them, so every engine trains the
job's own loss and metrics.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import sys

from absl import logging

from tfspeed import plan
from tfspeed.config import Config
from tfspeed.errors import UsageError
from tfspeed.training import decisions

# tfspeed.fit probes through these too (as job.measure_precision, job.precision_to_measure).
from tfspeed.training.precision_probe import (  # noqa: F401
    measure_job_precision,
    measure_precision,
    precision_to_measure,
)
from tfspeed.util import locks


@dataclasses.dataclass
class Job:
    """Everything a run sets up before its loop: shared by training and ``tfspeed.diagnose``."""

    config: Config
    runtime: object
    schema: object
    model: object
    train_data: object  # distributed, repeating
    eval_data: object | None  # distributed, finite
    eval_steps: int | None
    input_shape: tuple[int, ...]
    num_train: int
    prepare_seconds: float
    input_sharding: str = ""
    lock: locks.Lock | None = None  # on --model_dir, held by the chief until ``release``
    preprocess: object = None  # runs on each batch's inputs inside the compiled step
    input_report: dict = dataclasses.field(default_factory=dict)
    data_configs: dict = dataclasses.field(default_factory=dict)  # per split, cache resolved
    objectives: object = None  # the loss and metrics (tfspeed.training.objectives)
    epoch_batches: int = 0  # token data: batches in one pass (a batch is a token budget)
    batching: object = None  # token data: the resolved ``tfspeed.data.text.Batching``
    token_weight: float | None = None  # tfspeed.fit's token batches: divides each loss sum
    decisions: object = None  # measured choices, recorded for a rerun (training.decisions)
    probe_compiles: dict = dataclasses.field(default_factory=dict)  # probe -> step programs
    plan: object = None  # every auto, resolved: ``tfspeed.plan.Plan`` (report.json's plan)

    @property
    def train_data_config(self):
        """The train split's DataConfig as the pipeline runs it (``cache`` resolved)."""
        return self.data_configs.get(self.config.data.train_split, self.config.data)

    @property
    def steps_per_epoch(self) -> int:
        return self.epoch_batches or self.num_train // self.config.data.batch_size

    def release(self) -> None:
        """Lets another run use ``--model_dir`` (the end of the process does it too)."""
        if self.lock:
            self.lock.release()

def prepare(config: Config) -> Job:
    """Resolves the runtime, locks ``--model_dir``, converts demo data if asked, builds the
    datasets and the model. Call ``release()`` on the job when done with it.

    Args:
      config: a validated experiment config.

    Returns:
      The ``Job``, holding the lock on ``--model_dir`` on the chief.

    Raises:
      UsageError: another live run (training or diagnosis) holds ``--model_dir``.
    """
    from tfspeed import runtime

    _make_dir(config.model_dir)
    # Two runs writing one model_dir would overwrite each other's checkpoints, logs and
    # report. Only the chief writes there; the other workers lock their own directories.
    alone = runtime.cluster_tasks() <= 1
    lock = locks.lock_model_dir(config.model_dir) if alone else None
    try:
        # A single process converts first: --intra_op_threads=auto sizes the model from the
        # schema, and converting starts no TensorFlow runtime. (A cluster's chief converts
        # later: its strategy must exist before anything else touches TensorFlow.)
        converted_s = _prepare_data(config) if alone else 0.0
        # Devices (logical CPUs, GPU memory growth) and threads are fixed once an op runs.
        rt = runtime.setup(config.runtime,
                           forward_flops=functools.partial(_forward_flops, config))
        if lock is None and rt.is_chief:
            lock = locks.lock_model_dir(config.model_dir)
        return _build(config, rt, lock, converted_s)
    except BaseException:
        if lock:
            lock.release()
        raise

def _forward_flops(config: Config, replicas: int) -> float | None:
    """The model's forward FLOPs per replica step (``tfspeed.runtime.threads``); None without data."""
    from tfspeed.data import pipeline
    from tfspeed.data import schema as schema_lib
    from tfspeed.runtime import threads
    from tfspeed.training import models

    if not os.path.exists(os.path.join(config.data.data_dir, schema_lib.SCHEMA_FILE)):
        return None  # the real build reports the missing data
    schema = schema_lib.read(config.data.data_dir)
    if schema.text:
        return None  # token batches vary in shape: sized as without a model
    shape = pipeline.input_shape(schema, config.data)
    return threads.forward_flops(lambda: models.build(config.model, shape, schema.num_outputs),
                                 shape, max(config.data.batch_size // replicas, 1))

def _build(config: Config, rt, lock: locks.Lock | None, converted_s: float = 0.0) -> Job:
    """``prepare`` once the runtime is set up and the run directory is ours (``converted_s``:
    seconds converting data already spent)."""
    import keras

    from tfspeed import runtime
    from tfspeed.data import job_input, pipeline
    from tfspeed.data import schema as schema_lib
    from tfspeed.data import text as text_lib

    if config.train.profile_steps and not runtime.backends.get(rt.backend).tf_profiler:
        raise UsageError("--profile_steps captures with TensorFlow's profiler, which does not "
                         "see a step on the JAX backend; drop it, or run with "
                         "KERAS_BACKEND=tensorflow to profile")
    prepare_seconds = converted_s + (_prepare_data(config) if rt.is_chief
                                     else _wait_for_data(config))
    schema = schema_lib.read(config.data.data_dir)
    data = config.data
    if data.data_service:
        from tfspeed.data import service_client as service

        service.check_reachable(data.data_service)
    num_train = schema.split(data.train_split).num_records
    keras.utils.set_random_seed(data.seed)
    batching, epoch_batches, compiles = None, 0, {}
    decided = decisions.Decisions(config.model_dir, config, rt.backend, writes=rt.is_chief,
                                  reuses=rt.num_workers == 1)
    # Before anything is trained: a killed attempt's rerun compares its kernels with these.
    decided.first_kernels(decisions.kernels(rt.backend, rt.plan.intra_op_threads))
    if text_lib.is_text(schema):
        batching = _decided_batching(config, rt, schema, decided, compiles)
        _check_text_batch(batching, schema, data.train_split)
        rt = runtime.for_batching(rt, config.runtime, batching.mode)
        epoch_batches = max(1, text_lib.batches_per_epoch(batching, schema, data.train_split))
    else:
        _check_batch(data.batch_size, num_train, rt.num_replicas, data.train_split)
    steps_per_epoch = epoch_batches or num_train // data.batch_size
    inputs = job_input.build(config, schema, rt, num_train, steps_per_epoch, batching)
    # The whole split unless --eval_steps caps it. Not a count computed here: with several
    # workers one may hold a batch more than another, and tf.distribute then runs every
    # worker until the last has no data (the others get empty batches). Text caps the
    # sequences it reads instead (job_input): its batches of similar lengths are not a sample.
    eval_steps = (config.train.eval_steps or None) if batching is None else None
    input_shape = pipeline.input_shape(schema, data)
    probed = ""  # precision's source where a probe decided it
    if precision_to_measure(config, rt) and (recorded := decided.get("precision")):
        rt, probed = decisions.with_precision(rt, recorded), plan.REUSED
    elif precision_to_measure(config, rt):
        rt = measure_job_precision(config, rt, schema, inputs, input_shape, steps_per_epoch,
                                   batching, compiles, engine_at=engine_at)
        keras.utils.set_random_seed(data.seed)  # the probe's models drew from the generator
        decided.record("precision", {"value": rt.plan.precision,
                                     "reason": rt.plan.reasons["precision"]})
        probed = plan.MEASURED
    model, goals = build_model(config, rt, schema, input_shape, batching)
    # One input pipeline per worker process.
    sharding = pipeline.sharding(len(schema.split(data.train_split).shards), rt.num_workers)
    if data.data_service:
        sharding = (f"{sharding}; read on the tf.data service at {data.data_service} "
                    f"({data.data_service_sharding} sharding over its workers)")
    if rt.num_workers > 1:
        logging.info("worker %d of %d; input sharded %s", rt.worker_index, rt.num_workers,
                     sharding)
    if inputs.report["placement"]["where"] == "device":
        sharding = "none: every worker holds the split in-graph and gathers its replicas' part"
    return Job(config=config, runtime=rt, schema=schema, model=model,
               train_data=inputs.train, eval_data=inputs.eval,
               eval_steps=eval_steps, input_shape=input_shape, num_train=num_train,
               prepare_seconds=prepare_seconds, input_sharding=sharding, lock=lock,
               preprocess=inputs.preprocess, input_report=inputs.report,
               data_configs=inputs.configs, objectives=goals, epoch_batches=epoch_batches,
               batching=batching, decisions=decided, probe_compiles=compiles,
               plan=_plan(config, rt, inputs.report, batching, probed))


def _plan(config: Config, rt, input_report: dict, batching, probed: str):
    """The job's ``tfspeed.plan.Plan``: the runtime's decisions, the input's, the batching's."""
    out = runtime_plan(config, rt, probed)
    out = out.with_(**dict(plan.of_input(config.data, input_report).decisions))
    return out.with_(batching=batching.decision()) if batching is not None else out


def runtime_plan(config: Config, rt, probed: str = ""):
    """The runtime's decisions as a ``tfspeed.plan.Plan`` (``probed``: precision's source
    where a probe decided it, ``measured`` or ``reused``)."""
    values = {"strategy": rt.plan.strategy, "precision": rt.plan.precision,
              "xla": rt.plan.xla, "intra_op_threads": rt.plan.intra_op_threads}
    return plan.of_runtime(config.runtime, rt.plan.reasons, values, probed)


def report_plan(job: Job, tuning: dict) -> dict:
    """report.json's ``plan``: every ``auto`` of the run, its value, reason and source
    (``tuning``: the trainer's steps per execution)."""
    spe = plan.steps_per_execution(job.config.train.steps_per_execution, tuning)
    return (job.plan or plan.Plan()).with_(steps_per_execution=spe).to_json()


# An engine built to be timed, not to train a run: its schedule never ends early.
PROBE_UPDATES = 10**6


def build_model(config: Config, rt, schema, input_shape: tuple[int, ...], batching=None):
    """The job's model, built in the strategy's scope under the current precision policy,
    with the loss and metrics resolved for it: the one place a job's model and objectives
    come from (training, the precision probe, ``tfspeed.tune`` and ``tfspeed.diagnose``).

    Args:
      batching: token data: the job's resolved batching (its T and S size the model).

    Returns:
      ``(model, objectives)``.
    """
    from tfspeed.data import text
    from tfspeed.training import models, objectives

    spec, extra = None, {}
    if text.is_text(schema):
        batching = batching or resolve_batching(config, rt, schema)
        spec = {"vocab_size": schema.text["tokenizer"]["vocab_size"], "task": schema.task,
                "max_length": batching.max_length, "max_segments": batching.max_segments}
        extra = {"sequences": True}  # dict targets {"label", "weight"}, weighted exactly
    with rt.scope():
        model = models.build(config.model, input_shape, schema.num_outputs, text=spec)
    goals = objectives.resolve(config.train.loss, config.train.metrics or None, schema.task,
                               model, **extra)
    return model, goals


def resolve_batching(config: Config, rt, schema, recall=None, probe=None):
    """The job's token batching: ``tfspeed.data.text.resolve`` with what the model tells
    (whether it keeps packed sequences apart, its attention's cost) and the runtime
    (``plan.compiled_modes``). Resolved once per job; its input, model, report, tune and
    diagnose all take this value. ``recall``, ``probe``: ``tfspeed.plan.batching``'s."""
    from tfspeed.data import text
    from tfspeed.runtime import backends
    from tfspeed.training import models

    k = models.attention_length(config.model, schema.task, schema.num_outputs)
    train = config.train
    compiled = plan.compiled_modes(config.runtime.xla, rt.plan.xla,
                                   backends.get(rt.backend).compiles_every_step)
    return text.resolve(config.data, schema, models.takes_segments(config.model.name),
                        rt.num_replicas, attention_length=k, compiled=compiled,
                        run_steps=train.train_steps * train.grad_accum_steps,
                        run_epochs=0 if train.train_steps else train.epochs,
                        recall=recall, probe=probe)


def _decided_batching(config: Config, rt, schema, decided, compiles: dict):
    """The job's batching as ``tfspeed.plan.batching`` walks it: the first run's recorded
    mode in a rerun (``decided``: ``training.decisions``), else predicted, else measured
    (``measure_batching``) and recorded."""
    batching = measure_batching(config, rt, schema, compiles,
                                recall=lambda: decided.get("batching"))
    if batching.source == "measured":  # a prediction is made again alike; a measurement not
        decided.record("batching", {"mode": batching.mode, "reason": batching.reason,
                                    "measured": batching.measured})
    return batching


def measure_batching(config: Config, rt, schema, compiles: dict | None = None, recall=None):
    """The job's batching with its probe: where ``tfspeed.plan.batching`` finds bucket and
    pack within the cost model's error and both passes of both modes fit in the probe's
    share of the run, each mode's own batches (the same number, from the job's pipeline)
    train a fresh copy of the job's model (``autotune.time_batchings``). ``compiles``, if
    given, learns how many step programs the probe compiled (``compiles["batching"]``)."""
    return resolve_batching(config, rt, schema, recall=recall, probe=functools.partial(
        _time_batchings, config, rt, schema, compiles))


def _time_batchings(config: Config, rt, schema, compiles: dict | None) -> dict:
    """``tfspeed.plan.batching``'s probe: ``{"rates", "steps"}``, or ``{"skipped": why}``."""
    import keras

    from tfspeed.data import text as text_lib
    from tfspeed.probes import autotune

    data, train = config.data, config.train
    modes = {m: resolve_batching(dataclasses.replace(
        config, data=dataclasses.replace(data, batching=m)), rt, schema)
        for m in ("bucket", "pack")}
    batches = {m: max(text_lib.batches_per_epoch(b, schema, data.train_split), 1)
               for m, b in modes.items()}
    # A run given in steps: as many passes as its steps are of the mode with more batches.
    passes = (train.train_steps * train.grad_accum_steps / max(batches.values())
              if train.train_steps else train.epochs)
    steps = autotune.batching_probe_steps(len(modes["bucket"].boundaries), batches, passes)
    if not steps:
        return {"skipped": f"a probe of {2 * autotune.PROBE_N} batches of each mode is over "
                           f"{autotune.PROBE_SHARE:.0%} of this run ({passes:.3g} passes)"}
    runs = {m: _probe_run(config, rt, schema, b, steps) for m, b in modes.items()}
    rates = autotune.time_batchings(runs, steps, agree=rt.mean_over_workers,
                                    progress=logging.info)
    keras.utils.set_random_seed(data.seed)  # the probe's models drew from the generator
    if compiles is not None:
        compiles["batching"] = sum(run[0].compiled_functions for run in runs.values())
    return {"rates": rates, "steps": steps}


def _probe_run(config: Config, rt, schema, batching, steps: int):
    """``(engine, iterator, real tokens)`` for timing ``batching``: the job's model under
    ``batching``'s runtime (XLA for packed rows), on ``steps`` training batches of its
    pipeline, held in memory and repeated. Shuffled whatever ``--shuffle`` says: the first
    batches of a split in its stored order need not be a sample of its lengths."""
    import numpy as np

    from tfspeed import runtime
    from tfspeed.data import pipeline

    data = dataclasses.replace(config.data, cache="none", augment=(), shuffle=True)
    ds = pipeline.build_from_config(data, data.train_split, training=True, schema=schema,
                                    batching=batching).take(steps).cache()
    real = sum(int(np.sum(x["segment_ids"].numpy() > 0)) for x, _ in ds)  # fills the cache
    mode_rt = runtime.for_batching(rt, config.runtime, batching.mode)
    engine, _ = engine_at(config, mode_rt, schema, pipeline.input_shape(schema, data), None,
                          mode_rt.plan.precision, batching=batching)
    return engine, iter(rt.distribute(ds.repeat())), real


def build_engine(config: Config, rt, model, goals, preprocess=None,
                 total_updates: int = PROBE_UPDATES, batching=None):
    """The engine for ``model`` with the job's objectives and optimisation settings
    (``batching``: token data's, whose expected weight per batch scales the loss)."""
    from tfspeed.training import trainer

    return trainer.make_engine(model, goals, config.train, rt, config.data.batch_size,
                               total_updates, preprocess,
                               weight_scale=weight_scale(batching, goals))


def weight_scale(batching, goals) -> float | None:
    """Token data: what one micro-batch's summed loss is divided by, its expected weight
    (real tokens for an lm, sequences for classification); None otherwise."""
    if batching is None:
        return None
    return batching.expected_weight(goals.report.get("task", "classification"))

def engine_at(config: Config, rt, schema, input_shape, preprocess, precision: str,
              xla: bool | None = None, batching=None):
    """A fresh model and its engine under ``precision`` (and ``xla``), for timing: the
    job's own model, loss and metrics. Sets the global Keras policy to ``precision``.

    Returns:
      ``(engine, runtime)``: the runtime with ``precision``/``xla`` in its plan.
    """
    import keras

    timed = dataclasses.replace(rt.plan, precision=precision,
                                loss_scale=precision == "mixed_float16",
                                xla=rt.plan.xla if xla is None else xla)
    rt = dataclasses.replace(rt, plan=timed)
    keras.mixed_precision.set_global_policy(precision)
    model, goals = build_model(config, rt, schema, input_shape, batching)
    return build_engine(config, rt, model, goals, preprocess, batching=batching), rt

@contextlib.contextmanager
def data_errors(data_dir: str):
    """Turns a data problem the user must fix, met by TensorFlow while reading, into one line
    (a corrupt shard under --on_corrupt=fail, labels the schema disagrees with, a record that
    does not parse)."""
    import tensorflow as tf

    from tfspeed.data import pipeline

    try:
        yield
    except tf.errors.OpError as e:
        message = pipeline.user_error(e)
        if message is None and _PARSE_FAILURE in str(e.message):
            message = (f"a record in {data_dir} has a valid checksum but does not parse as "
                       f"this schema's tf.train.Example; repair with `python -m tfspeed.verify "
                       f"{data_dir} --repair`")
        if message is None:
            raise
        raise UsageError(message.removeprefix("tfspeed: ")) from None

_PARSE_FAILURE = "Could not parse example input"

def _wait_for_data(config: Config, timeout_s: float = 3600.0) -> float:
    """On a worker that is not the chief: waits for the chief's ``--prepare_source``
    conversion (two processes converting into one directory would collide)."""
    import time

    from tfspeed.data.schema import SCHEMA_FILE

    path = os.path.join(config.data.data_dir, SCHEMA_FILE)
    if not config.data.prepare_source or os.path.exists(path):
        return 0.0
    logging.info("waiting for the chief to convert %s into %s", config.data.prepare_source,
                 config.data.data_dir)
    start = time.monotonic()
    while not os.path.exists(path):
        if time.monotonic() - start > timeout_s:
            raise UsageError(f"{path} did not appear within {timeout_s:.0f} s: the chief's "
                             "conversion failed; see its log")
        time.sleep(0.5)
    return time.monotonic() - start

def _check_batch(batch_size: int, num_train: int, replicas: int, split: str) -> None:
    if batch_size > num_train:
        raise UsageError(f"--batch_size={batch_size} is larger than the {num_train} records of "
                         f"split {split!r}; lower --batch_size")
    if batch_size % replicas:
        raise UsageError(f"--batch_size={batch_size} does not split evenly over {replicas} "
                         f"replicas; use a multiple of {replicas}")

def _check_text_batch(batching, schema, split: str) -> None:
    """Batches of token records: the budget must fit the split (whole batches exist)."""
    stats = schema.split(split).text or {}
    sequences, tokens = schema.split(split).num_records, int(stats.get("tokens", 0))
    texts = batching.mode == "pad" or batching.bucket_size > 0  # a batch of --batch_size
    if texts and batching.batch_size > sequences:
        raise UsageError(f"--batch_size={batching.batch_size} is larger than the {sequences} "
                         f"sequences of split {split!r}; lower --batch_size")
    if not texts and tokens and batching.tokens_per_batch > tokens:
        raise UsageError(f"a batch of {batching.tokens_per_batch} tokens (--tokens_per_batch, "
                         f"or --batch_size x the mean length) is more than the {tokens} tokens of "
                         f"split {split!r}; lower --tokens_per_batch or --batch_size")


def _prepare_data(config: Config) -> float:
    """Converts ``--prepare_source`` into the data dir if no finished conversion is there."""
    from tfspeed.data.schema import SCHEMA_FILE

    source = config.data.prepare_source
    if not source or os.path.exists(os.path.join(config.data.data_dir, SCHEMA_FILE)):
        return 0.0
    from tfspeed.convert import convert

    logging.info("converting %s into %s first", source, config.data.data_dir)
    result = convert(source, config.data.data_dir, progress=sys.stdout.isatty())
    return float(result.summary["seconds"])

def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        probe = os.path.join(path, f".write-test-{os.getpid()}")  # two runs may probe at once
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--model_dir={path} is not writable ({e.strerror}); pick another "
                         "directory") from None
