"""Worker processes for the Python of a user's pipeline (see ``tfspeed.attach.workers``).

Workers are fresh interpreters (``subprocess``), never forks of this one: forking a process
whose TensorFlow threads hold locks can deadlock the child, and multiprocessing's 'spawn' and
'forkserver' run the user's main script again in every child when it has no ``__main__``
guard. Functions travel by cloudpickle (closures and lambdas included); elements by pickle
over each worker's stdin and stdout. A pass keeps its pool while it runs and gives it back to
its dataset when it ends; a pass abandoned midway or failed ends its workers, and a dataset's
idle workers end with it, or at exit.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import struct
import subprocess
import sys
import threading
import weakref

DEPTH = 4  # elements in flight per map worker
AHEAD = 8  # elements a generator's producer may hold before the consumer takes them
# An idle pool waits this long for the next pass (the next epoch, after validation) before
# its processes end: a new pool costs a fresh interpreter and the function's imports.
IDLE_SECONDS = 5.0
_HEADER = struct.Struct("<Q")
_CHILD = "from tfspeed.attach.pool import serve; serve()"


class WorkerError(RuntimeError):
    """A user's function raised in a worker process, or its process died: one line."""


# -- The wire: length-prefixed pickles over a worker's stdin and stdout. --------------------

def _send(stream, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _recv(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None
    return pickle.loads(stream.read(_HEADER.unpack(head)[0]))


def one_line(e: BaseException) -> str:
    """An exception as one line: its type and message."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


# -- The worker process. -------------------------------------------------------------------

def serve() -> None:
    """A worker's main: runs the function its parent sends on each message, until its stdin
    ends (the parent closed it, or died)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the user's prints go to stderr, never into the replies
    sys.stdout = sys.stderr
    credits, work = threading.Semaphore(0), collections.deque()
    ready = threading.Condition()

    def read():  # always drains stdin, so a parent's write never waits on a busy worker
        while True:
            msg = _recv(sys.stdin.buffer)
            if msg is None:  # the parent is gone: a producer waiting for credit stops too
                credits.release(AHEAD + 1)
            elif msg[0] == "credit":
                credits.release(msg[1])
                continue
            with ready:
                work.append(msg)
                ready.notify()
            if msg is None:
                return

    threading.Thread(target=read, daemon=True).start()
    # BrokenPipeError: the parent stopped reading, its pass is over.
    with contextlib.suppress(BrokenPipeError, KeyboardInterrupt):
        _work(replies, credits, work, ready)


def _work(replies, credits, work, ready) -> None:
    fn = None
    while True:
        with ready:
            ready.wait_for(lambda: work)
            msg = work.popleft()
        if msg is None:
            return
        if msg[0] == "fn":
            fn = _load(*msg[1:])
        elif msg[0] == "call":
            try:
                _send(replies, ("ok", fn(*msg[1])))
            except BaseException as e:  # noqa: BLE001  the user's error, sent back as one line
                _send(replies, ("error", one_line(e)))
        elif msg[0] == "stream":
            _stream(fn, replies, credits)


def _load(payload: bytes, path: list[str], eager: int, outputs: int):
    """The user's function; ``eager``: a py_function's, which takes and gives tensors."""
    sys.path[:] = path  # the parent's: modules its function names import here too
    try:
        import cloudpickle

        fn = cloudpickle.loads(payload)
    except BaseException as e:  # noqa: BLE001  raised at the first call, where it is reported
        err = e

        def fn(*args):
            raise err
    if outputs < 0:  # a generator
        return fn
    if eager:
        import tensorflow as tf

    def call(*args):
        if eager:
            args = [tf.constant(a) for a in args]
        out = fn(*args)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        if len(out) != outputs:
            raise ValueError(f"returned {len(out)} values where {outputs} were declared")
        return [o.numpy() if hasattr(o, "numpy") else o for o in out]
    return call


def _stream(gen, replies, credits) -> None:
    try:
        for value in gen():
            credits.acquire()  # bounded: never more than AHEAD elements unread
            _send(replies, ("ok", value))
        _send(replies, ("end", None))
    except BaseException as e:  # noqa: BLE001
        _send(replies, ("error", one_line(e)))


# -- The parent's side. --------------------------------------------------------------------

class Pool:
    """``size`` worker processes, each holding the same function."""

    def __init__(self, name: str, payload: bytes, size: int, eager: bool, outputs: int):
        self.name = name
        self.procs = [subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, env=_child_env())
                      for _ in range(size)]
        for p in self.procs:
            _send(p.stdin, ("fn", payload, list(sys.path), int(eager), outputs))
        self.close = weakref.finalize(self, _end, list(self.procs))  # at exit too

    def _reply(self, w: int):
        msg = _recv(self.procs[w].stdout)
        if msg is None:
            code = self.procs[w].wait()
            raise WorkerError(f"the worker process running {self.name} died (exit code "
                              f"{code})")
        if msg[0] == "error":
            raise WorkerError(f"{self.name} raised in a worker process: {msg[1]}")
        return msg

    def imap(self, items):
        """For each (keep, args) of ``items``, in their order: (keep, the function's result
        on args)."""
        items, pending, sent = iter(items), collections.deque(), 0

        def submit() -> None:
            nonlocal sent
            item = next(items, None)
            if item is not None:
                w = sent % len(self.procs)
                _send(self.procs[w].stdin, ("call", item[1]))
                pending.append((w, item[0]))
                sent += 1
        for _ in range(DEPTH * len(self.procs)):
            submit()
        while pending:
            w, keep = pending.popleft()
            result = self._reply(w)[1]
            submit()
            yield keep, result

    def stream(self):
        """The elements of one pass of the generator, in order."""
        p = self.procs[0]
        _send(p.stdin, ("stream",))
        _send(p.stdin, ("credit", AHEAD))
        while (msg := self._reply(0))[0] != "end":
            _send(p.stdin, ("credit", 1))
            yield msg[1]


def _child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # tfspeed itself must import in the child even where it is not installed (a checkout).
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


def _end(procs) -> None:
    for p in procs:  # EOF on stdin: each worker returns from serve()
        with contextlib.suppress(OSError):
            p.stdin.close()
    for p in procs:
        p.stdout.close()  # a worker blocked on writing a reply gets EPIPE and ends
        try:
            p.wait(timeout=1)
        except subprocess.TimeoutExpired:  # busy in the user's code: no need to wait for it
            p.kill()
            p.wait()


class Workers:
    """The worker pools of one rewritten dataset: a pass takes an idle pool (or starts one)
    and gives it back when it ends, so the next epoch finds its workers started; a pool idle
    for ``IDLE_SECONDS`` ends."""

    def __init__(self, fn, size: int, eager: bool = False, outputs: int = -1):
        self.name = describe(fn)
        self.payload = dumps(fn)
        self.size, self.eager, self.outputs = size, eager, outputs
        self.idle: list[Pool] = []
        self.lock = threading.Lock()
        weakref.finalize(self, _close_all, self.idle)

    def run(self, use):
        """Yields what ``use(pool)`` yields; the pool goes back when the pass ends, and ends
        with it when the pass fails or is abandoned."""
        with self.lock:
            pool = self.idle.pop() if self.idle else None
        pool = pool or Pool(self.name, self.payload, self.size, self.eager, self.outputs)
        done = False
        try:
            yield from use(pool)
            done = True
        finally:
            if done:
                pool.returned = object()  # this return's own timer, not an earlier one's
                with self.lock:
                    self.idle.append(pool)
                timer = threading.Timer(IDLE_SECONDS, self._expire, [pool, pool.returned])
                timer.daemon = True
                timer.start()
            else:
                pool.close()

    def close(self) -> None:
        """Ends the idle pools now (a pass still running keeps its own until it ends)."""
        with self.lock:
            idle, self.idle[:] = list(self.idle), []
        _close_all(idle)

    def _expire(self, pool: Pool, returned: object) -> None:
        with self.lock:
            if pool not in self.idle or pool.returned is not returned:  # taken meanwhile
                return
            self.idle.remove(pool)
        pool.close()


def dumps(fn) -> bytes:
    """``fn`` pickled by cloudpickle, with every function it carries by value (its own
    helpers, a script's) stripped of what autograph leaves on a function it has seen
    (``ag_dnc_wrapper__``): sent with it, each worker would import TensorFlow to unpickle it."""
    import io
    import types

    import cloudpickle

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, types.FunctionType) and any(
                    k.startswith("ag_") for k in getattr(obj, "__dict__", {})):
                bare = types.FunctionType(obj.__code__, obj.__globals__, obj.__name__,
                                          obj.__defaults__, obj.__closure__)
                bare.__qualname__, bare.__module__ = obj.__qualname__, obj.__module__
                bare.__kwdefaults__ = obj.__kwdefaults__
                bare.__dict__.update(
                    {k: v for k, v in obj.__dict__.items() if not k.startswith("ag_")})
                obj = bare
            return super().reducer_override(obj)

    out = io.BytesIO()
    Pickler(out).dump(fn)
    return out.getvalue()


def _close_all(pools: list) -> None:
    for pool in pools:
        pool.close()


def describe(fn) -> str:
    """A function's name as its user wrote it: ``load``, or ``<lambda> (train.py:12)``."""
    name = (getattr(fn, "__qualname__", None) or repr(fn)).rsplit(".<locals>.", 1)[-1]
    code = getattr(fn, "__code__", None)
    file = os.path.basename(code.co_filename) if code is not None else ""
    if name == "<lambda>" and file and not file.startswith("__autograph_generated"):
        name += f" ({file}:{code.co_firstlineno})"
    return name


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)
