"""A user's Keras callbacks, called as Keras' own ``fit`` calls them.

Keras' ``fit`` calls ``on_train_begin``; for each epoch ``on_epoch_begin``, then per compiled
call (``steps_per_execution`` batches) ``on_train_batch_begin(first batch)`` and
``on_train_batch_end(last batch, logs)``, the indices counted within the epoch, then
``on_epoch_end(epoch, logs)`` with the epoch's loss and metrics and ``val_*`` where it
evaluated; finally ``on_train_end`` with the last epoch's logs. It stops after the current
call once a callback sets ``model.stop_training``. The trainer's loop ends its calls at epoch
ends when there are callbacks, so each call lies within one epoch. The ``steps_per_execution``
tuner's probe calls (at most 5% of the run, at its start, ``autotune.PROBE_N`` steps each) are
not cut: one may cross an epoch's end, which then ends after it (an epoch shorter than a probe
call may go unannounced). ``keras.callbacks.CallbackList`` dispatches, as in Keras.
"""

from __future__ import annotations

import keras
import numpy as np
from absl import logging


class Callbacks:
    """The Keras callbacks of one training run, told of each call of the engine.

    Args:
      callbacks: ``keras.callbacks.Callback``s (empty: every method does nothing).
      model: the model they see as ``self.model``.
      steps_per_epoch: micro-steps (Keras' batches) in one epoch.
      total: micro-steps of the whole run.
      metric_names: the engine's metrics, after ``loss``, in its outputs.
      sync: makes the model's variables hold the trained values (JAX), before epoch ends.
    """

    def __init__(self, callbacks, model, steps_per_epoch: int, total: int, metric_names,
                 sync=lambda: None):
        self.given = list(callbacks)
        self.model, self.per_epoch, self.total, self.sync = model, steps_per_epoch, total, sync
        self.names = ("loss", *metric_names)
        self.list = keras.callbacks.CallbackList(
            self.given, model=model, epochs=-(-total // steps_per_epoch),
            steps=steps_per_epoch, verbose=0)
        # Batch logs cost a host sync per call: computed only for a callback that reads them.
        self._batch_logs = any(_overrides(c, "on_train_batch_end") or
                               _overrides(c, "on_batch_end") for c in self.given)
        self._epoch = None  # the epoch begun and not yet ended
        self._pending: list = []  # (micro-steps, outputs) of calls not yet summed on the host
        self._sums: dict = {}  # the epoch's sums of each call's means x its micro-steps
        self._steps = 0
        self.last_logs: dict = {}

    def __bool__(self) -> bool:
        return bool(self.given)

    @property
    def stop(self) -> bool:
        """Whether a callback asked training to stop (``model.stop_training``)."""
        return bool(self.given) and bool(getattr(self.model, "stop_training", False))

    def train_begin(self) -> None:
        if self.given:
            self.model.stop_training = False
            self.list.on_train_begin()

    def call(self, done: int, n: int, run, end_epoch: bool = False) -> dict:
        """Runs ``run()``, a call of ``n`` micro-steps from ``done``, between its batch hooks
        (none for a call of no step); ``end_epoch``: ends the epoch it finished, if any."""
        if n:
            self.before_call(done)
        out = run()
        if n:
            self.after_call(done + n, n, out)
            if end_epoch and self.epoch_ends(done + n, n):
                self.end_epoch()
        return out

    def before_call(self, done: int) -> None:
        """Before a call that starts at micro-step ``done``: a new epoch begins there."""
        if not self.given:
            return
        if self._epoch is None:
            self._epoch = done // self.per_epoch
            self._pending, self._sums, self._steps = [], dict.fromkeys(self.names, 0.0), 0
            self.list.on_epoch_begin(self._epoch)
        self.list.on_train_batch_begin(done % self.per_epoch)

    def after_call(self, done: int, n: int, out: dict) -> None:
        """After a call of ``n`` micro-steps that ended at ``done``."""
        if not self.given or not n:
            return
        self._pending.append((n, {name: out[name] for name in self.names}))
        logs = self._means() if self._batch_logs else None
        self.list.on_train_batch_end((done - 1) % self.per_epoch, logs)

    def epoch_ends(self, done: int, n: int) -> bool:
        """Whether the call of ``n`` micro-steps that ended at ``done`` finished an epoch
        before the run's end (the last epoch ends after the final evaluation)."""
        return bool(self.given) and done < self.total and (
            done // self.per_epoch > (done - n) // self.per_epoch)

    def end_epoch(self, evaluated: dict | None = None) -> None:
        """Ends the epoch begun (a last one may be cut short by the run's end or a stop):
        its logs are the means of its calls' loss and metrics, with ``val_*`` of
        ``evaluated``."""
        if self._epoch is None:
            return
        self.sync()
        logs = {**self._means(),
                **{f"val_{name}": value for name, value in (evaluated or {}).items()}}
        epoch, self._epoch = self._epoch, None
        self.list.on_epoch_end(epoch, logs)
        self.last_logs = logs

    def train_end(self, logs: dict) -> None:
        """The end of training: ``logs`` where no epoch ended (nothing was trained)."""
        if self.stop:  # a rerun on the same model_dir would resume and train on
            logging.info("a callback set model.stop_training: the run ended early, its "
                         "checkpoint and report saved")
        if self.given:
            self.list.on_train_end(self.last_logs or logs)

    def _means(self) -> dict:
        """The epoch's loss and metrics so far: each call's means weighted by its
        micro-steps (Keras' running means, for batches of equal weight). Reads the calls'
        outputs on the host: a sync, at an epoch's end or for a callback that reads batches."""
        for n, out in self._pending:
            self._steps += n
            for name in self.names:
                self._sums[name] += n * float(np.asarray(out[name]))
        self._pending = []
        return {name: total / max(self._steps, 1) for name, total in self._sums.items()}


def _overrides(callback, method: str) -> bool:
    """Whether ``callback`` has its own ``method`` (a subclass's or ``LambdaCallback``'s):
    Keras marks the base class's empty hooks ``_is_default``, and tests them the same way."""
    return not getattr(getattr(callback, method), "_is_default", False)
