"""Stopping a run on a signal: SIGTERM/SIGINT end the current execution, the trainer saves a
final checkpoint and raises ``Stopped``; rerunning the same command resumes."""

from __future__ import annotations

import signal
import threading


class Stopped(Exception):
    """Training stopped by SIGTERM/SIGINT after a final checkpoint; rerunning resumes it.

    Attributes:
      exit_status: 128 + the signal number (143 for SIGTERM), the shell convention.
    """

    def __init__(self, signum: int, updates: int):
        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name} at update {updates}; "
                         "rerun the same command to resume")
        self.exit_status = 128 + signum


class StopRequests:
    """While active, SIGTERM and SIGINT only set ``signum``: the loop ends its current
    execution, and ``fit`` saves and raises ``Stopped``. A second signal acts at once (the
    previous handler is back). Signal handlers exist only in the main thread."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, enabled: bool = True):
        self.signum = 0
        self.enabled = enabled
        self._previous: dict = {}

    def __enter__(self) -> StopRequests:
        if self.enabled and threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._request) for s in self.SIGNALS}
        return self

    def _request(self, signum, frame) -> None:
        self.signum = signum
        signal.signal(signum, self._previous[signum])

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
