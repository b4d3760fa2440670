"""tests/forked.py: a forked process behaves as subprocess's own for what the suite reads."""

import os
import signal
import subprocess
import sys

import pytest

from tests import forked

ENV = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}


def test_a_forked_command_has_its_own_status_streams_cwd_environment_and_argv(tmp_path):
    code = ("import os, sys; print(os.getcwd(), os.environ['ONLY_HERE'], sys.argv[1:], "
            "sys.stdin.read()); print('to stderr', file=sys.stderr); sys.exit(3)")
    done = forked.run([sys.executable, "-c", code, "a", "b"], cwd=tmp_path,
                      env={**ENV, "ONLY_HERE": "yes"}, input="given", timeout=60)
    assert done.returncode == 3
    assert done.stdout == f"{tmp_path} yes ['a', 'b'] given\n"
    assert done.stderr == "to stderr\n"
    assert "ONLY_HERE" not in os.environ


def test_a_scripts_error_is_its_traceback_alone_and_status_1(tmp_path):
    (tmp_path / "boom.py").write_text("import sys\n\nraise ValueError('no such column')\n")
    done = forked.run([sys.executable, "boom.py"], cwd=tmp_path, env=ENV, timeout=60)
    written = subprocess.run([sys.executable, "boom.py"], cwd=tmp_path, env=ENV,
                             capture_output=True, text=True, timeout=60)
    assert done.returncode == written.returncode == 1
    assert done.stderr == written.stderr
    assert done.stderr.splitlines()[1] == f'  File "{tmp_path / "boom.py"}", line 3, in <module>'


def test_signals_reach_the_forked_process_and_its_status_says_so():
    process = forked.Popen([sys.executable, "-c", "import time; print('up', flush=True); "
                            "time.sleep(600)"], env=ENV, stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "up\n" and process.poll() is None
    assert process.pid != os.getpid()
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.stdout.close()


def test_a_command_past_its_timeout_is_killed():
    with pytest.raises(subprocess.TimeoutExpired):
        forked.run([sys.executable, "-c", "import time; time.sleep(600)"], env=ENV, timeout=1)


def test_only_python_is_forked():
    with pytest.raises(ValueError, match=r"runs \[sys.executable, ...\]"):
        forked.Popen(["echo", "hi"])
