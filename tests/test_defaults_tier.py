"""The default tier: the text job with the product's own defaults (precision, XLA and
batching ``auto``, checkpoints by the clock), each run a process of its own, on both kinds
of host whatever this machine is: oneDNN's custom kernels on (``TF_ENABLE_ONEDNN_OPTS=1``,
as TensorFlow does itself on CPUs with native bfloat16) and off (``=0``). The precision
probe's path runs on any machine with ``--precision=measure``; ``auto`` runs it where the
CPU has native bfloat16.

Each job trains, then the same command with more steps resumes it: the rerun restores the
first run's last update, reuses its measured decisions instead of probing again, and the
report says whether the resume is exact, and why: it is on the first attempt's kernels, and
is not where oneDNN was turned on in between."""

import json
import os
import sys

import pytest

from tests import forked
from tests.conftest import REPO

STEPS = 4


def _train(data_dir, model_dir, onednn: str, *flags):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "TF_ENABLE_ONEDNN_OPTS": onednn}
    done = forked.run(
        [sys.executable, "-m", "tfspeed.train", f"--data_dir={data_dir}",
         f"--model_dir={model_dir}", "--model=transformer", "--width=16", "--depth=1",
         "--heads=2", "--batch_size=16", "--log_every=2", "--eval_split=", *flags],
        cwd=REPO, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((model_dir / "report.json").read_text()), done.stderr


@pytest.mark.parametrize("onednn, rerun_onednn, precision",
                         [("1", "1", "measure"), ("0", "1", "auto")])
def test_defaults_resume_with_the_first_runs_decisions(text_dirs, tmp_path, onednn,
                                                       rerun_onednn, precision):
    data, run_dir = text_dirs["classification"], tmp_path / "run"
    # --noshuffle: the input order is fixed, so only the kernels decide exactness.
    flags = [f"--precision={precision}", "--noshuffle"]
    first, _ = _train(data, run_dir, onednn, f"--train_steps={STEPS}", *flags)
    again, log = _train(data, run_dir, rerun_onednn, f"--train_steps={2 * STEPS}", *flags)
    runtime = first["runtime"]
    assert first["config"]["runtime"]["xla"] == "auto"
    assert runtime["xla"] == (first["input"]["batching"]["mode"] == "pack")
    probed = runtime["reasons"]["precision"].startswith(("auto: measured", "measure"))
    assert probed == (precision == "measure" or "avx512_bf16" in _cpu_flags()
                      or "amx_bf16" in _cpu_flags()), runtime["reasons"]
    # The probe's two engines (float32 and the mixed policy) are compiled programs: counted.
    assert first["probe_compiled_programs"].get("precision", 0) == (2 if probed else 0)
    assert first["compiled_programs"] >= 1
    # The rerun resumed where the first ended, and took the first run's choices.
    assert first["resume"]["from_update"] == 0 and again["resume"]["from_update"] == STEPS
    assert again["optimizer_updates"] == 2 * STEPS
    assert again["runtime"]["precision"] == runtime["precision"]
    assert again["input"]["batching"]["mode"] == first["input"]["batching"]["mode"]
    if probed:
        assert first["decisions"]["made"] == ["precision"] and not first["decisions"]["reused"]
        assert again["decisions"]["reused"] == ["precision"]
        assert again["runtime"]["reasons"]["precision"].endswith("reused from the first run")
        assert again["probe_compiled_programs"] == {}
        assert "precision probe" not in log
    # Exact on the first attempt's kernels; not where oneDNN was turned on in between
    # (its kernels sum in another order than Eigen's).
    assert again["resume"]["exact"] == (onednn == rerun_onednn), again["resume"]
    if onednn != rerun_onednn:
        assert "onednn False -> True" in again["resume"]["why"], again["resume"]


def _cpu_flags() -> set[str]:
    from tfspeed.runtime import hostmem

    return set(hostmem.cpu_flags())
