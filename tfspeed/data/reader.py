"""The read stage: a shard's records, parsed once, with every lost record accounted for.

TF cannot resume reading inside a damaged TFRecord file, a cut inside a record header ends
a file silently, and a record with a valid checksum but a payload that does not parse would
fail the pipeline. The shard reader here counts each shard's records against
``schema.json``, so whatever is lost is reported (or fails the run), never silent, and a
bad payload costs that record alone.

The hot path is sacred: every per-record ``map`` or ``scan`` with a function costs a sizeable
share of a photo's decode (``benchmarks/decode_ops.py``: ``passthrough`` against ``decode``).
So records move in groups of up to ``GROUP`` (and ``GROUP_BYTES``) through everything here:
one vectorised ``parse_example`` per group (with a per-record fallback only for a group that
fails to parse), one counting ``scan`` step per group. The reader yields the groups. Where records
are shuffled, the pipeline unbatches them after the parallel ``interleave``, so that the
interleave hands over one element per group rather than per record (unshuffled, it keeps
taking records from the files in turn, one by one: see `tfspeed.data.pipeline`): 224-px raw
shards read cold faster, and JPEG shards at a little less CPU per photo (tfspeed cold in
``benchmarks/input_pipeline.py``). Read alone over JPEG shards, shuffled as training reads
them, this runs slower than a bare ``TFRecordDataset`` per file in a parallel interleave: the
price of counting each shard's records (``benchmarks/input_pipeline.py``, the read stage).
"""

from __future__ import annotations

import re
import sys
import threading

import tensorflow as tf
from absl import logging

from tfspeed.config import DataConfig
from tfspeed.data.sizing import GROUP, GROUP_BYTES, MIN_GROUP, group_size  # noqa: F401 -- API

_lost_lock = threading.Lock()
_lost: dict[str, int] = {}  # shard path -> records lost, summed over reads (epochs)
_FAIL_PATTERN = re.compile(r"tfspeed: shard .*? --repair`")
_LABEL_PATTERN = re.compile(r"tfspeed: labels? .*?disagree")


def corruption_report() -> dict[str, int]:
    """Records lost to damaged, truncated or unparsable shards in this process: path -> count.

    Cumulative over every pipeline and epoch that read a damaged shard to its end.
    """
    with _lost_lock:
        return dict(_lost)


def reset_corruption_report() -> None:
    """Clears ``corruption_report()`` (tests, or a driver that reports per run)."""
    with _lost_lock:
        _lost.clear()


def user_error(error: BaseException) -> str | None:
    """The one-line ``tfspeed: ...`` message of a data error the user must fix, or None:
    a corrupt shard under ``on_corrupt="fail"``, or labels outside the schema's classes."""
    text = str(getattr(error, "message", error))
    match = _FAIL_PATTERN.search(text) or _LABEL_PATTERN.search(text)
    return match.group(0) if match else None


def corruption_error(error: BaseException) -> str | None:
    """The one-line ``tfspeed: shard ...`` message of an ``on_corrupt="fail"`` error, or None.

    TF wraps the message in iterator and node context; this digs it out, so a driver can
    turn it into a UsageError.
    """
    match = _FAIL_PATTERN.search(str(getattr(error, "message", error)))
    return match.group(0) if match else None


def shard_reader(config: DataConfig, parse_group, parse_one=None, check=None,
                 remote: bool = False, per_record: bool = False, group: int = GROUP):
    """(shard path, expected records) -> that shard's records in groups (a leading dimension;
    ``unbatch`` gives the records), lost ones accounted for.

    Args:
      config: ``data_dir`` (named in messages) and ``on_corrupt``.
      parse_group: serialized records ``[n]`` -> a structure of tensors with leading dim n
        (vectorised parse, and any decoding that works on a whole group); None keeps the
        serialized records (the bare read stage).
      parse_one: one serialized record -> one element of ``parse_group``'s structure; runs
        only for a group whose ``parse_group`` failed, so that a record with a valid
        checksum but a bad payload is dropped alone (and counted).
      check: parsed group -> a list of assertion ops (e.g. labels in range), run once per
        group after parsing, outside the fallback, so a failure stops the run.
      remote: the reader runs on a tf.data service worker, where no Python function can run:
        the accounting is then pure TF and a warning goes to the worker's log (the trainer
        counts the records of each epoch that did not arrive).
      per_record: parse each record with ``parse_one`` (one function call per record)
        instead of groups with ``parse_group`` (``--parse=single``; measured slower).
      group: records per group (``group_size``).

    Returns:
      A function for ``Dataset.interleave`` over ``(path, expected)`` pairs.

    A damaged record makes ``TFRecordDataset`` raise, and ``ignore_errors`` then drops the
    rest of the file; a cut inside a record header ends it with no error at all. Both are
    caught the same way: an empty group after the shard's last one, and at it a check (once
    per shard per epoch) of the records counted against ``schema.json``.
    """
    fail = config.on_corrupt == "fail"
    repair = f"python -m tfspeed.verify {config.data_dir} --repair"

    def account(path, read, expected):
        path = path.numpy().decode()
        read, expected = int(read), int(expected)
        lost = expected - read
        if lost <= 0:
            return ""
        message = _message(path, read, expected, repair)
        if fail:
            return message
        with _lost_lock:
            _lost[path] = _lost.get(path, 0) + lost
        logging.warning("%s", message)
        return ""

    def account_in_graph(path, read, expected):
        expected = tf.cast(expected, tf.int64)
        lost = expected - read
        # tf.strings.join, not tf.strings.format: format quotes and abbreviates strings.
        number = tf.strings.as_string
        message = tf.strings.join(["tfspeed: shard ", path, " ended after ", number(read),
                                   " of ", number(expected), " records, ", number(lost),
                                   f" lost (damaged, truncated or unparsable); repair with "
                                   f"`{repair}`"])
        if fail:
            return tf.where(lost > 0, message, "")
        return tf.cond(lost > 0, lambda: _warn_in_graph(message), lambda: tf.constant(""))

    def read(path, expected):
        records = tf.data.TFRecordDataset(path).ignore_errors()
        if per_record and parse_one is not None:
            groups = _batch(records.map(parse_one).ignore_errors(), group)
        else:
            groups = records.batch(group)
            if parse_group is not None:
                groups = groups.flat_map(_parse_alone_on_failure(parse_group, parse_one, group))
        # batch() never yields an empty group: an empty one marks the shard's end.
        end = tf.nest.map_structure(_empty, groups.element_spec)
        groups = groups.concatenate(tf.data.Dataset.from_tensors(end))

        def count(n, group):  # n: records before this group
            size = tf.cast(_rows(tf.nest.flatten(group)[0]), tf.int64)
            error = tf.cond(
                size == 0,
                (lambda: account_in_graph(path, n, expected)) if remote else
                (lambda: tf.py_function(account, [path, n, expected], tf.string)),
                lambda: tf.constant(""),
            )
            checks = [tf.debugging.Assert(tf.equal(error, ""), [error])]
            if check is not None:
                checks += check(group)
            with tf.control_dependencies(checks):
                return n + size, tf.nest.map_structure(tf.identity, group)

        return groups.scan(tf.constant(0, tf.int64), count)

    return read


def _parse_alone_on_failure(parse_group, parse_one, group: int):
    """A group -> a dataset of its one parsed group; if the vectorised parse fails (a bad
    payload), the group's records are parsed one by one and only the bad ones dropped.

    ``concatenate(...).take(1)``: the per-record path is built lazily and never runs when
    the fast one produced its element.
    """

    def per_group(records):
        fast = tf.data.Dataset.from_tensors(records).map(parse_group).ignore_errors()
        alone = _batch(tf.data.Dataset.from_tensor_slices(records).map(parse_one)
                       .ignore_errors(), group)
        return fast.concatenate(alone).take(1)

    return per_group


def _batch(ds: tf.data.Dataset, group: int) -> tf.data.Dataset:
    """Records parsed one by one -> groups like ``parse_group``'s: variable-length ones
    (token sequences) as a RaggedTensor, as ``tf.io.RaggedFeature`` parses a group."""
    ragged = any(None in s.shape for s in tf.nest.flatten(ds.element_spec))
    return ds.ragged_batch(group) if ragged else ds.batch(group)


def _empty(spec):
    """A group of no records of ``spec`` (dense or ragged)."""
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensor.from_row_splits(tf.zeros([0], spec.dtype),
                                               tf.zeros([1], spec.row_splits_dtype))
    return tf.zeros([0, *spec.shape[1:]], spec.dtype)


def _rows(x) -> tf.Tensor:
    return x.nrows() if isinstance(x, tf.RaggedTensor) else tf.shape(x)[0]


def _message(path: str, read: int, expected: int, repair: str) -> str:
    return (f"tfspeed: shard {path} ended after {read} of {expected} records, "
            f"{expected - read} lost (damaged, truncated or unparsable); repair with `{repair}`")


def _warn_in_graph(message):
    with tf.control_dependencies([tf.print(message, output_stream=sys.stderr)]):
        return tf.constant("")
