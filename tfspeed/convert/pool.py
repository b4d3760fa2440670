"""Writes many shards at once: this process and worker processes, side by side.

This process writes shards too, from the first moment. Workers are forked where that is safe
(`start_method`: ready at once), else spawned: those start Python and import numpy, PIL and
protobuf first (never TensorFlow). A feeder thread hands the tasks
left to the workers, one at a time, so whoever is free takes the next shard and a worker
that started late simply writes fewer. Results reach the caller in this (main) thread only,
between this process's own shards and at the end.

Workers die with this process (`_die_with_parent`): a forked worker holds the write end of
its own task pipe, so after a ``kill -9`` of the converter it would wait on that pipe forever.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from tfspeed.convert.sources import Chunk
from tfspeed.convert.writer import ShardResult, ShardTask, keep_freed_memory, write_shard
from tfspeed.data import schema as schema_lib


def start_pool(workers: int, warm: int) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of up to ``workers`` processes, ``warm`` of them started right away.

    Started before the work is known, their start-up overlaps with listing the source and
    measuring storage.
    """
    context = multiprocessing.get_context(start_method())
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_die_with_parent, initargs=(os.getpid(),)
    )
    for _ in range(min(warm, workers)):
        pool.submit(keep_freed_memory)  # each submit starts a process while none is idle
    return pool


def stop_now(pool: concurrent.futures.ProcessPoolExecutor) -> None:
    """Stops ``pool`` at once, after a failure: its workers are killed (a rerun deletes any
    shard one left half-written), then its manager thread is waited for. Left running
    (``shutdown(wait=False)``), that thread closes its wake-up pipe while Python's exit
    handler may still write to it: an ``OSError`` traceback after the one-line error."""
    for process in list((getattr(pool, "_processes", None) or {}).values()):
        process.kill()
    pool.shutdown(wait=True, cancel_futures=True)


def start_method() -> str:
    """How worker processes start: ``fork`` where that is safe, else ``spawn``.

    A forked worker is ready at once, with the converter's modules already imported; a
    spawned one first starts Python and imports them, and with the storage probe now that
    short, the workers' start-up was what the first shards waited for. Forking is safe only
    from a process with one thread and no TensorFlow (whose thread pools and locks a fork
    would copy half-held; the command line imports none), and only on Linux (macOS' system
    libraries are not fork-safe).
    """
    safe = (sys.platform.startswith("linux") and "tensorflow" not in sys.modules
            and threading.active_count() == 1)
    return "fork" if safe else "spawn"


# How often a worker checks that the converter still lives: the longest an orphan outlives it.
_PARENT_CHECK_S = 0.2


def _die_with_parent(parent: int) -> None:
    """Ends this worker process soon after ``parent`` (the converter) ends, however it ended.

    Not ``prctl(PR_SET_PDEATHSIG)``: Linux sends that signal when the *thread* that started the
    worker ends, and spawned workers are started by whichever thread submits (here the
    feeder thread, which ends before the pool does). A thread that polls ``getppid()`` costs
    microseconds a check, works on every platform, and also catches a parent that died
    before this ran (``getppid()`` is then already another process).
    """

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_CHECK_S)
        os._exit(1)  # no cleanup: the rerun deletes the shard this worker left half-written

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def write_shards(
    out_dir: str,
    tasks: Sequence[ShardTask],
    make_chunk: Callable[[str, int, int], Chunk],
    template: schema_lib.Schema,
    *,
    workers: int,
    on_result: Callable[[ShardResult], None],
    on_record: Callable[[], None] | None = None,
    pool: concurrent.futures.Executor | None = None,
) -> None:
    """Writes ``tasks`` with ``workers`` writers: this process and ``workers - 1`` worker processes.

    Args:
      out_dir: the output directory.
      tasks: the shards to write.
      make_chunk: ``(split, start, stop) -> Chunk`` (called in this process).
      template: the schema whose features encode the records.
      workers: writers in all, this process included.
      on_result: called in this thread with each finished shard, in completion order.
      on_record: called after each item of the shards this process writes (progress).
      pool: a `start_pool` of ``workers - 1`` processes (else one is started, and stopped).
    """
    todo = _Tasks(tasks)
    helpers = min(workers, len(tasks)) - 1
    if helpers < 1:
        for task in todo:
            chunk = make_chunk(task.split, task.start, task.stop)
            on_result(write_shard(out_dir, task.file, chunk, template, on_record))
        return
    own = pool is None
    pool = start_pool(helpers, warm=helpers) if own else pool

    def submit(task: ShardTask) -> concurrent.futures.Future:
        chunk = make_chunk(task.split, task.start, task.stop)  # in the feeder thread
        return pool.submit(write_shard, out_dir, task.file, chunk, template)

    results = _Results()
    threading.Thread(target=_feed, args=(todo, submit, helpers, results), daemon=True).start()
    try:
        for task in todo:
            chunk = make_chunk(task.split, task.start, task.stop)
            on_result(write_shard(out_dir, task.file, chunk, template, on_record))
            results.deliver(on_result, wait=False)
        results.deliver(on_result, wait=True)
    except BaseException:
        todo.close()  # the feeder submits nothing more
        stop_now(pool)
        raise
    if own:
        pool.shutdown()


class _Tasks:
    """The tasks not taken yet, shared by this thread and the feeder."""

    def __init__(self, tasks: Sequence[ShardTask]):
        self._tasks, self._lock = iter(tasks), threading.Lock()

    def __iter__(self) -> Iterator[ShardTask]:
        return self

    def __next__(self) -> ShardTask:
        with self._lock:
            return next(self._tasks)

    def close(self) -> None:
        with self._lock:
            self._tasks = iter(())


class _Results:
    """Finished futures (or the feeder's error), then an end mark, from the feeder thread."""

    def __init__(self):
        self.queue: queue.Queue = queue.Queue()
        self.ended = False

    def deliver(self, on_result: Callable[[ShardResult], None], wait: bool) -> None:
        """Passes on the shards finished so far; with ``wait``, all of them, to the end."""
        while not self.ended:
            try:
                item = self.queue.get(block=wait)
            except queue.Empty:
                return
            if item is None:
                self.ended = True
            elif isinstance(item, BaseException):
                raise item
            else:
                on_result(item.result())  # raises what the worker raised


def _feed(todo: _Tasks, submit, helpers: int, results: _Results) -> None:
    """Keeps one task in flight per helper process until none is left (a thread)."""
    pending: set[concurrent.futures.Future] = set()
    try:
        while True:
            while len(pending) < helpers and (task := next(todo, None)) is not None:
                pending.add(submit(task))
            if not pending:
                break
            done, pending = concurrent.futures.wait(
                pending, return_when=concurrent.futures.FIRST_COMPLETED
            )
            for future in done:
                results.queue.put(future)
    except BaseException as e:  # e.g. the pool was shut down under it: the main thread raises
        results.queue.put(e)
    finally:
        results.queue.put(None)
