"""One set of defaults: the config dataclasses, the command line and ``tfspeed.fit`` resolve the
same job; ``auto`` is a value of its own; the config imports no TensorFlow."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from tests import forked
from tests.conftest import REPO
from tfspeed import config as config_lib
from tfspeed.config import AUTO, Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.errors import UsageError

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_auto_is_a_value_of_its_own():
    train, runtime = TrainConfig(), RuntimeConfig()
    assert train.steps_per_execution == AUTO and runtime.intra_op_threads == AUTO
    assert (runtime.strategy, runtime.precision, runtime.xla) == (AUTO, AUTO, AUTO)
    assert TrainConfig(steps_per_execution=4).validate().steps_per_execution == 4
    for bad, message in ((0, "must be >= 1"), ("sometimes", "must be a number or 'auto'"),
                         (-1, "must be >= 1")):
        with pytest.raises(UsageError, match=message):
            TrainConfig(steps_per_execution=bad).validate()
    with pytest.raises(UsageError, match=r"--intra_op_threads=-1 must be >= 0 \(0: one per "
                                         r"core\) or 'auto'"):
        RuntimeConfig(intra_op_threads=-1).validate()


def test_evaluations_along_the_run_need_an_eval_split():
    """--eval_every_epochs with --eval_split='' once trained on and evaluated nothing."""
    config = Config(data=DataConfig(data_dir="d", eval_split=""),
                    train=TrainConfig(eval_every_epochs=1), model_dir="m")
    with pytest.raises(UsageError, match=r"--eval_every_epochs=1 evaluates on --eval_split, "
                                         r"which is empty; name a split"):
        config.validate()
    assert dataclasses.replace(config, train=TrainConfig()).validate()


def test_every_flag_comes_from_a_field_with_its_default_and_help():
    from absl import flags

    from tfspeed.config import flags as config_flags  # noqa: F401 -- defines the flags

    for section in config_lib.SECTIONS.values():
        for field in dataclasses.fields(section):
            flag = flags.FLAGS[config_lib.flag_name(field)]
            assert flag.help.endswith(field.metadata["help"])
            default = field.default
            expected = [str(v) for v in default] if isinstance(default, tuple) else (
                str(default) if "Auto" in str(field.type) else default)
            assert flag.default == expected, field.name


def _report(path) -> dict:
    return json.loads((path / "report.json").read_text())


def _json(value):
    """As report.json holds it (tuples become lists)."""
    return json.loads(json.dumps(value))


def test_python_the_command_line_and_fit_resolve_the_same_defaults(digits_dir, tmp_path):
    """Config() in Python, the CLI with no flags but the paths, and tfspeed.fit with no
    keywords: the same settings, resolved the same way, in each report.json."""
    from tfspeed.training.run import run

    run(Config(data=DataConfig(data_dir=digits_dir), model_dir=str(tmp_path / "python")).validate())
    python = _report(tmp_path / "python")
    done = forked.run([sys.executable, "-m", "tfspeed.train", f"--data_dir={digits_dir}",
                       f"--model_dir={tmp_path / 'cli'}"], cwd=REPO, env=ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cli = _report(tmp_path / "cli")
    import tfspeed.data
    from tfspeed.training import models

    train = tfspeed.data.build(digits_dir, "train", 128)
    fit = tfspeed.fit(lambda: models.build(ModelConfig(), (8, 8, 1), 10), train,
                      model_dir=str(tmp_path / "fit"))
    fitted = _report(tmp_path / "fit")
    assert fitted["config"] == _json(fit["config"])
    for report in (python, cli, fitted):
        assert report["config"]["train"] == _json(dataclasses.asdict(TrainConfig()))
        assert report["config"]["runtime"] == _json(dataclasses.asdict(RuntimeConfig()))
    expected = {**dataclasses.asdict(Config()), "data": {**dataclasses.asdict(DataConfig()),
                                                         "data_dir": digits_dir}}
    for report, name in ((python, "python"), (cli, "cli")):
        assert report["config"] == _json({**expected, "model_dir": str(tmp_path / name)})
    # Resolved the same way: the hardware rules and the tuner ran for each.
    resolved = [(r["runtime"]["strategy"], _precision_rule(r), r["runtime"]["xla"],
                 r["steps_per_execution"]["auto"]) for r in (python, cli, fitted)]
    assert resolved[0] == resolved[1] == resolved[2]
    assert resolved[0][3] is True


def _precision_rule(report) -> str:
    """How the precision was resolved. Where the probe ran (a host with native bf16), each run
    timed its own steps, and on a shared machine the figures can fall either side of the
    margin: what must agree is that each run took the policy its own figures chose."""
    import re

    from tfspeed.probes.costs import AUTO_MARGIN

    precision = report["runtime"]["precision"]
    reason = report["runtime"]["reasons"]["precision"]
    found = re.search(r"measured ([\d.]+) ms/step in float32, ([\d.]+) in (\w+)", reason)
    if not found:
        return precision
    f32, other, policy = float(found[1]), float(found[2]), found[3]
    expected = policy if other <= (1 - AUTO_MARGIN) * f32 else "float32"
    if abs(other - (1 - AUTO_MARGIN) * f32) > 0.01:  # the figures are rounded to 0.01 ms
        assert precision == expected, reason
    return "measured"


def test_importing_the_config_imports_no_tensorflow():
    code = ("import sys; import tfspeed.config, tfspeed.config.flags; "
            "c = tfspeed.config.DataConfig(data_dir='x', augment=('flip',)).validate(); "
            "print('tensorflow' in sys.modules, 'keras' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", "False"]


def test_the_config_names_match_the_code_that_implements_them():
    from tfspeed.data import ops
    from tfspeed.training import models

    assert set(config_lib.MODELS) == set(models.MODELS)
    assert set(config_lib.AUGMENTATIONS) == set(ops.AUGMENTATIONS)
