"""Measured decisions kept in ``checkpoints/decisions.json``: a rerun of the same job reads
them back instead of measuring again; another job's flags do not reuse them."""

import dataclasses
import json

from tfspeed.config import Config, DataConfig
from tfspeed.training import decisions


def _config(tmp_path, batch_size=16):
    return Config(data=DataConfig(data_dir=str(tmp_path / "data"), batch_size=batch_size),
                  model_dir=str(tmp_path / "run"))


def _measured():
    return 8, 33, {"value": 8, "auto": True, "probe_steps": 33, "step_ms": 1.5}


def _never():
    raise AssertionError("measured again")


def test_steps_per_call_measured_once_then_reused(tmp_path):
    config = _config(tmp_path)
    first = decisions.Decisions(config.model_dir, config, "tensorflow")
    assert decisions.tuned(first, _measured) == _measured()
    assert first.report()["made"] == ["steps_per_execution"]
    rerun = decisions.Decisions(config.model_dir, config, "tensorflow")
    n, used, report = decisions.tuned(rerun, _never)
    assert (n, used) == (8, 0) and report["reused"] == "from the first run"
    assert report["step_ms"] == 1.5
    assert rerun.report()["reused"] == ["steps_per_execution"]
    assert rerun.report()["note"] == "steps_per_execution: reused from the first run"


def test_a_default_taken_is_not_recorded(tmp_path):
    config = _config(tmp_path)
    first = decisions.Decisions(config.model_dir, config, "tensorflow")
    decisions.tuned(first, lambda: (16, 0, {"value": 16, "auto": True, "probe": "none"}))
    rerun = decisions.Decisions(config.model_dir, config, "tensorflow")
    assert decisions.tuned(rerun, _measured) == _measured()


def test_another_jobs_decisions_are_measured_again_and_replaced(tmp_path):
    config = _config(tmp_path)
    decisions.tuned(decisions.Decisions(config.model_dir, config, "tensorflow"), _measured)
    other = dataclasses.replace(config, data=dataclasses.replace(config.data, batch_size=32))
    for backend, job in (("jax", config), ("tensorflow", other)):
        again = decisions.Decisions(job.model_dir, job, backend)
        assert decisions.tuned(again, _measured) == _measured()
        assert again.report()["reused"] == []
    # A longer run of the same job (more --train_steps) resumes the same computation.
    longer = dataclasses.replace(other, train=dataclasses.replace(other.train,
                                                                  train_steps=1000))
    assert decisions.tuned(decisions.Decisions(longer.model_dir, longer, "tensorflow"),
                           _never)[0] == 8


def test_the_first_attempts_kernels_are_kept(tmp_path):
    config = _config(tmp_path)
    on = {"backend": "tensorflow", "onednn": True, "intra_op_threads": 2}
    first = decisions.Decisions(config.model_dir, config, "tensorflow")
    assert first.first_kernels(on) == on
    rerun = decisions.Decisions(config.model_dir, config, "tensorflow")
    assert rerun.first_kernels({**on, "onednn": False}) == on
    saved = json.loads((tmp_path / "run" / "checkpoints" / "decisions.json").read_text())
    assert saved["kernels"] == on
    # A process that only reads (a worker of a multi-worker job) writes nothing.
    reader = decisions.Decisions(str(tmp_path / "other"), config, "tensorflow", writes=False)
    reader.first_kernels(on)
    assert not (tmp_path / "other").exists()
