"""Exclusive locks on the directories a run writes into; a refused run is told who holds them.

Two training runs on one ``--model_dir`` (say, a scheduler restarts a job whose old process
still runs), or two conversions into one ``--output``, would overwrite each other's files
without a word. A lock here is ``fcntl.flock`` on a small file that its owner keeps open for
the life of the run: the kernel releases it when the process ends, however it ends (SIGKILL
included), so a dead owner never blocks anyone. The owner writes its pid, host, start time
and command into the file, so that a refused run can name the process that holds it.

The lock file is removed on release. A run that takes the lock checks afterwards that the
file it locked is still the one at that path, so that a file removed in between (by its
releasing owner) is never held by two runs at once. On file systems without ``flock``
(some NFS setups) runs go on unprotected, with one warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import json
import os
import shlex
import shutil
import socket
import sys
import time
from collections.abc import Iterator

from absl import logging

from tfspeed.errors import UsageError

LOCK_FILE = ".tfspeed-lock"  # in a locked directory: --model_dir, a conversion's --output
_COMMAND_CHARS = 300  # enough to recognise a command; a long flag list is cut
_OWNER_WAIT_S = 1.0  # a new owner writes its details right after it takes the lock


@dataclasses.dataclass(frozen=True)
class Owner:
    """The process holding a lock, as it described itself."""

    pid: int
    host: str
    started: str
    command: str

    @classmethod
    def this_process(cls) -> Owner:
        argv = list(getattr(sys, "orig_argv", sys.argv))
        if argv:
            argv[0] = os.path.basename(argv[0])  # "python", not the venv's full path
        command = " ".join(shlex.join(argv).split())  # one line, for a one-line message
        if len(command) > _COMMAND_CHARS:
            command = command[:_COMMAND_CHARS] + "..."
        return cls(os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"),
                   command)

    def describe(self) -> str:
        return f"pid {self.pid} on {self.host}, running since {self.started}: `{self.command}`"


class Lock:
    """A held lock (or, where the file system has no locks, a stand-in); ``release()`` or
    the end of the process frees it."""

    def __init__(self, path: str, fd: int | None = None):
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Removes the lock file, then unlocks it (in that order: see the module doc)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if _same_file(self._fd, self.path):
                os.remove(self.path)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> Lock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def acquire(path: str, what: str, fix: str) -> Lock:
    """Takes the exclusive lock at ``path`` for this process, or says who holds it.

    Args:
      path: the lock file; created if missing.
      what: what the lock protects, for the message (e.g. ``--model_dir=runs/a``).
      fix: what the user can do instead (e.g. ``use another --model_dir``).

    Returns:
      The held ``Lock``; release it when done (the OS does so if the process dies).

    Raises:
      UsageError: another live process holds it: ``{what} is in use by pid N on HOST,
        running since TIME: `COMMAND`; {fix}``.
    """
    try:
        import fcntl
    except ImportError:  # Windows: no concurrent-run protection
        return Lock(path)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{what} is in use by {_owner(path)}; {fix}") from None
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            logging.warning("cannot lock %s (%s): a second run on it would not be detected",
                            path, e.strerror)
            return Lock(path)
        if _same_file(fd, path):
            break
        os.close(fd)  # its owner removed it as we locked it: lock the file now at ``path``
    owner = json.dumps(dataclasses.asdict(Owner.this_process())).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, owner, 0)
    return Lock(path, fd)


@contextlib.contextmanager
def own_dir(parent: str, name: str, what: str, fix: str) -> Iterator[str]:
    """A directory of this process's own, ``parent/name-PID``, removed at the end.

    Directories ``parent/name-*`` left by dead processes (a killed worker) are removed
    first; a live process using ``name`` (a second job on the same directory) is an error.
    One lock per ``name`` (``parent/name.lock``) decides which: whoever holds it, owns them.

    Args:
      parent: where the directory goes.
      name: its name without the pid, e.g. ``.worker-1``.
      what, fix: as for ``acquire``.

    Yields:
      The directory's path (not yet created).
    """
    with acquire(os.path.join(parent, f"{name}.lock"), what, fix):
        prefix = os.path.join(parent, f"{name}-")
        for stale in glob.glob(glob.escape(prefix) + "*"):  # we hold the lock: theirs are dead
            shutil.rmtree(stale, ignore_errors=True)
        path = f"{prefix}{os.getpid()}"
        try:
            yield path
        finally:
            shutil.rmtree(path, ignore_errors=True)


def _owner(path: str) -> str:
    """Who holds the lock at ``path``, as its owner wrote it (it may not have yet)."""
    deadline = time.monotonic() + _OWNER_WAIT_S
    while True:
        try:
            with open(path) as f:
                return Owner(**json.load(f)).describe()
        except (OSError, ValueError, TypeError):
            if time.monotonic() > deadline:
                return f"another process (its lock file {path} does not name it)"
            time.sleep(0.05)


def _same_file(fd: int, path: str) -> bool:
    try:
        mine, now = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (now.st_dev, now.st_ino)


def lock_model_dir(model_dir: str, flag: str = "--model_dir") -> Lock:
    """The lock on a run directory: two runs writing one directory (training, diagnosis,
    ``tfspeed.fit``) would overwrite each other's checkpoints, logs and report.

    Raises:
      UsageError: a live run holds it, naming that run and what to do.
    """
    return acquire(os.path.join(model_dir, LOCK_FILE), f"{flag}={model_dir}",
                   f"wait for it to finish or stop it, or use another {flag}")
