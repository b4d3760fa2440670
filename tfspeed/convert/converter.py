"""Converts a dataset into TFRecord shards plus ``schema.json``: `convert()`.

Sources: imagefolder:PATH, csv:PATH, npz:PATH, tfds:NAME (prepared in --tfds_data_dir), digits;
text (tokenised here, see `tfspeed.convert.sources.text`): textfolder:PATH, jsonl:PATH, csv:PATH
with a text column, pystdlib, pydocstrings.
Rerunning an interrupted conversion resumes it; rerunning a finished one returns at once.
The command line over it is `tfspeed.convert.cli`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Callable

from absl import logging

from tfspeed.convert import plan as plan_lib
from tfspeed.convert import runners, sources, writer
from tfspeed.convert import storage as storage_lib
from tfspeed.convert.sources import lengths
from tfspeed.data import source_files
from tfspeed.data.schema import Schema, Split, names_of
from tfspeed.errors import UsageError
from tfspeed.util import locks, system
from tfspeed.util.files import write_bytes_atomic

# Bump when the records a given source and options produce change: old outputs then no
# longer count as "already converted".
CONVERTER_VERSION = 2  # 2: --image_size, raw and auto storage, image sides in schema.json


@dataclasses.dataclass(frozen=True)
class ConvertResult:
    """What `convert` did.

    Attributes:
      schema: the finished dataset's schema (as written to ``output/schema.json``).
      summary: ``records`` (in the dataset), ``seconds``, ``records_per_sec`` (written this
        run), ``bytes``, ``shards`` (split -> count), ``skipped``, ``resumed_shards`` (kept
        from an earlier, interrupted or finished run), ``workers`` (the local runner's
        writers; None under Beam).
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
    workers: int | None = None,
    runner: str = "local",
    beam_options: str = "",
    image_size: int = 0,
    image_max_side: int = 0,
    image_format: str = "auto",
    raw_budget_mb: float | None = None,
    label_column: str = "label",
    tfds_data_dir: str | None = None,
    task: str = "classification",
    named_columns: bool = False,
    text: sources.TextOptions | None = None,
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
      workers: processes writing shards with the local runner (1 writes in this process);
        None = the CPUs available, as on the command line.
      runner: who writes the shards: ``local`` (this machine) or ``beam`` (an Apache Beam
        pipeline); the output is the same bytes either way.
      beam_options: Beam pipeline options as one shell-quoted string, for ``runner="beam"``,
        e.g. ``"--direct_num_workers=4 --direct_running_mode=multi_processing"``.
      image_size: stores images ready for ``N`` x ``N`` training: the pixels of
        ``tf.image.resize(tf.io.decode_jpeg(data, channels=3), [N, N])``; 0 = off.
      image_max_side: images are shrunk so their long side is at most this (aspect kept,
        for random-resized crops); 0 keeps them. Not with ``image_size``.
      image_format: ``auto``, ``jpeg``, ``png`` or ``raw`` (uint8 pixels; needs one image
        shape); auto measures which is faster to read (see `tfspeed.convert.storage`).
      raw_budget_mb: the largest raw dataset auto picks raw for; None = a quarter of RAM.
      label_column: the CSV column holding the labels.
      tfds_data_dir: where a ``tfds:`` dataset was prepared (TFDS' default if None).
      task: ``classification``, ``regression`` (csv, npz) or ``lm`` (text: token ids only).
      named_columns: each CSV column is a named model input.
      text: the options of a text source (tokeniser, --max_length, --long, fields); None =
        the defaults (`sources.TextOptions`).
      overwrite: replace another dataset's files in ``output`` (only ours: shards, schema.json,
        plan and temporary files).
      progress: show a progress bar (on a terminal).

    Returns:
      A `ConvertResult`. Raises `UsageError` for bad options, bad input or an ``output`` that
      holds another dataset.
    """
    start = time.perf_counter()
    options = sources.SourceOptions(
        image_format,
        image_max_side,
        image_size,
        label_column,
        validation_fraction,
        seed,
        tfds_data_dir,
        task,
        named_columns,
        # The workers load the tokeniser from the output directory.
        text=dataclasses.replace(text or sources.TextOptions(), data_dir=os.path.abspath(output)),
    )
    budget = storage_lib.default_raw_budget_mb() if raw_budget_mb is None else raw_budget_mb
    workers = system.cpus_available() if workers is None else workers
    _check_options(shards, target_shard_mb, workers, budget, options)
    _check_tables(source, options)
    shard_runner = runners.make_runner(runner, workers=workers, beam_options=beam_options)
    # Before the storage probe decodes its first images: with glibc's default thresholds each
    # fresh 0.15-0.6 MB array is mapped and faulted in anew, which slowed the probe's
    # resizes several-fold (measured once, not benchmarked; see `writer.keep_freed_memory`).
    writer.keep_freed_memory()
    # Worker processes start now: their start-up overlaps with listing and measuring.
    with shard_runner.started(shards or writer.MIN_SHARDS):
        src = sources.open_source(source, options)
        _check_images(source, src, options)
        source_files.check_output(output, source)  # shards never mix with source files
        _make_dir(output)
        layout = _Layout(source, src, options, shards, target_shard_mb)
        # Two conversions into one directory would delete each other's shards as strays.
        with locks.acquire(os.path.join(output, locks.LOCK_FILE), f"--output={output}",
                           "wait for it to finish or stop it, or choose another --output"):
            job = _storage_job(layout, output, budget, overwrite)
            result = _run(job, layout, output, shard_runner, start, overwrite, progress)
    writers = workers if runner == "local" else None
    return dataclasses.replace(result, summary={**result.summary, "workers": writers})


def _run(
    job: _Job,
    layout: _Layout,
    output: str,
    runner: runners.Runner,
    start: float,
    overwrite: bool,
    progress: bool,
) -> ConvertResult:
    """Writes ``job`` into ``output`` (locked): the missing shards, then ``schema.json``."""
    files = [t.file for t in job.tasks]
    plan = plan_lib.Manifest(output, job.template.fingerprint, files, job.template.storage)
    finished = None if overwrite else plan.finished()
    if finished:
        _save_files(output, layout.src.files)  # the directory is this conversion's
        summary = _summary(finished, time.perf_counter() - start, len(job.tasks), written=0)
        return ConvertResult(finished, summary, output, already_converted=True)
    results = plan.prepare(overwrite)
    _save_files(output, layout.src.files)
    kept = len(results)
    written = _write_missing(plan, job, results, runner, progress)
    splits = _splits(layout.src.splits, job.tasks, results)
    schema = dataclasses.replace(job.template, splits=splits)
    if not sum(split.num_records for split in schema.splits.values()):
        raise UsageError(
            f"no record could be made from {layout.source}: every item was skipped "
            "(see the warnings above); check the source's files"
        )
    plan.finish(schema, results)
    summary = _summary(schema, time.perf_counter() - start, kept, written)
    return ConvertResult(schema, summary, output)


@dataclasses.dataclass(frozen=True)
class _Job:
    """A conversion, its image storage decided: the schema to fill, the shards to write."""

    template: Schema
    tasks: list[writer.ShardTask]
    make_chunk: Callable[[str, int, int], sources.Chunk]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """What shapes a conversion's records besides the image storage."""

    source: str
    src: sources.Source
    options: sources.SourceOptions
    shards: int
    target_shard_mb: float

    def job(self, storage: dict) -> _Job:
        """The conversion with images stored as ``storage["image_format"]`` says."""
        src, o = self.src, self.options
        image_format = storage.get("image_format", "")
        split_bytes = src.split_bytes
        if image_format == "raw":  # + 32 bytes of Example and TFRecord framing per record
            split_bytes = {s: n * (_image_bytes(src) + 32) for s, n in src.splits.items()}
        counts = writer.shard_counts(src.splits, split_bytes, self.shards, self.target_shard_mb)
        shaping = {"shards": self.shards, "target_shard_mb": self.target_shard_mb, **src.options}
        image = None
        if src.image_shape is not None:
            shaping.update(
                image_format=image_format, image_size=o.image_size, image_max_side=o.image_max_side
            )
            channels = src.image_shape[-1]
            image = sources.ImageStorage(image_format, o.image_size, o.image_max_side, channels)
        template = Schema(
            features=names_of(src.features_with(image_format)),
            inputs=src.inputs,
            label="label" if any(f.name == "label" for f in src.features) else "",
            class_names=src.class_names,
            splits={},
            source=self.source,
            options=shaping,
            fingerprint=_fingerprint(self.source, src.identity, shaping, counts),
            stats=src.stats,
            storage=storage,
            text=src.text,
        )
        make_chunk = functools.partial(src.make_chunk, storage=image)
        return _Job(template, writer.plan_tasks(src.splits, counts), make_chunk)


def _storage_job(layout: _Layout, output: str, budget_mb: float, overwrite: bool) -> _Job:
    """The job with the image storage decided: for ``auto``, the earlier run's choice in
    ``output`` if it was this very conversion (so it resumes), else a new measurement."""
    src, requested = layout.src, layout.options.image_format
    if src.image_shape is None:
        return layout.job({})
    fingerprint, earlier = plan_lib.earlier(output)
    if (
        requested == "auto"
        and not overwrite
        and earlier.get("requested") == "auto"
        and earlier.get("raw_budget_mb", round(budget_mb, 1)) == round(budget_mb, 1)
        and earlier.get("image_format") in sources.FORMATS
    ):
        job = layout.job(earlier)
        if job.template.fingerprint == fingerprint:
            return job
    storage = storage_lib.choose(
        requested,
        src.image_shape,
        raw_mb=sum(src.splits.values()) * _image_bytes(src) / 2**20,
        budget_mb=budget_mb,
        sample=lambda: _sample(layout),
        probe_dir=output,
    )
    return layout.job(storage)


def _image_bytes(src: sources.Source) -> int:
    """Bytes of one image stored raw (0 while sides vary)."""
    return math.prod(side or 0 for side in src.image_shape)


def _sample(layout: _Layout) -> list:
    """A few images of the train split (the first, a random sample) as stored raw."""
    src, o = layout.src, layout.options
    split = "train" if "train" in src.splits else next(iter(src.splits))
    stop = min(storage_lib.PROBE_IMAGES, src.splits[split])
    raw = sources.ImageStorage("raw", o.image_size, o.image_max_side, src.image_shape[-1])
    records = src.make_chunk(split, 0, stop, storage=raw).records()
    return [r[sources.IMAGE].value for r in records if not isinstance(r, sources.Skip)]


def _write_missing(
    plan: plan_lib.Manifest,
    job: _Job,
    results: dict[str, writer.ShardResult],
    runner: runners.Runner,
    progress: bool,
) -> int:
    """Writes the shards not in ``results``, adding them to it; returns the records written."""
    from tqdm import tqdm

    todo = [t for t in job.tasks if t.file not in results]
    items = {t.file: t.stop - t.start for t in job.tasks}
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
        runner.write(
            plan, todo, job.make_chunk, job.template, on_result=on_result, on_record=on_record
        )
    return written[0]


def _splits(sizes, tasks, results) -> dict[str, Split]:
    """The schema's splits, shards in order, skipped items gathered per split."""
    splits = {}
    for split in sizes:
        shards = [results[t.file] for t in tasks if t.split == split]
        skipped = tuple(s for r in shards for s in r.skipped)
        with_images = [r for r in shards if r.min_image_side]
        sides = None
        if with_images:
            sides = (
                min(r.min_image_side for r in with_images),
                max(r.max_image_side for r in with_images),
            )
        text = lengths.split_stats([r.text for r in shards])
        splits[split] = Split(split, tuple(r.to_shard() for r in shards), skipped, sides, text)
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
        **({"text": lengths.totals(s.text for s in schema.splits.values())} if schema.text else {}),
    }


def _check_options(
    shards: int, target_shard_mb: float, workers: int, budget_mb: float, o: sources.SourceOptions
) -> None:
    """Raises a UsageError naming the first bad option value."""
    formats = ("auto", *sources.FORMATS)
    problems = [
        (shards < 0, f"--shards={shards}: must be >= 0 (0 = automatic)"),
        (not target_shard_mb > 0, f"--target_shard_mb={target_shard_mb}: must be > 0"),
        (not 0 <= o.validation_fraction < 1, f"--validation_fraction={o.validation_fraction}: "
         "must be in [0, 1), e.g. 0.1"),
        (o.seed < 0, f"--seed={o.seed}: must be >= 0"),
        (workers < 1, f"--workers={workers}: must be >= 1"),
        (o.image_max_side < 0, f"--image_max_side={o.image_max_side}: must be >= 0 (0 = keep)"),
        (o.image_size < 0, f"--image_size={o.image_size}: must be >= 0 (0 = keep the sizes)"),
        (o.image_size > 0 and o.image_max_side > 0, f"--image_size={o.image_size} and "
         f"--image_max_side={o.image_max_side} conflict: pass --image_size to train on N x N "
         "resized images, --image_max_side to keep the aspect for random-resized crops"),
        (o.image_format not in formats, f"--image_format={o.image_format}: use one of "
         f"{', '.join(formats)}"),
        (not budget_mb >= 0, f"--raw_budget_mb={budget_mb}: must be >= 0 (0 = never raw for auto)"),
        (not o.label_column, "--label_column is empty: name the CSV column holding the labels"),
        (o.task not in ("classification", "regression", "lm"), f"--task={o.task}: use "
         "classification, regression or lm"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise UsageError(message)


def _check_tables(source: str, o: sources.SourceOptions) -> None:
    """Regression and named columns are for tables (csv; npz for regression)."""
    kind = source.partition(":")[0]
    if o.task == "regression" and kind not in ("csv", "npz"):
        raise UsageError(f"--task=regression needs numeric targets: a csv: or npz: source, "
                         f"not --source={source}")
    if o.named_columns and kind != "csv":
        raise UsageError(f"--named_columns makes each CSV column a named input: it needs a "
                         f"csv: source, not --source={source}")


def _check_images(source: str, src: sources.Source, o: sources.SourceOptions) -> None:
    """Raises a UsageError for image options the source's images cannot take."""
    if src.image_shape is None:
        given = [f"--{name}={value}" for name, value in (("image_size", o.image_size),
                 ("image_max_side", o.image_max_side)) if value]  # fmt: skip
        given += [f"--image_format={o.image_format}"] if o.image_format != "auto" else []
        if given:
            raise UsageError(
                f"{given[0]}: --source={source} has no images (csv and npz arrays are stored "
                "as they are); drop the option"
            )
    elif o.image_format == "raw" and None in src.image_shape:
        raise UsageError(
            f"--image_format=raw needs images of one size, and those of --source={source} "
            "vary: add --image_size=N (e.g. --image_size=224), or store them as "
            "--image_format=jpeg"
        )


def _save_files(output: str, files: dict[str, bytes]) -> None:
    """Saves a source's files (a text source's tokeniser) beside the shards, atomically."""
    for name, data in files.items():
        write_bytes_atomic(os.path.join(output, name), data)


def _make_dir(output: str) -> None:
    if os.path.exists(output) and not os.path.isdir(output):
        raise UsageError(f"--output={output} is a file; name a directory")
    try:
        os.makedirs(output, exist_ok=True)
    except OSError as e:
        raise UsageError(
            f"cannot create --output={output}: {e.strerror}; choose a writable path"
        ) from None
