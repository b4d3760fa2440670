"""What ``tfspeed.tune`` measures, typed: the input's cost per element, the step's per
precision and XLA setting, and the facts of the job that bound the candidates.

The JSON layout (``to_json``/``from_json``) is the one ``tune.json`` records and the measuring
child process hands over: keys such as ``"float32/off"`` for a step and ``"cold/batched"`` or
``"memory"`` for an input.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class StepKey:
    """Which step: its precision policy and whether XLA compiles it."""

    precision: str
    xla: str  # on, off

    def __str__(self) -> str:
        return f"{self.precision}/{self.xla}"

    @classmethod
    def from_str(cls, text: str) -> StepKey:
        precision, xla = text.split("/")
        return cls(precision, xla)


@dataclasses.dataclass(frozen=True)
class InputKey:
    """Which input: decoded every epoch (``cache="none"``, with its parse mode) or read from
    a cache (parsing happened once, before it: ``parse`` is always ``batched`` there)."""

    cache: str  # none, memory, disk
    parse: str = "batched"  # batched, single

    def __post_init__(self):
        if self.cache != "none":
            object.__setattr__(self, "parse", "batched")

    def __str__(self) -> str:
        return f"cold/{self.parse}" if self.cache == "none" else self.cache

    @classmethod
    def from_str(cls, text: str) -> InputKey:
        kind, _, parse = text.partition("/")
        return cls("none", parse) if kind == "cold" else cls(kind)


COLD = InputKey("none", "batched")  # the pipeline as it runs with no cache


@dataclasses.dataclass(frozen=True)
class StepTiming:
    """The step alone on a held batch: the fastest of its timed calls."""

    overhead_s: float  # a call's fixed cost, besides its steps
    step_s: float  # wall seconds per step
    cpu_per_step_s: float  # CPU-seconds per step (all threads)
    steps_timed: int  # steps per timed call


@dataclasses.dataclass(frozen=True)
class InputTiming:
    """The input pipeline alone, per element."""

    cpu_s: float  # CPU-seconds (all threads)
    wall_s: float


@dataclasses.dataclass(frozen=True)
class InputStages:
    """CPU-seconds per element that each stage of the cold pipeline adds."""

    read: float
    decode: float
    after_cache: float | None  # the warm pipeline's, where a cache was measured


@dataclasses.dataclass(frozen=True)
class Measurements:
    """Phase 1's findings: what the cost model (``tuning.predict``) predicts from."""

    batch_size: int
    cores: int
    steps_per_epoch: int
    size_mb: float  # the train split, decoded
    ram_budget_mb: float
    ram_budget_source: str
    device_ok: bool  # the split may be held in the step (it fits, and it was measured)
    image_storage: str  # jpeg, png, raw; "" for no image input
    input: dict[InputKey, InputTiming]
    step: dict[StepKey, StepTiming]
    stages: InputStages
    parses: tuple[str, ...]  # the parse modes measured cold
    caches: tuple[str, ...]  # none, and the cache measured (memory or disk)
    objectives: dict  # the loss and metrics the timed steps trained
    device_step_ratio: float = 1.0  # the step with the split in it, over the step alone
    # Seconds the first step setting took to build, trace and call once: a verifying run
    # sets up no faster (the text transformer's: 8-10 s on 2 cores, where a small image
    # model's fits in ``verify.SETUP_S``).
    setup_s: float = 0.0
    device_step: StepTiming | None = None
    # Token records only (absent otherwise): ``{"held_tokens"`` (computed tokens of the
    # batch the steps were timed on), ``"held_width"`` (its row length), ``"held_units"``
    # (its work in ``costs``' units), ``"mean_length"``, ``"max_length"``,
    # ``"batch_size"``, ``"tokens_per_batch"`` (the choices, the job's own first),
    # ``"batching": {mode: {"expected_padding", "input_cpu_per_token"}}`` (the modes
    # measured; pack only where the model takes segment ids), ``"expected_padding"``,
    # ``"costs"`` (``probes.costs.predicted_costs`` of the job's resolved figures, uncompiled:
    # predicted work per real token of each mode, padding and attention counted),
    # ``"attention_length"`` (the model's K, or None),
    # ``"job": {"batching", "tokens_per_batch"}`` (what the job's own flags resolve to)}.
    text: dict | None = None

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["input"] = {str(k): dataclasses.asdict(v) for k, v in self.input.items()}
        out["step"] = {str(k): dataclasses.asdict(v) for k, v in self.step.items()}
        out["stages"] = dataclasses.asdict(self.stages)
        out["parses"], out["caches"] = list(self.parses), list(self.caches)
        if self.text is None:  # absent for image and table jobs, as before
            del out["text"]
        if self.device_step is None:  # absent, as before typed measurements
            del out["device_step"]
        else:
            out["device_step"] = dataclasses.asdict(self.device_step)
        return out

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Measurements:
        plain = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        device_step = d.get("device_step")
        return cls(**{
            **plain,
            "input": {InputKey.from_str(k): InputTiming(**v) for k, v in d["input"].items()},
            "step": {StepKey.from_str(k): StepTiming(**v) for k, v in d["step"].items()},
            "stages": InputStages(**d["stages"]),
            "parses": tuple(d["parses"]), "caches": tuple(d["caches"]),
            "device_step": StepTiming(**device_step) if device_step else None})
