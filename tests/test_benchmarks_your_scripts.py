"""benchmarks/your_scripts.py, smallest run: its real scripts are written, differ from the
script as written by the optimize lines alone, and run under ``python -m tfspeed.run`` to a
record."""

import json
import os
import subprocess
import sys

from conftest import REPO


def test_your_scripts_writes_real_scripts_and_runs_one_under_tfspeed_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "your_scripts.py"), "--rounds=1",
         "--epochs=2", "--images=4", "--pipelines=csv_lines", "--models=small",
         "--routes=tfspeed_run", f"--workdir={tmp_path}"],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO), "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout)
    run = record["figures"]["csv_lines/small"]["tfspeed_run"]
    assert run["failed"] == [] and run["lines_changed"] == 0
    assert run["examples_per_sec"]["median"] > 0 and len(run["examples_per_sec"]["rounds"]) == 1
    assert run["said"], "tfspeed.run printed nothing: the script ran without it"
    assert record["figures"]["csv_lines/small"]["input_alone"]["examples_per_epoch"] == 442
    written = (tmp_path / "scripts" / "csv_lines_small_as_written.py").read_text().splitlines()
    optimized = (tmp_path / "scripts" / "csv_lines_small_optimize.py").read_text().splitlines()
    assert not any("import tfspeed" in line or "tfspeed.optimize" in line for line in written)
    added = [line for line in optimized if line not in written]
    assert added == ["import tfspeed", "train = tfspeed.optimize(train)"]
    assert [line for line in optimized if line in written] == written
