"""Python in a user's pipeline, moved out of the training process: a ``from_generator`` source
and ``numpy_function``/``py_function`` maps run in worker processes, in order.

Both run under the training process's GIL as written, one element at a time. Here:

- a generator cannot be split (its elements may depend on one another), so the whole of it
  runs in ONE producer process, which runs ahead of the consumer by at most ``AHEAD`` elements;
- a map's Python function runs over a pool of processes, one per core, each element sent to
  the next worker in turn and read back in the same turn: the order of the pipeline as written,
  with at most ``DEPTH`` elements in flight per worker.

The processes themselves are ``tfspeed.attach.pool``'s. ``optimize`` keeps the rewrite only
where it measures faster over the start of a pass and gives the same first elements there;
otherwise the pipeline stays as written, with one line why.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from tfspeed.attach.pool import AHEAD, Pool, Workers, cores, describe, one_line

PYTHON_OPS = ("PyFunc", "EagerPyFunc", "PyFuncStateless")
# Kept only when the start of a pass runs this much faster in workers: the probe lasts about a
# second, and on 2 cores a producer process that measured +0.3 % there ran a whole run at
# 0.75-0.79x (benchmarks/your_pipelines.py, generator_pil, a quiet host).
KEEP_MARGIN = 1.15
# Ops a map's function may hold around its one Python call and still move whole to a worker:
# they pass values through (set_shape adds no op; ensure_shape's check is the signature's).
PASS_OPS = ("Placeholder", "Identity", "EnsureShape", "NoOp")


# -- Reading the pipeline: where Python runs, and what it is. ------------------------------

def _is_generator(node) -> bool:
    return type(node).__name__ == "_FlatMapDataset" and "GeneratorDataset" in {
        op.type for op in node._map_func.function.graph.get_operations()}


def _python_map(node) -> bool:
    from tfspeed.attach import graph

    return type(node).__name__ in graph.MAPS and bool(
        set(PYTHON_OPS) & graph.function_ops(node))


def runs_python(dataset) -> bool:
    """Whether ``dataset``'s chain holds a generator or a map that runs Python."""
    from tfspeed.attach import graph

    return any(_is_generator(n) or _python_map(n) for n in graph.chain(dataset))


def find_generator(node) -> tuple[object | None, str]:
    """The callable given to ``from_generator`` (held by the closures TF made of it), with
    its ``args=`` bound as the generator receives them; or None and why."""
    seen, todo, state, args = set(), [node._map_func._func], None, None
    while todo and len(seen) < 500:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if type(obj).__name__ == "_GeneratorState":
            state = obj
        code = getattr(obj, "__code__", None)
        for name, cell in zip(code.co_freevars if code else (), getattr(obj, "__closure__", None) or (),
                              strict=False):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if name == "args" and code.co_name == "get_iterator_id_fn":
                args = value
            todo.append(value)
        todo += [getattr(obj, a) for a in ("__wrapped__", "__func__") if hasattr(obj, a)]
    if state is None:
        return None, "tfspeed cannot find the generator inside this from_generator"
    if args:
        given, why = _as_received(args)
        if why:
            return None, why
        return functools.partial(state._generator, *given), ""
    return state._generator, ""


def _as_received(args) -> tuple[list, str]:
    """``from_generator``'s ``args`` as its generator receives them, each tensor converted as
    TensorFlow converts it for the generator (``numpy_function``'s conversion: a string
    scalar becomes bytes, a list of strings an array of them); or why they cannot be read."""
    import numpy as np
    import tensorflow as tf

    received = []

    def keep(*values):
        received.extend(values)
        return np.int64(0)

    try:
        tf.numpy_function(keep, list(args), tf.int64)
    except Exception as e:  # noqa: BLE001  graph tensors, or ones no longer readable
        return [], f"its from_generator's args= cannot be read here ({one_line(e)})"
    return received, ""


def map_plan(node) -> tuple[dict | None, str]:
    """How a map's outputs come from its one Python call: {'fn', 'eager', 'inputs',
    'outputs', 'count'}, or None and why it cannot move to worker processes."""
    from tensorflow.python.ops import script_ops

    fn_graph = node._map_func.function.graph
    ops = fn_graph.get_operations()
    python = [op for op in ops if op.type in PYTHON_OPS]
    other = sorted({op.type for op in ops} - set(PASS_OPS) - set(PYTHON_OPS))
    if len(python) != 1 or other or fn_graph._functions:
        what = f"TensorFlow ops ({', '.join(other[:3])})" if other else (
            f"{len(python)} Python calls" if len(python) != 1 else "nested functions")
        return None, (f"its map does {what} around its Python function; only a map that "
                      "calls one numpy_function or py_function alone moves to worker processes")
    if node._map_func.function.captured_inputs:
        return None, "its map's Python function captures tensors, which stay in this process"
    call, places = python[0], [t.name for t in fn_graph.inputs]

    def source(t):
        while t.op.type in ("Identity", "EnsureShape"):
            t = t.op.inputs[0]
        if t.op is call:
            return ("py", t.value_index)
        return ("arg", places.index(t.name)) if t.name in places else None

    outputs, inputs = [source(t) for t in fn_graph.outputs], [source(t) for t in call.inputs]
    if None in outputs or any(s is None or s[0] != "arg" for s in inputs):
        return None, "its map's outputs do not come straight from its Python function"
    registered = script_ops._py_funcs.get(call.get_attr("token").decode())
    eager = call.type == "EagerPyFunc"
    fn = _unwrap(getattr(registered, "_func", None) if eager else registered)
    if fn is None:
        return None, "its map's Python function is no longer registered with TensorFlow"
    return {"fn": fn, "eager": eager, "inputs": [s[1] for s in inputs], "outputs": outputs,
            "count": len(call.outputs)}, ""


def _unwrap(fn):
    """The user's own function inside the wrapper TensorFlow puts around it (autograph's
    do_not_convert). (What autograph leaves on the function itself, ``pool.dumps`` drops.)"""
    while fn is not None and getattr(fn, "__globals__", {}).get(
            "__name__", "").startswith("tensorflow."):
        inner = [c.cell_contents for c in fn.__closure__ or () if callable(c.cell_contents)]
        if len(inner) != 1:
            break
        fn = inner[0]
    return fn


# -- Rebuilding it on worker processes. -----------------------------------------------------

def _from_generator(feed, spec):
    import tensorflow as tf

    return tf.data.Dataset.from_generator(feed, output_signature=spec)


def _generator_source(gen, spec):
    workers = Workers(gen, 1)
    out = _from_generator(lambda: workers.run(Pool.stream), spec)
    out._tfspeed_workers = workers  # the pools live as long as the dataset
    return out, workers


def _worker_map(base, node, plan):
    workers = Workers(plan["fn"], cores(), plan["eager"], plan["count"])
    out = _from_generator(lambda: workers.run(_mapped(base, node.element_spec, plan)),
                          node.element_spec)
    out._tfspeed_workers = workers
    return out, workers


def _mapped(base, spec, plan):
    """A map's pass with its Python on a pool: ``use(pool)`` yields its elements, in order."""
    import tensorflow as tf

    picks, outputs = plan["inputs"], plan["outputs"]

    def calls():
        for element in base.as_numpy_iterator():
            flat = tf.nest.flatten(element)
            yield flat, [flat[j] for j in picks]

    def use(pool):
        for flat, result in pool.imap(calls()):
            yield tf.nest.pack_sequence_as(spec, [
                result[k] if kind == "py" else flat[k] for kind, k in outputs])
    return use


def rewrite(dataset) -> tuple[object | None, list[str] | str]:
    """``dataset`` rebuilt with its generator and Python maps on worker processes, and what
    moved in words; or None and why not, in one line."""
    import tensorflow as tf

    from tfspeed.attach import graph

    nodes = graph.chain(dataset)
    base, moved = nodes[0], []
    for node in nodes[1:]:
        if _is_generator(node) or _python_map(node):
            found, why = (find_generator(node) if _is_generator(node) else map_plan(node))
            if found is None:
                return None, why
            fn = found if _is_generator(node) else found["fn"]
            name = describe(fn.func if isinstance(fn, functools.partial) else fn)  # args bound
            if not _is_generator(node) and not all(
                    isinstance(s, tf.TensorSpec) for s in tf.nest.flatten(base.element_spec)):
                return None, (f"the elements {name} takes are not plain tensors "
                              f"({base.element_spec}): they cannot go to a worker process")
            try:
                if _is_generator(node):
                    base, workers = _generator_source(fn, node.element_spec)
                    moved.append(f"the generator {name} runs in a producer process, "
                                 f"{AHEAD} elements ahead, in order")
                else:
                    base, workers = _worker_map(base, node, found)
                    moved.append(f"the map's Python function {name} runs in "
                                 f"{workers.size} worker processes, in order")
            except Exception as e:  # noqa: BLE001  cloudpickle's errors have no common base
                return None, f"{name} cannot be pickled for a worker process ({one_line(e)})"
        elif not moved:
            base = node  # the user's own object: nothing before it changed
        elif type(node).__name__ in graph.REBUILD:
            base = graph.rebuild(node, base)
        else:
            return None, (f"tfspeed cannot rebuild {graph._name(node)}, which follows the "
                          "Python in the pipeline: left as written")
    if base.element_spec != dataset.element_spec:
        return None, f"its rebuilt form would change the element_spec to {base.element_spec}"
    return base, moved


def attach(dataset, report, cache_dir: str | None, probe_seconds: float):
    """``optimize``'s answer for a pipeline that runs Python: the rewrite where it measures
    faster and gives the same elements, else ``dataset`` with one line why (on ``report``).

    Args:
      dataset: the user's pipeline (``runs_python(dataset)``).
      report: the ``optimize.Report`` to fill.
      cache_dir: where the timing is kept, once per pipeline (as a store's timing).
      probe_seconds: each contender's timing, at most.

    Returns:
      The dataset to use.
    """
    def _unchanged(dataset, report, reason):
        report.leave(reason)
        return dataset

    out, moved = rewrite(dataset)
    if out is None:
        return _unchanged(dataset, report, moved)
    path = _timing_path(dataset, out, cache_dir)
    timed = _read(path)
    if timed is None:
        timed = _time(dataset, out, probe_seconds)
        _write(path, timed)
    if timed.get("failed"):
        return _unchanged(dataset, report, f"its Python failed in a worker process "
                          f"({timed['failed']})")
    if not timed["same"]:
        return _unchanged(dataset, report, "its Python gives other elements in a worker "
                          "process than in this one (random, or state kept between calls)")
    report.before_per_s, report.after_per_s = timed["before_per_s"], timed["after_per_s"]
    report.timed = f"{timed.get('timed', 'the pipeline')}, in this process -> in workers,"
    if report.after_per_s < KEEP_MARGIN * report.before_per_s:
        return _unchanged(dataset, report, "its Python measured no faster in worker "
                          "processes on this machine")
    report.changed += moved
    report.verdict = "running the pipeline's Python in worker processes, in order"
    return out


def _time(dataset, out, seconds: float) -> dict:
    """Both contenders over the start of a pass, and whether they agree there: a single
    Python map first alone (``_map_alone``), and only where its workers measure faster there,
    the whole pipeline against the rewrite, whose ``from_generator`` has a cost of its own."""
    from tfspeed.attach import graph
    from tfspeed.attach.store import PROBE_SHARE_OF_EPOCH

    count = int(dataset.cardinality())
    most = max(2, count // PROBE_SHARE_OF_EPOCH) if count > 0 else 1 << 30
    alone = _map_alone(dataset, count, most)
    if alone is not None:  # each pass runs to the end of its cut input
        timed = _contest(dataset, *alone, 1 << 30, seconds)
        if timed.get("failed") or not timed["same"] or (
                timed["after_per_s"] < KEEP_MARGIN * timed["before_per_s"]):
            return {**timed, "timed": "its Python map"}
    return {**_contest(dataset, graph.copy(dataset), out, None, most, seconds),
            "timed": "the pipeline"}


def _contest(dataset, before_ds, after_ds, probe_workers, most: int, seconds: float) -> dict:
    # Alone, a map's elements come one from each worker in turn: each worker's first one is
    # its start (a fresh interpreter and the function's imports), warm-up for both contenders.
    warm = probe_workers.size if probe_workers is not None else 1
    before, want = _probe(before_ds, seconds, most, warm)
    try:
        after, got = _probe(after_ds, seconds, most, warm)
    except Exception as e:  # noqa: BLE001  TF wraps the worker's one line in its own error
        lines = str(e).splitlines()
        return {"failed": next((x.strip() for x in lines if "worker process" in x),
                               lines[0] if lines else type(e).__name__)[:300]}
    finally:
        if probe_workers is not None:  # the probe's own: no pass of theirs comes again
            probe_workers.close()
    return {"before_per_s": before, "after_per_s": after, "same": not _deterministic(dataset)
            or _equal(want, got)}


def _map_alone(dataset, count: int, most: int):
    """The one Python map of ``dataset`` as written and on worker processes, each a pass of
    its own over the inputs that ``most`` elements after the first need, with the workers'
    pass read in this thread, not through ``from_generator``; None where the pipeline has a
    generator or more Python, or a count is unknown.

    Returns:
      (the map as written, the workers' pass, the probe's workers).

    Once a process has iterated any ``from_generator`` (the rewrite is one), its
    numpy_function maps as written stalled about 0.6 s at the end of one epoch in two
    (TF 2.21, 2 cores): a first run whose workers measured slower paid that every epoch.
    """
    import math

    from tfspeed.attach import graph

    nodes = graph.chain(dataset)
    python = [i for i, n in enumerate(nodes) if _is_generator(n) or _python_map(n)]
    if len(python) != 1 or not _python_map(nodes[python[0]]):
        return None
    node, upstream = nodes[python[0]], nodes[python[0] - 1]
    taken = int(upstream.cardinality())
    plan, _ = map_plan(node)
    if count <= 0 or taken <= 0 or plan is None:
        return None
    base = upstream.take(min(taken, max(cores() + 2, math.ceil((most + 1) * taken / count))))
    workers = Workers(plan["fn"], cores(), plan["eager"], plan["count"])
    return graph.rebuild(node, base), workers.run(_mapped(base, node.element_spec, plan)), workers


def _probe(dataset, seconds: float, most: int, warm: int = 1) -> tuple[float, list]:
    """Elements/s of one pass's start after its first ``warm`` elements, and its first
    elements (at most 64, to compare)."""
    from tfspeed.attach.store import timed_pass

    rate, _, kept = timed_pass(dataset, seconds, most, keep=64, warm=warm)
    return rate, kept


def _equal(a: list, b: list) -> bool:
    import numpy as np

    return all(len(x) == len(y) and all(np.array_equal(p, q) for p, q in zip(x, y, strict=True))
               for x, y in zip(a, b, strict=False))


def _deterministic(dataset) -> bool:
    """Whether the pipeline as written gives the same elements pass after pass, outside its
    Python (which is what the comparison checks)."""
    from tfspeed.attach import graph

    for node in graph.chain(dataset):
        if type(node).__name__ == "_ShuffleDataset":
            return False
        if type(node).__name__ in graph.MAPS and "random" in graph.impurity(
                graph.function_ops(node) - set(PYTHON_OPS)):
            return False
    return True


def _timing_path(dataset, out, cache_dir) -> str:
    """Where the timing of this pipeline is kept: keyed by its functions (cloudpickled, with
    what their closures hold), its chain and its element_spec."""
    from tfspeed.attach import graph, store

    key = hashlib.sha1(repr(dataset.element_spec).encode())
    for node in graph.chain(out):
        key.update(type(node).__name__.encode())
        workers = getattr(node, "_tfspeed_workers", None)
        if workers is not None:
            key.update(workers.payload)
    return os.path.join(store.root(cache_dir), "workers", key.hexdigest()[:20] + ".json")


def _read(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write(path: str, timed: dict) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump(timed, f)
        os.replace(path + ".tmp", path)
    except OSError:  # a read-only cache: time again next run
        pass
