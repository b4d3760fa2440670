"""Converts a dataset into TFRecord shards plus ``schema.json``: `convert()`.

Sources: imagefolder:PATH, csv:PATH, npz:PATH, tfds:NAME (prepared in --tfds_data_dir), digits.
Rerunning an interrupted conversion resumes it; rerunning a finished one returns at once.
The command line over it is `tfspeed.convert.cli`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Sequence

from absl import logging

from tfspeed.convert import runners, sources, writer
from tfspeed.data.schema import Schema, Split, names_of
from tfspeed.errors import UsageError

# Bump when the records a given source and options produce change: old outputs then no
# longer count as "already converted".
CONVERTER_VERSION = 1


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What `convert` did.

    Attributes:
      schema: the finished dataset's schema (as written to ``output/schema.json``).
      summary: ``records`` (in the dataset), ``seconds``, ``records_per_sec`` (written this
        run), ``bytes``, ``shards`` (split -> count), ``skipped``, ``resumed_shards`` (kept
        from an earlier, interrupted or finished run).
      output: the output directory.
      already_converted: the output already held this conversion; nothing was written.
    """

    schema: Schema
    summary: dict
    output: str
    already_converted: bool = False


def convert(
    source: str,
    output: str,
    *,
    shards: int = 0,
    target_shard_mb: float = 128.0,
    validation_fraction: float = 0.1,
    seed: int = 0,
    workers: int = 1,
    runner: str = "local",
    beam_options: str = "",
    image_max_side: int = 0,
    image_format: str = "jpeg",
    label_column: str = "label",
    tfds_data_dir: str | None = None,
    overwrite: bool = False,
    progress: bool = False,
) -> ConvertResult:
    """Converts ``source`` into ``output``: shards, then ``schema.json``; resumes if interrupted.

    Args:
      source: ``imagefolder:PATH``, ``csv:PATH``, ``npz:PATH``, ``tfds:NAME`` or ``digits``.
      output: the output directory (created if missing).
      shards: shards of the train split (other splits proportionally fewer); 0 = automatic:
        16 (parallel reads, files to split over training workers) or ``target_shard_mb``
        per shard, whichever gives more.
      target_shard_mb: the shard size aimed at when ``shards`` is 0.
      validation_fraction: share of a split-less source held out as ``validation``, in [0, 1).
      seed: seeds the train/validation split and the order of records within each split.
      workers: processes writing shards with the local runner; 1 writes in this process.
      runner: who writes the shards: ``local`` (this machine) or ``beam`` (an Apache Beam
        pipeline); the output is the same bytes either way.
      beam_options: Beam pipeline options as one shell-quoted string, for ``runner="beam"``,
        e.g. ``"--direct_num_workers=4 --direct_running_mode=multi_processing"``.
      image_max_side: images are shrunk so their long side is at most this; 0 keeps them.
      image_format: ``jpeg`` or ``png``, the encoding of stored images.
      label_column: the CSV column holding the labels.
      tfds_data_dir: where a ``tfds:`` dataset was prepared (TFDS' default if None).
      overwrite: replace another dataset's files in ``output`` (only ours: shards, schema.json,
        plan and temporary files).
      progress: show a progress bar (on a terminal).

    Returns:
      A `ConvertResult`. Raises `UsageError` for bad options, bad input or an ``output`` that
      holds another dataset.
    """
    start = time.perf_counter()
    options = sources.SourceOptions(
        image_format, image_max_side, label_column, validation_fraction, seed, tfds_data_dir
    )
    _check_options(shards, target_shard_mb, workers, options)
    shard_runner = runners.make_runner(runner, workers=workers, beam_options=beam_options)
    src = sources.open_source(source, options)
    counts = writer.shard_counts(src.splits, src.split_bytes, shards, target_shard_mb)
    tasks = writer.plan_tasks(src.splits, counts)
    shaping = {"shards": shards, "target_shard_mb": target_shard_mb, **src.options}
    template = Schema(
        features=names_of(src.features),
        inputs=src.inputs,
        label="label",
        class_names=src.class_names,
        splits={},
        source=source,
        options=shaping,
        fingerprint=_fingerprint(source, src.identity, shaping, counts),
        stats=src.stats,
    )
    _make_dir(output)
    plan = writer.Plan(output, template.fingerprint, [t.file for t in tasks])
    with writer.locked(output):
        finished = None if overwrite else plan.finished()
        if finished:
            summary = _summary(finished, time.perf_counter() - start, len(tasks), written=0)
            return ConvertResult(finished, summary, output, already_converted=True)
        results = plan.prepare(overwrite)
        kept = len(results)
        written = _write_missing(plan, tasks, results, src, template, shard_runner, progress)
        schema = dataclasses.replace(template, splits=_splits(src.splits, tasks, results))
        if not sum(split.num_records for split in schema.splits.values()):
            raise UsageError(
                f"no record could be made from {source}: every item was skipped "
                "(see the warnings above); check the source's files"
            )
        plan.finish(schema, results)
    summary = _summary(schema, time.perf_counter() - start, kept, written)
    return ConvertResult(schema, summary, output)


def _write_missing(
    plan: writer.Plan,
    tasks: Sequence[writer.ShardTask],
    results: dict[str, writer.ShardResult],
    src: sources.Source,
    template: Schema,
    runner: runners.Runner,
    progress: bool,
) -> int:
    """Writes the shards not in ``results``, adding them to it; returns the records written."""
    from tqdm import tqdm

    todo = [t for t in tasks if t.file not in results]
    items = {t.file: t.stop - t.start for t in tasks}
    bar = tqdm(
        total=sum(items.values()),
        initial=sum(items.values()) - sum(items[t.file] for t in todo),
        unit=" records",
        disable=None if progress else True,
    )
    counted = [0]  # items of the shard in flight already shown (in-process writing)
    written = [0]

    def on_record() -> None:
        counted[0] += 1
        bar.update(1)

    def on_result(result: writer.ShardResult) -> None:  # the runner recorded it in the plan
        results[result.file] = result
        written[0] += result.num_records
        bar.update(items[result.file] - counted[0])
        counted[0] = 0
        for skip in result.skipped:
            logging.warning("skipped %s: %s", skip["item"], skip["reason"])

    with bar:
        runner.write(plan, todo, src.make_chunk, template, on_result=on_result, on_record=on_record)
    return written[0]


def _splits(sizes, tasks, results) -> dict[str, Split]:
    """The schema's splits, shards in order, skipped items gathered per split."""
    splits = {}
    for split in sizes:
        shards = [results[t.file] for t in tasks if t.split == split]
        skipped = tuple(s for r in shards for s in r.skipped)
        splits[split] = Split(split, tuple(r.to_shard() for r in shards), skipped)
    return splits


def _fingerprint(source: str, identity: str, options: dict, counts: dict) -> str:
    """Equal fingerprints mean equal records: hashes the content identity and the options."""
    kind = source.partition(":")[0]
    key = {
        "converter": CONVERTER_VERSION,
        "kind": kind,
        "identity": identity,
        "options": options,
        "shards": counts,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def _summary(schema: Schema, seconds: float, resumed: int, written: int) -> dict:
    shards = [s for split in schema.splits.values() for s in split.shards]
    return {
        "records": sum(s.num_records for s in shards),
        "seconds": seconds,
        "records_per_sec": written / seconds if seconds > 0 else 0.0,
        "bytes": sum(s.num_bytes for s in shards),
        "shards": {name: len(split.shards) for name, split in schema.splits.items()},
        "skipped": sum(len(split.skipped) for split in schema.splits.values()),
        "resumed_shards": resumed,
    }


def _check_options(
    shards: int, target_shard_mb: float, workers: int, o: sources.SourceOptions
) -> None:
    """Raises a UsageError naming the first bad option value."""
    problems = [
        (shards < 0, f"--shards={shards}: must be >= 0 (0 = automatic)"),
        (not target_shard_mb > 0, f"--target_shard_mb={target_shard_mb}: must be > 0"),
        (not 0 <= o.validation_fraction < 1, f"--validation_fraction={o.validation_fraction}: "
         "must be in [0, 1), e.g. 0.1"),
        (o.seed < 0, f"--seed={o.seed}: must be >= 0"),
        (workers < 1, f"--workers={workers}: must be >= 1"),
        (o.image_max_side < 0, f"--image_max_side={o.image_max_side}: must be >= 0 (0 = keep)"),
        (o.image_format not in ("jpeg", "png"), f"--image_format={o.image_format}: use jpeg or png"),
        (not o.label_column, "--label_column is empty: name the CSV column holding the labels"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise UsageError(message)


def _make_dir(output: str) -> None:
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"--output={output} is a file; name a directory")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create --output={output}: {e.strerror}; choose a writable path"
        ) from None
