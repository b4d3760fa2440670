"""What every command-line entry point shares: quiet start-up and one-line user errors."""

from __future__ import annotations

import errno
import os
import socket
import sys
from collections.abc import Callable

from tfspeed.errors import exit_on_usage_error
from tfspeed.runtime import hostmem


def import_tensorflow_quietly() -> None:
    """Imports TensorFlow with its C++ start-up banner silenced.

    TF writes "All log messages before absl::InitializeLog()..." and oneDNN notices to
    file descriptor 2 before ``TF_CPP_MIN_LOG_LEVEL`` takes effect, so a one-line error
    would arrive buried under them. A failed import restores stderr first, so its
    traceback is still seen.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if "tensorflow" in sys.modules:
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow  # noqa: F401
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


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


_FULL = {errno.ENOSPC: "no space left on device", errno.EROFS: "read-only file system",
         errno.EDQUOT: "disk quota exceeded", errno.EACCES: "permission denied"}


def storage_error(error: BaseException) -> str | None:
    """One line for a full or read-only disk met while writing outputs, else None."""
    if isinstance(error, OSError) and error.errno in _FULL:
        where = f" writing {error.filename}" if error.filename else ""
        return (f"{_FULL[error.errno]}{where}: free some space or point --model_dir/--output "
                "at a writable disk; the unfinished outputs are not marked complete")
    text = str(getattr(error, "message", error))
    for reason in _FULL.values():
        if reason in text.lower():
            detail = text.split("}}")[-1].splitlines()[0].split(";")[0].strip()[:160]
            return (f"{reason} writing {detail}: free some space or point --model_dir/--output "
                    "at a writable disk; the unfinished outputs are not marked complete")
    return None


def _quiet_tensorflow_info() -> None:
    """Keeps tfspeed's INFO lines but drops TF's (async checkpoint threads narrate each save)."""
    import logging

    from absl import logging as absl_logging

    def keep(record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or "tensorflow" not in record.pathname

    logging.getLogger("tensorflow").setLevel(logging.WARNING)
    absl_logging.get_absl_logger().addFilter(keep)


def convert_main() -> None:
    """``tfspeed-convert`` / ``scripts/to_tfrecord.py``: the converter's CLI.

    It starts without TensorFlow (~2-3 s and ~0.5 GB saved): shards are written without it,
    and only a ``tfds:`` source imports it, quietly, when opened.
    """
    # The converter does no TF math: a TFDS worker that imports TF then starts without the
    # oneDNN banner on stderr. The caller's settings win.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    hostmem.apply()  # again: oneDNN off means malloc unless the pool is asked for
    from tfspeed.convert import run

    run()


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
