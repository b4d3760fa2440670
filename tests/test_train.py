"""The main job: flags -> config -> run -> report.json, and its user errors."""

import json
import os
import sys

import pytest
from absl import flags
from absl.testing import flagsaver
from conftest import REPO

from tests import forked
from tfspeed import train
from tfspeed.config import flags as tfspeed_flags
from tfspeed.errors import UsageError

REPORT_KEYS = {"eval_accuracy", "eval_loss", "batch_examples_per_sec", "step_time_ms",
               "optimizer_updates", "config", "runtime"}


def _run_cli(*args, cwd=REPO, timeout=300, **env_vars):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env_vars}
    return forked.run([sys.executable, "-m", "tfspeed.train", *args], cwd=cwd, env=env,
                      timeout=timeout)


def test_smoke_job_converts_the_demo_data_and_writes_a_report(tmp_path):
    """From nothing: the job converts digits itself, trains 6 updates and reports them.

    With oneDNN off, as on a CPU without VNNI/AMX, where TensorFlow alone would allocate host
    memory with malloc."""
    data_dir, model_dir = tmp_path / "digits", tmp_path / "run"
    proc = _run_cli("--flagfile=pipelines/smoke.flags", f"--data_dir={data_dir}",
                    f"--model_dir={model_dir}", TF_ENABLE_ONEDNN_OPTS="0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (data_dir / "schema.json").exists()
    report = json.loads((model_dir / "report.json").read_text())
    assert set(report) >= REPORT_KEYS
    assert report["optimizer_updates"] == 6
    assert report["batch_examples_per_sec"] > 0 and report["step_time_ms"] > 0
    assert 0 <= report["input_wait_pct"] <= 100
    assert report["peak_host_rss_mb"] > 100  # a TF process holds hundreds of MB
    assert report["versions"]["host_allocator"] == "pool"
    assert "with malloc" not in proc.stderr
    assert 0 <= report["eval_accuracy"] <= 1 and report["eval_loss"] > 0
    assert report["config"]["train"]["train_steps"] == 6
    assert report["runtime"]["reasons"]["precision"]
    # Converted first, then sized before TensorFlow started: a tiny MLP's ops on one thread.
    assert report["runtime"]["intra_op_threads"] == 1
    assert report["runtime"]["reasons"]["intra_op_threads"].startswith("auto: a small step")
    assert (model_dir / "model.keras").exists()
    assert list((model_dir / "logs" / "train").glob("events.out.tfevents.*"))
    assert "eval_accuracy=" in proc.stdout


def _config(argv):
    tfspeed_flags.parse(["tfspeed.train", *argv])
    return tfspeed_flags.to_config()


@flagsaver.flagsaver
def test_digits_demo_reaches_the_promised_accuracy(digits_dir, tmp_path):
    config = _config(["--flagfile=" + str(REPO / "pipelines/digits.flags"),
                      f"--data_dir={digits_dir}", f"--model_dir={tmp_path}", "--epochs=15"])
    report = train.run(config)
    assert report["eval_accuracy"] >= 0.9
    assert report["optimizer_updates"] == 15 * (
        report["dataset"]["num_train"] // config.data.batch_size)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--bogus=1"], "Unknown command line flag 'bogus'"),
        (["--batch_size=abc"], "flag --batch_size=abc"),
        (["--flagfile=/nonexistent.flags"], "Unable to open flagfile"),
        (["--cache=ram"], "flag --cache=ram"),
    ],
)
@flagsaver.flagsaver
def test_flag_errors_are_one_line_and_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        tfspeed_flags.parse(["tfspeed.train", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--train_steps=-3"], "--train_steps=-3 must be >= 0"),
        (["--batch_size=0"], "--batch_size=0 must be > 0"),
        (["--model=vgg"], "--model='vgg' is not one of"),
        (["--augment=rotate"], "--augment='rotate'"),
        (["--learning_rate=0"], "--learning_rate=0.0 must be > 0"),
        (["--intra_op_threads=many"], "--intra_op_threads='many' must be a number or 'auto'"),
        (["--intra_op_threads=-1"], "--intra_op_threads=-1 must be >= 0"),
    ],
)
@flagsaver.flagsaver
def test_bad_values_are_usage_errors(argv, message, tmp_path):
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        _config([f"--data_dir={tmp_path}", f"--model_dir={tmp_path}", *argv])


@flagsaver.flagsaver
def test_image_model_on_tabular_data_is_a_usage_error(tabular_dir, tmp_path):
    with pytest.raises(UsageError, match="--model=cnn needs image inputs.*use --model=mlp"):
        train.run(_config([f"--data_dir={tabular_dir}", f"--model_dir={tmp_path}",
                           "--model=cnn", "--batch_size=8"]))


@flagsaver.flagsaver
def test_run_time_mistakes_are_usage_errors(digits_dir, tmp_path):
    with pytest.raises(UsageError, match="larger than the .* records"):
        train.run(_config([f"--data_dir={digits_dir}", f"--model_dir={tmp_path}",
                           "--batch_size=100000"]))
    read_only = tmp_path / "ro"
    read_only.mkdir()
    read_only.chmod(0o500)
    if os.access(read_only, os.W_OK):  # root ignores permissions: use a path under a file
        read_only = tmp_path / "a_file"
        read_only.write_text("")
    with pytest.raises(UsageError, match="is not writable"):
        train.run(_config([f"--data_dir={digits_dir}", f"--model_dir={read_only}/run"]))


def test_cli_error_is_one_line_without_traceback(tmp_path):
    proc = _run_cli(f"--data_dir={tmp_path}/missing", f"--model_dir={tmp_path}/run")
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")
    assert "missing does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_flags_module_is_the_only_flag_reader():
    """Library modules take config values; only the commands, tfspeed.config.flags and the
    commands' shared help (util/cli: --helpfull lists absl's flags) define or read absl flags."""
    assert "data_dir" in flags.FLAGS
    commands = {"train", "tune", "diagnose", "verify", "launch", "data_service", "bench",
                "config/flags", "convert/cli", "util/cli"}
    library = [p for p in (REPO / "tfspeed").rglob("*.py")
               if str(p.relative_to(REPO / "tfspeed").with_suffix("")) not in commands]
    assert len(library) > 40
    for path in library:
        source = path.read_text()
        assert "from absl import flags" not in source and "flags.FLAGS" not in source, path
