"""How wide each stage of the read side is: one pure function of the cores and the shards.

Every thread count, width and group size the image pipeline uses is decided here, once per
split, so the rule can be tested for machines CI does not have (CI has 2 cores; users train
beside a GPU with 8 to 64). No TensorFlow here: ``AUTOTUNE`` is tf.data's value (-1).

What is known (``benchmarks/input_pipeline.py``, 3,000 real photos, 224 px, cold from JPEG):
- On 2 cores tfspeed decodes at or above the TF guide's file pipeline (2.4-2.5k against
  2.2-2.3k img/s), with every stage's parallelism left to AUTOTUNE.
- On 16 cores (an H100 host) it reached 8.0-8.7k img/s against the guide's 9.6-10.6k, and
  0.88x its own decode limit (the same decode over JPEG bytes in memory) against 0.94x on 2.
  Its read stage alone (read, parse, count; no decode) ran 242k records/s there, 15k per
  core, while a decode takes a core per ~600 photos/s: reading needs about 1 core in 25.
- tf.data's autotuner shares one CPU budget (the cores) among every parallel stage
  (tensorflow#58819, #62821: it can ignore that budget), and the interleave may be given up
  to ``cycle_length`` threads that compete with the decode for the same cores.

So the rule keeps the sizes measured at or above the guide on 2 cores, on every machine: the
many-core sizes below are a hypothesis for ``benchmarks/input_pipeline.py`` on a 16-core host
(issue 38), not measured, so not applied. The hypothesis: from 8 cores, cap the interleave's
threads at ``max(2, ceil(cores / 8))`` (one read thread parses ~15k records/s, a decode core
~600 photos/s) and open a shard per core, leaving the cores to the decode map
(``many_core_hypothesis``).
"""

from __future__ import annotations

import dataclasses
import math
import os

AUTOTUNE = -1  # tf.data.AUTOTUNE
# Set to "many_core" (benchmarks/input_pipeline.py's contender, on a host of MANY_CORES or
# more), the pipeline takes ``many_core_hypothesis``' sizes: what is measured against today's.
READ_SIZING_ENV = "TFSPEED_READ_SIZING"

# From this many cores on, the read stage gets explicit threads instead of AUTOTUNE (below
# it, AUTOTUNE measured at or above the guide's pipeline: no reason to change).
MANY_CORES = 8
# Cores of decode one read thread feeds: a read thread parses ~15k records/s (16 cores),
# a decode core ~600 photos/s, so one read thread could feed ~25; 8 leaves 3x slack for
# bigger records, a slower disk and the unshuffled per-record hand-over.
DECODE_CORES_PER_READ_THREAD = 8
MIN_READ_THREADS = 2  # one stalled on a file read leaves the other reading
# Shard files open at once: at least 16 (latency of remote reads: each open file has
# a read ahead), and one per core where there are more cores and shards (each open shard
# is read and parsed by one thread at a time: fewer open shards than threads idles some).
MIN_CYCLE_LENGTH = 16

GROUP = 64  # records per parse / count step, at most
# Bytes per group, at most: a group of big records (224 px raw photos, 150 KB each) stays in
# the CPU's cache while it is parsed and split. Cold on those photos, such groups ran a few %
# faster than groups of 64, in every comparison (measured once on 2 cores, not benchmarked).
# A per-core cache size, so it does not change with the number of cores.
GROUP_BYTES = 2 << 20
MIN_GROUP = 8


def group_size(record_bytes: float) -> int:
    """Records per group for records of ``record_bytes`` each (as stored)."""
    return int(max(MIN_GROUP, min(GROUP, GROUP_BYTES // max(record_bytes, 1))))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """The read side's widths for one split.

    Attributes:
      cycle_length: shard files the interleave reads from at once.
      read_threads: the interleave's ``num_parallel_calls`` (threads reading and parsing
        groups), or ``AUTOTUNE``.
      group: records per parse/count step (``group_size``).

    What stays AUTOTUNE on every machine, and why: the per-record map (decode, augment: the
    stage that should grow with the cores, as it does in the guide's pipeline), the batch
    and batch-level maps, and the last prefetch (its depth follows the step time). The
    shuffle buffer is sized in bytes (``plan.SHUFFLE_BUFFER_MB``), not per core.
    """

    cycle_length: int
    read_threads: int
    group: int

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def input_sizes(cores: int, shards: int, record_bytes: float) -> Sizes:
    """The widths of the read side on ``cores`` cores for ``shards`` shard files of
    records of ``record_bytes`` each (as stored): the sizes measured at or above the guide on
    2 cores (up to 16 shards at once, AUTOTUNE threads), on every machine until a many-core
    rule is measured (``many_core_hypothesis``).

    Args:
      cores: the cores tf.data's threads run on (``--input_threads``, else the CPUs this
        process may use).
      shards: the shard files this input pipeline reads.
      record_bytes: bytes per record as stored (``plan.record_bytes(..., encoded=True)``).
    """
    if os.environ.get(READ_SIZING_ENV) == "many_core":
        return many_core_hypothesis(cores, shards, record_bytes)
    return _measured(shards, record_bytes)


def _measured(shards: int, record_bytes: float) -> Sizes:
    shards = max(1, int(shards))
    return Sizes(cycle_length=min(shards, MIN_CYCLE_LENGTH), read_threads=AUTOTUNE,
                 group=group_size(record_bytes))


def many_core_hypothesis(cores: int, shards: int, record_bytes: float) -> Sizes:
    """What to measure against ``input_sizes`` on a host with ``MANY_CORES`` or more (the
    pipeline uses it only under ``READ_SIZING_ENV=many_core``): a shard open per core, and
    the interleave's threads capped at what the decode needs with slack."""
    cores, shards = max(1, int(cores)), max(1, int(shards))
    cycle_length = min(shards, max(MIN_CYCLE_LENGTH, cores))
    if cores < MANY_CORES:
        return _measured(shards, record_bytes)
    wanted = max(MIN_READ_THREADS, math.ceil(cores / DECODE_CORES_PER_READ_THREAD))
    return Sizes(cycle_length=cycle_length, read_threads=min(cycle_length, wanted),
                 group=group_size(record_bytes))
