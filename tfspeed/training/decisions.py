"""Choices a run makes by measuring, recorded once and reused when the run is resumed.

``--precision=auto`` (on a host with native bfloat16, or ``measure``), ``--batching=auto``
(where it times bucket against pack) and ``--steps_per_execution=auto`` time the model on
this machine. A killed run, rerun, must not time them again: the probes cost their time
a second time (~80 s for the default text job on 2 cores), and timings on a shared machine
are noisy, so a second measurement can pick the other precision or batching and the
resumed run then trains a different computation than the checkpoint's. The first run
writes each choice to ``MODEL_DIR/checkpoints/decisions.json`` (beside the state that
depends on it: removing the checkpoints starts the run, and its decisions, afresh); a
rerun of the same job reads them back and its report says "reused from the first run".
"""

from __future__ import annotations

import hashlib
import json
import os

from absl import logging

from tfspeed import plan
from tfspeed.util.files import write_json_atomic

FILE = "decisions.json"
REUSED = plan.REUSED_NOTE  # "reused from the first run"


def _fingerprint(config, backend: str) -> str:
    """What the decisions depend on: the data, model and runtime flags and the backend
    (not the run's length: a rerun that trains longer resumes the same computation)."""
    sections = config.to_json()
    key = {name: sections[name] for name in ("data", "model", "runtime")}
    key["backend"] = backend
    key["train"] = {"grad_accum_steps": sections["train"]["grad_accum_steps"]}
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


class Decisions:
    """The measured choices of one run directory.

    Only a single-process run reuses them: the workers of a multi-worker job measure
    together (collectives), and one reading a file the others do not see would wait alone.
    """

    def __init__(self, model_dir: str, config, backend: str, *, writes: bool = True,
                 reuses: bool = True):
        """Args:
          model_dir: the run directory (the file lives in its ``checkpoints``).
          config: the job's config: decisions of another job in this directory are not
            reused (and are overwritten when this one decides).
          backend: Keras' backend, part of what the decisions depend on.
          writes: whether this process records (the chief).
          reuses: whether this process may reuse (a single-process run).
        """
        self.path = os.path.join(model_dir, "checkpoints", FILE)
        self.fingerprint = _fingerprint(config, backend)
        self.writes = writes
        self.reused: list[str] = []
        self._made: dict = {}
        self._first: dict = {}  # the first run's file: its decisions and its kernels
        self._recorded = self._read() if reuses else {}

    def _read(self) -> dict:
        try:
            with open(self.path) as f:
                found = json.load(f)
        except (OSError, ValueError):
            return {}
        if found.get("fingerprint") != self.fingerprint:
            logging.info("%s holds the decisions of another job's flags: measuring again",
                         self.path)
            return {}
        self._first = found
        return dict(found.get("decisions", {}))

    def get(self, name: str) -> dict | None:
        """The first run's decision ``name`` (marked reused), or None if it made none."""
        value = self._recorded.get(name)
        if value is not None:
            self.reused.append(name)
            self._made[name] = value
            logging.info("%s: %s (%s)", name, REUSED, self.path)
        return value

    def record(self, name: str, value: dict) -> None:
        """Keeps the decision ``name`` (JSON values) for a resumed run."""
        self._made[name] = value
        if self.writes:
            self._write()

    def _write(self) -> None:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        write_json_atomic(self.path, {"fingerprint": self.fingerprint,
                                      "decisions": {**self._recorded, **self._made},
                                      "kernels": self._first.get("kernels")})

    def first_kernels(self, current: dict) -> dict:
        """The kernels the run's first attempt computed with (``kernels()``), recorded now
        if this is the first: a rerun on other kernels resumes, but not bit-exactly."""
        if self._first.get("kernels") is None:
            self._first["kernels"] = current
            if self.writes:
                self._write()
        return self._first["kernels"]

    def report(self) -> dict:
        """report.json's ``decisions``: which were made here and which reused."""
        return {"file": self.path, "made": sorted(set(self._made) - set(self.reused)),
                "reused": sorted(self.reused),
                **({"note": f"{', '.join(sorted(self.reused))}: {REUSED}"}
                   if self.reused else {})}


def with_precision(rt, recorded: dict):
    """``rt`` with the first run's precision (``recorded``: its value and reason) in force,
    as the probe leaves it (the global Keras policy set too)."""
    import dataclasses

    import keras

    choice = recorded["value"]
    keras.mixed_precision.set_global_policy(choice)
    return dataclasses.replace(rt, plan=dataclasses.replace(
        rt.plan, precision=choice, loss_scale=choice == "mixed_float16",
        reasons={**rt.plan.reasons, "precision": f"{recorded['reason']}; {REUSED}"}))


def kernels(backend: str, intra_op_threads: int) -> dict:
    """Which kernels compute the step here: the same model, data and order give the same
    bits only on the same kernels and thread count (reductions are summed in another order
    elsewhere).

    Args:
      backend: Keras' backend; on JAX, XLA's kernels (TensorFlow's settings do not apply).
      intra_op_threads: the threads one op may use (0: TensorFlow's default, one a core).

    Returns:
      ``{"backend", "onednn", "intra_op_threads"}``.
    """
    from tfspeed.runtime import backends

    if not backends.get(backend).tf_kernels:
        return {"backend": backend}
    from tensorflow.python.util import _pywrap_util_port

    return {"backend": backend,
            # oneDNN's custom kernels: TensorFlow's default on CPUs with AVX512_BF16 or
            # AMX, else off; TF_ENABLE_ONEDNN_OPTS=0/1 decides on any x86 CPU.
            "onednn": bool(_pywrap_util_port.IsMklEnabled()),
            "intra_op_threads": intra_op_threads or len(os.sched_getaffinity(0))}


def tuned(decided: Decisions | None, tune):
    """``--steps_per_execution=auto``: the first run's N where it measured one, else
    ``tune()`` (``autotune.tune_steps_per_execution``), recorded when it measured.

    Returns:
      ``(N, steps the probe used, report)``.
    """
    recorded = decided.get("steps_per_execution") if decided else None
    if recorded:
        return recorded["value"], 0, {**recorded, "reused": "from the first run"}
    n, used, report = tune()
    if decided and "probe_steps" in report:  # measured, not a default taken
        decided.record("steps_per_execution", report)
    return n, used, report
