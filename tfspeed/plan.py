"""One plan: every ``auto`` of a job resolved by the rules written here, each decision with
its value, its reason and its source (given by a flag, predicted, measured by a probe, or
reused from the first run's ``decisions.json``).

No TensorFlow (``tests/test_plan.py`` checks): what the rules need is handed in (the hardware, the cost
model's predicted costs, a probe to call, the first run's record), so the runtime, the
data pipeline, the job, ``tfspeed.fit`` and tune decide alike on the same facts. The job
keeps a ``Plan`` of its decisions; report.json's ``plan`` is ``Plan.to_json()``.

The batching decision walks: ``--batching`` given -> reused from the first run -> the cost
model's prediction (``probes.costs``) -> a probe of bucket against pack where the
prediction is within the model's error. XLA's ``auto``: on for an accelerator, and on a
CPU only for packed rows (one static shape, one compile): ``xla`` and ``compiled_modes``.
Steps per call: the smallest power of two whose call overhead is a small share of the call
(``steps_per_call``; ``probes.autotune`` times the overhead and the step). The input's
placement: in the step where the decoded split fits the RAM budget (``placement``). The
cache of a split: none for a split read once, else in memory where it fits the budget, else
on disk (``cache``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from tfspeed.config import AUTO, BATCHING_MODES
from tfspeed.errors import UsageError

# How much better another choice has to be before auto takes it (``probes.costs`` names
# the project's other margins):
# - auto keeps the plainer choice unless the other is predicted (batching) or measured
#   (precision) this much cheaper: padding over buckets (one shape fewer to trace, no
#   grouping buffer, which the costs leave out); float32 over mixed_bfloat16 (exact, and a
#   close race on a shared machine is noise).
AUTO_MARGIN = 0.05
# - Not a preference but the cost model's error: auto times bucket against pack where
#   neither is predicted this many times cheaper (predicted/measured has ranged 0.9-1.5
#   over the benchmark's records).
BATCHING_MARGIN = 1.5

GIVEN, PREDICTED, MEASURED, REUSED = "given", "predicted", "measured", "reused"
REUSED_NOTE = "reused from the first run"  # training.decisions.REUSED says the same
CPU_BF16 = "auto: this CPU has native bfloat16 (AVX512_BF16/AMX)"
BFLOAT16_MIN_CC = (8, 0)  # Ampere: bfloat16 tensor cores
FLOAT16_MIN_CC = (7, 0)  # Volta: float16 tensor cores


@dataclasses.dataclass(frozen=True)
class Decision:
    """One ``auto`` (or its flag) resolved.

    Attributes:
      value: what it resolved to.
      reason: one sentence, with the figures it rests on.
      source: ``given`` (a flag), ``predicted`` (a rule or the cost model), ``measured``
        (a probe timed it) or ``reused`` (the first run's decision, on a rerun).
    """

    value: object
    reason: str
    source: str

    def to_json(self) -> dict:
        return {"value": self.value, "reason": self.reason, "source": self.source}


@dataclasses.dataclass(frozen=True)
class Plan:
    """The decisions of one job, by name (``batching``, ``xla``, ``precision``, ...)."""

    decisions: tuple[tuple[str, Decision], ...] = ()

    def get(self, name: str) -> Decision | None:
        return dict(self.decisions).get(name)

    def value(self, name: str, default=None):
        found = self.get(name)
        return default if found is None else found.value

    def with_(self, **decisions: Decision) -> Plan:
        """This plan with ``decisions`` added or replaced (in their order)."""
        kept = tuple((n, d) for n, d in self.decisions if n not in decisions)
        return Plan(kept + tuple(decisions.items()))

    def to_json(self) -> dict:
        """report.json's ``plan``: ``{name: {"value", "reason", "source"}}``."""
        return {name: d.to_json() for name, d in self.decisions}


def source_of(requested) -> str:
    """The source of a decision resolved by a rule elsewhere (the cache's, the input
    placement's, the strategy's): given where its flag was set, else predicted."""
    return PREDICTED if requested == AUTO else GIVEN


# ---- XLA -----------------------------------------------------------------------------------

def xla(requested: str, accelerator: bool, batching: str | None = None) -> Decision:
    """``--xla``: on for a GPU/TPU; on a CPU off, but for packed token rows (``batching``
    ``pack``): one static shape compiles once, and XLA fuses the masked attention's
    element-wise work (the transformer trained faster so, ``benchmarks/sequences.py``).
    Bucketed and padded batches change shape, one compile each, seconds apart: a one-pass
    run lost more to them than XLA saved (docs/benchmarks.md, "sequences")."""
    if requested != AUTO:
        return Decision(requested == "on", f"--xla={requested}", GIVEN)
    if accelerator:
        return Decision(True, "auto: on for GPU/TPU, where fused kernels usually win", PREDICTED)
    if batching == "pack":
        return Decision(True, "auto: on for packed token batches (one static shape: one "
                              "compile, fused masked attention)", PREDICTED)
    return Decision(False, "auto: off on CPU (measured slower here, plus compile time)",
                    PREDICTED)


def compiled_modes(requested: str, xla_on: bool, compiles_every_step: bool) -> tuple[str, ...]:
    """The batchings whose every batch shape compiles: all where each step is compiled (JAX)
    or XLA is on already; else those ``xla`` turns it on for (on a CPU, packed rows)."""
    if compiles_every_step or xla_on:
        return BATCHING_MODES
    return tuple(m for m in BATCHING_MODES if xla(requested, False, m).value)


# ---- batching ------------------------------------------------------------------------------

def batching_modes(takes_segments: bool) -> tuple[str, ...]:
    """The batching modes a model can train on: packed rows only where it takes segment ids
    (keeps packed sequences apart)."""
    return tuple(m for m in BATCHING_MODES if takes_segments or m != "pack")


def predict_batching(costs: dict[str, float], takes_segments: bool) -> Decision:
    """What the cost model picks, and why: the cheapest of bucket and pack for a model that
    keeps packed sequences apart; for others bucket when it saves at least ``AUTO_MARGIN``
    over padding each batch to its longest (pack is left out: it would mix their texts)."""
    figures = ", ".join(f"{m} {costs[m]:.2f}" for m in BATCHING_MODES if m in costs)
    if takes_segments:
        mode = min(("bucket", "pack"), key=lambda m: costs[m])
        why = ""
    else:
        mode = "bucket" if costs["bucket"] <= (1 - AUTO_MARGIN) * costs["pad"] else "pad"
        why = ("; pack left out: the model is not known to keep packed sequences apart "
               "(segment ids); pass pack for one that does")
    return Decision(mode, f"auto: {mode}, the least compute per real token ({figures}){why}",
                    PREDICTED)


def batching(requested: str, costs: dict[str, float], takes_segments: bool, *,
             recall: Callable[[], dict | None] | None = None,
             probe: Callable[[], dict] | None = None) -> tuple[Decision, dict]:
    """``--batching``: the one walk of its ``auto``.

    Args:
      requested: ``--batching``.
      costs: the cost model's predicted work per real token of each mode.
      takes_segments: the model keeps packed sequences apart (``auto`` may pack).
      recall: the first run's recorded decision (``{"mode", "reason", "measured"}``) or
        None; called only for ``auto``.
      probe: times bucket against pack on the job's model; called only where neither is
        predicted ``BATCHING_MARGIN`` cheaper. Returns ``{"rates": {mode: real tokens/s},
        "steps": batches each}``, or ``{"skipped": why}``. None: nothing is timed here.

    Returns:
      ``(decision, measured)``: ``measured`` is ``{mode: {"real_tokens_per_sec",
      "batches"}}`` where a probe timed the modes (the first run's, where reused), else {}.
    """
    if requested != AUTO:
        return Decision(requested, f"--batching={requested}", GIVEN), {}
    recorded = recall() if recall else None
    if recorded:
        return Decision(recorded["mode"], f"{recorded['reason']}; {REUSED_NOTE}", REUSED), dict(
            recorded.get("measured") or {})
    predicted = predict_batching(costs, takes_segments)
    if not takes_segments or probe is None:
        return predicted, {}
    ratio = max(costs["bucket"], costs["pack"]) / max(min(costs["bucket"], costs["pack"]), 1e-9)
    if ratio >= BATCHING_MARGIN:
        return dataclasses.replace(predicted, reason=(
            f"{predicted.reason}; not timed: predicted {ratio:.2f}x apart, beyond the cost "
            f"model's error")), {}
    timed = probe()
    if "skipped" in timed:
        return dataclasses.replace(
            predicted, reason=f"{predicted.reason}; not timed: {timed['skipped']}"), {}
    rates, steps = timed["rates"], timed["steps"]
    mode = max(rates, key=rates.get)
    figures = ", ".join(f"{m} {r:,.0f}" for m, r in rates.items())
    reason = (f"auto: {mode}, the more real tokens/s measured over {steps} batches each "
              f"({figures}; predicted work per real token: bucket {costs['bucket']:.2f}, "
              f"pack {costs['pack']:.2f})")
    measured = {m: {"real_tokens_per_sec": round(r, 1), "batches": steps}
                for m, r in rates.items()}
    return Decision(mode, reason, MEASURED), measured


def pinned_batching(requested: str, resolved: str) -> dict:
    """A rerun of a job's flags (tune's run of the user's flags): ``{"batching": resolved}``
    where ``--batching`` was ``auto``, the mode the job resolved; a short run would decide
    otherwise (compiles weigh more in it: a 3-step run bucketed what the job packed)."""
    return {"batching": resolved} if requested == AUTO and resolved else {}


# ---- precision -----------------------------------------------------------------------------

def hardware_precision(hw) -> tuple[str, str]:
    """The policy the hardware offers (``hw``: ``runtime.Hardware``), and why."""
    if hw.tpus:
        return "mixed_bfloat16", "auto: TPU computes in bfloat16 natively"
    if hw.gpus:
        cc = min(hw.gpus)
        if cc >= BFLOAT16_MIN_CC:
            return "mixed_bfloat16", (f"auto: GPU compute capability {cc[0]}.{cc[1]} runs "
                                      "bfloat16 at float16 speed without loss scaling")
        if cc >= FLOAT16_MIN_CC:
            return "mixed_float16", (f"auto: GPU compute capability {cc[0]}.{cc[1]} has float16 "
                                     "tensor cores")
        return "float32", f"auto: GPU compute capability {cc[0]}.{cc[1]} has no tensor cores"
    if hw.cpu_has_bf16:
        return "mixed_bfloat16", CPU_BF16
    return "float32", "auto: this CPU has no native bfloat16"


def precision(requested: str, hw) -> Decision:
    """``--precision`` before any probe: the hardware's policy for ``auto``; for ``measure``
    the mixed policy the probe times against float32.

    Raises:
      UsageError: ``mixed_float16`` on a machine without a GPU.
    """
    if requested == AUTO:
        return Decision(*hardware_precision(hw), PREDICTED)
    if requested == "measure":
        choice, _ = hardware_precision(hw)
        mixed = "mixed_bfloat16" if choice == "float32" else choice
        return Decision(mixed, f"measure: float32 against {mixed}, timed on this model",
                        PREDICTED)
    if requested == "mixed_float16" and not hw.gpus:
        raise UsageError(
            "--precision=mixed_float16 needs a GPU (this machine has none and emulates float16 "
            "slowly); use --precision=auto" + (" (bfloat16 is native on this CPU)"
                                               if hw.cpu_has_bf16 else " or float32"))
    return Decision(requested, f"--precision={requested}", GIVEN)


def measured_precision(candidate: str, step_seconds: dict[str, float],
                       requested: str = AUTO) -> Decision:
    """The policy to train in, from measured step times, and why: the mixed policy has to
    earn its rounding, so it is taken only when ``AUTO_MARGIN`` faster than float32 (a close
    race on a shared machine goes to the exact policy).

    Args:
      candidate: the mixed policy measured against float32 (``mixed_bfloat16`` where the
        hardware rule chose it, or for ``--precision=measure``).
      step_seconds: seconds per step under each measured policy.
      requested: ``--precision`` as given (``auto`` or ``measure``), for the reason.
    """
    f32, mixed = step_seconds["float32"], step_seconds[candidate]
    figures = f"{1000 * f32:.2f} ms/step in float32, {1000 * mixed:.2f} in {candidate}"
    if mixed <= (1 - AUTO_MARGIN) * f32:
        return Decision(candidate, f"{requested}: measured {figures} for this model: "
                                   f"{candidate} is at least {AUTO_MARGIN:.0%} faster", MEASURED)
    return Decision("float32", f"{requested}: measured {figures} for this model: "
                               f"{candidate.removeprefix('mixed_')} is not {AUTO_MARGIN:.0%} "
                               "faster here, so float32 (exact) is kept", MEASURED)


def precision_to_measure(requested: str, reason: str) -> bool:
    """Whether the precision probe runs: ``--precision=measure``, or ``auto`` where the
    hardware rule chose bfloat16 for a CPU (``reason``: the runtime's; a small model often
    runs faster in float32 there, so it is timed)."""
    return requested == "measure" or (requested == AUTO and reason == CPU_BF16)


# ---- steps per call ------------------------------------------------------------------------

CALL_OVERHEAD = 0.02  # the share of a compiled call that its fixed overhead may take
UNMEASURED_STEPS = 16  # steps per call where a run is too short to probe


@dataclasses.dataclass(frozen=True)
class CallCost:
    """Seconds of one compiled-loop call: ``overhead + steps * step``."""

    overhead: float
    step: float


def call_cost(empty: float, many: float, n: int) -> CallCost:
    """The cost model from the median seconds of a 0-step call and an ``n``-step call."""
    return CallCost(overhead=empty, step=max(many - empty, 1e-9) / n)


def steps_per_call(cost: CallCost, cap: int) -> int:
    """``--steps_per_execution=auto``'s rule: the smallest power of two N with
    ``overhead <= CALL_OVERHEAD * N * step``, at most ``cap`` (one epoch)."""
    n = 1
    while n < cap and cost.overhead > CALL_OVERHEAD * n * cost.step:
        n *= 2
    return max(1, min(n, cap))


def unmeasured_steps_per_call(cap: int) -> int:
    """Steps per call where the run is too short to probe: ``UNMEASURED_STEPS``, at most
    ``cap``."""
    return max(1, min(UNMEASURED_STEPS, cap))


# ---- input placement -----------------------------------------------------------------------

def placement(requested: str, split: str, estimate_mb: float, budget_mb: float,
              budget_source: str, blocker: str) -> Decision:
    """``--input_placement``: ``device`` holds the training split in the step, ``host`` reads
    it through tf.data. ``auto`` holds it where its decoded size fits the RAM budget and
    nothing needs the pipeline (``blocker``: what does, in words, or empty).

    Raises:
      UsageError: ``device`` was asked for where ``blocker`` needs the pipeline.
    """
    if requested in ("host", "device"):
        if requested == "device" and blocker:
            raise UsageError(f"--input_placement=device cannot hold the input in the step: "
                             f"{blocker}; use --input_placement=host or auto")
        return Decision(requested, f"--input_placement={requested}", GIVEN)
    if blocker:
        return Decision("host", f"auto: {blocker}", PREDICTED)
    size = (f"the decoded {split!r} split takes ~{estimate_mb:,.1f} MB, the budget is "
            f"{budget_mb:,.0f} MB ({budget_source})")
    if estimate_mb > budget_mb:
        return Decision("host", f"auto: {size}: tf.data", PREDICTED)
    return Decision("device", f"auto: {size}: held in the step", PREDICTED)


# ---- the cache -----------------------------------------------------------------------------

def cache(requested: str, split: str, estimate_mb: float, budget_mb: float,
          budget_source: str, read_once: bool) -> Decision:
    """``--cache`` for one split: ``memory``, ``disk`` or ``none``. ``auto`` caches nothing
    for a split read once (``read_once``), in memory where its cached size fits the RAM
    budget, and on disk otherwise.

    Raises:
      UsageError: ``memory`` was asked for where the split does not fit the budget.
    """
    size = (f"{split!r} cached takes ~{estimate_mb:,.0f} MB, the budget is "
            f"{budget_mb:,.0f} MB ({budget_source})")
    fits = estimate_mb <= budget_mb
    if requested == "memory" and not fits:
        raise UsageError(f"--cache=memory cannot hold the data: {size}; use --cache=disk "
                         "(or --cache=none), or raise --ram_budget_mb")
    if requested != AUTO:
        return Decision(requested, f"--cache={requested}", GIVEN)
    if read_once:
        return Decision("none", f"auto: {split!r} is read once, a cache cannot pay", PREDICTED)
    if fits:
        return Decision("memory", f"auto: {size}: in memory", PREDICTED)
    return Decision("disk", f"auto: {size}: on disk, under --cache_dir", PREDICTED)


# ---- the job's plan ------------------------------------------------------------------------

def steps_per_execution(requested, tuning: dict) -> Decision:
    """``--steps_per_execution`` as the trainer resolved it (``tuning``: its report,
    ``autotune.tune_steps_per_execution``'s or the first run's)."""
    if requested != AUTO:
        return Decision(requested, f"--steps_per_execution={requested}", GIVEN)
    if tuning.get("reused"):
        return Decision(tuning["value"], f"{tuning.get('rule', 'measured')}; {REUSED_NOTE}",
                        REUSED)
    if "probe_steps" in tuning:
        return Decision(tuning["value"], (
            f"auto: {tuning['rule']}: call overhead {tuning['call_overhead_ms']} ms, a step "
            f"{tuning['step_ms']} ms"), MEASURED)
    return Decision(tuning["value"], f"auto: {tuning.get('probe', 'not measured')}", PREDICTED)


def of_runtime(config, reasons: dict, values: dict, measured: str = "") -> Plan:
    """The runtime's decisions (``config``: the ``RuntimeConfig``; ``reasons`` and
    ``values``: the resolved runtime's, by name). ``measured``: ``precision``'s source where
    a probe decided it (``measured`` or ``reused``)."""
    out = {}
    for name in ("strategy", "precision", "xla", "intra_op_threads"):
        if name in reasons:
            requested = getattr(config, name)
            source = measured if name == "precision" and measured else source_of(requested)
            out[name] = Decision(values[name], reasons[name], source)
    return Plan().with_(**out)


def of_input(config, report: dict) -> Plan:
    """The input's decisions (``config``: the ``DataConfig``; ``report``: the job input's,
    ``data.job_input``): where the step gets its batches, each split's cache."""
    out = {"input_placement": Decision(report["placement"]["where"],
                                       report["placement"]["reason"],
                                       source_of(config.input_placement))}
    for split, cache in report.get("cache", {}).items():
        out[f"cache.{split}"] = Decision(cache["mode"], cache["reason"], source_of(config.cache))
    return Plan().with_(**out)
