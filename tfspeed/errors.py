"""User-facing errors: one line, exit status 2, never a traceback."""

from __future__ import annotations

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
