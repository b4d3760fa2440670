"""benchmarks/sequences.py end to end at a tiny size: one round, two contenders, each in a
process of its own; checks the record's structure, not its timings."""

import json
import subprocess
import sys

from conftest import REPO


def test_one_tiny_round(tmp_path):
    results = tmp_path / "results"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "benchmarks" / "sequences.py"), f"--workdir={tmp_path}",
         "--datasets=pydoc_lm", "--items=60", "--max_length=64", "--width=16", "--depth=1",
         "--heads=2", "--batch_size=8", "--rounds=1",
         "--contenders=guide_padded_batch,tfspeed_pack", f"--results_dir={results}",
         "--tag=test"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    record = json.loads(out)
    assert record["name"] == "sequences"
    assert record["config"]["datasets"]["pydoc_lm"]["task"] == "lm"
    written = list(results.glob("sequences-*-test.json"))
    assert len(written) == 1 and json.loads(written[0].read_text()) == record

    figures = record["figures"]["pydoc_lm"]
    pids = set()
    for contender in ("guide_padded_batch", "tfspeed_pack"):
        (run,) = figures[contender]["rounds"]
        assert "failed" not in run, run.get("error")
        assert run["real_tokens_per_sec"] > 0 and 0 <= run["padding_fraction"] < 1
        assert run["eval_metrics"]["loss"] > 0
        assert figures[contender]["real_tokens_per_sec"]["min"] <= figures[contender][
            "real_tokens_per_sec"]["median"]
        pids.add(run["pid"])
    assert proc.pid not in pids and len(pids) == 2  # each contender in a process of its own
    assert "tfspeed_pack/guide_padded_batch" in record["ratios"]["pydoc_lm"]
