"""``python -m tfspeed.diagnose --flagfile=...``: where does the time go, and what to try next.

Same flags as ``tfspeed.train``. After a warm-up, it measures for a bounded number of steps:
  (a) the input pipeline alone (examples/s),
  (b) the model's real training step alone on one batch held in memory
      (``Dataset.from_tensors(batch).repeat()``: the compute ceiling),
  (c) both together (examples/s, and the share of step time spent waiting for input),
  (d) a profile of (c), read with xprof,
plus the time each pipeline stage adds and peak memory. From these it gives a verdict —
input-bound, compute-bound or memory-bound — and next steps ranked by expected gain.
Writes ``MODEL_DIR/diagnose/diagnose.json`` and ``diagnose.png``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from absl import app, logging

from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError
from tfspeed.runtime import hostmem
from tfspeed.util.cli import main_entry


@dataclasses.dataclass(frozen=True)
class Options:
    """How long each measurement runs (in training steps, after ``warmup`` steps)."""

    steps: int = 40
    warmup: int = 10
    profile_steps: int = 10


def run(config, options: Options = Options()) -> dict:  # noqa: B008 -- frozen
    """Measures, decides and writes the diagnosis; returns it as a dict."""
    from tfspeed import train

    # It trains the model and writes into --model_dir: it holds the run's lock too, so a
    # training run and a diagnosis on one directory never overwrite each other.
    with train.data_errors(config.data.data_dir):
        job = train.prepare(config)
    out_dir = os.path.join(config.model_dir, "diagnose")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with train.data_errors(config.data.data_dir):
            figures = measure(job, options, out_dir)
        result = {**figures, **decide(job, figures)}
        with open(os.path.join(out_dir, "diagnose.json"), "w") as f:
            json.dump(result, f, indent=2)
        result["chart"] = _chart(result, os.path.join(out_dir, "diagnose.png"))
    finally:
        job.release()
    for line in report_lines(result):
        print(line)
    print(f"details: {out_dir}/diagnose.json, chart: {result['chart']}")
    return result


def measure(job, options: Options, out_dir: str) -> dict:
    """Runs (a)-(d) and the per-stage timing; returns the figures."""
    import tensorflow as tf

    from tfspeed import train
    from tfspeed.data import pipeline

    config, batch = job.config, job.config.data.batch_size
    in_step = hasattr(job.train_data, "replica_batch")
    local = pipeline.build_from_config(job.train_data_config, config.data.train_split,
                                       training=True, schema=job.schema)
    if in_step:  # what the job runs: batches gathered inside the step, no tf.data per step
        input_alone = _time_in_step_gather(job, options) * batch
    else:
        warmup = options.warmup + min(job.steps_per_epoch, 200)  # fill an in-memory cache
        input_alone = _time_iterator(iter(local), options.steps, warmup) * batch
    held = next(iter(local))
    synthetic = job.runtime.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensors(held).repeat())
    engine = train.build_engine(config, job.runtime, job.model, job.objectives, job.preprocess)
    compute_alone = _time_engine(engine, iter(synthetic), options) * batch
    together, wait_pct = _time_engine_with_wait(engine, _batches(job), options)
    profile = _profile(engine, _batches(job), options, out_dir)
    if in_step:
        # xprof's input analysis reads tf.data iterators; a step that gathers its own batch
        # has none, and xprof then says it cannot tell. The step's own timing can.
        profile["conclusion"] = (
            "input is gathered inside the step (no tf.data iterator), so xprof's input "
            "analysis does not apply; the step's own timing above measures the wait")
        stages = {"in-step gather": 1000 / max(input_alone / batch, 1e-9)}
    else:
        stages = _stage_times(job, options)
    placement = job.input_report.get("placement", {}).get("where", "host")
    return {
        "examples_per_sec": {"input_alone": input_alone, "compute_alone": compute_alone,
                             "together": together * batch},
        "input_wait_pct": wait_pct,
        "stages_ms_per_batch": stages,
        "profile": profile,
        "memory": _memory(),
        "input_measured": ("the in-step gather the job trains on (--input_placement=device)"
                           if in_step else "the job's tf.data pipeline"),
        "settings": {"batch_size": batch, "model": config.model.name,
                     "objectives": engine.objectives.report,
                     "input_placement": placement,
                     "precision": job.runtime.precision, "xla": job.runtime.xla,
                     "cache": job.train_data_config.cache,
                     "data_service": config.data.data_service or None,
                     "steps_per_execution":
                         config.train.steps_per_execution, "steps": options.steps},
    }


def _time_in_step_gather(job, options: Options) -> float:
    """Batches per second of the in-step input alone: the gathers (and augmentation) a step
    runs for its batch, in one compiled loop, with no model."""
    import tensorflow as tf

    source, strategy = job.train_data, job.runtime.strategy

    @tf.function
    def gather(start, n):
        total = tf.constant(0.0)
        for step in tf.range(start, start + n):
            x, _ = strategy.run(source.replica_batch, (step,))
            for part in tf.nest.flatten(strategy.experimental_local_results(x)):
                total += tf.cast(tf.reduce_sum(part[:1]), tf.float32)
        return total

    gather(tf.constant(0, tf.int64), tf.constant(options.warmup, tf.int64)).numpy()
    start = time.perf_counter()
    gather(tf.constant(options.warmup, tf.int64), tf.constant(options.steps, tf.int64)).numpy()
    return options.steps / (time.perf_counter() - start)


def _time_iterator(iterator, steps: int, warmup: int) -> float:
    """Batches per second pulled from ``iterator`` after ``warmup`` batches."""
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(steps):
        next(iterator)
    return steps / (time.perf_counter() - start)


def _time_engine(engine, iterator, options: Options) -> float:
    return _time_engine_with_wait(engine, iterator, options)[0]


def _time_engine_with_wait(engine, iterator, options: Options) -> tuple[float, float]:
    """Steps/s of the real training step on ``iterator``, and % of time waiting for input."""
    n = max(engine.options.steps_per_execution, 1)
    for _ in range(max(options.warmup // n, 1)):
        engine.train(iterator, n)["loss"].numpy()
    executions = max(options.steps // n, 1)
    waited = 0.0
    start = time.perf_counter()
    for _ in range(executions):
        out = engine.train(iterator, n)
        waited = waited + out["input_wait_s"]
    out["loss"].numpy()
    seconds = time.perf_counter() - start
    return executions * n / seconds, 100 * min(float(waited) / seconds, 1.0)


def _profile(engine, iterator, options: Options, out_dir: str) -> dict:
    from tfspeed.diagnosis import profiling

    window = profiling.ProfileWindow(os.path.join(out_dir, "logs"), 1, options.profile_steps)
    for step in range(options.profile_steps):
        with window.trace(step):
            engine.train_one(iterator)
        window.after(step + 1)
    window.stop()
    return window.summary


def _batches(job):
    """What the engine trains on: the job's in-graph source, or an iterator over its data."""
    return job.train_data if hasattr(job.train_data, "replica_batch") else iter(job.train_data)


def _stage_times(job, options: Options) -> dict[str, float]:
    """Milliseconds each pipeline stage adds per batch, from pipelines cut after each stage."""
    from tfspeed.data import pipeline

    config, batch = job.train_data_config, job.config.data.batch_size
    times, previous = {}, 0.0
    for stage in pipeline.STAGES:
        ds = pipeline.build_from_config(config, config.train_split, training=True,
                                        schema=job.schema, until=stage)
        if stage != "batch":
            ds = ds.repeat().batch(batch)  # count whole batches of elements, like the model
        per_batch_ms = 1000 / _time_iterator(iter(ds), options.steps, options.warmup +
                                             min(job.steps_per_epoch, 200))
        times[stage] = max(per_batch_ms - previous, 0.0)
        previous = max(per_batch_ms, previous)
    return times


def _memory() -> dict:
    import resource

    import tensorflow as tf

    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20
    memory = {"peak_host_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              "host_total_mb": total, "host_allocator": hostmem.describe()}
    for i, _ in enumerate(tf.config.list_physical_devices("GPU")):
        info = tf.config.experimental.get_memory_info(f"GPU:{i}")
        memory[f"gpu{i}_peak_mb"] = info["peak"] / 2**20
    return memory


def decide(job, figures: dict) -> dict:
    """The verdict and the next steps, from the figures (pure: no measuring here)."""
    from tfspeed.diagnosis import advice

    config = dataclasses.replace(job.config, data=job.train_data_config)  # cache resolved
    return advice.decide(config, job.schema, job.runtime.plan, figures)


def report_lines(result: dict) -> list[str]:
    eps = result["examples_per_sec"]
    memory = result["memory"]
    lines = [
        f"tfspeed diagnose: {result['verdict'].upper()}" + (
            f" ({result['severity']})" if result.get("severity") else "") + f": {result['why']}",
        f"  input alone          : {eps['input_alone']:10.0f} examples/s "
        f"({result.get('input_measured', 'the tf.data pipeline')})",
        f"  model alone          : {eps['compute_alone']:10.0f} examples/s (synthetic batch)",
        f"  together             : {eps['together']:10.0f} examples/s, "
        f"{result['input_wait_pct']:.0f}% of the time waiting for input",
        f"  peak host memory     : {memory['peak_host_rss_mb'] / 1024:.1f} GB of "
        f"{memory['host_total_mb'] / 1024:.1f} GB (allocator: "
        f"{memory.get('host_allocator', 'unknown')})",
    ]
    if result["profile"].get("conclusion"):
        lines.append(f"  xprof: {result['profile']['conclusion']}")
    stages = result["stages_ms_per_batch"]
    lines.append("  input stages (ms per batch): " + ", ".join(
        f"{name} {ms:.1f}" for name, ms in stages.items()))
    lines.append("next steps, by expected gain:")
    for i, step in enumerate(result["next_steps"], 1):
        lines.append(f"  {i}. {step['advice']}  [{step['expected_gain']}]")
    return lines


def _chart(result: dict, path: str) -> str:
    """Throughput of (a)/(b)/(c) and time per pipeline stage, as a PNG a person can look at."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    eps = result["examples_per_sec"]
    stages = result["stages_ms_per_batch"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    names = ["input alone", "model alone", "together"]
    values = [eps["input_alone"], eps["compute_alone"], eps["together"]]
    left.bar(names, values, color=["#4c72b0", "#55a868", "#c44e52"])
    left.set_ylabel("examples/s")
    left.set_title(f"verdict: {result['verdict']}")
    right.barh(list(stages), list(stages.values()), color="#8172b2")
    right.invert_yaxis()
    right.set_xlabel("ms per batch added by the stage")
    right.set_title("input pipeline stages")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise UsageError(f"unexpected arguments {argv[1:]}: every option is a --flag")
    config = tfspeed_flags.to_config()
    steps, warmup = tfspeed_flags.diagnose_options()
    run(config, Options(steps=steps, warmup=warmup))


def run_main() -> None:
    main_entry(lambda: app.run(main, flags_parser=tfspeed_flags.parse))


if __name__ == "__main__":
    logging.set_verbosity(logging.WARNING)
    run_main()
