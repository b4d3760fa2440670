"""The tf.data service: run the expensive part of the input pipeline on other processes/hosts.

tfspeed does not implement a service of its own: it starts TensorFlow's dispatcher and
workers (``python -m tfspeed.data_service``) and hands the pipeline's read → parse → decode
→ shuffle → augment part to them with ``tf.data.experimental.service.distribute``. What
stays in the training process, and why, is described in ``tfspeed.data.pipeline``.

Sharding (``--data_service_sharding``):
  ``dynamic``: the dispatcher hands out shard files to workers as they ask for work; each
    record is delivered at most once per epoch, also when a worker dies (its unfinished
    files are lost for that epoch, and counted here).
  ``file``: each worker reads a fixed share of the files; the dispatcher needs the worker
    list (``dispatcher --worker_addresses=...``). Exactly once unless a worker dies.
  ``off``: every worker produces the whole epoch ("parallel epochs"): with k workers each
    record arrives k times per epoch. For many trainers sharing warm workers.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
from urllib.parse import urlsplit

from absl import logging

from tfspeed.errors import UsageError

SHARDING_MODES = ("off", "dynamic", "file")
PROTOCOL = "grpc"


def parse_address(address: str, flag: str = "data_service") -> tuple[str, int]:
    """``grpc://HOST:PORT`` -> (host, port); a UsageError naming ``--flag`` otherwise."""
    url = urlsplit(address if "://" in address else f"{PROTOCOL}://{address}")
    try:
        port = url.port
    except ValueError:
        port = None
    if url.scheme != PROTOCOL or not url.hostname or not port or url.path not in ("", "/"):
        raise UsageError(f"--{flag}={address!r} is not a dispatcher address; use "
                         f"grpc://HOST:PORT (e.g. grpc://127.0.0.1:5050)")
    return url.hostname, port


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Raises a UsageError if nothing listens at the dispatcher's address.

    TensorFlow's client retries an unreachable dispatcher for a long time; a typo in the
    address should fail at once instead.
    """
    host, port = parse_address(address)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
        reason = e.strerror or str(e)
        raise UsageError(
            f"no tf.data service dispatcher at {address} ({reason}); start one with "
            f"`python -m tfspeed.data_service dispatcher --port={port} --work_dir=DIR` and "
            f"workers with `python -m tfspeed.data_service worker --dispatcher={host}:{port}`"
        ) from None


def sharding_policy(mode: str):
    """The ``tf.data.experimental.service.ShardingPolicy`` for a ``--data_service_sharding``."""
    import tensorflow as tf

    policies = tf.data.experimental.service.ShardingPolicy
    return {"off": policies.OFF, "dynamic": policies.DYNAMIC, "file": policies.FILE}[mode]


def distribute(ds, address: str, mode: str):
    """Runs ``ds`` on the service at ``address``; each iteration is a new job (one epoch)."""
    import tensorflow as tf

    return ds.apply(tf.data.experimental.service.distribute(
        processing_mode=sharding_policy(mode), service=address))


@dataclasses.dataclass
class EpochCount:
    """What the service delivered for one split: epochs finished, elements delivered and
    lost (delivered fewer than the split holds), summed over epochs."""

    epochs: int = 0
    expected: int = 0
    delivered: int = 0
    lost: int = 0
    duplicated: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


_lock = threading.Lock()
_counts: dict[str, EpochCount] = {}


def record_epoch(split: str, delivered: int, expected: int, mode: str, address: str) -> None:
    """Accounts one finished epoch of ``split`` read through the service, warning on loss."""
    with _lock:
        count = _counts.setdefault(split, EpochCount())
        count.epochs += 1
        count.expected += expected
        count.delivered += delivered
        count.lost += max(expected - delivered, 0)
        count.duplicated += max(delivered - expected, 0)
    if delivered < expected:
        logging.warning(
            "tfspeed: the tf.data service at %s delivered %d of %d records of split %r this "
            "epoch, %d lost (a service worker stopped mid-epoch, or a shard is damaged: "
            "see the workers' logs); training goes on", address, delivered, expected, split,
            expected - delivered)
    elif delivered > expected and mode != "off":
        logging.warning("tfspeed: the tf.data service delivered %d of %d records of split %r "
                        "this epoch (some twice)", delivered, expected, split)


def report() -> dict[str, dict]:
    """Per split: epochs, expected, delivered, lost and duplicated records so far."""
    with _lock:
        return {split: count.to_json() for split, count in _counts.items()}


def reset_report() -> None:
    with _lock:
        _counts.clear()


def serve(groups, config, split, expected, deterministic):
    """``groups`` (of records) run on the service, one job per epoch, endlessly; each
    epoch's groups counted by ``count_epoch``. Returns the groups as they arrive."""
    import tensorflow as tf

    remote = distribute(groups, config.data_service, config.data_service_sharding)

    def epoch(_):
        return count_epoch(remote, split, expected, config)

    # Two epochs in flight: the service tells a consumer that an epoch (a job) has ended
    # only at its next heartbeat, ~1 s after the last record; meanwhile the next epoch's
    # records flow. Each epoch still delivers every record at most once. A deterministic
    # pipeline takes epochs one after the other.
    in_flight = 1 if deterministic else 2
    return tf.data.Dataset.range(2**62).interleave(
        epoch, cycle_length=in_flight, block_length=1, num_parallel_calls=in_flight,
        deterministic=deterministic)


def count_epoch(groups, split, expected, config):
    """Passes an epoch's groups through, and at its end tells ``service.record_epoch`` how
    many records came (counted per group: the per-record cost stays off the hot path)."""
    import tensorflow as tf

    def account(delivered):
        record_epoch(split, int(delivered), expected, config.data_service_sharding,
                     config.data_service)
        return True

    def count(n, group):
        size = tf.cast(tf.shape(tf.nest.flatten(group)[0])[0], tf.int64)  # records in it
        done = tf.cond(size == 0, lambda: tf.py_function(account, [n], tf.bool),
                       lambda: tf.constant(True))
        with tf.control_dependencies([done]):
            return n + size, tf.nest.map_structure(tf.identity, group)

    end = tf.nest.map_structure(  # token groups are [B, longest]: None -> 0
        lambda s: tf.zeros([0, *(d or 0 for d in s.shape[1:])], s.dtype), groups.element_spec)
    groups = groups.concatenate(tf.data.Dataset.from_tensors(end))
    return groups.scan(tf.constant(0, tf.int64), count)
