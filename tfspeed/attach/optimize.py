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
import shutil
import sys
import time

from tfspeed.errors import UsageError

RAM_SHARE = 0.25  # of the memory available now: the most a stored part may hold in RAM
DISK_SHARE = 0.5  # of the free disk: the most a store may take
PROBE_SECONDS = 1.0  # each contender's timing on a later run, at most
PROBE_SHARE_OF_EPOCH = 5  # and at most 1/5 of an epoch's elements
# Attributes Keras' dataset utilities set on the datasets they return (scripts read them).
USER_ATTRIBUTES = ("class_names", "file_paths")


@dataclasses.dataclass
class Report:
    """What ``optimize`` did: ``changed`` and ``unchanged`` in words, the store, and the
    elements/s timed (``before``: as written, ``after``: rewritten) where a store was read."""

    changed: list[str] = dataclasses.field(default_factory=list)
    unchanged: list[str] = dataclasses.field(default_factory=list)
    store: str = ""
    state: str = ""
    before_per_s: float | None = None
    after_per_s: float | None = None
    verdict: str = ""

    def line(self) -> str:
        rates = ""
        if self.before_per_s and self.after_per_s:
            rates = (f"; {self.before_per_s:,.0f} -> {self.after_per_s:,.0f} elements/s "
                     f"({self.after_per_s / self.before_per_s:.1f}x)")
        return f"tfspeed.optimize: {self.verdict}{rates}"


def optimize(dataset, model=None, *, cache_dir: str | None = None,
             ram_budget_mb: float | None = None, probe_seconds: float = PROBE_SECONDS,
             quiet: bool = False):
    """Returns ``dataset`` faster: the same ``element_spec`` and the same elements.

    Args:
      dataset: a ``tf.data.Dataset``, as the script builds it.
      model: the compiled Keras model it trains, where a rewrite needs one (text batched by
        length: only where this model gives the same outputs on trimmed padding).
      cache_dir: where stores go; default ``$TFSPEED_CACHE_DIR`` or ``~/.cache/tfspeed``.
      ram_budget_mb: the most a stored part may also hold in RAM (later epochs read it
        there); default a quarter of the memory available now.
      probe_seconds: each contender's timing when a store is read.
      quiet: print nothing (the report is on ``result.tfspeed_report``).

    Returns:
      The dataset (rewritten, or the one given), with ``tfspeed_report`` set to a ``Report``;
      given a model, ``(dataset, model)``, the model adapted where a rewrite needs it.
    """
    import tensorflow as tf

    if not isinstance(dataset, tf.data.Dataset):
        raise UsageError(f"tfspeed.optimize takes a tf.data.Dataset, got "
                         f"{type(dataset).__name__}: wrap arrays with "
                         "tf.data.Dataset.from_tensor_slices((x, y)).batch(N)")
    report = Report()
    out = _rewrite(dataset, report, cache_dir, ram_budget_mb, probe_seconds)
    from tfspeed.attach import lengths  # text padded to a fixed length, batched by length

    out, adapted = lengths.by_length(out, dataset, model, report, probe_seconds)
    report.unchanged += [
        "dtypes: images leave the pipeline as they did (the uint8 rewrite is not built yet)",
    ]
    for name in USER_ATTRIBUTES:
        if hasattr(dataset, name):
            setattr(out, name, getattr(dataset, name))
    out.tfspeed_report = report
    if not quiet:
        print(report.line(), file=sys.stderr)
    return out if model is None else (out, adapted)


def _rewrite(dataset, report: Report, cache_dir, ram_budget_mb, probe_seconds):
    from tfspeed.attach import graph, store

    plan = graph.plan(dataset)
    if plan.stored is None:
        return _unchanged(dataset, report, plan.reason)
    try:
        ops = store.graph_ops(plan.stored)
        key, files = store.fingerprint(plan.stored)
    except Exception as e:  # noqa: BLE001  e.g. "PyFunc is stateful" (tensorflow#44763)
        return _unchanged(dataset, report, f"its graph cannot be read "
                          f"({str(e).splitlines()[0][:120]})")
    why = graph.impurity(ops)
    if why:
        return _unchanged(dataset, report, f"its source {why}")
    budget = _budget(plan.stored, ram_budget_mb, cache_dir)
    if isinstance(budget, str):
        return _unchanged(dataset, report, budget)
    held = store.Store(store.root(cache_dir), key)
    report.store, report.state = held.folder, held.state
    if held.state == "busy":
        return _unchanged(dataset, report, "another live process is writing its store "
                          f"{held.folder}")
    base = plan.stored.cache(held.prefix)
    in_ram = budget.get("fits_ram", False)
    if in_ram:  # later epochs read RAM, not the file
        base = base.cache()
    out = plan.replay(base)
    if out.element_spec != dataset.element_spec:  # a rebuild that does not give it back
        return _unchanged(dataset, report, "its rebuilt form would change the element_spec "
                          f"to {out.element_spec}")
    _describe(plan, report, files, in_ram)
    if held.state == "writing":
        report.verdict = (f"storing the deterministic part ({plan.maps_stored} map(s)) as it "
                          f"passes, at {held.folder}; later epochs and runs replay it")
        return out
    timed = held.timing()
    if timed is None:  # once per store: the figures are kept beside it for every later run
        # On copies (iterating the user's own object would advance its shuffles' seeds), for
        # at most a fifth of an epoch each: the probe must not cost what it could save.
        share = max(2, int(dataset.cardinality()) // PROBE_SHARE_OF_EPOCH)
        timed = {"before_per_s": _rate(graph.copy(dataset), probe_seconds, share),
                 "after_per_s": _rate(plan.replay(plan.stored.cache(held.prefix)),
                                      probe_seconds, share)}
        held.keep_timing(timed)
    report.before_per_s, report.after_per_s = timed["before_per_s"], timed["after_per_s"]
    if report.after_per_s > report.before_per_s:
        report.verdict = f"replaying the stored deterministic part from {held.folder}"
        return out
    report.changed.clear()
    if in_ram:  # computing beats reading the file; later epochs still read RAM
        report.changed.append(f"{plan.maps_stored} deterministic map(s) computed in the first "
                              "epoch and replayed from RAM in later ones")
        report.verdict = ("the store on disk read slower than computing: the deterministic "
                          "part is kept in RAM for later epochs")
        return plan.replay(plan.stored.cache())
    return _unchanged(dataset, report, "the stored part read no faster than computing it, "
                      "and it does not fit the RAM budget")


def _unchanged(dataset, report: Report, reason: str):
    report.verdict = f"left as written: {reason}"
    report.unchanged.append(f"the pipeline: {reason}")
    return dataset


def _describe(plan, report: Report, files: int, in_ram: bool) -> None:
    where = "on disk and in RAM" if in_ram else "on disk"
    report.changed.append(
        f"{plan.maps_stored} deterministic map(s){' and the batch' if plan.batched else ''} "
        f"computed once and stored {where} (keyed by the graph and {files} input file(s))")
    if plan.moved:
        report.changed.append(f"{plan.moved} map(s) moved before the shuffle of elements "
                              "(the same seeds, so the same orders)")
    if plan.suffix:
        report.unchanged.append(f"replayed every epoch as written: {', '.join(plan.suffix)}")
    if plan.reason:
        report.unchanged.append(f"the store ends at {plan.reason}: nothing after a random "
                                "op is stored")


def _budget(stored, ram_budget_mb, cache_dir) -> dict | str:
    """Whether the stored part fits the disk (else a reason) and the RAM budget, from the
    size of its first element times its cardinality."""
    import os

    import tensorflow as tf

    from tfspeed.attach import store

    count = int(stored.cardinality())
    if count == tf.data.INFINITE_CARDINALITY:
        return "its deterministic part repeats forever"
    first = next(iter(stored.take(1)), None)
    if first is None:
        return "the pipeline is empty"
    per = sum(int(t.numpy().nbytes) for t in tf.nest.flatten(first)
              if hasattr(t, "numpy"))
    total = per * count if count >= 0 else None
    folder = store.root(cache_dir)
    os.makedirs(folder, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if total is not None and total > DISK_SHARE * free:
        return (f"its deterministic part (~{total / 2**30:.1f} GiB) is over half the free "
                f"disk at {folder}: give optimize(cache_dir=...) on a larger disk")
    ram = (ram_budget_mb * 2**20 if ram_budget_mb is not None
           else RAM_SHARE * _available_memory())
    return {"bytes": total, "fits_ram": total is not None and total <= ram}


def _available_memory() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return 2.0 * 2**30


def _rate(dataset, seconds: float, most: int) -> float:
    """Elements/s of one pass's start, after its first element (the warm-up), over at most
    ``most`` elements or ``seconds``."""
    it = iter(dataset)
    if next(it, None) is None:
        return 0.0
    n, start = 0, time.perf_counter()
    for _ in it:
        n += 1
        if n >= most or time.perf_counter() - start >= seconds:
            break
    return n / max(time.perf_counter() - start, 1e-9)
