"""Measurements taken while training, one responsibility each."""

from __future__ import annotations

import statistics
import time

import tensorflow as tf


class ThroughputMeter:
    """Batch examples/s, step time and the share of time spent waiting for input, per window
    of steps, logged to TensorBoard.

    The trainer calls ``tick`` only where it syncs with the device anyway (at log points),
    so measuring adds no host-device sync per step. Calls that are not the steady state
    (the one that traces and compiles the step, profiled ones) it syncs once and hands to
    ``exclude``: counted in a window, the trace alone made a short digits run report
    several times its real step time. ``summary`` is the median over the measured windows
    only, and says when too few steps remain for it (``MIN_STEPS``).

    One figure, one meaning: ``batch_examples_per_sec`` is the batch size times steps/s,
    for batches of a fixed number of examples. Token batches hold a varying number of
    sequences: they add ``tokens`` to each window, ``(real, computed, sequences)``, and
    report ``real_tokens_per_sec`` and ``sequences_per_sec`` (counted) instead, medians over
    the measured windows the same way; the padding fraction (1 - real / computed) is over
    the whole run.

    Args:
      global_batch_size: examples in one step.
      log_dir: if set, scalars go to TensorBoard there.
    """

    MIN_STEPS = 10  # fewer measured steps make no median worth reporting

    def __init__(self, global_batch_size: int, log_dir: str | None = None):
        self.global_batch_size = global_batch_size
        self.windows: list[tuple[int, float, float]] = []  # (steps, seconds, input wait s)
        self.excluded: list[tuple[int, float, float]] = []  # warm-up, the same way
        self.window_tokens: list[tuple[int, int, int]] = []  # per window: real, computed, seqs
        self.excluded_tokens: list[tuple[int, int, int]] = []
        self.writer = tf.summary.create_file_writer(log_dir) if log_dir else None
        self._writes: dict = {}  # sorted scalar names -> the compiled write
        self._start = time.perf_counter()

    def restart(self) -> None:
        """Starts a new window now (e.g. after a pause for evaluation or tuning)."""
        self._start = time.perf_counter()

    def exclude(self, steps: int, input_wait_s: float = 0.0,
                tokens: tuple[int, int, int] = (0, 0, 0)) -> None:
        """The ``steps`` steps since the last tick are warm-up: kept out of the figures (but
        their ``tokens`` count in the padding fraction); a new window starts now. The caller
        has waited for them to finish."""
        now = time.perf_counter()
        self.excluded.append((steps, now - self._start, input_wait_s))
        self.excluded_tokens.append(tuple(tokens))
        self._start = now

    def close(self, steps: int, input_wait_s: float = 0.0,
              tokens: tuple[int, int, int] = (0, 0, 0)) -> dict[str, float]:
        """Closes a measured window of ``steps`` steps ending now, without logging it (before
        a call to ``exclude``); returns its figures, like ``tick``."""
        now = time.perf_counter()
        seconds, self._start = now - self._start, now
        if not steps:
            return {}
        self.windows.append((steps, seconds, input_wait_s))
        self.window_tokens.append(tuple(tokens))
        return _one_rate({**_figures(steps, seconds, input_wait_s, self.global_batch_size),
                          **_token_figures(*tokens, seconds)})

    def tick(self, steps: int, step: int, input_wait_s: float = 0.0,
             also: dict[str, float] | None = None,
             tokens: tuple[int, int, int] = (0, 0, 0)) -> dict[str, float]:
        """Closes a window of ``steps`` steps ending now.

        Args:
          steps: steps in the window; 0 (all were excluded) logs only ``also``.
          step: the global step at its end (the TensorBoard x axis).
          input_wait_s: seconds of the window the step spent waiting for its next batch.
          also: more scalars to log at this step (losses, metrics), in the same write.
          tokens: ``(real, computed, sequences)`` of the window's token batches.

        Returns:
          ``batch_examples_per_sec`` (token batches: ``real_tokens_per_sec``,
          ``sequences_per_sec`` and ``padding_fraction`` instead), ``step_time_ms`` and
          ``input_wait_pct`` of the window (empty for a window of 0 steps).
        """
        figures = self.close(steps, input_wait_s, tokens)
        if self.scalars({**figures, **(also or {})}, step):
            # Tracing the write (once) is setup, like the first window's tracing: counted
            # in the next window, it cut a tiny model's second window to a fraction of its
            # speed. Every later log point's cost stays in the windows.
            self._start = time.perf_counter()
        return figures

    def scalars(self, values: dict[str, float], step: int) -> bool:
        """Writes ``values`` for TensorBoard in one compiled call; whether it had to trace it.

        One ``tf.summary.scalar`` per value from Python cost a tiny model a visible share of
        its window of 100 steps. A function per set of names writes them all in one call,
        called as its concrete function: tf.function's dispatch (signature matching, the
        cache lookup) was most of what a call cost (measured once on 2 cores, not
        benchmarked).
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

            write = tf.function(scalars, autograph=False).get_concrete_function(
                tf.TensorSpec([len(names)], tf.float32), tf.TensorSpec([], tf.int64))
            self._writes[names] = write
        write(tf.constant([float(values[name]) for name in names]), tf.constant(step, tf.int64))
        return traced

    def summary(self) -> dict:
        """Median step time and batch examples/s over the measured windows.

        Returns:
          ``step_time_ms``, ``batch_examples_per_sec``, ``input_wait_pct``, ``steps_measured``,
          ``steps_excluded`` (warm-up), ``seconds_measured`` (the measured windows' time),
          ``seconds_excluded`` (warm-up's: the call that traced, probes) and
          ``too_few_steps`` (fewer than ``MIN_STEPS`` measured: the figures are then over
          all steps, warm-up included, and no median); for token batches, instead of
          ``batch_examples_per_sec``, ``real_tokens_per_sec`` and ``sequences_per_sec`` (the
          same way), and ``padding_fraction``
          (over every step of the run, warm-up included), ``real_tokens_measured`` (in
          the measured windows: over ``seconds_measured``, a whole-run rate without warm-up)
          and ``real_tokens`` (every step's).
        """
        measured = sum(steps for steps, _, _ in self.windows)
        excluded = sum(steps for steps, _, _ in self.excluded)
        windows = self.windows if measured >= self.MIN_STEPS else self.windows + self.excluded
        summary = {"step_time_ms": 0.0, "batch_examples_per_sec": 0.0, "input_wait_pct": 0.0}
        if measured < self.MIN_STEPS and windows:  # one figure over everything there is
            summary = _figures(*(sum(w[i] for w in windows) for i in range(3)),
                               self.global_batch_size)
        elif windows:
            step_s = statistics.median(seconds / steps for steps, seconds, _ in windows)
            summary = {
                "step_time_ms": 1000 * step_s,
                "batch_examples_per_sec": self.global_batch_size / step_s,
                "input_wait_pct": 100 * statistics.median(
                    min(wait / seconds, 1.0) for _, seconds, wait in windows),
            }
        return _one_rate({
            **summary, **self._token_summary(measured >= self.MIN_STEPS),
            "steps_measured": measured, "steps_excluded": excluded,
            "seconds_measured": sum(seconds for _, seconds, _ in self.windows),
            "seconds_excluded": sum(seconds for _, seconds, _ in self.excluded),
            "too_few_steps": measured < self.MIN_STEPS})

    def _token_summary(self, enough: bool) -> dict:
        everything = self.window_tokens + self.excluded_tokens
        real, computed, sequences = (sum(t[i] for t in everything) for i in range(3))
        if not computed:
            return {}
        if enough:
            pairs = list(zip(self.window_tokens, self.windows, strict=True))
            rates = {"real_tokens_per_sec": statistics.median(
                         t[0] / max(w[1], 1e-9) for t, w in pairs),
                     "sequences_per_sec": statistics.median(
                         t[2] / max(w[1], 1e-9) for t, w in pairs)}
        else:  # over everything there is, as the other figures
            seconds = sum(w[1] for w in self.windows + self.excluded)
            rates = _token_figures(real, computed, sequences, seconds)
        return {**rates, "padding_fraction": 1.0 - real / computed,
                "real_tokens_measured": sum(t[0] for t in self.window_tokens),
                "real_tokens": real}


def _one_rate(figures: dict) -> dict:
    """Token batches hold a varying number of sequences: the batch size over the step time
    means nothing there, and their rate is ``sequences_per_sec``."""
    if "sequences_per_sec" in figures:
        figures.pop("batch_examples_per_sec", None)
    return figures


def _token_figures(real: int, computed: int, sequences: int, seconds: float) -> dict:
    if not computed:
        return {}
    seconds = max(seconds, 1e-9)
    return {"real_tokens_per_sec": real / seconds, "sequences_per_sec": sequences / seconds,
            "padding_fraction": 1.0 - real / computed}


def _figures(steps: int, seconds: float, input_wait_s: float, batch: int) -> dict[str, float]:
    seconds = max(seconds, 1e-9)
    return {"batch_examples_per_sec": steps * batch / seconds,
            "step_time_ms": 1000 * seconds / steps,
            "input_wait_pct": 100 * min(input_wait_s / seconds, 1.0)}
