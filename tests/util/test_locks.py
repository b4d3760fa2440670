"""Locks on run and output directories, between real processes."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tfspeed.errors import UsageError
from tfspeed.util import locks

HOLD = ("import sys, time; from tfspeed.util import locks; "
        "lock = locks.lock_model_dir(sys.argv[1]); print('held', flush=True); time.sleep(60)")


def _holder(directory):
    process = subprocess.Popen([sys.executable, "-c", HOLD, str(directory)], cwd=REPO,
                               stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_held_directory_names_its_owner_and_a_dead_owner_never_blocks(tmp_path):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(UsageError) as caught:
            locks.lock_model_dir(str(tmp_path))
        message = str(caught.value)
        assert re.fullmatch(
            rf"--model_dir={re.escape(str(tmp_path))} is in use by pid {holder.pid} on \S+, "
            r"running since [-\d]+ [:\d]+: `\S*python\S* -c .*`; wait for it to finish or stop "
            r"it, or use another --model_dir", message), message
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    lock = locks.lock_model_dir(str(tmp_path), "model_dir")  # the OS freed the dead one's lock
    try:
        owner = (tmp_path / locks.LOCK_FILE).read_text()
        assert f'"pid": {os.getpid()}' in owner
    finally:
        lock.release()
    assert not (tmp_path / locks.LOCK_FILE).exists()


def test_a_lock_is_exclusive_within_one_process_too(tmp_path):
    first = locks.lock_model_dir(str(tmp_path))
    try:
        with pytest.raises(UsageError, match=f"is in use by pid {os.getpid()}"):
            locks.lock_model_dir(str(tmp_path))
    finally:
        first.release()
    again = locks.lock_model_dir(str(tmp_path))
    again.release()
