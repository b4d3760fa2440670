"""The benchmark record comparison: a planted regression is flagged, an equal pair passes."""

import copy
import json
import subprocess
import sys

import pytest
from conftest import REPO

from tfspeed import bench

RECORD = {
    "name": "input_pipeline",
    "config": {"images": 2000},
    "figures": {
        "a_files": {"images_per_sec": 300.0, "seconds": 10.0, "peak_rss_mb": 900.0},
        "c_tfspeed": {"images_per_sec": 600.0, "seconds": 5.0, "peak_rss_mb": 950.0,
                      "batches": 60},
    },
    "ratios": {"c/a": 2.0},
}


def _write(tmp_path, name, record):
    path = tmp_path / name
    path.write_text(json.dumps(record))
    return str(path)


def _compare(tmp_path, old, new, *extra):
    return subprocess.run(
        [sys.executable, "-m", "tfspeed.bench", "compare", _write(tmp_path, "old.json", old),
         _write(tmp_path, "new.json", new), *extra],
        capture_output=True, text=True, cwd=REPO, timeout=60)


def test_equal_records_pass(tmp_path):
    proc = _compare(tmp_path, RECORD, RECORD)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 regression(s) beyond 10% in 6 figures" in proc.stdout


def test_planted_regressions_are_flagged_in_both_directions(tmp_path):
    slower = copy.deepcopy(RECORD)
    slower["figures"]["c_tfspeed"]["images_per_sec"] = 480.0  # -20 % throughput
    slower["figures"]["a_files"]["peak_rss_mb"] = 1100.0  # +22 % memory
    slower["figures"]["a_files"]["seconds"] = 10.5  # +5 %: within the threshold
    proc = _compare(tmp_path, RECORD, slower)
    assert proc.returncode == 1
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REGRESSION")]
    assert sorted(line.split()[1] for line in lines) == [
        "a_files/peak_rss_mb:", "c_tfspeed/images_per_sec:"]
    assert "2 regression(s)" in proc.stdout


def test_improvements_and_threshold():
    faster = copy.deepcopy(RECORD)
    faster["figures"]["c_tfspeed"]["images_per_sec"] = 900.0
    faster["figures"]["c_tfspeed"]["seconds"] = 4.0
    assert not any(row["regression"] for row in bench.compare(RECORD, faster))
    slightly = copy.deepcopy(RECORD)
    slightly["figures"]["c_tfspeed"]["images_per_sec"] = 560.0  # -6.7 %
    assert not any(r["regression"] for r in bench.compare(RECORD, slightly, threshold=0.10))
    assert any(r["regression"] for r in bench.compare(RECORD, slightly, threshold=0.05))


@pytest.mark.parametrize("bad, message", [
    ({"name": "train_step", "figures": {}}, "compare records of the same benchmark"),
    ("not json", "cannot read benchmark record"),
])
def test_bad_records_are_one_line_errors(tmp_path, bad, message):
    new_path = tmp_path / "new.json"
    new_path.write_text(bad if isinstance(bad, str) else json.dumps(bad))
    proc = subprocess.run(
        [sys.executable, "-m", "tfspeed.bench", "compare", _write(tmp_path, "old.json", RECORD),
         str(new_path)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert message in proc.stderr


def test_run_converter_writes_into_a_fresh_directory_and_reports_its_rate(tmp_path):
    """The benchmarks' way of converting: the converter's own command line, its reported
    rate, and what an earlier run left in the output deleted first (a re-run with fewer
    shards leaves no stale shard behind)."""
    from conftest import write_photos

    photos = write_photos(tmp_path / "photos", classes=2, per_class=6)
    out = str(tmp_path / "out")
    first = bench.run_converter(f"imagefolder:{photos}", out, "--shards=3")
    second = bench.run_converter(f"imagefolder:{photos}", out, "--shards=2")
    assert (first["shards"], second["shards"]) == (3, 2)
    assert second["records_per_sec"] > 0
    assert "12 records" in second["summary"]
    assert second["storage"]["image_format"] == "jpeg"
    with pytest.raises(SystemExit, match="--shards=-1 failed"):
        bench.run_converter(f"imagefolder:{photos}", out, "--shards=-1")


def _rounds(*histories):
    return [{"round": i, "eval_history": [
        {"epoch": e + 1, "accuracy": acc, "loss": loss, "train_seconds": 10.0 * (e + 1)}
        for e, (acc, loss) in enumerate(history)]} for i, history in enumerate(histories)]


def test_time_to_target_counts_the_passes_a_contender_needs_to_match_the_peer():
    """benchmarks/sequences.py's time-to-target: the target is the best peer's median
    one-pass figure; a contender that needs two passes takes twice the time, and one that
    mostly never gets there has no median."""
    peers = {
        "guide_padded_batch": _rounds([(0.60, 1.2)], [(0.60, 1.2)], [(0.60, 1.2)]),
        "bucket_by_sequence_length": _rounds(*[[(0.70, 1.0), (0.80, 0.8)]] * 3),
    }
    ours = {
        "bucket": _rounds([(0.65, 1.1), (0.72, 0.9)], [(0.69, 1.1), (0.70, 0.95)],
                          [(0.72, 0.9), (0.8, 0.7)]),
        "pack": _rounds([(0.5, 2.0), (0.6, 1.5)], [(0.5, 2.0), (0.6, 1.5)],
                        [(0.71, 0.9), (0.8, 0.7)]),
    }
    target = bench.accuracy_target(peers, "accuracy")
    assert target == {"metric": "accuracy", "value": 0.70,
                      "set_by": "bucket_by_sequence_length after one pass"}

    def to_target(rounds):
        return bench.seconds_to_target(target, [r["eval_history"] for r in rounds])

    assert to_target(peers["bucket_by_sequence_length"])["median"] == 10.0
    assert to_target(ours["bucket"]) == {"median": 20.0, "min": 10.0, "max": 20.0,
                                         "reached": 3, "rounds": 3}
    assert to_target(ours["pack"]) == {"median": None, "min": 10.0, "max": None,
                                       "reached": 1, "rounds": 3}
    loss = bench.accuracy_target(peers, "loss")  # lower is better: the best peer's
    assert loss["value"] == 1.0 and loss["set_by"].startswith("bucket_by_sequence_length")
    assert bench.seconds_to(loss, ours["pack"][2]["eval_history"]) == 10.0
    assert bench.seconds_to(loss, ours["pack"][0]["eval_history"]) == float("inf")
