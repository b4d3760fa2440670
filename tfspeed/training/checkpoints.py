"""Checkpoints of a training run: weights, optimizer, engine state and the input position.

Written every ``checkpoint_every`` updates under ``model_dir/checkpoints`` (the last few
kept), never from a diverged state, and restored from the newest one that restores: a
damaged one is moved to ``checkpoints/damaged/`` and costs only the updates since the one
before it.
"""

from __future__ import annotations

import glob
import json
import os
import time

import numpy as np
import tensorflow as tf
from absl import logging

from tfspeed.config import TrainConfig, is_auto
from tfspeed.data import ingraph
from tfspeed.errors import UsageError, storage_error
from tfspeed.training.engine import Engine


def _damaged(error: Exception) -> bool:
    """Whether a restore failed on damaged files: DataLossError for a bad checksum, a plain
    OpError from TF's checkpoint reader (bad index, missing data file), IndexError for a
    truncated data file, OutOfRangeError for a damaged length ("Read less bytes than
    requested"). Not a checkpoint of another model, nor a resource problem."""
    return (isinstance(error, (tf.errors.DataLossError, tf.errors.OutOfRangeError, IndexError))
            or type(error) is tf.errors.OpError)


def _reason(error: Exception) -> str:
    """The first line of a TF error, without its graph-node prefix and op suffix."""
    text = str(getattr(error, "message", error)).split("}}")[-1].split("[Op:")[0].strip()
    return (text.splitlines() or [type(error).__name__])[0][:200]


def _write_state(directory: str, paths: list[str], stamps: list[float],
                 last_preserved: float) -> None:
    """Atomically writes the ``checkpoint`` state file as ``CheckpointManager`` does: a
    ``CheckpointState`` in text format, paths relative to ``directory``. (TF's own writer,
    ``update_checkpoint_state``, is deprecated and says so in four lines of log.)"""
    names = [os.path.basename(p) for p in paths]
    lines = [f"model_checkpoint_path: {json.dumps(names[-1])}"]
    lines += [f"all_model_checkpoint_paths: {json.dumps(name)}" for name in names]
    lines += [f"all_model_checkpoint_timestamps: {stamp!r}" for stamp in stamps]
    lines.append(f"last_preserved_timestamp: {last_preserved!r}")
    path = os.path.join(directory, "checkpoint")
    with open(f"{path}.tmp-{os.getpid()}", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(f"{path}.tmp-{os.getpid()}", path)


class LossDiverged(UsageError):
    """The training loss or the weights became NaN/Inf; nothing of it was checkpointed."""


class Checkpoints:
    """Model, optimizer, engine state (accumulators, counters, loss scale) and the input
    position under ``model_dir/checkpoints``, every ``checkpoint_every`` updates, keeping
    the last few. Never saves a diverged state (``LossDiverged`` instead)."""

    def __init__(self, engine: Engine, model_dir: str, config: TrainConfig, iterator,
                 write_dir: str | None = None, asynchronous: bool = True):
        """Args:
          engine: the training state.
          model_dir: the run directory; checkpoints are restored from its ``checkpoints``.
          config: how often and how many to keep.
          iterator: the input iterator, saved too where tf.data can.
          write_dir: where this process writes checkpoints, if not ``model_dir``: every
            worker of a multi-worker job must save (saving reads synchronised variables
            with collectives), but only the chief into the run directory.
          asynchronous: write checkpoints in a background thread.
        """
        self.engine = engine
        # auto: by the clock, at log points (where every worker of a job agrees on it).
        self.every = 0 if is_auto(config.checkpoint_every) else config.checkpoint_every
        self.seconds = config.checkpoint_seconds if is_auto(config.checkpoint_every) else 0.0
        self._saved_at = time.monotonic()
        self.directory = os.path.join(model_dir, "checkpoints")
        self.write_directory = os.path.join(write_dir or model_dir, "checkpoints")
        self.asynchronous = asynchronous
        self.keep = config.keep_checkpoints
        self.k = config.grad_accum_steps
        # In-graph input: the position is the engine's micro-step, restored with the rest.
        self.in_graph = ingraph.is_in_step(iterator)
        try:
            self._track(None if self.in_graph else iterator)
        except ValueError:
            # MirroredStrategy's DistributedIterator (and its MultiDeviceIterator) are not
            # trackable in TF 2.21; only the default strategy's plain iterator is.
            self._track(None, f"{type(iterator).__name__} cannot be checkpointed")
        self._set_options()
        self.last_saved = -1

    @property
    def restores_position(self) -> bool:
        """Whether a restore puts the input back where it was (else: fast-forward it)."""
        return self.has_iterator or self.in_graph

    def _set_options(self) -> None:
        # Async: the step goes on while the checkpoint is written from a copy of the values.
        # Not with the input position in it: the iterator's state is serialised by the
        # writer thread, later than the weights were copied, so the two would disagree.
        self.options = tf.train.CheckpointOptions(
            enable_async=self.asynchronous and not self.has_iterator)

    def _track(self, iterator, why: str = "") -> None:
        items = {"state": self.engine.checkpoint_state()}
        self.has_iterator = iterator is not None
        if iterator is not None:
            items["iterator"] = iterator
        elif why:
            logging.warning("the input position is not checkpointed (%s): a resumed run "
                            "skips to the same step of the epoch instead", why)
        self.checkpoint = tf.train.Checkpoint(**items)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.write_directory,
                                                  max_to_keep=self.keep)

    def restore(self) -> int:
        """Restores the newest checkpoint that restores, if any; returns its update (0 if none).

        A checkpoint that fails to restore (a flipped byte, a truncated file: TF checks every
        tensor's checksum) costs only itself: it is moved to ``checkpoints/damaged/`` with
        one warning and the next older one is tried. Each restore assigns every saved
        variable and the input position, so nothing of a half-restored damaged one remains.

        Raises:
          UsageError: checkpoints exist, but none of them restores.
        """
        # The manager records a checkpoint in the ``checkpoint`` state file (atomically) only
        # after its files are written, even when saving async; a lost file still falls back.
        state = tf.train.get_checkpoint_state(self.directory)
        listed = list(state.all_model_checkpoint_paths) if state else []
        complete = [p for p in listed if tf.io.gfile.exists(p + ".index")]
        damaged = {}
        for path in reversed(complete):
            try:
                self._restore(path)
                break
            except (tf.errors.OpError, IndexError) as e:
                if not _damaged(e):
                    raise
                damaged[path] = _reason(e)
        else:
            if damaged:  # left in place: a rerun must not silently start from scratch
                newest, reason = next(iter(damaged.items()))
                raise UsageError(
                    f"no checkpoint in {self.directory} restores: all {len(damaged)} are "
                    f"damaged (newest {os.path.basename(newest)}: {reason}); move that "
                    "directory away to train from scratch, or use another --model_dir")
            return 0
        if damaged:
            self._set_aside(damaged, state, [p for p in complete if p not in damaged])
        self.engine.after_restore()
        updates = int(self.engine.updates)
        logging.info("resumed from %s at update %d", path, updates)
        self.last_saved = updates
        return updates

    def _restore(self, path: str) -> None:
        # Restore creates the save counter after reading: a failed restore would leave it
        # unmatched, and TF would warn about it (several lines) when the status is dropped.
        self.checkpoint.save_counter  # noqa: B018 -- creates it
        try:
            self.checkpoint.restore(path).assert_existing_objects_matched()
        except AssertionError:
            if not self.has_iterator:
                raise
            # Written by a run that could not save its input position (another strategy, or
            # a pipeline tf.data cannot save): restore the rest, fast-forward the input.
            self._track(None, f"{os.path.basename(path)} holds no input position")
            self.checkpoint.restore(path).assert_existing_objects_matched()

    def _set_aside(self, damaged: dict[str, str], state, kept: list[str]) -> None:
        """Moves damaged checkpoints to ``damaged/``, one warning each, and rewrites the
        ``checkpoint`` state file without them. A manager that still counted them would keep
        fewer good checkpoints than ``keep_checkpoints`` and later try to delete them, so a
        new one reads the new state. Only the chief: the other workers read its directory."""
        if self.write_directory != self.directory:
            for path, reason in damaged.items():
                logging.warning("checkpoint %s does not restore (%s); resumed from an older "
                                "one", path, reason)
            return
        aside = os.path.join(self.directory, "damaged")
        os.makedirs(aside, exist_ok=True)
        for path, reason in damaged.items():
            for file in glob.glob(glob.escape(path) + ".*"):
                os.replace(file, os.path.join(aside, os.path.basename(file)))
            logging.warning("checkpoint %s does not restore (%s); moved it to %s and resumed "
                            "from %s", path, reason, aside, os.path.basename(kept[-1]))
        stamps = dict(zip(state.all_model_checkpoint_paths, state.all_model_checkpoint_timestamps,
                          strict=False))
        _write_state(self.directory, kept, [stamps[p] for p in kept] if stamps else [],
                     state.last_preserved_timestamp)
        self.manager = tf.train.CheckpointManager(self.checkpoint, self.write_directory,
                                                  max_to_keep=self.keep)

    def maybe_save(self, updates: int) -> None:
        """Saves every ``checkpoint_every`` updates (call after each call of steps)."""
        if self.every and updates // self.every > max(self.last_saved, 0) // self.every:
            self._save(updates)

    def maybe_save_in_time(self, updates: int, agree=lambda seconds: seconds) -> None:
        """``checkpoint_every=auto``: saves once ``checkpoint_seconds`` have passed since the
        last save (call at log points; ``agree`` makes every worker of a multi-worker job
        take the same decision: a save holds collectives)."""
        if self.seconds and agree(time.monotonic() - self._saved_at) >= self.seconds:
            self._save(updates)

    def save(self, final: bool = False) -> None:
        updates = int(self.engine.updates)
        if updates != self.last_saved:
            self._save(updates)
        if final:
            self.checkpoint.sync()  # the async writer must finish before the process exits

    def check_finite(self, weights: bool = True) -> None:
        """Raises ``LossDiverged`` if a loss since the start, or (``weights``) any weight, is
        NaN/Inf.

        One host sync; called at log points (the loss only: scanning every weight there cost
        a visible share of a tiny model's log window) and before each save (the weights too: a
        checkpoint never holds a diverged state), never per step.
        """
        step, loss = (np.asarray(t) for t in self.engine.first_nonfinite_loss)
        if step:
            what = (f"loss became {'NaN' if loss != loss else 'Inf'} at update "
                    f"{(step - 1) // self.k + 1} (micro-step {step})")
        elif weights and not self.engine.all_finite():
            updates = int(self.engine.updates)
            what = f"the weights became NaN/Inf by update {updates}"
        else:
            return
        self.checkpoint.sync()
        good = self.manager.latest_checkpoint
        where = (f"the last good checkpoint is {os.path.basename(good)}" if good
                 else "no checkpoint was written")
        raise LossDiverged(f"{what}; {where} — lower --learning_rate or check the data")

    def _save(self, updates: int) -> None:
        self.check_finite()
        self._saved_at = time.monotonic()
        self.engine.before_save()
        try:
            self.manager.save(checkpoint_number=updates, options=self.options)
        except tf.errors.OpError as e:
            # tf.data refuses to save some pipelines (a py_function: "EagerPyFunc is
            # stateful"; symbolic checkpoints through cache()); nothing was written.
            if not self.has_iterator or storage_error(e):
                raise  # a full or read-only disk is the user's to fix, not a pipeline limit
            reason = e.message.split("}}")[-1].split("[Op:")[0].strip()
            self._track(None, f"tf.data cannot save this pipeline: {reason}")
            self.manager.save(checkpoint_number=updates, options=self.options)
        except ValueError as e:
            if not self.options.experimental_enable_async_checkpoint:
                raise
            # TF 2.21 + Keras 3: the second async save fails while copying Keras variables to
            # the CPU ("tf.function only supports singleton tf.Variables"). Nothing was
            # written; save synchronously from now on.
            logging.warning("async checkpointing failed (%s); saving synchronously", e)
            self.options = tf.train.CheckpointOptions()
            self.manager.save(checkpoint_number=updates, options=self.options)
        self.last_saved = updates


MODEL_FILE = "model.keras"
WEIGHTS_FILE = "model.weights.h5"


def export_model(model, model_dir: str) -> dict:
    """Writes the trained model where a run ends: ``model.weights.h5`` always (any built
    model saves its weights), ``model.keras`` where the model serialises. A subclassed model
    without ``get_config`` does not; that costs one warning line, never the run.

    Each file is written under a temporary name and renamed, so a killed save never looks
    finished.

    Returns:
      What was written, for report.json: ``{"weights": path, "model": path or None}`` and,
      where ``model.keras`` could not be written, ``"model_not_saved"``: the reason and how
      to reload the weights instead.
    """
    weights = os.path.join(model_dir, WEIGHTS_FILE)
    tmp = os.path.join(model_dir, f"model.tmp-{os.getpid()}.weights.h5")
    model.save_weights(tmp)
    os.replace(tmp, weights)
    out = {"weights": weights, "model": None}
    path = os.path.join(model_dir, MODEL_FILE)
    tmp = os.path.join(model_dir, f"model.tmp-{os.getpid()}.keras")
    try:
        model.save(tmp)
    except Exception as e:  # noqa: BLE001 -- Keras raises many kinds for what will not serialise
        if os.path.exists(tmp):
            os.remove(tmp)
        why = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        out["model_not_saved"] = (
            f"{MODEL_FILE} not written ({type(e).__name__}: {why}); give the model a "
            f"get_config(), or rebuild it with your function and load {WEIGHTS_FILE} "
            "(model.load_weights)")
        logging.warning("%s", out["model_not_saved"])
        return out
    os.replace(tmp, path)
    out["model"] = path
    return out
