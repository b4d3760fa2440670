"""A diagnosis end to end: prepare the job, measure, decide, write diagnose.json and the chart,
print the verdict. ``run(config)`` is what ``python -m tfspeed.diagnose`` calls."""

from __future__ import annotations

import dataclasses
import json
import os

from tfspeed.diagnosis.measure import Options, measure
from tfspeed.training import job as job_lib


def run(config, options: Options = Options()) -> dict:  # noqa: B008 -- frozen
    """Measures, decides and writes the diagnosis; returns it as a dict."""
    # It trains the model and writes into --model_dir: it holds the run's lock too, so a
    # training run and a diagnosis on one directory never overwrite each other.
    with job_lib.data_errors(config.data.data_dir):
        job = job_lib.prepare(config)
    out_dir = os.path.join(config.model_dir, "diagnose")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with job_lib.data_errors(config.data.data_dir):
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

def decide(job, figures: dict) -> dict:
    """The verdict and the next steps, from the figures (pure: no measuring here)."""
    from tfspeed.diagnosis import advice

    config = dataclasses.replace(job.config, data=job.train_data_config)  # cache resolved
    return advice.decide(config, job.schema, job.runtime.plan, figures)

def report_lines(result: dict) -> list[str]:
    eps, ms = result["examples_per_sec"], result["ms_per_batch"]
    memory = result["memory"]
    unit = result.get("unit", "examples")  # token batches: sequences
    lines = [
        f"tfspeed diagnose: {result['verdict'].upper()}" + (
            f" ({result['severity']})" if result.get("severity") else "") + f": {result['why']}",
        f"  input alone          : {eps['input_alone']:10.0f} {unit}/s, "
        f"{ms['input_alone']:8.1f} ms per batch "
        f"({result.get('input_measured', 'the tf.data pipeline')})",
        f"  model alone          : {eps['compute_alone']:10.0f} {unit}/s, "
        f"{ms['compute_alone']:8.1f} ms per step (batches held in memory)",
        f"  together             : {eps['together']:10.0f} {unit}/s, "
        f"{ms['together']:8.1f} ms per step, "
        f"{result['input_wait_pct']:.0f}% of the time waiting for input",
        f"  peak host memory     : {memory['peak_host_rss_mb'] / 1024:.1f} GB of "
        f"{memory['host_total_mb'] / 1024:.1f} GB (allocator: "
        f"{memory.get('host_allocator', 'unknown')})",
    ]
    if "padding_fraction" in result:
        batching = result["batching"]
        lines.append(f"  tokens               : {result['real_tokens_per_sec']:10.0f} real "
                     f"tokens/s, {result['padding_fraction']:.0%} of those computed are "
                     f"padding (--batching={batching['mode']}, "
                     f"--tokens_per_batch={batching['tokens_per_batch']})")
        k = batching.get("attention_length")
        if k:  # attention over each row's whole width: the waste padding figures do not show
            width = batching["max_length"] if batching["mode"] == "pack" else None
            lines.append(
                "  attention            : a token attends over its whole row: "
                + (f"{width} positions in packed rows, {width / k:.1f}x its other work"
                   if width else f"rows only as wide as their batch's (K = {k:.0f})")
                + "; predicted compute per real token: " + ", ".join(
                    f"{m} {c:.2f}" for m, c in batching["costs"].items()))
    if result.get("precision"):
        from tfspeed.diagnosis import precision

        lines.append(f"  precision            : {precision.describe(result['precision'])}")
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
    from tfspeed.util import charts

    eps = result["examples_per_sec"]
    stages = result["stages_ms_per_batch"]
    values = [eps["input_alone"], eps["compute_alone"], eps["together"]]
    return charts.bar_chart(path, [
        charts.Panel(["input alone", "model alone", "together"], {"": values},
                     f"{result.get('unit', 'examples')}/s",
                     f"verdict: {result['verdict']}", horizontal=False,
                     colors=["#4c72b0", "#55a868", "#c44e52"]),
        charts.Panel(list(stages), {"": list(stages.values())},
                     "ms per batch added by the stage", "input pipeline stages",
                     colors=["#8172b2"]),
    ], size=(10, 4))
