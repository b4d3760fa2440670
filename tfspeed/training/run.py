"""Running one job end to end: train, evaluate, save, and write the report.

``run(config)`` is what ``python -m tfspeed.train`` calls. A finished run always leaves its
report, its checkpoint and its weights (``model.weights.h5``; ``model.keras`` where the model
serialises).
"""

from __future__ import annotations

from tfspeed.config import Config
from tfspeed.training.job import Job, data_errors, prepare, report_plan, weight_scale
from tfspeed.util import system


def run(config: Config) -> dict:
    """Runs one experiment end to end and returns the report (also written to model_dir).

    Args:
      config: a validated experiment config.

    Returns:
      The report dict: evaluation metrics, throughput, updates, resolved settings.
    """
    with data_errors(config.data.data_dir):
        job = prepare(config)  # an in-graph input reads its split here already
    try:
        return _train_and_report(job)
    finally:
        job.release()

def _train_and_report(job: Job) -> dict:

    from tfspeed.data import cache as data_cache
    from tfspeed.training import report, trainer

    config = job.config
    model, rt, schema, data = job.model, job.runtime, job.schema, config.data
    num_train, input_shape, prepare_seconds = job.num_train, job.input_shape, job.prepare_seconds
    with data_errors(data.data_dir):
        result = trainer.fit(
            model, job.train_data, job.eval_data, config.train, rt,
            steps_per_epoch=job.steps_per_epoch,
            eval_steps=job.eval_steps,
            global_batch_size=data.batch_size,
            model_dir=config.model_dir,
            preprocess=job.preprocess,
            objectives=job.objectives,
            weight_scale=weight_scale(job.batching, job.objectives),
            decisions=job.decisions,
        )
    data_cache.seal_built()  # caches this run finished: the next run checks their checksums
    weights = weights_sha256(model)
    service_counts = _service_report(data, rt)  # before the chief/others split: collectives
    if not rt.is_chief:  # the chief writes the model and the report
        print(f"worker {rt.worker_index} of {rt.num_workers} finished at update "
              f"{result.optimizer_updates}: weights sha256 {weights}")
        return {"optimizer_updates": result.optimizer_updates, "weights_sha256": weights}
    from tfspeed.training import checkpoints

    saved = checkpoints.export_model(model, config.model_dir)
    out = {
        "eval_accuracy": result.eval_metrics.get("accuracy"),
        "eval_loss": result.eval_metrics.get("loss"),
        "eval_metrics": result.eval_metrics,
        "eval_history": result.eval_history,
        **result.throughput,
        "optimizer_updates": result.optimizer_updates,
        "micro_steps": result.micro_steps,
        "skipped_updates": result.skipped_updates,
        "resumed_from_update": result.resumed_from_update,
        "steps_per_execution": result.steps_per_execution,
        "plan": report_plan(job, result.steps_per_execution),
        "compiled_programs": result.compiled_programs,
        # The probes' engines are programs compiled too (one each per input shape timed).
        "probe_compiled_programs": job.probe_compiles,
        "decisions": job.decisions.report() if job.decisions else {},
        "resume": _resume(job, result.resumed_from_update),
        "learning_rate": result.learning_rate,
        "profile": result.profile,
        "peak_host_rss_mb": system.peak_rss_mb(),
        "train_metrics": result.train_metrics,
        "seconds": {"prepare_data": prepare_seconds, **result.seconds},
        "runtime": rt.to_json(),
        "input_sharding": job.input_sharding,
        "input": job.input_report,
        "objectives": job.objectives.report,
        "data_service": service_counts,
        "weights_sha256": weights,
        "saved": saved,
        "dataset": _dataset_report(schema, config, num_train, input_shape),
        "config": config.to_json(),
    }
    path = report.write(config.model_dir, out)
    for line in report.summary_lines(out):
        print(line)
    if config.train.profile_steps:
        from tfspeed.probes import profiling

        for line in profiling.summary_lines(result.profile):
            print(line)
        print(f"profile: tensorboard --logdir={config.model_dir}/logs (Profile tab)")
    print(f"report: {path}")
    report.check_evaluation(out["eval_metrics"], config.model_dir)
    return out

def _resume(job: Job, from_update: int) -> dict:
    """report.json's ``resume`` (``report.resume``), the kernels compared with the first
    attempt's (``training.decisions``)."""
    from tfspeed.training import decisions, report

    rt = job.runtime
    here = decisions.kernels(rt.backend, rt.plan.intra_op_threads)
    first = job.decisions.first_kernels(here) if job.decisions else here
    return report.resume(job.config, from_update, first, here)


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
    from tfspeed.data import service_client as service

    splits = service.report()
    if rt.num_workers > 1:  # every worker must take part in these all-reduces
        counts = splits.get(data.train_split, service.EpochCount().to_json())
        splits = {data.train_split: {
            name: round(rt.mean_over_workers(float(value)) * (
                1 if name == "epochs" else rt.num_workers))  # epochs: each worker's own
            for name, value in sorted(counts.items())}}
    return {"address": data.data_service, "sharding": data.data_service_sharding,
            "splits": splits}


def _dataset_report(schema, config, num_train: int, input_shape) -> dict:
    """report.json's ``dataset``: what was trained on (for text: task, vocabulary and the
    train split's token statistics)."""
    out = {"source": schema.source, "num_train": num_train, "num_classes": schema.num_classes,
           "input_shape": ({k: list(v) for k, v in input_shape.items()}
                           if isinstance(input_shape, dict) else list(input_shape))}
    if schema.text:
        stats = dict(schema.split(config.data.train_split).text or {})
        stats.pop("lengths", None)  # per-length counts: in schema.json, too long for here
        out.update(task=schema.task, vocab_size=schema.text["tokenizer"]["vocab_size"],
                   tokens=stats)
    return out
