"""Start tf.data service servers: ``python -m tfspeed.data_service dispatcher|worker``.

  python -m tfspeed.data_service dispatcher --port=5050 --work_dir=/shared/dispatcher
  python -m tfspeed.data_service worker --dispatcher=HOST:5050 [--port=5051]

Then train with ``--data_service=grpc://HOST:5050``. These are TensorFlow's own servers
(``tf.data.experimental.service.DispatchServer`` / ``WorkerServer``). With ``--work_dir`` the
dispatcher journals its state there and a restarted dispatcher carries on where it was
(fault-tolerant mode); workers re-register by themselves. Each server prints one line
``... listening on grpc://HOST:PORT`` once it serves, then runs until killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from absl import app, flags, logging

from tfspeed.errors import UsageError, exit_on_usage_error
from tfspeed.util.cli import exit_on_help, flags_usage, free_ports, main_entry

COMMANDS = ("dispatcher", "worker")

_PORT = flags.DEFINE_integer("port", None, "Port to serve on (dispatcher default 5050; "
                             "worker default: any free port).")
_WORK_DIR = flags.DEFINE_string(
    "work_dir", "", "Dispatcher: journal directory; makes the dispatcher fault-tolerant "
    "(a restarted one resumes its jobs). Put it on storage that outlives the host.")
_WORKER_ADDRESSES = flags.DEFINE_list(
    "worker_addresses", [], "Dispatcher: the fixed worker list HOST:PORT,... that "
    "--data_service_sharding=file needs (workers then need a fixed --port).")
_WORKER_TIMEOUT_MS = flags.DEFINE_integer(
    "worker_timeout_ms", 0, "Dispatcher: ms without a heartbeat before a worker counts as "
    "gone and its work is handed to others (0: TensorFlow's default).")
_DISPATCHER = flags.DEFINE_string("dispatcher", "", "Worker: the dispatcher's HOST:PORT.")
_HOST = flags.DEFINE_string(
    "host", "localhost", "Worker: the host name clients reach this worker at.")
_SUPERVISE = flags.DEFINE_boolean(
    "supervise", True, "Worker: restart the server at the same address if it dies. TF's "
    "dispatcher gives a dead worker's task to nobody else; consumers wait until a worker "
    "at that address returns (what a cluster manager restarting it would also achieve).")

RESTART_DELAY_S = 1.0


def dispatcher(port: int, work_dir: str = "", worker_addresses=(), worker_timeout_ms: int = 0):
    """Starts a dispatcher on ``port`` (0: any free port); returns the running server."""
    import tensorflow as tf

    svc = tf.data.experimental.service
    options = {"port": port, "protocol": "grpc"}
    if work_dir:
        _make_dir(work_dir)
        options.update(work_dir=work_dir, fault_tolerant_mode=True)
    if worker_addresses:
        options["worker_addresses"] = list(worker_addresses)
    if worker_timeout_ms:
        options["worker_timeout_ms"] = worker_timeout_ms
    return _start(lambda: svc.DispatchServer(svc.DispatcherConfig(**options)), "dispatcher", port)


def worker(dispatcher_address: str, port: int = 0, host: str = "localhost"):
    """Starts a worker for the dispatcher at ``dispatcher_address``; returns the server."""
    import tensorflow as tf

    from tfspeed.data import service_client as service

    service.check_reachable(dispatcher_address)
    svc = tf.data.experimental.service
    config = svc.WorkerConfig(dispatcher_address=dispatcher_address.split("://")[-1],
                              port=port, worker_address=f"{host}:%port%", protocol="grpc")
    return _start(lambda: svc.WorkerServer(config), "worker", port)


def _start(make, what: str, port: int):
    import tensorflow as tf

    try:
        return make()
    except (tf.errors.OpError, RuntimeError) as e:
        detail = str(getattr(e, "message", e)).strip().splitlines()[0][:160]
        raise UsageError(f"the {what} could not start on port {port} ({detail}); pick a free "
                         "--port") from None


def _make_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--work_dir={path} cannot be created ({e.strerror}); pick a writable "
                         "directory") from None


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in COMMANDS:
        raise UsageError("say which server to start: python -m tfspeed.data_service "
                         "dispatcher --port=P --work_dir=DIR | worker --dispatcher=HOST:P")
    if argv[1] == "dispatcher":
        port = 5050 if _PORT.value is None else _PORT.value
        server = dispatcher(port, _WORK_DIR.value, _WORKER_ADDRESSES.value,
                            _WORKER_TIMEOUT_MS.value)
        where = f"grpc://localhost:{server._server.bound_port()}"
        extra = f" (journal in {_WORK_DIR.value})" if _WORK_DIR.value else ""
    else:
        if not _DISPATCHER.value:
            raise UsageError("worker needs --dispatcher=HOST:PORT, the address the dispatcher "
                             "printed")
        if _SUPERVISE.value:
            supervise(_DISPATCHER.value, _PORT.value or 0, _HOST.value)
            return
        server = worker(_DISPATCHER.value, _PORT.value or 0, _HOST.value)
        where = f"grpc://{_HOST.value}:{server._server.bound_port()}"
        extra = f" for dispatcher {_DISPATCHER.value}"
    print(f"tfspeed data service {argv[1]} listening on {where}{extra} (pid {os.getpid()})",
          flush=True)
    server.join()


def supervise(dispatcher_address: str, port: int, host: str) -> None:
    """Runs a worker server in a child process and restarts it, at the same port, whenever
    it dies; returns when this process is asked to stop (SIGTERM/SIGINT)."""
    port = port or free_ports(1)[0]  # fixed across restarts: tasks are bound to the address
    command = [sys.executable, "-m", "tfspeed.data_service", "worker", "--nosupervise",
               f"--dispatcher={dispatcher_address}", f"--port={port}", f"--host={host}"]
    stopping = []

    def stop(signum, frame):
        stopping.append(signum)
        if child.poll() is None:
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        child = subprocess.Popen(command)
        status = child.wait()
        if stopping or status == 0:
            return
        if status == 2:  # a usage error: restarting would only repeat it
            sys.exit(2)
        logging.warning("data service worker on port %d died (%s); restarting it at the same "
                        "address (the records it held are lost for this epoch)", port,
                        f"signal {-status}" if status < 0 else f"status {status}")
        time.sleep(RESTART_DELAY_S)


def run_main() -> None:
    exit_on_help(lambda: flags_usage(__doc__, {
        "dispatcher": [_PORT, _WORK_DIR, _WORKER_ADDRESSES, _WORKER_TIMEOUT_MS],
        "worker": [_DISPATCHER, _HOST, _SUPERVISE]}))
    if "worker" in sys.argv[1:2] and "--nosupervise" not in sys.argv:
        # The supervisor only starts and watches the server process: no TensorFlow here
        # (saves seconds and memory per worker host).
        sys.exit(exit_on_usage_error(lambda: app.run(main)))
    main_entry(lambda: app.run(main))


if __name__ == "__main__":
    sys.exit(run_main())
