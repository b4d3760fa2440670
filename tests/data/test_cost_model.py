"""``--batching=auto``'s cost model against the measured rates of the sequences records.

auto picks bucket or pack from predicted work per real token (``costs.predicted_costs``):
attention over each row's width (the model's K), padding, and XLA's faster steps where a
mode compiles. ``benchmarks/sequences.py`` times bucket and pack on the same model and three
real corpora. Here the prediction, recomputed by today's code from what each record holds
(row widths, padding, the model), is set against each record's measured pack/bucket ratio:
over the records of a quiet machine (``FIRST_QUIET`` on), the median of predicted/measured
must be within ``TOLERANCE`` of 1, and where every record measured a clear gap the model
ranks the modes the same way. One record alone is not enough: pack's rate on short texts
swung by 1.5x between two quiet runs. Changing the cost model, the attention formula or the
XLA gains away from measurement fails this; so does committing records the model does not
fit (refit ``costs.XLA_GAIN`` and ``XLA_OVERHEAD_TOKENS`` then). No timing is taken here.
"""

import glob
import json
import os
import statistics

import pytest

from tfspeed.probes import costs

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
TOLERANCE = 0.25  # predicted/measured: the spread of rounds on a shared machine
CLEAR_GAP = 0.15  # a measured gap this wide must be ranked the same way by the model
FIRST_QUIET = "sequences-2026-11-27"  # earlier records were taken under other load


def quiet_records() -> list[dict]:
    found = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "sequences-*.json"))):
        if os.path.basename(path) < FIRST_QUIET:
            continue
        with open(path) as f:
            record = json.load(f)
        if record["config"].get("complete") and all(
                {"tfspeed_bucket", "tfspeed_pack"} <= set(figures)
                for figures in record["figures"].values()):
            found.append(record)
    assert found, f"no complete sequences record with bucket and pack under {RESULTS}"
    return found


def corpora() -> list[str]:
    return sorted({name for record in quiet_records() for name in record["figures"]})


def median_rate(figures: dict, contender: str) -> float:
    return statistics.median(r["real_tokens_per_sec"] for r in figures[contender]["rounds"])


def steady_cost(batching: dict, mode: str, attention_length: float, xla: bool,
                task: str) -> float:
    """A mode's predicted work per real token without compiles (the record's rates leave the
    first step out), recomputed from the record's batching figures."""
    if mode == "pack":
        cost = costs.row_cost(batching["max_length"], attention_length,
                             batching["expected_padding"]["pack"])
    else:
        cost = batching["costs"]["bucket"]  # uncompiled in the record (checked below)
    tokens = batching["tokens_per_batch"] / batching["replicas"]
    return cost * (costs.compiled_factor(1, 0.0, tokens, task) if xla else 1.0)


def ratios(record: dict, name: str) -> tuple[float, float]:
    """(predicted, measured) pack speed over bucket speed on corpus ``name`` of ``record``."""
    from tfspeed.training import transformer

    facts, model = record["config"]["datasets"][name], record["config"]["model"]
    figures, task = record["figures"][name], facts["task"]
    k = transformer.attention_length(model["width"], model["depth"], model["heads"],
                                     facts["vocab_size"] if task == "lm" else 0)
    runs = {mode: figures[f"tfspeed_{mode}"]["rounds"][0] for mode in ("bucket", "pack")}
    assert runs["bucket"]["batching"]["attention_length"] == pytest.approx(k, rel=1e-6)
    assert not runs["bucket"]["xla"], "bucket's recorded cost is an uncompiled one"
    cost = {mode: steady_cost(run["batching"], mode, k, run["xla"], task)
            for mode, run in runs.items()}
    measured = median_rate(figures, "tfspeed_pack") / median_rate(figures, "tfspeed_bucket")
    return cost["bucket"] / cost["pack"], measured


@pytest.mark.parametrize("name", corpora())
def test_the_cost_model_ranks_bucket_and_pack_as_the_records_measured(name):
    pairs = [ratios(record, name) for record in quiet_records() if name in record["figures"]]
    off = statistics.median(predicted / measured for predicted, measured in pairs)
    assert off == pytest.approx(1.0, abs=TOLERANCE), (name, pairs)
    if all(measured > 1 + CLEAR_GAP for _, measured in pairs) or all(
            measured < 1 - CLEAR_GAP for _, measured in pairs):
        assert all((predicted > 1) == (pairs[0][1] > 1) for predicted, _ in pairs), pairs
