"""Dry-run a multi-worker job on one machine: ``python -m tfspeed.launch --workers=N -- FLAGS``.

  python -m tfspeed.launch --workers=2 -- --flagfile=pipelines/digits.flags

starts N ``python -m tfspeed.train FLAGS --strategy=multi_worker`` processes, each with a
``TF_CONFIG`` naming all N on free 127.0.0.1 ports and its own index; worker 0 is the chief
(it writes checkpoints, logs, the model and report.json). Output lines carry a
``[worker i]`` prefix. On a real cluster, the cluster manager sets ``TF_CONFIG`` instead.

When a worker dies, the others cannot go on (every step is an all-reduce over all of
them): the launcher stops them and, with ``--max_restarts``, starts the whole job again;
it resumes from the chief's last checkpoint, as a cluster manager would do it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

from absl import app, flags

from tfspeed.errors import UsageError, exit_on_usage_error
from tfspeed.util.cli import exit_on_help, flags_usage, free_ports

_WORKERS = flags.DEFINE_integer("workers", 2, "Worker processes to start.")
_MAX_RESTARTS = flags.DEFINE_integer(
    "max_restarts", 0, "Times to restart the whole job after a worker dies.")
_MODULE = flags.DEFINE_string("module", "tfspeed.train", "Python module each worker runs.")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "Address the workers listen on.")

STOP_GRACE_S = 10.0


def tf_config(hosts: list[str], index: int) -> str:
    """The ``TF_CONFIG`` of worker ``index`` in a cluster of ``hosts`` (worker 0 is chief)."""
    return json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})


def launch(argv: list[str], workers: int, module: str = "tfspeed.train",
           host: str = "127.0.0.1", max_restarts: int = 0) -> int:
    """Runs the job, restarting it up to ``max_restarts`` times; returns the exit status."""
    if workers < 1:
        raise UsageError(f"--workers={workers} must be >= 1")
    if max_restarts < 0:
        raise UsageError(f"--max_restarts={max_restarts} must be >= 0")
    for attempt in range(max_restarts + 1):
        status, who = _run_once(argv, workers, module, host)
        if status == 0:
            return 0
        what = _describe(status)
        if attempt == max_restarts:
            _say(f"worker {who} {what}; no restarts left (--max_restarts={max_restarts})")
            return status if status > 0 else 128 - status
        _say(f"worker {who} {what}; restarting all {workers} workers (restart {attempt + 1} "
             f"of {max_restarts}): the job resumes from its last checkpoint")
    return 1


def _run_once(argv, workers, module, host) -> tuple[int, int]:
    """Starts the workers and waits; returns (0, -1) or (a failed worker's status, index)."""
    hosts = [f"{host}:{port}" for port in free_ports(workers, host)]
    command = [sys.executable, "-m", module, *argv, "--strategy=multi_worker"]
    processes = []
    for index in range(workers):
        env = {**os.environ, "TF_CONFIG": tf_config(hosts, index)}
        process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, bufsize=1)
        processes.append(process)
        threading.Thread(target=_relay, args=(process, index), daemon=True).start()
        _say(f"worker {index}: pid {process.pid} at {hosts[index]}")
    try:
        while True:
            for index, process in enumerate(processes):
                code = process.poll()
                if code not in (None, 0):
                    _stop(processes)
                    return code, index
            if all(p.poll() == 0 for p in processes):
                return 0, -1
            time.sleep(0.2)
    except KeyboardInterrupt:
        _stop(processes)
        raise


def _relay(process: subprocess.Popen, index: int) -> None:
    for line in process.stdout:
        sys.stdout.write(f"[worker {index}] {line}")
        sys.stdout.flush()


def _stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM, then SIGKILL after a grace period, for every worker still running."""
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for p in processes:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _describe(status: int) -> str:
    if status < 0:
        return f"was killed by {signal.Signals(-status).name}"
    return f"exited with status {status}"


def _say(message: str) -> None:
    print(f"[launch] {message}", flush=True)


def main(argv: list[str]) -> int:
    train_flags = argv[1:]
    if not train_flags:
        raise UsageError("give the training flags after --, e.g. python -m tfspeed.launch "
                         "--workers=2 -- --flagfile=pipelines/digits.flags")
    return launch(train_flags, _WORKERS.value, _MODULE.value, _HOST.value,
                  _MAX_RESTARTS.value)


def run_main() -> None:
    exit_on_help(lambda: flags_usage(
        __doc__, {"launch": [_WORKERS, _MAX_RESTARTS, _MODULE, _HOST]}))
    sys.exit(exit_on_usage_error(lambda: app.run(main)))


if __name__ == "__main__":
    run_main()
