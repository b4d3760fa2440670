"""TensorBoard-profiler capture of a step window, and a plain-words summary of it.

Keras' ``TensorBoard(profile_batch=...)`` writes traces without step markers, so xprof's
input-pipeline analysis comes out empty ("No step marker observed"). Here every profiled
execution runs inside ``tf.profiler.experimental.Trace("train", step_num=..., _r=1)``, which
gives xprof its steps. The summary is read in-process with ``xprof.convert.raw_to_tool_data``
(no TensorBoard server). Profiling never stops training: failures are logged.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os

from absl import logging

# xprof's own thresholds for the share of step time spent waiting for input.
INPUT_BOUND_HIGH_PCT = 20.0
INPUT_BOUND_MODERATE_PCT = 5.0


class ProfileWindow:
    """Profiles the executions that run steps ``start`` to ``end`` (micro-steps, inclusive).

    Args:
      logdir: TensorBoard log dir; the profile lands in ``logdir/plugins/profile/<run>/``.
      start, end: the step window; ``start`` > 0 skips tracing and warm-up.
    """

    def __init__(self, logdir: str, start: int, end: int):
        self.logdir, self.start, self.end = logdir, start, end
        self.active = False
        self.finished = False
        self.summary: dict = {}

    def covers(self, step: int) -> bool:
        """Whether the step after ``step`` falls in the window (and is still to be captured)."""
        return not self.finished and self.start <= step + 1 <= self.end

    def trace(self, step: int):
        """A context for the step after ``step``; starts the profiler on the first one."""
        if not self.covers(step):
            return contextlib.nullcontext()
        if not self.active:
            self.active = self._call(_start, self.logdir)
            if not self.active:
                self.finished = True
                return contextlib.nullcontext()
        import tensorflow as tf

        return tf.profiler.experimental.Trace("train", step_num=step, _r=1)

    def after(self, step: int) -> None:
        """Called after an execution that ended at ``step``; stops and summarises at the end."""
        if self.active and step >= self.end:
            self.stop()

    def stop(self) -> None:
        if not self.active:
            return
        self.active, self.finished = False, True
        if self._call(_stop):
            self.summary = self._call(summarize, self.logdir) or {}

    @staticmethod
    def _call(fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # a profiler problem must never end training
            logging.warning("profiler: %s failed: %s", fn.__name__, e)
            return None


def _start(logdir: str) -> bool:
    import tensorflow as tf

    tf.profiler.experimental.start(logdir)
    return True


def _stop() -> bool:
    import tensorflow as tf

    tf.profiler.experimental.stop()
    return True


def latest_xplanes(logdir: str) -> list[str]:
    """The ``.xplane.pb`` files of the newest profile run under ``logdir``."""
    runs = sorted(glob.glob(os.path.join(logdir, "plugins", "profile", "*")))
    return sorted(glob.glob(os.path.join(runs[-1], "*.xplane.pb"))) if runs else []


def _tool(paths: list[str], tool: str):
    from xprof.convert import raw_to_tool_data

    data = raw_to_tool_data.xspace_to_tool_data(paths, tool, {})
    data = data[0] if isinstance(data, tuple) else data
    return json.loads(data.decode() if isinstance(data, bytes) else data)


def summarize(logdir: str, top: int = 5) -> dict:
    """Reads the newest profile under ``logdir`` into plain figures.

    Returns:
      ``{"xplane", "steps", "step_time_ms", "input_wait_ms", "input_wait_pct",
      "conclusion", "slowest_input_stages": [{"stage", "self_time_ms", "share_pct"}],
      "top_ops": [{"op", "type", "self_time_us", "share_pct"}]}``; empty if no profile.
    """
    paths = latest_xplanes(logdir)
    if not paths:
        return {}
    summary = {"xplane": paths[0], **_input_pipeline(_tool(paths, "input_pipeline_analyzer"), top)}
    summary["top_ops"] = _top_ops(_tool(paths, "framework_op_stats"), top)
    return summary


def _table(tables: list, column: str) -> dict:
    for table in tables:
        if any(c.get("id") == column for c in table.get("cols", [])):
            return table
    return {"cols": [], "rows": [], "p": {}}


def _rows(table: dict) -> list[dict]:
    ids = [c["id"] for c in table.get("cols", [])]
    return [dict(zip(ids, (cell.get("v") for cell in row["c"]), strict=False))
            for row in table.get("rows", [])]


def _input_pipeline(tables: list, top: int) -> dict:
    steps = _table(tables, "stepTimeMs")
    props = steps.get("p", {})
    step_ms = float(props.get("steptime_ms_average", 0) or 0)
    wait_ms = float(props.get("infeed_time_ms_avg", 0) or 0)
    stages = sorted(_rows(_table(tables, "selfTimeInMs")), key=lambda r: -r["selfTimeInMs"])
    return {
        "steps": len(steps.get("rows", [])),
        "step_time_ms": step_ms,
        "input_wait_ms": wait_ms,
        "input_wait_pct": 100 * wait_ms / step_ms if step_ms else 0.0,
        "conclusion": props.get("input_conclusion", ""),
        "slowest_input_stages": [
            {"stage": r["opName"], "self_time_ms": r["selfTimeInMs"],
             "share_pct": 100 * r["selfTimeInPercent"]} for r in stages[:top]],
    }


def _top_ops(tables: list, top: int) -> list[dict]:
    rows = [r for r in _rows(_table(tables, "total_self_time")) if r["type"] != "IDLE"]
    rows.sort(key=lambda r: -r["total_self_time"])
    total = sum(r["total_self_time"] for r in rows) or 1.0
    return [{"op": r["operation"], "type": r["type"], "self_time_us": r["total_self_time"],
             "share_pct": 100 * r["total_self_time"] / total} for r in rows[:top]]


def summary_lines(summary: dict) -> list[str]:
    """The profile in a few lines a person reads."""
    if not summary:
        return ["profile: nothing captured"]
    lines = [f"profile ({summary['steps']} steps): {summary['step_time_ms']:.1f} ms/step, "
             f"{summary['input_wait_ms']:.1f} ms ({summary['input_wait_pct']:.0f}%) waiting "
             "for input"]
    if summary.get("conclusion"):
        lines.append(f"  xprof: {summary['conclusion']}")
    for stage in summary.get("slowest_input_stages", [])[:3]:
        lines.append(f"  input stage {stage['stage']}: {stage['share_pct']:.0f}% of input time")
    for op in summary.get("top_ops", [])[:3]:
        lines.append(f"  op {op['op']} ({op['type']}): {op['share_pct']:.0f}% of op time")
    return lines
