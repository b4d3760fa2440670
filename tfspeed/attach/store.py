"""Where a pipeline's deterministic part is stored, under a key that changes with it.

The key is a hash of the part's graph (with the functions' generated names made canonical, so
the same code gives the same key in every process) and of the size and modification time of
every file its graph names. A changed map, a changed argument or a touched source file gives a
new key, and so a new store: a stale one is never read.

A store is written by ``tf.data``'s file cache while the first run passes over the data, under a
lock this process holds. It is complete when the cache's index exists and no writer's lockfile
is left; a store left half-written by a killed run is removed and written again.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil

from tfspeed.errors import UsageError
from tfspeed.util import files, locks

ENV_DIR = "TFSPEED_CACHE_DIR"
TIMING = "timing.json"
PROBE_SHARE_OF_EPOCH = 10  # a timing covers at most 1/10 of the stored part's elements
PROBE_LEAST = 2  # but at least these (after the first): a rate needs two
PROBE_UNKNOWN = 64  # elements timed where the stored part's count is unknown
CONSTANT_BYTES = 1024  # constants larger than this are hashed, not printed, into the key
_HELD: dict[str, locks.Lock] = {}  # stores this process is writing: locked until it exits


def root(given: str | None = None) -> str:
    """The folder of stores: ``given``, ``$TFSPEED_CACHE_DIR`` or ``~/.cache/tfspeed``."""
    return given or os.environ.get(ENV_DIR) or os.path.join(
        os.path.expanduser("~"), ".cache", "tfspeed", "datasets")


def fingerprint(dataset) -> tuple[str, int]:
    """The key of ``dataset``'s graph and input files, and how many files it names.

    Raises:
      ValueError: the graph cannot be serialised (a Python function, a generator).
    """
    key, count, _ = describe(dataset)
    return key, count


def describe(dataset) -> tuple[str, int, set[str]]:
    """``fingerprint``'s key and file count, and every op type in the graph and its
    functions (``graph_ops``), from one serialisation of the graph.

    Raises:
      ValueError: the graph cannot be serialised (a Python function, a generator).
    """
    graph = _graph_def(dataset)
    ops = _op_types(graph)
    _digest_constants(graph)
    _canonical_nodes(graph)
    # Generated function names hold counters of this process (__inference_..._1234), and
    # the library is ordered by them: each name becomes "fn", each function hashed on its own.
    names = sorted((f.signature.name for f in graph.library.function), key=len, reverse=True)
    functions = [str(f) for f in graph.library.function]
    del graph.library.function[:]
    parts = [_canonical(part, names) for part in (str(graph), *functions)]
    digest = hashlib.sha256()
    for part in [parts[0], *sorted(parts[1:])]:
        digest.update(part.encode())
    inputs = _files(dataset)
    for path in inputs:
        st = os.stat(path)
        digest.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:24], len(inputs), ops


def _canonical_nodes(graph) -> None:
    """Node names and attributes that hold counters or ids of this process ("ZipDataset:10",
    "HashTableFromGraphDef/0/1768...", a table's "hash_table_<uid>") become their positions."""
    names = {node.name: f"n{i}" for i, node in enumerate(graph.node)}
    for node in graph.node:
        node.name = names[node.name]
        for k, given in enumerate(node.input):
            control, base = given.startswith("^"), given.lstrip("^")
            name, _, port = base.partition(":")
            node.input[k] = ("^" if control else "") + names.get(name, name) + (
                f":{port}" if port else "")
        for attr in ("metadata", "shared_name"):
            if attr in node.attr:
                del node.attr[attr]


def _canonical(text: str, names: list[str]) -> str:
    for name in names:
        text = text.replace(name, "fn")
    return text


def _digest_constants(graph) -> None:
    """Large constants (the user's arrays, from_tensor_slices) are replaced by their digest:
    printing 0.5 MB of digits as text took 0.15 s, more than a small pipeline's epoch."""
    nodes = [*graph.node, *(n for f in graph.library.function for n in f.node_def)]
    for node in nodes:
        if "value" in node.attr and node.attr["value"].HasField("tensor"):
            tensor = node.attr["value"].tensor
            if len(tensor.tensor_content) > CONSTANT_BYTES:
                tensor.tensor_content = hashlib.sha256(tensor.tensor_content).digest()


def graph_ops(dataset) -> set[str]:
    """Every op type in ``dataset``'s graph and its functions."""
    return _op_types(_graph_def(dataset))


def _graph_def(dataset):
    from tensorflow.core.framework import graph_pb2

    return graph_pb2.GraphDef.FromString(dataset._as_serialized_graph(
        external_state_policy=_warn_policy()).numpy())


def _op_types(graph) -> set[str]:
    ops = {n.op for n in graph.node}
    for fn in graph.library.function:
        ops |= {n.op for n in fn.node_def}
    return ops


def _warn_policy():
    from tensorflow.python.data.ops.options import ExternalStatePolicy

    return ExternalStatePolicy.WARN


def _files(dataset) -> list[str]:
    """The existing files named by string tensors the pipeline's objects hold (file lists,
    paths): their sizes and times go into the key."""
    import tensorflow as tf

    found, seen, todo = set(), set(), [dataset]
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        for value in vars(node).values():
            for item in value if isinstance(value, (tuple, list)) else [value]:
                if isinstance(item, tf.data.Dataset):
                    todo.append(item)
                elif isinstance(item, tf.Tensor) and item.dtype == tf.string and hasattr(
                        item, "numpy") and item.shape.num_elements() <= 1_000_000:
                    found |= {os.path.abspath(p.decode("utf-8", "replace"))
                              for p in item.numpy().reshape(-1)
                              if len(p) < 4096 and os.path.isfile(p)}
    return sorted(found)


class Store:
    """One stored part: ``prefix`` is the file cache's path, ``state`` one of ``complete``,
    ``writing`` (this process writes it now) or ``busy`` (another live process does)."""

    def __init__(self, folder: str, key: str):
        self.folder = os.path.join(folder, key)
        self.prefix = os.path.join(self.folder, "elements")
        self.key = key
        self._locked = False  # this object took the writer's lock (not another in-process)
        self.state = self._open()

    def _open(self) -> str:
        os.makedirs(self.folder, exist_ok=True)
        if self.complete():
            return "complete"
        if self.folder in _HELD:  # this process writes it: a second pipeline reads as it goes
            return "writing"
        try:
            lock = locks.acquire(os.path.join(self.folder, "writer.lock"), "a dataset store",
                                 "wait for the other run, or give another cache_dir")
        except UsageError:  # another live process writes it
            return "busy"
        _remove_partial(self.prefix)  # a killed writer's leftovers: never read
        _HELD[self.folder] = lock
        self._locked = True
        return "writing"

    def abandon(self) -> None:
        """Nothing is written after all: the lock goes back (another process may write)."""
        if self._locked:
            self._locked = False
            _HELD.pop(self.folder).release()

    def complete(self) -> bool:
        """The file cache finished a whole pass: its index is there and no writer's lock."""
        return os.path.exists(self.prefix + ".index") and not glob.glob(
            glob.escape(self.prefix) + "*.lockfile")

    def timing(self) -> dict | None:
        """The store against the pipeline as written, as a later run first timed them."""
        try:
            with open(os.path.join(self.folder, TIMING)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def keep_timing(self, figures: dict) -> None:
        files.write_json_atomic(os.path.join(self.folder, TIMING), figures)

    def size_bytes(self) -> int:
        return sum(os.path.getsize(p) for p in glob.glob(glob.escape(self.prefix) + "*"))


def _remove_partial(prefix: str) -> None:
    for path in glob.glob(glob.escape(prefix) + "*"):
        if os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.remove(path)


def sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", text)


def timed_pass(dataset, seconds: float, most: int, keep: int = 0,
               warm: int = 1) -> tuple[float, int, list]:
    """Elements/s of one pass's start, after its first ``warm`` elements (the warm-up), over
    at most ``most`` elements or ``seconds``: the one timing optimize and its worker probe
    share.

    Returns:
      The rate, how many elements were timed, and the first ``keep`` elements as lists of
      NumPy arrays (to compare two contenders' elements).
    """
    import time

    import numpy as np
    import tensorflow as tf

    def kept_form(element):
        return [np.asarray(t) for t in tf.nest.flatten(element)]

    it, kept = iter(dataset), []
    for _ in range(warm):
        first = next(it, None)
        if first is None:
            return 0.0, 0, kept
        if len(kept) < keep:
            kept.append(kept_form(first))
    n, start = 0, time.perf_counter()
    for element in it:
        n += 1
        if len(kept) < keep:
            kept.append(kept_form(element))
        if n >= most or time.perf_counter() - start >= seconds:
            break
    return n / max(time.perf_counter() - start, 1e-9), n, kept
