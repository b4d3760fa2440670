"""Measurements taken while training, one responsibility each."""

from __future__ import annotations

import statistics
import time

import tensorflow as tf


class ThroughputMeter:
    """Examples/s, step time and the share of time spent waiting for input, per window of
    steps, logged to TensorBoard.

    The trainer calls ``tick`` only where it syncs with the device anyway (at log points),
    so measuring adds no host-device sync per step. The first window holds tracing and
    compilation, so ``summary`` skips it when there are more.

    Args:
      global_batch_size: examples in one step.
      log_dir: if set, scalars go to TensorBoard there.
    """

    def __init__(self, global_batch_size: int, log_dir: str | None = None):
        self.global_batch_size = global_batch_size
        self.windows: list[tuple[int, float, float]] = []  # (steps, seconds, input wait s)
        self.writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._writes: dict = {}  # sorted scalar names -> the compiled write
        self._start = time.perf_counter()

    def restart(self) -> None:
        """Starts a new window now (e.g. after a pause for evaluation or tuning)."""
        self._start = time.perf_counter()

    def tick(self, steps: int, step: int, input_wait_s: float = 0.0,
             also: dict[str, float] | None = None) -> dict[str, float]:
        """Closes a window of ``steps`` steps ending now.

        Args:
          steps: steps in the window.
          step: the global step at its end (the TensorBoard x axis).
          input_wait_s: seconds of the window the step spent waiting for its next batch.
          also: more scalars to log at this step (losses, metrics), in the same write.
        """
        now = time.perf_counter()
        seconds, self._start = now - self._start, now
        self.windows.append((steps, seconds, input_wait_s))
        figures = {"examples_per_sec": steps * self.global_batch_size / seconds,
                   "step_time_ms": 1000 * seconds / steps,
                   "input_wait_pct": 100 * min(input_wait_s / seconds, 1.0)}
        if self.scalars({**figures, **(also or {})}, step):
            # Tracing the write (~0.1-0.2 s, once) is setup, like the first window's tracing:
            # counted in the next window, it took a tiny model's second window to a third of
            # its speed. Every later log point's cost stays in the windows.
            self._start = time.perf_counter()
        return figures

    def scalars(self, values: dict[str, float], step: int) -> bool:
        """Writes ``values`` for TensorBoard in one compiled call; whether it had to trace it.

        One ``tf.summary.scalar`` per value from Python cost ~0.5 ms each: 4 ms per log point,
        6% of a tiny model's window of 100 steps. A function per set of names writes them all
        in one call, called as its concrete function: tf.function's dispatch (signature
        matching, the cache lookup) took 1 of the 1.4 ms a call cost.
        """
        if not self.writer:
            return False
        names = tuple(sorted(values))
        write = self._writes.get(names)
        traced = write is None
        if write is None:
            writer = self.writer

            def scalars(vector, at):
                with writer.as_default(step=at):
                    for i, name in enumerate(names):
                        tf.summary.scalar(name, vector[i])

            write = tf.function(scalars).get_concrete_function(
                tf.TensorSpec([len(names)], tf.float32), tf.TensorSpec([], tf.int64))
            self._writes[names] = write
        write(tf.constant([float(values[name]) for name in names]), tf.constant(step, tf.int64))
        return traced

    def summary(self) -> dict[str, float]:
        """Median step time and examples/s over the windows (the first skipped if possible)."""
        windows = self.windows[1:] if len(self.windows) > 1 else self.windows
        if not windows:
            return {"step_time_ms": 0.0, "examples_per_sec": 0.0, "input_wait_pct": 0.0,
                    "steps_measured": 0}
        step_s = statistics.median(seconds / steps for steps, seconds, _ in windows)
        return {
            "step_time_ms": 1000 * step_s,
            "examples_per_sec": self.global_batch_size / step_s,
            "input_wait_pct": 100 * statistics.median(
                min(wait / seconds, 1.0) for _, seconds, wait in windows),
            "steps_measured": sum(steps for steps, _, _ in windows),
        }
