"""Phase 2 of ``tfspeed.tune``: the cost model (pure, no TensorFlow).

Every candidate's steady-state examples/s from the measurements: per batch the step takes
``w = s + c / N`` of wall time and ``u`` CPU-seconds, the input ``i`` CPU-seconds (0 in the
step), so ``T = max(w, i / threads, (u + i) / cores)``.
"""

from __future__ import annotations

import dataclasses
import itertools

from tfspeed.tuning import autotune
from tfspeed.tuning.measurements import InputKey, Measurements, StepKey, StepTiming


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting of every knob."""

    input_placement: str  # host, device
    cache: str  # none, memory, disk (host only)
    parse: str  # batched, single
    input_threads: int  # 0: one per core
    precision: str
    xla: str  # on, off
    steps_per_execution: int
    batching: str = ""  # pad, bucket, pack (token records only; "": not a knob here)
    tokens_per_batch: int = 0  # the token budget of a bucket or packed batch (0: n/a)

    @property
    def step_key(self) -> StepKey:
        return StepKey(self.precision, self.xla)

    def flags(self) -> dict[str, str]:
        """Every knob as a flag value (the token knobs only where they apply)."""
        return {k: str(v) for k, v in dataclasses.asdict(self).items()
                if v or k not in _TEXT_KNOBS}

    def label(self) -> str:
        where = ("in-step" if self.input_placement == "device" else
                 f"tf.data cache={self.cache}" + (f" parse={self.parse}" if self.cache == "none"
                                                  else "") +
                 (f" threads={self.input_threads}" if self.input_threads else ""))
        tokens = (f"batching={self.batching}" + (f" tokens={self.tokens_per_batch}"
                                                 if self.batching != "pad" else "") + ", "
                  if self.batching else "")
        return (f"{tokens}{where}, {self.precision}, xla={self.xla}, "
                f"spe={self.steps_per_execution}")


_TEXT_KNOBS = ("batching", "tokens_per_batch")


def predict(c: Candidate, m: Measurements) -> dict:
    """Steady-state examples/s of ``c`` from the measurements ``m`` (see the module doc).

    Returns:
      The prediction with its parts: wall ``w`` and CPU ``u`` of the step per batch
      (``step_ms``, ``step_cpu_ms``), the input's CPU ``i`` per batch (``input_cpu_ms``), and
      which term bounds the time ``T`` (``bound``: step, input or cores).
    """
    if c.batching and m.text:
        return _predict_tokens(c, m)
    step = m.step[c.step_key]
    scale = m.device_step_ratio if c.input_placement == "device" else 1.0
    w = scale * (step.step_s + step.overhead_s / c.steps_per_execution)
    u = scale * step.cpu_per_step_s
    if c.input_placement == "device":
        i = 0.0
    else:
        i = m.batch_size * m.input[InputKey(c.cache, c.parse)].cpu_s
    threads = min(c.input_threads or m.cores, m.cores)
    terms = {"step": w, "input": i / threads, "cores": (u + i) / m.cores}
    bound = max(terms, key=terms.get)
    return {"examples_per_sec": m.batch_size / terms[bound], "bound": bound,
            "step_ms": 1000 * w, "step_cpu_ms": 1000 * u, "input_cpu_ms": 1000 * i}


def _predict_tokens(c: Candidate, m: Measurements) -> dict:
    """``predict`` for token batches: the step's time scales with the tokens it computes
    (padding included), the input's with the tokens it batches; what is learnt from is the
    real share, ``1 - expected_padding`` of the batching from the split's lengths.

    ``examples_per_sec`` is sequences/s (real tokens/s over the mean length), so token
    candidates rank among themselves by real tokens/s.
    """
    text = m.text
    mode = text["batching"][c.batching]
    padding = mode["expected_padding"]
    if c.batching == "pad":  # a batch of B sequences padded to its longest
        computed = text["batch_size"] * text["mean_length"] / max(1 - padding, 1e-3)
    else:
        computed = c.tokens_per_batch
    step = m.step[c.step_key]
    per_token = computed / max(text["held_tokens"], 1)
    w = step.step_s * per_token + step.overhead_s / c.steps_per_execution
    u = step.cpu_per_step_s * per_token
    i = mode["input_cpu_per_token"] * computed
    threads = min(c.input_threads or m.cores, m.cores)
    terms = {"step": w, "input": i / threads, "cores": (u + i) / m.cores}
    bound = max(terms, key=terms.get)
    real = computed * (1 - padding) / terms[bound]
    return {"examples_per_sec": real / max(text["mean_length"], 1e-9), "bound": bound,
            "real_tokens_per_sec": real, "expected_padding": padding,
            "step_ms": 1000 * w, "step_cpu_ms": 1000 * u, "input_cpu_ms": 1000 * i}


def token_choices(m: Measurements) -> list[tuple[str, int]]:
    """(batching, tokens_per_batch) pairs of a token job: pad at its batch size, bucket
    and pack (where measured) at each token budget."""
    text = m.text
    pairs = [("pad", text["tokens_per_batch"][0])]
    for mode in ("bucket", "pack"):
        if mode in text["batching"]:
            pairs += [(mode, tokens) for tokens in text["tokens_per_batch"]]
    return pairs


def candidates(m: Measurements) -> list[Candidate]:
    """Every combination of the knobs the measurements cover (infeasible ones left out)."""
    if m.text:
        base = dataclasses.replace(m, text=None)
        return [dataclasses.replace(c, batching=mode, tokens_per_batch=tokens)
                for c in candidates(base) for mode, tokens in token_choices(m)]
    steps = {key: spe_choices(timing, m.steps_per_epoch) for key, timing in m.step.items()}
    threads = sorted({0, *([m.cores - 1] if m.cores > 1 else [])})
    inputs = [("device", "none", "batched", 0)] if m.device_ok else []
    for cache in m.caches:
        parses = m.parses if cache == "none" else ["batched"]
        inputs += [("host", cache, p, t) for p in parses for t in threads]
    return [Candidate(where, cache, parse, t, key.precision, key.xla, n)
            for (where, cache, parse, t), key in itertools.product(inputs, m.step)
            for n in steps[key]]


def rank(m: Measurements) -> list[dict]:
    """Every candidate with its prediction, fastest first.

    Where predictions tie (the step or the cores bound both), fewer tf.data threads come
    first: threads the input does not need only wake up and preempt a step that keeps every
    core busy. ``benchmarks/tune.py``'s grids measured one thread faster than all cores with
    a cached input on each of its three workloads.

    Returns:
      ``{"candidate": Candidate, **predict(candidate, m)}`` for each candidate.
    """
    def key(r):
        c = r["candidate"]
        return -r["examples_per_sec"], min(c.input_threads or m.cores, m.cores)

    return sorted(({"candidate": c, **predict(c, m)} for c in candidates(m)), key=key)


def spe_choices(step: StepTiming, per_epoch: int) -> list[int]:
    """1, and the cost model's N (``autotune.steps_per_execution``) when it is more."""
    n = autotune.steps_per_execution(
        autotune.CallCost(step.overhead_s, max(step.step_s, 1e-9)), max(per_epoch, 1))
    return sorted({1, n})
