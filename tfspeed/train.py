"""The training driver: ``python -m tfspeed.train --flagfile=pipelines/digits.flags``.

Kept thin on purpose: parse flags into a Config, then ``run(config)``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys

from absl import app, logging

from tfspeed import flags as tfspeed_flags
from tfspeed.cli import main_entry
from tfspeed.config import Config
from tfspeed.errors import UsageError


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

    @property
    def steps_per_epoch(self) -> int:
        return self.num_train // self.config.data.batch_size


def prepare(config: Config) -> Job:
    """Resolves the runtime, converts demo data if asked, builds the datasets and the model."""
    import keras

    from tfspeed import models, runtime
    from tfspeed.data import pipeline
    from tfspeed.data import schema as schema_lib

    _make_dir(config.model_dir)
    # Devices (logical CPUs, GPU memory growth) can only be configured before any op runs.
    rt = runtime.setup(config.runtime)
    prepare_seconds = _prepare_data(config) if rt.is_chief else _wait_for_data(config)
    schema = schema_lib.read(config.data.data_dir)
    data = config.data
    if data.data_service:
        from tfspeed.data import service

        service.check_reachable(data.data_service)
    num_train = schema.split(data.train_split).num_records
    _check_batch(data.batch_size, num_train, rt.num_replicas, data.train_split)
    keras.utils.set_random_seed(data.seed)
    strategy = rt.strategy

    def dataset(split, training):
        return strategy.distribute_datasets_from_function(
            lambda ctx: pipeline.build_from_config(data, split, training=training,
                                                   input_context=ctx, schema=schema))

    eval_data, eval_steps = None, None
    if data.eval_split:
        eval_data = dataset(data.eval_split, False)
        eval_steps = math.ceil(schema.split(data.eval_split).num_records / data.batch_size)
    input_shape = pipeline.input_shape(schema, data)
    with strategy.scope():
        model = models.build(config.model, input_shape, schema.num_classes)
    # One input pipeline per worker process.
    sharding = pipeline.sharding(len(schema.split(data.train_split).shards), rt.num_workers)
    if data.data_service:
        sharding = (f"{sharding}; read on the tf.data service at {data.data_service} "
                    f"({data.data_service_sharding} sharding over its workers)")
    if rt.num_workers > 1:
        logging.info("worker %d of %d; input sharded %s", rt.worker_index, rt.num_workers,
                     sharding)
    return Job(config=config, runtime=rt, schema=schema, model=model,
               train_data=dataset(data.train_split, True), eval_data=eval_data,
               eval_steps=eval_steps, input_shape=input_shape, num_train=num_train,
               prepare_seconds=prepare_seconds, input_sharding=sharding)


def run(config: Config) -> dict:
    """Runs one experiment end to end and returns the report (also written to model_dir).

    Args:
      config: a validated experiment config.

    Returns:
      The report dict: evaluation metrics, throughput, updates, resolved settings.
    """
    import tensorflow as tf

    from tfspeed import report, trainer
    from tfspeed.data import pipeline

    job = prepare(config)
    model, rt, schema, data = job.model, job.runtime, job.schema, config.data
    num_train, input_shape, prepare_seconds = job.num_train, job.input_shape, job.prepare_seconds
    try:
        result = trainer.fit(
            model, job.train_data, job.eval_data, config.train, rt,
            steps_per_epoch=job.steps_per_epoch,
            eval_steps=job.eval_steps,
            global_batch_size=data.batch_size,
            model_dir=config.model_dir,
        )
    except tf.errors.OpError as e:
        message = pipeline.user_error(e)  # a data problem the user must fix, said in one line
        if message is None and _PARSE_FAILURE in str(e.message):
            message = (f"a record in {data.data_dir} has a valid checksum but does not parse as "
                       f"this schema's tf.train.Example; repair with `python -m tfspeed.verify "
                       f"{data.data_dir} --repair`")
        if message is None:
            raise
        raise UsageError(message.removeprefix("tfspeed: ")) from None
    weights = weights_sha256(model)
    service_counts = _service_report(data, rt)  # before the chief/others split: collectives
    if not rt.is_chief:  # the chief writes the model and the report
        print(f"worker {rt.worker_index} of {rt.num_workers} finished at update "
              f"{result.optimizer_updates}: weights sha256 {weights}")
        return {"optimizer_updates": result.optimizer_updates, "weights_sha256": weights}
    _save_model(model, os.path.join(config.model_dir, "model.keras"))
    out = {
        "eval_accuracy": result.eval_metrics.get("accuracy"),
        "eval_loss": result.eval_metrics.get("loss"),
        **result.throughput,
        "optimizer_updates": result.optimizer_updates,
        "micro_steps": result.micro_steps,
        "skipped_updates": result.skipped_updates,
        "resumed_from_update": result.resumed_from_update,
        "steps_per_execution": result.steps_per_execution,
        "learning_rate": result.learning_rate,
        "profile": result.profile,
        "peak_host_rss_mb": _peak_rss_mb(),
        "train_metrics": result.train_metrics,
        "seconds": {"prepare_data": prepare_seconds, **result.seconds},
        "runtime": rt.to_json(),
        "input_sharding": job.input_sharding,
        "data_service": service_counts,
        "weights_sha256": weights,
        "dataset": {"source": schema.source, "num_train": num_train,
                    "num_classes": schema.num_classes, "input_shape": list(input_shape)},
        "config": config.to_json(),
    }
    path = report.write(config.model_dir, out)
    for line in report.summary_lines(out):
        print(line)
    if config.train.profile_steps:
        from tfspeed import profiling

        for line in profiling.summary_lines(result.profile):
            print(line)
        print(f"profile: tensorboard --logdir={config.model_dir}/logs (Profile tab)")
    print(f"report: {path}")
    return out


_PARSE_FAILURE = "Could not parse example input"


def weights_sha256(model) -> str:
    """A digest of the model's weights: equal on every worker of a synchronous job."""
    import hashlib

    digest = hashlib.sha256()
    for weight in model.get_weights():
        digest.update(weight.tobytes())
    return digest.hexdigest()


def _service_report(data, rt) -> dict:
    """What the service delivered, summed over the training workers."""
    if not data.data_service:
        return {}
    from tfspeed.data import service

    splits = service.report()
    if rt.num_workers > 1:  # every worker must take part in these all-reduces
        counts = splits.get(data.train_split, service.EpochCount().to_json())
        splits = {data.train_split: {
            name: round(rt.mean_over_workers(float(value)) * (
                1 if name == "epochs" else rt.num_workers))  # epochs: each worker's own
            for name, value in sorted(counts.items())}}
    return {"address": data.data_service, "sharding": data.data_service_sharding,
            "splits": splits}


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


def _save_model(model, path: str) -> None:
    """Saves under a temporary name, then renames: a killed save never looks finished."""
    tmp = f"{path[: -len('.keras')]}.tmp-{os.getpid()}.keras"
    model.save(tmp)
    os.replace(tmp, path)


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _check_batch(batch_size: int, num_train: int, replicas: int, split: str) -> None:
    if batch_size > num_train:
        raise UsageError(f"--batch_size={batch_size} is larger than the {num_train} records of "
                         f"split {split!r}; lower --batch_size")
    if batch_size % replicas:
        raise UsageError(f"--batch_size={batch_size} does not split evenly over {replicas} "
                         f"replicas; use a multiple of {replicas}")


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
        probe = os.path.join(path, ".write-test")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise UsageError(f"--model_dir={path} is not writable ({e.strerror}); pick another "
                         "directory") from None


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    config = tfspeed_flags.to_config()
    from tfspeed import trainer

    try:
        run(config)
    except trainer.Stopped as e:
        print(e, file=sys.stderr)  # one line; the checkpoint is written
        sys.exit(e.exit_status)


def run_main() -> None:
    """Console entry point: one-line errors with exit status 2 for user mistakes."""
    main_entry(lambda: app.run(main, flags_parser=tfspeed_flags.parse))


if __name__ == "__main__":
    run_main()
