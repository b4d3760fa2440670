"""The training step's cost model: what each batching mode computes per real token, what a
compile costs and what XLA gains; and the margins by which one choice must beat another.

numpy only, no TensorFlow: ``data.text`` predicts each batching's cost with it,
``tfspeed.plan`` decides from those costs with its margins, tune and diagnose predict with it
(their output is written before TensorFlow starts).
"""

from __future__ import annotations

import numpy as np

from tfspeed.plan import AUTO_MARGIN, BATCHING_MARGIN  # noqa: F401 -- auto's margins, named here too

# Where each batch shape is compiled (XLA: JAX always, TensorFlow's packed rows): one compile
# costs about this many of the run's batches (the transformer on 2 cores: 2-4 s to compile
# against 0.1-0.3 s a step), so a short run takes fewer buckets.
COMPILE_BATCHES = 20.0
# ... and once compiled, a step runs faster, the more so the fewer tokens a replica's batch
# holds: XLA fuses the step's many small ops, whose fixed cost small batches feel most. The
# gain is ``XLA_GAIN[task] * (1 + XLA_OVERHEAD_TOKENS / tokens)``: fitted on the steady rates
# of packed rows with XLA against bucketed rows without it, given the work ``predicted_costs``
# puts in each (the transformer of benchmarks/sequences.py, 2 cores, the records of a quiet
# machine from sequences-2026-11-27-auto.json on). The medians the records imply: a
# classifier 1.13 at 8,192 tokens a batch (pystdlib; 1.01-1.24) and 1.47 at 1,285-1,536
# (pydocs; 1.15-1.72), a language model 1.74 at 1,536 (pydoc_lm; 1.59-1.79): an lm projects
# and scores every position over the whole vocabulary, more for XLA to fuse than a
# classifier's one pooled output. It decides only between a compiled mode and one that is
# not (TensorFlow on a CPU compiles packed rows alone); ``tests/data/test_cost_model.py``
# holds it against those records.
XLA_GAIN = {"classification": 1.05, "lm": 1.25}
XLA_OVERHEAD_TOKENS = 600.0

# How much better another choice has to be before it is taken. Each means something of its
# own, so each has its own value. auto's two (AUTO_MARGIN, BATCHING_MARGIN) are the plan's,
# which decides with them; imported above.
# - tune ranks a token budget other than the job's as if this much slower: it changes the
#   updates per epoch, not only the speed.
TOKEN_BUDGET_MARGIN = 0.03
# - diagnose advises another batching only where it is predicted this many times the real
#   tokens/s: a change the user makes by hand.
ADVICE_GAIN = 1.1


def predicted_costs(counts: np.ndarray, padding: dict, max_length: int,
                    attention_length: float | None, compiled=(),
                    shape_cost: float = 0.0, batch_tokens: float = float("inf"),
                    task: str = "classification") -> dict[str, float]:
    """Compute per real token of each mode, in units of the per-token work: a row of width
    w costs each of its tokens ``1 + w / K`` (K = ``attention_length``: a token attends to
    all w positions of its row, the masked ones too), and padding costs as real tokens.
    A mode in ``compiled`` pays a compile per batch shape, each ``shape_cost`` of the run:
    one for packed rows, one per bucket, one per width for padded batches; its steps then
    cost ``1 / xla_gain(batch_tokens, task)`` of an uncompiled one's (``batch_tokens``: a
    replica's tokens per batch).

    Args:
      counts: ``counts[n]``: the sequences of length n (after the long policy).
      padding: ``data.text.expected_padding``'s figures, with ``pack``'s.
      max_length: T, a packed row's width.

    Returns:
      ``{mode: work per real token}`` for pad, bucket and pack.
    """
    k = attention_length or float("inf")
    real = float(np.dot(np.arange(len(counts)), counts)) or 1.0

    def per_token(width):
        return 1.0 + width / k

    lower, bucketed = 0, 0.0
    for boundary in padding["boundaries"]:
        held = counts[lower + 1: boundary + 1].sum()
        bucketed += held * boundary * per_token(boundary)
        lower = boundary
    shapes = {"pad": float(np.count_nonzero(counts)), "bucket": len(padding["boundaries"]),
              "pack": 1}
    compile_ = {m: compiled_factor(shapes[m], shape_cost, batch_tokens, task)
                if m in compiled else 1.0 for m in shapes}
    return {"pad": round(row_cost(padding["pad_width"], k, padding["pad"]) * compile_["pad"], 4),
            "bucket": round(bucketed / real * compile_["bucket"], 4),
            "pack": round(row_cost(max_length, k, padding["pack"]) * compile_["pack"], 4)}


def row_cost(width: int, attention_length: float, padding: float) -> float:
    """The work per real token of rows of ``width`` holding ``padding`` (``predicted_costs``'
    units): every position pays ``1 + width / K``."""
    return (1.0 + width / attention_length) / max(1 - padding, 1e-3)


def xla_gain(batch_tokens: float, task: str = "classification") -> float:
    """How much faster a compiled step of ``task``'s model runs, for batches of
    ``batch_tokens`` per replica."""
    gain = XLA_GAIN.get(task, XLA_GAIN["classification"])
    return gain * (1 + XLA_OVERHEAD_TOKENS / max(batch_tokens, 1.0))


def compiled_factor(shapes: float, shape_cost: float, batch_tokens: float,
                    task: str = "classification") -> float:
    """What compiling every batch shape does to a mode's cost: ``shapes`` compiles of
    ``shape_cost`` of the run each, then steps ``xla_gain(batch_tokens, task)`` faster."""
    return (1 + shapes * shape_cost) / xla_gain(batch_tokens, task)
