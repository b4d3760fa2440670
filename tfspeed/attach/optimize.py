"""``tfspeed.optimize(ds)``: the user's own ``tf.data`` pipeline, with its deterministic part
materialised once and replayed, in one line.

    train = tfspeed.optimize(train)

The first run stores the elements of the pipeline's deterministic part as they pass (decoded
and resized images, vectorised texts), under a key of its graph and input files; every later
run, and every later epoch, reads them instead of computing them again. Whatever is random
(augmentation, shuffles) runs after the store, as before, with the same seeds. A later run
times the rewrite against the pipeline as written and keeps the faster; a pipeline that cannot
be read is returned as it is, with one line that says why.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import sys

from tfspeed.attach.store import PROBE_LEAST, PROBE_SHARE_OF_EPOCH, PROBE_UNKNOWN
from tfspeed.errors import UsageError

RAM_SHARE = 0.25  # of the memory available now: the most a stored part may hold in RAM
DISK_SHARE = 0.5  # of the free disk: the most a store may take
PROBE_SECONDS = 1.0  # each contender's timing on a later run, at most
USER_CACHE = ("your .cache() in memory replaced by tfspeed's (the same elements, held once; "
              "a store on disk also serves later runs)")
# Attributes Keras' dataset utilities set on the datasets they return (scripts read them).
USER_ATTRIBUTES = ("class_names", "file_paths")


@dataclasses.dataclass
class Report:
    """What ``optimize`` did: ``changed`` and ``unchanged`` in words, the store, and the
    elements/s of ``timed`` (the stored part: ``before`` computed as written, ``after`` read
    from the store, over ``probe_elements`` elements where a store was read; or the Python,
    in this process and in worker processes)."""

    changed: list[str] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    store: str = ""
    state: str = ""
    before_per_s: float | None = None
    after_per_s: float | None = None
    probe_elements: int = 0
    verdict: str = ""
    timed: str = "stored part"

    def leave(self, reason: str) -> None:
        """Records that the pipeline is left as written, and why."""
        self.verdict = f"left as written: {reason}"
        self.unchanged.append(f"the pipeline: {reason}")

    def line(self) -> str:
        rates = ""
        if self.before_per_s and self.after_per_s:
            rates = (f"; {self.timed} {self.before_per_s:,.0f} -> {self.after_per_s:,.0f} "
                     "elements/s "
                     f"({self.after_per_s / self.before_per_s:.1f}x)")
        return f"tfspeed.optimize: {self.verdict}{rates}"


def optimize(dataset, model=None, *, cache_dir: str | None = None,
             ram_budget_mb: float | None = None, probe_seconds: float = PROBE_SECONDS,
             quiet: bool = False):
    """Returns ``dataset`` faster: the same ``element_spec`` and the same elements; with
    ``model``, returns ``(dataset, model)``, where images may travel as uint8.

        train = tfspeed.optimize(train)
        train, model = tfspeed.optimize(train, model)   # then model.fit(train, ...)

    Where the pipeline's last map scales uint8 images to floats exactly (``tf.cast(x,
    tf.float32) / 255.``, ``tf.image.convert_image_dtype``, ``keras.layers.Rescaling`` on
    uint8), the dataset given back with a model yields the uint8 images (4x fewer bytes to the
    device), and the model given back takes them, gives each value what the pipeline's cast
    and constants gave (a lookup inside its compiled step, exact on every backend), and calls
    yours: the same numbers, and your model's own weights (training it trains yours; save
    yours as before). A rebuilt shuffle has the same seeds and gives the same orders as a
    fresh copy of yours; under ``python -m tfspeed.run`` it also goes on from the order yours
    would give next where the script iterated it before ``fit`` (an ``adapt``, a peek at a
    batch). Called in a script on a dataset it already iterated, the orders are those of a
    fresh copy. Without a model the images
    still leave as float32 (a store holds them as uint8). Images from a resize, as
    ``keras.utils.image_dataset_from_directory`` gives them, are fractional and stay as they
    are; the report says why.

    Args:
      dataset: a ``tf.data.Dataset``, as the script builds it.
      model: the compiled ``keras.Model`` given to ``fit``, or None: the rewrites that need
        it (uint8 images scaled inside a model around yours; text batched by length, only
        where this model gives the same outputs on trimmed padding).
      cache_dir: where stores go; default ``$TFSPEED_CACHE_DIR`` or ``~/.cache/tfspeed``.
      ram_budget_mb: the most a stored part may also hold in RAM (later epochs read it
        there); default a quarter of the memory available now.
      probe_seconds: each contender's timing when a store is read.
      quiet: print nothing (the report is on ``result.tfspeed_report``).

    Returns:
      Without ``model``: the dataset (rewritten, or the one given), with ``tfspeed_report``
      set to a ``Report``. With ``model``: a tuple ``(dataset, model)``, the model being a new
      one around yours (compiled as yours was) where the dataset yields uint8 images, a
      rebuilt one on your layers where text is batched by length and yours was built for the
      fixed length only, else yours.
    """
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        raise UsageError(f"tfspeed.optimize takes a tf.data.Dataset, got "
                         f"{type(dataset).__name__}: wrap arrays with "
                         "tf.data.Dataset.from_tensor_slices((x, y)).batch(N)")
    report = Report()
    from tfspeed.attach import dtypes  # uint8 images where the pipeline scales them exactly

    found = dtypes.find(dataset, model)
    source = dataset if found.uint8 is None else found.uint8
    out = _rewrite(source, report, cache_dir, ram_budget_mb, probe_seconds)
    out, adapted = dtypes.finish(found, dataset, source, out, model, report)
    from tfspeed.attach import lengths  # text padded to a fixed length, batched by length

    out, adapted = lengths.by_length(out, dataset, adapted, report, probe_seconds)
    for name in USER_ATTRIBUTES:
        if hasattr(dataset, name):
            setattr(out, name, getattr(dataset, name))
    out.tfspeed_report = report
    if not quiet:
        print(report.line(), file=sys.stderr)
    return out if model is None else (out, adapted)


def _rewrite(dataset, report: Report, cache_dir, ram_budget_mb, probe_seconds):
    from tfspeed.attach import graph, store, workers

    if workers.runs_python(dataset):  # worker processes for its Python, or one line why not
        return workers.attach(dataset, report, cache_dir, probe_seconds)
    plan = graph.plan(dataset)
    if plan.stored is None:
        return _unchanged(dataset, report, plan.reason)
    try:
        key, files, ops = store.describe(plan.stored)
    except Exception as e:  # noqa: BLE001  e.g. "PyFunc is stateful" (tensorflow#44763)
        return _unchanged(dataset, report, f"its graph cannot be read "
                          f"({str(e).splitlines()[0][:120]})")
    why = graph.impurity(ops)
    if why:
        return _unchanged(dataset, report, f"its source {why}")
    held = store.Store(store.root(cache_dir), key)
    report.store, report.state = held.folder, held.state
    if held.state == "busy":
        return _unchanged(dataset, report, "another live process is writing its store "
                          f"{held.folder}")
    budget = _budget(plan.stored, held, ram_budget_mb)
    if not isinstance(budget, str):
        budget = _check_buffer(plan, budget)
    if isinstance(budget, str):
        held.abandon()
        report.store = report.state = ""
        return _unchanged(dataset, report, budget)
    base = plan.stored.cache(held.prefix)
    in_ram = budget["fits_ram"]
    if in_ram:  # later epochs read RAM, not the file
        base = base.cache()
    out = plan.replay(base)
    if out.element_spec != dataset.element_spec:  # a rebuild that does not give it back
        held.abandon()
        return _unchanged(dataset, report, "its rebuilt form would change the element_spec "
                          f"to {out.element_spec}")
    _describe(plan, report, files, in_ram)
    if held.state == "writing":
        report.verdict = (f"storing the deterministic part ({plan.maps_stored} map(s)) as it "
                          f"passes, at {held.folder}; later epochs and runs replay it")
        return out
    timed = held.timing()
    if timed is None:  # once per store: the figures are kept beside it for every later run
        timed = _probe(plan.stored, held.prefix, budget["count"], probe_seconds)
        held.keep_timing(timed)
    report.before_per_s, report.after_per_s = timed["before_per_s"], timed["after_per_s"]
    report.probe_elements = timed.get("elements", 0)
    if report.after_per_s > report.before_per_s:
        report.verdict = f"replaying the stored deterministic part from {held.folder}"
        return out
    report.changed.clear()
    if in_ram:  # computing beats reading the file; later epochs still read RAM
        report.changed.append(f"{plan.maps_stored} deterministic map(s) computed in the first "
                              "epoch and replayed from RAM in later ones")
        if plan.cache:
            report.changed.append(USER_CACHE)
        report.verdict = ("the store on disk read slower than computing: the deterministic "
                          "part is kept in RAM for later epochs")
        return plan.replay(plan.stored.cache())
    return _unchanged(dataset, report, "the stored part read no faster than computing it, "
                      "and it does not fit the RAM budget")


def _probe(stored, prefix: str, count: int, seconds: float) -> dict:
    """The stored part computed against the stored part read, each for at most a tenth of
    its elements (``PROBE_UNKNOWN`` where its count is unknown) or ``seconds``.

    Only the stored part: what follows it is the same in both (timing whole pipelines also
    filled a moved shuffle's buffer, a whole epoch of the store, before its first element).
    The stored part holds no shuffle, so iterating the user's own objects advances no seeds.
    """
    most = max(PROBE_LEAST, count // PROBE_SHARE_OF_EPOCH) if count >= 0 else PROBE_UNKNOWN
    before, n = _rate(stored, seconds, most)
    after, _ = _rate(stored.cache(prefix), seconds, n)
    return {"before_per_s": before, "after_per_s": after, "elements": n}


def _unchanged(dataset, report: Report, reason: str):
    report.leave(reason)
    return dataset


def _describe(plan, report: Report, files: int, in_ram: bool) -> None:
    where = "on disk and in RAM" if in_ram else "on disk"
    report.changed.append(
        f"{plan.maps_stored} deterministic map(s){' and the batch' if plan.batched else ''} "
        f"computed once and stored {where} (keyed by the graph and {files} input file(s))")
    if plan.moved:
        report.changed.append(f"{plan.moved} map(s) moved before the shuffle of elements "
                              "(the same seeds, so the same orders)")
    if plan.cache:
        report.changed.append(USER_CACHE)
    if plan.suffix:
        report.unchanged.append(f"replayed every epoch as written: {', '.join(plan.suffix)}")
    if plan.reason:
        report.unchanged.append(f"the store ends at {plan.reason}: nothing after a random "
                                "op is stored")


def _budget(stored, held, ram_budget_mb) -> dict | str:
    """Whether the stored part fits the disk (else a reason) and the RAM budget: its size on
    disk once stored, else from its ``element_spec`` (one element is computed only where
    that has unknown dimensions: in a first run, it is computed twice)."""
    import tensorflow as tf

    count = int(stored.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return "its deterministic part repeats forever"
    if count == 0:
        return "the pipeline is empty"
    if held.state == "complete":
        total = held.size_bytes()
    else:
        per = _spec_bytes(stored)
        if per is None:
            first = next(iter(stored.take(1)), None)
            if first is None:
                return "the pipeline is empty"
            per = element_bytes(first)
        total = per * count if count >= 0 else None
        free = shutil.disk_usage(os.path.dirname(held.folder)).free
        if total is not None and total > DISK_SHARE * free:
            return (f"its deterministic part (~{total / 2**30:.1f} GiB) is over half the free "
                    f"disk at {os.path.dirname(held.folder)}: give optimize(cache_dir=...) on "
                    "a larger disk")
    ram = (ram_budget_mb * 2**20 if ram_budget_mb is not None
           else RAM_SHARE * _available_memory())
    return {"bytes": total, "count": count, "ram": ram,
            "fits_ram": total is not None and total <= ram}


def element_bytes(element) -> int:
    """Bytes of one computed element (a nest of tensors)."""
    import tensorflow as tf

    return sum(_nbytes(t.numpy()) for t in tf.nest.flatten(element) if hasattr(t, "numpy"))


def _nbytes(value) -> int:
    """Bytes of one computed component: a string's (``bytes``, or an array of them) are
    its characters, not the pointers NumPy counts."""
    import numpy as np

    if isinstance(value, bytes):
        return len(value)
    if value.dtype == object:
        return sum(len(v) for v in value.ravel())
    return int(np.asarray(value).nbytes)


def _check_buffer(plan, budget: dict) -> dict | str:
    """A map moved before a shuffle fills its buffer with stored elements (decoded images)
    instead of what it held (paths): list_files' buffer is every file, the whole decoded
    epoch. Refused where that is over the RAM budget (the store itself may stay on disk)."""
    if not plan.buffered or budget["bytes"] is None or budget["count"] <= 0:
        return budget
    held = min(plan.buffered, budget["count"]) * budget["bytes"] / budget["count"]
    if held <= budget["ram"]:
        return budget
    return (f"moving its map(s) before the shuffle would hold {plan.buffered} computed "
            f"elements (~{held / 2**20:,.0f} MiB) in the shuffle's buffer, over the RAM budget "
            f"({budget['ram'] / 2**20:,.0f} MiB; optimize(ram_budget_mb=...))")


def _spec_bytes(stored) -> int | None:
    """Bytes of one element from its ``element_spec``: None where a dimension (other than a
    batch's, with the maps after the batch) is unknown, or a component is a string, ragged or
    sparse."""
    import numpy as np
    import tensorflow as tf

    from tfspeed.attach import graph

    node = stored  # the batch the stored part ends with, through the maps after it
    while not hasattr(node, "_batch_size") and hasattr(node, "_input_dataset") and (
            hasattr(node, "_map_func") or type(node).__name__ in graph.PASSTHROUGH):
        node = node._input_dataset
    batch = getattr(node, "_batch_size", None)
    total = 0
    for spec in tf.nest.flatten(stored.element_spec):
        if type(spec) is not tf.TensorSpec or spec.dtype == tf.string:
            return None
        dims = spec.shape.as_list() if spec.shape.rank is not None else None
        if dims and dims[0] is None and batch is not None:
            dims[0] = int(batch)  # a batch without drop_remainder: the last one is smaller
        if dims is None or None in dims:
            return None
        total += int(np.prod(dims, dtype=np.int64)) * spec.dtype.size
    return total


def _available_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 2.0 * 2**30


def _rate(dataset, seconds: float, most: int) -> tuple[float, int]:
    """Elements/s of one pass's start, after its first element (the warm-up), over at most
    ``most`` elements or ``seconds``; and how many elements were timed."""
    from tfspeed.attach.store import timed_pass

    rate, n, _ = timed_pass(dataset, seconds, most)
    return rate, n
