"""Measurement callbacks, one responsibility each."""

from __future__ import annotations

import statistics
import time

import keras
import tensorflow as tf


class ThroughputMeter(keras.callbacks.Callback):
    """Logs examples/s and step time every ``log_every`` steps, without a per-step host sync.

    Keras calls ``on_train_batch_end`` once per execution (``steps_per_execution`` steps);
    the wall clock between calls over a window of steps gives the step time. The first
    window holds tracing and compilation, so summaries skip it when there are more.

    Args:
      global_batch_size: examples in one step.
      log_every: steps per measurement window.
      log_dir: if set, scalars go to TensorBoard there.
    """

    def __init__(self, global_batch_size: int, log_every: int = 50, log_dir: str | None = None):
        super().__init__()
        self.global_batch_size = global_batch_size
        self.log_every = log_every
        self.windows: list[tuple[int, float]] = []  # (steps, seconds)
        self._writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._steps = 0
        self._window_steps = 0
        self._window_start: float | None = None
        self._epoch_steps = 0

    def on_train_begin(self, logs=None):
        self._window_start = time.perf_counter()

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch_steps = 0

    def on_train_batch_end(self, batch, logs=None):
        # ``batch`` is the index of the execution's last step within the epoch.
        steps = batch + 1 - self._epoch_steps
        self._epoch_steps = batch + 1
        self._steps += steps
        self._window_steps += steps
        if self._window_steps >= self.log_every:
            self._close_window()

    def on_train_end(self, logs=None):
        if self._window_steps:
            self._close_window()
        if self._writer:
            self._writer.flush()

    def _close_window(self):
        now = time.perf_counter()
        seconds = now - self._window_start
        self.windows.append((self._window_steps, seconds))
        if self._writer:
            with self._writer.as_default(step=self._steps):
                tf.summary.scalar("examples_per_sec", self._window_steps * self.global_batch_size / seconds)
                tf.summary.scalar("step_time_ms", 1000 * seconds / self._window_steps)
        self._window_steps = 0
        self._window_start = now

    def summary(self) -> dict[str, float]:
        """Median step time and examples/s over the windows (the first skipped if possible)."""
        windows = self.windows[1:] if len(self.windows) > 1 else self.windows
        if not windows:
            return {"step_time_ms": 0.0, "examples_per_sec": 0.0, "steps_measured": 0}
        step_s = statistics.median(seconds / steps for steps, seconds in windows)
        return {
            "step_time_ms": 1000 * step_s,
            "examples_per_sec": self.global_batch_size / step_s,
            "steps_measured": sum(steps for steps, _ in windows),
        }


class StopAtStep(keras.callbacks.Callback):
    """Stops training once the optimizer has made ``updates`` updates."""

    def __init__(self, updates: int):
        super().__init__()
        self.updates = updates

    def on_train_batch_end(self, batch, logs=None):
        if int(self.model.optimizer.iterations.numpy()) >= self.updates:
            self.model.stop_training = True
