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
import statistics

from absl import logging

# xprof leaves the first and the last step it sees out of its analysis (they may be cut
# off): one traced step on each side of the window, named apart, keeps the window whole.
EDGE_STEPS = 1
EDGE_NAME = "train_edge"
# xprof's own thresholds for the share of step time spent waiting for input.
INPUT_BOUND_HIGH_PCT = 20.0
INPUT_BOUND_MODERATE_PCT = 5.0


class ProfileWindow:
    """Profiles micro-steps ``start`` to ``end`` (1-based, inclusive), each step in its own call.

    The trainer runs many steps per call (``steps_per_execution``), and a call that ran across
    the window's edges would hide the window inside it. ``limit`` cuts calls at the edges
    instead: the call before the window ends just before it, each step of the window runs as
    a call of its own inside ``Trace("train", step_num=step)`` (xprof needs a marker per step;
    ``step`` counts from 1), and the calls after it go on at full size. One step on each side
    is traced too, as ``EDGE_NAME``: xprof drops the first and last step it sees, and the
    step before also takes the one-step function's tracing out of the window.

    Args:
      logdir: TensorBoard log dir; the profile lands in ``logdir/plugins/profile/<run>/``.
      start, end: the step window; ``start`` > 1 keeps tracing and warm-up out of it.
    """

    def __init__(self, logdir: str, start: int, end: int):
        self.logdir, self.start, self.end = logdir, start, end
        self.active = False
        self.finished = False
        self.traced: list[int] = []  # the steps that ran inside a step marker
        self.failure = ""
        self.summary: dict = {}

    @property
    def first(self) -> int:
        """The first step traced: the window's, or the edge step before it."""
        return max(self.start - EDGE_STEPS, 1)

    @property
    def last(self) -> int:
        """The last step traced: the edge step after the window."""
        return self.end + EDGE_STEPS

    def limit(self, done: int, steps: int) -> int:
        """How many of the next ``steps`` steps (after ``done``) one call may run."""
        if self.finished or done >= self.last:
            return steps
        if done + 1 >= self.first:
            return 1
        return min(steps, self.first - 1 - done)

    def covers(self, step: int) -> bool:
        """Whether the step after ``step`` is to be traced: in the window or on its edge."""
        return not self.finished and self.first <= step + 1 <= self.last

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

        if self.start <= step + 1 <= self.end:
            self.traced.append(step + 1)
            return tf.profiler.experimental.Trace("train", step_num=step + 1, _r=1)
        return tf.profiler.experimental.Trace(EDGE_NAME, step_num=step + 1, _r=1)

    def after(self, step: int) -> None:
        """Called after an execution that ended at ``step``; stops and summarises at the end."""
        if self.active and step >= self.last:
            self.stop(step)

    def stop(self, done: int | None = None) -> None:
        """Ends the capture (the run ended at step ``done``) and fills ``summary``."""
        done = done if done is not None else (self.traced[-1] if self.traced else 0)
        was_active, self.active, self.finished = self.active, False, True
        if was_active and self._call(_stop):
            self.summary = self._call(summarize, self.logdir) or {}
        self.summary = {**self._capture(done), **self.summary}

    def _capture(self, done: int) -> dict:
        """What was captured and how, for report.json and ``summary_lines``."""
        entry = {"window": [self.start, self.end],
                 "captured": [self.traced[0], self.traced[-1]] if self.traced else []}
        if self.traced:
            entry["calls"] = ("cut at the window's edges: each step of the window ran as "
                              "its own traced call")
        if self.failure:
            entry["reason"] = f"the profiler failed: {self.failure}"
        elif not self.traced:
            entry["reason"] = (f"the run ended at step {done}, before the window"
                               if done < self.start else
                               f"the run resumed at step {done}, past the window")
        elif self.traced[-1] < self.end:
            entry["reason"] = f"the run ended at step {done}, inside the window"
        return entry

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # a profiler problem must never end training
            logging.warning("profiler: %s failed: %s", fn.__name__, e)
            self.failure = self.failure or f"{fn.__name__}: {e}"
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


def step_markers(xplane: str, name: str = "train") -> list[int]:
    """The ``step_num`` of each ``Trace(name, step_num=...)`` event in an ``.xplane.pb``: the
    markers xprof's step analysis is built from, read straight from the file."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    space = xplane_pb2.XSpace()
    with open(xplane, "rb") as f:
        space.ParseFromString(f.read())
    steps = set()
    for plane in space.planes:
        event_ids = {i for i, m in plane.event_metadata.items() if m.name == name}
        step_ids = {i for i, m in plane.stat_metadata.items() if m.name == "step_num"}
        for line in plane.lines:
            for event in line.events:
                if event.metadata_id in event_ids:
                    steps.update(stat.int64_value or stat.uint64_value
                                 for stat in event.stats if stat.metadata_id in step_ids)
    return sorted(steps)


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
    # xprof keeps or drops the edge steps (the first and last it saw) case by case, and the
    # first edge step holds the one-step function's tracing: the figures are the window's
    # steps only (xprof's own averages are the means of these rows).
    window = [r for r in _rows(steps) if str(r.get("stepnum", "")).split(" ")[0] != EDGE_NAME]
    if window and all("stepTimeMs" in r and "infeedTimeMs" in r for r in window):
        step_ms = statistics.fmean(float(r["stepTimeMs"]) for r in window)
        wait_ms = statistics.fmean(float(r["infeedTimeMs"]) for r in window)
    else:
        step_ms = float(props.get("steptime_ms_average", 0) or 0)
        wait_ms = float(props.get("infeed_time_ms_avg", 0) or 0)
    stages = sorted(_rows(_table(tables, "selfTimeInMs")), key=lambda r: -r["selfTimeInMs"])
    return {
        "steps": len(window),
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
    if not summary.get("captured"):
        reason = summary.get("reason", "")
        if reason.startswith("the profiler failed"):
            return [f"profile: {reason}"]
        return [f"profile: nothing captured ({reason})" if reason else "profile: nothing captured"]
    first, last = summary["captured"]
    lines = [f"profile of steps {first}-{last}: calls {summary['calls']}"]
    if summary.get("reason"):
        lines.append(f"  {summary['reason']}")
    if "steps" not in summary:
        return [*lines, "  xprof could not read the profile (see the log)"]
    lines.append(f"  xprof ({summary['steps']} steps): {summary['step_time_ms']:.1f} ms/step, "
                 f"{summary['input_wait_ms']:.1f} ms ({summary['input_wait_pct']:.0f}%) waiting "
                 "for input")
    if summary.get("conclusion"):
        lines.append(f"  xprof: {summary['conclusion']}")
    for stage in summary.get("slowest_input_stages", [])[:3]:
        lines.append(f"  input stage {stage['stage']}: {stage['share_pct']:.0f}% of input time")
    for op in summary.get("top_ops", [])[:3]:
        lines.append(f"  op {op['op']} ({op['type']}): {op['share_pct']:.0f}% of op time")
    return lines
