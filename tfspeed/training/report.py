"""report.json and the human summary of a run."""

from __future__ import annotations

import math
import os

from tfspeed.errors import UsageError
from tfspeed.runtime import backends
from tfspeed.util import system
from tfspeed.util.files import write_json_atomic


class EvaluationDiverged(UsageError):
    """The evaluation loss is NaN/Inf though training's stayed finite; the report and the
    weights are written before it is raised, so nothing of the run is lost."""


def check_evaluation(eval_metrics: dict, model_dir: str) -> None:
    """Raises ``EvaluationDiverged`` if the evaluation loss is not finite: a run whose model
    cannot be evaluated never ends as a success (exit status 0)."""
    loss = (eval_metrics or {}).get("loss")
    if loss is None or math.isfinite(loss):
        return
    raise EvaluationDiverged(
        f"the evaluation loss is {'NaN' if loss != loss else 'Inf'} although training's stayed "
        f"finite; report.json and the weights are in {model_dir}. Look for rows the model "
        "divides by zero (a mask over every token of a sequence: Embedding(mask_zero=True) "
        "treats id 0 as padding) or a layer that behaves otherwise in inference")


def write(model_dir: str, report: dict) -> str:
    """Writes ``model_dir/report.json`` atomically; returns its path."""
    path = os.path.join(model_dir, "report.json")
    write_json_atomic(path, {**report, "versions": system.versions()})
    return path


def summary_lines(report: dict) -> list[str]:
    """A few lines a person reads at the end of a run."""
    evaluated = report.get("eval_metrics") or {}
    shown = "  ".join(f"eval_{name}={value:.4f}" for name, value in sorted(
        evaluated.items(), key=lambda item: item[0] == "loss"))  # the loss last, as before
    lines = [
        (f"{shown}  " if evaluated else "no evaluation split  ")
        + f"updates={report['optimizer_updates']}",
        _throughput_line(report),
    ]
    if report.get("compiled_programs", 0) > 1:  # each new input shape costs a compile
        lines.append(f"training step compiled {report['compiled_programs']} programs (one per "
                     "input shape)")
    if "peak_host_rss_mb" in report:
        lines.append(f"peak host memory: {report['peak_host_rss_mb'] / 1024:.2f} GB")
    runtime = report.get("runtime", {})
    if runtime:
        lines.append(
            f"runtime: {runtime['strategy']} x{runtime['num_replicas']}, "
            f"{runtime['precision']}, xla={'on' if runtime['xla'] else 'off'}"
            + (f", keras on {runtime['backend']}" if runtime.get("backend", backends.DEFAULT)
               != backends.DEFAULT else "")
        )
    return lines


def _throughput_line(report: dict) -> str:
    """The median speed, or why there is none: warm-up (tracing, compilation, profiled and
    probe calls) is never in it, and a run too short to leave enough other steps says so."""
    excluded = report.get("steps_excluded", 0)
    left_out = (f"; {excluded} warm-up step{'s' if excluded > 1 else ''} left out"
                if excluded else "")
    if report.get("too_few_steps"):
        return (f"throughput: too few steps measured ({report['steps_measured']}) for a median"
                f"{left_out}; over all steps: {report['step_time_ms']:.2f} ms/step, warm-up "
                "included")
    if "real_tokens_per_sec" not in report:
        speed = f"{report['batch_examples_per_sec']:.0f} examples/s"
    else:  # token batches: rows are not what was learnt from
        speed = (f"{_thousands(report['real_tokens_per_sec'])} real tokens/s "
                 f"({report['padding_fraction']:.0%} padding), "
                 f"{report['sequences_per_sec']:,.0f} sequences/s")
    return (f"throughput: {speed}, {report['step_time_ms']:.2f} ms/step, {report['input_wait_pct']:.0f}% waiting for "
            f"input (median over {report['steps_measured']} steps{left_out})")


def _thousands(value: float) -> str:
    """41234.5 -> '41k'; below 10,000 the number itself ('3,100')."""
    return f"{value / 1000:,.0f}k" if value >= 10_000 else f"{value:,.0f}"



def resume(config, from_update: int, first: dict, here: dict) -> dict:
    """report.json's ``resume``: the update a rerun restored, and whether a run killed and
    rerun ends with the bits of one never interrupted (``exact``), or why not.

    Args:
      config: the job's config (``--shuffle``, ``--deterministic``).
      from_update: the update restored (0: a fresh start).
      first: the kernels the run's first attempt computed with (``decisions.kernels``).
      here: this process's kernels.

    Returns:
      ``{"from_update", "exact", "why"}``.
    """
    data = config.data
    if data.shuffle and not data.deterministic:
        why = ("no: with shuffle on, parallel input stages hand elements on in the order "
               "they finish; --deterministic fixes the order")
    elif first != here:
        changed = ", ".join(f"{name} {first.get(name)} -> {here.get(name)}"
                            for name in sorted(here) if first.get(name) != here.get(name))
        why = (f"no: the first attempt computed on other kernels ({changed}; oneDNN follows "
               "TF_ENABLE_ONEDNN_OPTS): reductions round differently in the last bits")
    else:
        why = ("yes: the input order is fixed and the kernels are the first attempt's "
               f"({', '.join(f'{k}={v}' for k, v in here.items())})")
    return {"from_update": from_update, "exact": why.startswith("yes"), "why": why}
