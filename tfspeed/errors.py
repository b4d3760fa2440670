"""User-facing errors: one line, exit status 2, never a traceback."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable


class UsageError(Exception):
    """A mistake the user can fix: bad flags, bad paths, bad data.

    The message must say what is wrong, where, and how to fix it, on one line.
    """


def exit_on_usage_error(main: Callable[[], int | None]) -> int:
    """Runs ``main`` and turns a ``UsageError`` into one line on stderr and status 2."""
    try:
        return main() or 0
    except UsageError as e:
        message = " ".join(str(e).split())  # one line, whatever the message held
        print(f"error: {message}", file=sys.stderr)
        return 2


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
