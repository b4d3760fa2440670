"""``--batching=auto``'s cost model against the measured rates of the newest sequences record.

auto picks bucket or pack from predicted work per real token (``text.predicted_costs``):
attention over each row's width (the model's K), padding, and XLA's faster steps where a
mode compiles. ``benchmarks/sequences.py`` times bucket and pack on the same model and three
real corpora; here the prediction, recomputed by today's code from what the record holds
(row widths, padding, the model), must rank the two modes as the record measured them and
come within ``TOLERANCE`` of the measured ratio. Changing the cost model, the attention
formula or the XLA gains away from measurement fails this; so does committing a record the
model does not fit (refit ``text.XLA_GAIN`` then). No timing is taken here.
"""

import glob
import json
import os
import statistics

import pytest

from tfspeed.data import text

RESULTS = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results")
TOLERANCE = 0.25  # of the measured pack/bucket ratio: the rounds' spread on a shared machine
CLEAR_GAP = 0.15  # a measured gap this wide must be ranked the same way by the model


def newest_record() -> dict:
    found = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "sequences-*.json"))):
        with open(path) as f:
            record = json.load(f)
        if record["config"].get("complete") and all(
                {"tfspeed_bucket", "tfspeed_pack"} <= set(figures)
                for figures in record["figures"].values()):
            found.append((os.path.basename(path), record))
    assert found, f"no complete sequences record with bucket and pack under {RESULTS}"
    return max(found)[1]  # sequences-<date>[-tag].json: the newest date last


def corpora():
    record = newest_record()
    return [(name, record["config"], figures) for name, figures in record["figures"].items()]


def median_rate(figures: dict, contender: str) -> float:
    return statistics.median(r["real_tokens_per_sec"] for r in figures[contender]["rounds"])


def steady_cost(batching: dict, mode: str, attention_length: float, xla: bool,
                task: str) -> float:
    """A mode's predicted work per real token without compiles (the record's rates leave the
    first step out), recomputed from the record's batching figures."""
    if mode == "pack":
        cost = text.row_cost(batching["max_length"], attention_length,
                             batching["expected_padding"]["pack"])
    else:
        cost = batching["costs"]["bucket"]  # uncompiled in the record (checked below)
    return cost * (text.compiled_factor(1, 0.0, task) if xla else 1.0)


@pytest.mark.parametrize("name,config,figures", corpora(), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_the_cost_model_ranks_bucket_and_pack_as_the_record_measured(name, config, figures):
    from tfspeed.training import transformer

    facts, model = config["datasets"][name], config["model"]
    task = facts["task"]
    k = transformer.attention_length(model["width"], model["depth"], model["heads"],
                                     facts["vocab_size"] if task == "lm" else 0)
    runs = {mode: figures[f"tfspeed_{mode}"]["rounds"][0] for mode in ("bucket", "pack")}
    assert runs["bucket"]["batching"]["attention_length"] == pytest.approx(k, rel=1e-6)
    assert not runs["bucket"]["xla"], "bucket's recorded cost is an uncompiled one"
    cost = {mode: steady_cost(run["batching"], mode, k, run["xla"], task)
            for mode, run in runs.items()}
    predicted = cost["bucket"] / cost["pack"]  # pack's speed over bucket's
    measured = median_rate(figures, "tfspeed_pack") / median_rate(figures, "tfspeed_bucket")
    assert predicted == pytest.approx(measured, rel=TOLERANCE), (name, predicted, measured)
    if abs(measured - 1) > CLEAR_GAP:
        assert (predicted > 1) == (measured > 1), (name, predicted, measured)
