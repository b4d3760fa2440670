"""What every command-line entry point shares: ``--help``, quiet start-up and one-line user
errors."""

from __future__ import annotations

import socket
import sys
from collections.abc import Callable, Sequence

from absl import flags

from tfspeed.errors import exit_on_usage_error, storage_error
from tfspeed.util.system import import_tensorflow_quietly

HELP_ARGS = ("-h", "-?", "-help", "--help", "-helpshort", "--helpshort")
HELPFULL_ARGS = ("-helpfull", "--helpfull")
_FLAGS_TAIL = ("--flagfile=FILE reads flags from FILE, one per line (pipelines/*.flags);\n"
               "--helpfull lists every flag, absl's own too.")


def exit_on_help(usage: Callable[[], str], argv: Sequence[str] | None = None) -> None:
    """Prints ``usage()`` and exits with status 0 if ``argv`` (default: the command line)
    asks for help; ``--helpfull`` adds every absl flag defined. Arguments after ``--``
    belong to another command (``tfspeed.launch``'s workers) and are not looked at.

    Commands call it first, before TensorFlow starts (seconds), so help comes at once;
    absl's own ``--help`` exits with status 1 and lists only the flags the ``__main__``
    module defined itself, which for commands built on ``tfspeed.config.flags`` is none.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    args = args[:args.index("--")] if "--" in args else args
    full = any(arg in HELPFULL_ARGS for arg in args)
    if full or any(arg in HELP_ARGS for arg in args):
        print(usage())
        if full:
            print(f"\nall flags:\n{flags.FLAGS.get_help()}")
        sys.exit(0)


def flags_usage(doc: str, groups: dict[str, Sequence[flags.FlagHolder]]) -> str:
    """A command's help: ``doc``, then its own flags by group, each with its help text and
    default (absl's format)."""
    parts = [doc.strip()]
    for title, holders in groups.items():
        listing = flags.FlagValues()  # only this group's flags, rendered the way absl does
        for holder in holders:
            listing[holder.name] = flags.FLAGS[holder.name]
        parts.append(f"{title} flags:\n"
                     f"{listing.get_help(prefix='  ', include_special_flags=False)}")
    parts.append(_FLAGS_TAIL)
    return "\n\n".join(parts)


def main_entry(main: Callable[[], int | None],
               check: Callable[[], object] | None = None) -> None:
    """Runs a CLI ``main``: TF imported quietly, UsageError -> one line and exit status 2.
    ``check`` (arguments only, no TensorFlow) runs first: a mistake there is one line at
    once, not after TensorFlow's seconds of import."""
    if check is not None:
        def checked() -> int:
            check()
            return 0

        status = exit_on_usage_error(checked)
        if status:
            sys.exit(status)
    _check_keras_backend()
    import_tensorflow_quietly()
    _quiet_tensorflow_info()
    import tensorflow as tf

    try:
        status = exit_on_usage_error(main)
    except Exception as e:
        message = storage_error(e) if isinstance(e, (OSError, tf.errors.OpError)) else None
        if message is not None:
            print(f"error: {message}", file=sys.stderr)
            status = 2
        elif getattr(e, "tfspeed_script", None):  # a user's script (tfspeed.run, diagnose)
            _print_script_error(e)
            status = 1
        else:
            raise
    sys.exit(status)


def _print_script_error(error: BaseException) -> None:
    """A user's script's own error as ``python SCRIPT`` prints it: its traceback from the
    script's first frame (tfspeed's and runpy's frames above it are not the script's)."""
    import traceback

    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != error.tfspeed_script:
        tb = tb.tb_next
    traceback.print_exception(type(error), error, tb or error.__traceback__)


def _check_keras_backend() -> None:
    """A ``KERAS_BACKEND`` tfspeed has no engine for is one line before Keras imports it (a
    backend whose package is missing would fail inside that import with a traceback)."""
    import os

    from tfspeed.runtime import BACKENDS, unsupported_backend

    name = os.environ.get("KERAS_BACKEND", "")
    if name and name not in BACKENDS:
        print(f"error: {unsupported_backend(name)}", file=sys.stderr)
        sys.exit(2)


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
