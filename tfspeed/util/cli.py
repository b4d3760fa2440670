"""What every command-line entry point shares: quiet start-up and one-line user errors."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable

from tfspeed.errors import exit_on_usage_error, storage_error
from tfspeed.util.system import import_tensorflow_quietly


def main_entry(main: Callable[[], int | None]) -> None:
    """Runs a CLI ``main``: TF imported quietly, UsageError -> one line and exit status 2."""
    import_tensorflow_quietly()
    _quiet_tensorflow_info()
    import tensorflow as tf

    try:
        status = exit_on_usage_error(main)
    except (OSError, tf.errors.OpError) as e:
        message = storage_error(e)
        if message is None:
            raise
        print(f"error: {message}", file=sys.stderr)
        status = 2
    sys.exit(status)


def _quiet_tensorflow_info() -> None:
    """Keeps tfspeed's INFO lines but drops TF's (async checkpoint threads narrate each save)."""
    import logging

    from absl import logging as absl_logging

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "tensorflow" not in record.pathname

    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    absl_logging.get_absl_logger().addFilter(keep)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that were free a moment ago."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()
