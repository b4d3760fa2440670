"""Phase 2 of ``tfspeed.tune``: the cost model (pure, no TensorFlow).

Every candidate's steady-state speed from the measurements (``rate``: batch examples/s, token
batches' sequences/s): per batch the step takes
``w = s + c / N`` of wall time and ``u`` CPU-seconds, the input ``i`` CPU-seconds (0 in the
step), so ``T = max(w, i / threads, (u + i) / cores)``.
"""

from __future__ import annotations

import dataclasses
import itertools

from tfspeed import plan
from tfspeed.config import AUTO
from tfspeed.probes.costs import TOKEN_BUDGET_MARGIN
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
    tokens_per_batch: int = 0  # the token budget of a bucket or packed batch (0: none)

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
                                                 if self.tokens_per_batch
                                                 and self.batching != "pad" else "") + ", "
                  if self.batching else "")
        return (f"{tokens}{where}, {self.precision}, xla={self.xla}, "
                f"spe={self.steps_per_execution}")


_TEXT_KNOBS = ("batching", "tokens_per_batch")


def rate_key(figures: dict) -> str:
    """The speed a prediction or a measurement holds, the one candidates rank by:
    ``sequences_per_sec`` for token batches (real tokens/s over the split's mean length),
    else ``batch_examples_per_sec`` (the batch size times steps/s)."""
    return "sequences_per_sec" if "sequences_per_sec" in figures else "batch_examples_per_sec"


def rate(figures: dict) -> float:
    """The figure named by ``rate_key``."""
    return figures[rate_key(figures)]


def rate_unit(figures: dict) -> str:
    """``rate``'s unit, to print."""
    return "sequences/s" if rate_key(figures) == "sequences_per_sec" else "examples/s"


def predict(c: Candidate, m: Measurements) -> dict:
    """Steady-state speed of ``c`` from the measurements ``m`` (see the module doc):
    ``batch_examples_per_sec``, or ``sequences_per_sec`` for token batches (``rate``).

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
    return {"batch_examples_per_sec": m.batch_size / terms[bound], "bound": bound,
            "step_ms": 1000 * w, "step_cpu_ms": 1000 * u, "input_cpu_ms": 1000 * i}


def _predict_tokens(c: Candidate, m: Measurements) -> dict:
    """``predict`` for token batches. The step's time scales with the work a batch holds,
    in ``costs.predicted_costs``' units: each position of a row of w costs ``1 + w / K``
    (attention over every position of the row, padding's and other packed sequences' too),
    so a batch's work is its real tokens times its mode's cost per real token, against the
    work of the batch the step was timed on (``held_units``). The input's time scales with
    the tokens it batches (padding included). Without the model's K (a user's model) the
    costs count padding alone. The costs are the work alone (no XLA gain or compiles, as
    the job's ``Batching.costs`` fold in): each candidate's step is the one timed at its
    XLA setting.

    ``sequences_per_sec`` is real tokens/s over the mean length (sequences of the mean
    length), so token candidates rank among themselves by real tokens/s.
    """
    text = m.text
    padding = text["batching"][c.batching]["expected_padding"]
    real = real_tokens_per_batch(c, m)
    computed = real / max(1 - padding, 1e-3)
    cost = text.get("costs", {}).get(c.batching)  # absent from older tune.json files
    units = real * cost if cost else computed
    step = m.step[c.step_key]
    scale = units / max(text.get("held_units") or text["held_tokens"], 1)
    w = step.step_s * scale + step.overhead_s / c.steps_per_execution
    u = step.cpu_per_step_s * scale
    i = text["batching"][c.batching]["input_cpu_per_token"] * computed
    threads = min(c.input_threads or m.cores, m.cores)
    terms = {"step": w, "input": i / threads, "cores": (u + i) / m.cores}
    bound = max(terms, key=terms.get)
    rate = real / terms[bound]
    return {"sequences_per_sec": rate / max(text["mean_length"], 1e-9), "bound": bound,
            "real_tokens_per_sec": rate, "expected_padding": padding,
            "cost_per_real_token": cost, "step_ms": 1000 * w, "step_cpu_ms": 1000 * u,
            "input_cpu_ms": 1000 * i}


def real_tokens_per_batch(c: Candidate | None, m: Measurements) -> float:
    """Real tokens a batch of ``c`` holds on average (None: the job's own batching): a
    padded batch's ``--batch_size`` sequences of the mean length (a classifier's bucketed
    batch's ``bucket_size``), a bucketed or packed one's token budget less its expected
    padding."""
    text = m.text
    mode, tokens = ((c.batching, c.tokens_per_batch) if c is not None and c.batching else
                    (text["job"]["batching"], text["job"]["tokens_per_batch"]))
    if mode == "pad":
        return text["batch_size"] * text["mean_length"]
    if mode == "bucket" and text.get("bucket_size"):
        return text["bucket_size"] * text["mean_length"]
    return tokens * (1 - text["batching"][mode]["expected_padding"])


def examples_per_batch(c: Candidate | None, m: Measurements) -> float:
    """Examples a batch of ``c`` holds (None: the job's own flags): ``--batch_size``, or for
    token batches the sequences expected in one."""
    if not m.text:
        return float(m.batch_size)
    return real_tokens_per_batch(c, m) / max(m.text["mean_length"], 1e-9)


def token_choices(m: Measurements) -> list[tuple[str, int]]:
    """(batching, tokens_per_batch) pairs of a token job, of the batchings measured: pad at
    its batch size, bucket and pack at each token budget; a classifier's buckets at its
    batch size, with no budget (0): a budget would change what an update holds, not only the
    speed."""
    text = m.text
    pairs = [("pad", text["tokens_per_batch"][0])] if "pad" in text["batching"] else []
    if "bucket" in text["batching"] and text.get("bucket_size"):
        pairs.append(("bucket", 0))
    for mode in ("bucket", "pack"):
        if mode in text["batching"] and not (mode == "bucket" and text.get("bucket_size")):
            pairs += [(mode, tokens) for tokens in text["tokens_per_batch"]]
    return pairs


def candidates(m: Measurements) -> list[Candidate]:
    """Every combination of the knobs the measurements cover (infeasible ones left out).

    Token batches take XLA only packed where the step was also measured without it (a
    CPU): padded and bucketed batches change shape from batch to batch, and XLA compiles
    each shape, seconds apart, which the step timed on one held batch does not show (so the
    driver's ``--xla=auto`` leaves them uncompiled there: ``tfspeed.plan.compiled_modes``).
    """
    if m.text:
        base = dataclasses.replace(m, text=None)
        return [dataclasses.replace(c, batching=mode, tokens_per_batch=tokens)
                for c in candidates(base) for mode, tokens in token_choices(m)
                if c.xla == "off" or mode in _compiled(c, m)]
    steps = {key: spe_choices(timing, m.steps_per_epoch) for key, timing in m.step.items()}
    threads = sorted({0, *([m.cores - 1] if m.cores > 1 else [])})
    inputs = [("device", "none", "batched", 0)] if m.device_ok else []
    for cache in m.caches:
        parses = m.parses if cache == "none" else ["batched"]
        inputs += [("host", cache, p, t) for p in parses for t in threads]
    return [Candidate(where, cache, parse, t, key.precision, key.xla, n)
            for (where, cache, parse, t), key in itertools.product(inputs, m.step)
            for n in steps[key]]


def _compiled(c: Candidate, m: Measurements) -> tuple[str, ...]:
    """The batchings the driver's ``--xla=auto`` compiles where ``c``'s step was measured:
    every one where it was never measured without XLA (an accelerator), else packed rows."""
    return plan.compiled_modes(AUTO, StepKey(c.precision, "off") not in m.step, False)


def rank(m: Measurements) -> list[dict]:
    """Every candidate with its prediction, fastest first.

    A token budget other than the job's own ranks as if ``TOKEN_BUDGET_MARGIN`` slower: it
    changes the updates per epoch, not only the speed, so it has to be predicted clearly
    faster (with ``costs``, the step's work per real token does not depend on it: only the
    call overhead and the input do).

    Where predictions tie (the step or the cores bound both), fewer tf.data threads come
    first: threads the input does not need only wake up and preempt a step that keeps every
    core busy. ``benchmarks/tune.py``'s grids measured one thread faster than all cores with
    a cached input on each of its three workloads.

    Returns:
      ``{"candidate": Candidate, **predict(candidate, m)}`` for each candidate.
    """
    own = m.text["job"]["tokens_per_batch"] if m.text and "job" in m.text else None

    def key(r):
        c = r["candidate"]
        speed = rate(r)
        if own and c.tokens_per_batch and c.batching != "pad" and c.tokens_per_batch != own:
            speed *= 1 - TOKEN_BUDGET_MARGIN
        return -speed, min(c.input_threads or m.cores, m.cores)

    return sorted(({"candidate": c, **predict(c, m)} for c in candidates(m)), key=key)


def spe_choices(step: StepTiming, per_epoch: int) -> list[int]:
    """1, and the plan's N (``plan.steps_per_call``) when it is more."""
    n = plan.steps_per_call(plan.CallCost(step.overhead_s, max(step.step_s, 1e-9)),
                            max(per_epoch, 1))
    return sorted({1, n})
