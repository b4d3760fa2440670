"""Reading a user's ``tf.data`` pipeline and rebuilding it with its deterministic part stored.

A pipeline is a chain of dataset objects, each holding its input (``_input_dataset``) and the
arguments it was made with. ``plan`` walks the chain from the source and finds the longest
deterministic part that can be materialised once:

- every map whose function holds no random or stateful op is deterministic;
- a shuffle of elements followed by such maps commutes with them (a shuffle permutes positions
  whatever the values, and each map is one element in, one out), so the maps move before it
  and the shuffle replays on the stored elements, with its own seeds: the same orders;
- a batch right after the stored part is stored too (fewer, larger elements to replay);
- shards read through an ``interleave`` or ``flat_map`` before any map count as the source.

Nothing after a random op, a repeat, a filter behind a shuffle, or an op this module cannot
rebuild is ever stored: the rest of the chain is rebuilt as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

# Op types whose presence makes a function's output differ from call to call.
RANDOM_MARKERS = ("Random", "Rng", "Shuffle", "Sampl")
# Ops that run Python: the graph cannot be read (tensorflow#44763), nor its results trusted to
# be the same next time.
PYTHON_OPS = ("PyFunc", "EagerPyFunc", "PyFuncStateless")
# Chain nodes that only change how elements flow, never which: dropped inside the stored part.
PASSTHROUGH = ("_PrefetchDataset", "_OptionsDataset")
MAPS = ("_MapDataset", "_ParallelMapDataset")
BATCHES = ("_BatchDataset", "_ParallelBatchDataset")
# Deterministic without a function: kept in the stored part where no shuffle precedes them.
ORDERED = (*BATCHES, "_SkipDataset", "_TakeDataset", "_UnbatchDataset", "_RestructuredDataset")
# Reading the source through files (``interleave(tf.data.TFRecordDataset)``): part of the
# source where it comes before any map or shuffle and its function is deterministic. With
# ``deterministic=False`` its order varies run to run as written; stored, it is the first
# run's, and every epoch still holds the same elements.
READERS = ("_InterleaveDataset", "_ParallelInterleaveDataset", "_FlatMapDataset")


@dataclasses.dataclass
class Cut:
    """Where a pipeline is cut: ``stored`` builds the part to materialise (a dataset), ``replay``
    rebuilds the rest on top of a dataset of the stored elements. ``reason`` says why nothing
    is stored when ``stored`` is None; ``moved`` counts the maps moved before a shuffle."""

    stored: object | None
    replay: Callable | None
    reason: str
    maps_stored: int = 0
    moved: int = 0
    batched: bool = False
    suffix: list = dataclasses.field(default_factory=list)
    buffered: int = 0  # stored elements a moved shuffle holds at once (its buffer)
    cache: bool = False  # the user's .cache() in memory was folded into the store


def chain(dataset) -> list:
    """The dataset objects from the source to ``dataset``; the source is the first one without
    a single input (a file reader, tensor slices, a zip)."""
    nodes = [dataset]
    while hasattr(nodes[-1], "_input_dataset"):
        nodes.append(nodes[-1]._input_dataset)
    return nodes[::-1]


def function_ops(node) -> set[str]:
    """The op types of a map node's function, with the functions it calls."""
    graph = node._map_func.function.graph
    types = {op.type for op in graph.get_operations()}
    for fn in graph._functions.values():  # nested tf.functions and conditionals' branches
        types |= {n.op for n in fn.cached_definition.node_def}
    return types


def impurity(op_types: set[str]) -> str:
    """Why a function's results may differ between calls ('' when they cannot)."""
    python = sorted(t for t in op_types if t in PYTHON_OPS)
    if python:
        return "runs Python (tf.py_function or tf.numpy_function), which tfspeed cannot read"
    random = sorted(t for t in op_types if any(m in t for m in RANDOM_MARKERS))
    if random:
        return f"is random ({', '.join(random[:3])})"
    return ""


def plan(dataset) -> Cut:
    """Finds the part of ``dataset``'s chain to store and how to replay the rest."""
    nodes = chain(dataset)
    stored, maps, moved, pending, i, batched = nodes[0], 0, 0, [], 1, False
    cache = False  # the user's own .cache() in memory, inside the stored part
    while i < len(nodes):
        node, kind = nodes[i], type(nodes[i]).__name__
        if kind == "_ShuffleDataset":
            pending.append(node)
        elif kind in MAPS and not impurity(function_ops(node)):
            # Before any shuffle (or the user's cache) the user's own object is the stored
            # part; after one, the map is rebuilt on the stored part and the shuffles replay
            # after it.
            stored = rebuild(node, stored) if pending or cache else node
            maps, moved = maps + 1, moved + bool(pending)
        elif kind in READERS and stored is nodes[i - 1] and not (maps or pending or cache) \
                and not impurity(function_ops(node)):
            stored = node
        elif kind == "CacheDataset" and not pending and maps and _in_memory(node):
            # The store holds what it held, in RAM where it fits the budget, and every
            # later run reads it too: the user's cache would only hold a second copy.
            cache = True
        elif kind in PASSTHROUGH or (kind in ORDERED and not pending):
            if not pending and kind not in PASSTHROUGH:
                stored = rebuild(node, stored) if cache else node
            elif not pending and not cache:
                stored = node
            batched = batched or (kind in BATCHES and maps > 0)
        else:
            break
        i += 1
    stop = _stop_reason(nodes[i]) if i < len(nodes) else ""
    if maps == 0:
        first = f"; {stop} comes first" if stop else ""
        return Cut(None, None, f"no deterministic map after the source{first}: nothing is "
                    "worth storing")
    suffix = pending + nodes[i:]
    unknown = [_name(n) for n in suffix if type(n).__name__ not in REBUILD]
    if unknown:
        return Cut(None, None, f"tfspeed cannot rebuild {unknown[0]}, which follows the "
                    "deterministic part: left as written")
    buffered = max((int(n._buffer_size) for n in pending), default=0) if moved else 0
    return Cut(stored, lambda base: _replay(base, suffix, follow=True), stop, maps, moved,
               batched, [_name(n) for n in suffix], buffered, cache)


def _in_memory(node) -> bool:
    """Whether a ``.cache()`` holds its elements in memory (no file named)."""
    try:
        return not node._filename.numpy()
    except (AttributeError, TypeError):  # a graph tensor: not one to read here
        return False


def _name(node) -> str:
    return type(node).__name__.strip("_").removesuffix("Dataset")


def _stop_reason(node) -> str:
    """What ends the deterministic part, in words."""
    kind = type(node).__name__
    why = impurity(function_ops(node)) if hasattr(node, "_map_func") else ""
    if "Python" in why:
        what = "a generator (from_generator)" if kind == "_FlatMapDataset" else "a map"
        return (f"{what} that runs Python under the GIL, one element at a time: tfspeed can "
                "neither store nor parallelise it; write the loading with tf ops, or convert "
                "the data once with scripts/to_tfrecord.py")
    if kind in MAPS:
        return f"a map that {why}"
    return f"{_name(node)}"


def copy(dataset):
    """A new pipeline with ``dataset``'s transformations on its source (the same seeds), or
    ``dataset`` itself where one cannot be rebuilt."""
    nodes = chain(dataset)
    if any(type(n).__name__ not in REBUILD for n in nodes[1:]):
        return dataset
    return _replay(nodes[0], nodes[1:])


def _replay(base, suffix: list, follow: bool = False):
    """``suffix`` rebuilt on ``base``; with ``follow``, each reshuffling shuffle goes on from
    the order the script's own object would give next (``count_iterations``)."""
    for node in suffix:
        after = _ITERATED.get(id(node), (None, 0))[1] if follow else 0
        base = _shuffle(node, base, after) if after else rebuild(node, base)
    return base


# Iterators the script made over each reshuffling shuffle, by id (with the node, so that the
# id stays its own), while ``count_iterations`` is on.
_ITERATED: dict[int, list] = {}


@contextlib.contextmanager
def count_iterations(active: Callable[[], bool]):
    """Within the block, counts the iterators made over each reshuffling shuffle in a
    pipeline's chain while ``active()``. A shuffle draws its order for each new iterator from
    a seed generator held in its dataset; a script that iterated its training data before
    ``fit`` (``layer.adapt(train.map(...))``, a peek at a batch) left that generator a few
    draws on. A rebuilt shuffle starts from the first draw; ``plan``'s replay goes on from
    where the script's object would, so that ``fit`` sees the orders it would as written."""
    import tensorflow as tf

    real = tf.data.Dataset.__iter__

    def __iter__(self):  # noqa: N807 -- the method it stands in for
        if active():
            for node in chain(self):
                if type(node).__name__ == "_ShuffleDataset" and (
                        node._reshuffle_each_iteration is True):
                    _ITERATED.setdefault(id(node), [node, 0])[1] += 1
        return real(self)

    tf.data.Dataset.__iter__ = __iter__
    try:
        yield
    finally:
        tf.data.Dataset.__iter__ = real
        _ITERATED.clear()


def rebuild(node, base):
    """``node``'s transformation applied anew to ``base``."""
    return REBUILD[type(node).__name__](node, base)


def _map(node, base):
    import tensorflow as tf

    fn, structure = node._map_func.function, node._map_func.output_structure

    # The function is already traced: autograph would transpile this wrapper anew (~0.4 s
    # the first time in a process, more than a small pipeline's whole epoch).
    @tf.autograph.experimental.do_not_convert
    def call(*args):
        out = fn(*tf.nest.flatten(args))
        return tf.nest.pack_sequence_as(structure, tf.nest.flatten(out))

    parallel = getattr(node, "_num_parallel_calls", None)
    calls = None if parallel is None else int(parallel)
    deterministic = {"true": True, "false": False}.get(getattr(node, "_deterministic", ""))
    return base.map(call, num_parallel_calls=calls, deterministic=deterministic)


def _shuffle(node, base, after: int = 0):
    """The same shuffle, with the same seeds: the same permutations of positions, from the
    first; with ``after``, from the one after the first ``after`` (a seed generator of its
    own, moved on by as many iterators over a one-element shuffle that shares it)."""
    import tensorflow as tf
    from tensorflow.python.ops import gen_dataset_ops

    def on(data, generator):
        variant = gen_dataset_ops.shuffle_dataset_v3(
            data._variant_tensor, buffer_size=node._buffer_size, seed=node._seed,
            seed2=node._seed2, seed_generator=generator,
            reshuffle_each_iteration=node._reshuffle_each_iteration, **data._flat_structure)
        return tf.data.experimental.from_variant(variant, data.element_spec)

    if not after:
        return on(base, gen_dataset_ops.dummy_seed_generator())
    generator = gen_dataset_ops.anonymous_seed_generator(
        seed=node._seed, seed2=node._seed2, reshuffle=True)
    ahead = on(tf.data.Dataset.range(1), generator[0])
    for _ in range(after):
        iter(ahead)  # an iterator draws its seeds when it is made: nothing is read
    out = on(base, generator[0])
    out._tfspeed_seed_generator = generator  # the resource lives as long as the pipeline
    return out


def _batch(node, base):
    return base.batch(int(node._batch_size), drop_remainder=bool(node._drop_remainder))


def _prefetch(node, base):
    return base.prefetch(int(node._buffer_size))


def _repeat(node, base):
    return base.repeat(int(node._count))


def _take(node, base):
    return base.take(int(node._count))


def _skip(node, base):
    return base.skip(int(node._count))


def _unbatch(node, base):
    return base.unbatch()


def _options(node, base):
    return base.with_options(node._options_attr)


def _cache(node, base):
    return base.cache(node._filename)


REBUILD: dict[str, Callable] = {
    "_MapDataset": _map, "_ParallelMapDataset": _map, "_ShuffleDataset": _shuffle,
    "_BatchDataset": _batch, "_ParallelBatchDataset": _batch, "_PrefetchDataset": _prefetch,
    "_RepeatDataset": _repeat, "_TakeDataset": _take, "_SkipDataset": _skip,
    "_UnbatchDataset": _unbatch, "_OptionsDataset": _options, "CacheDataset": _cache,
    # Made by the op after it (unbatch normalises its input to dense): rebuilt by that op.
    "_RestructuredDataset": lambda node, base: base,
}
