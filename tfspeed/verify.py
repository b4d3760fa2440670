"""Checks a converted dataset's shards against ``schema.json`` and repairs damaged ones.

    python -m tfspeed.verify DATA_DIR            # exit 0: intact, 1: damage found
    python -m tfspeed.verify DATA_DIR --repair   # keep every intact record, quarantine the rest

Each shard is checked for TFRecord framing and CRCs (``tfspeed.data.integrity``), that every
record parses with the schema's feature spec, its record count and its sha256. ``--repair``
rewrites a damaged shard with its intact, parseable records in their order (temporary file,
fsync, rename), appends the bad bytes to ``DATA_DIR/quarantine/<shard>.bad`` with a JSON
sidecar of offsets and reasons, and updates ``schema.json`` (counts, sizes, checksums and a
``repairs`` list per split). Repair is idempotent: verifying afterwards finds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import sys

# None of these imports TensorFlow (--help prints at once); main_entry imports it quietly.
from tfspeed.data import integrity
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError
from tfspeed.util.cli import exit_on_help, main_entry
from tfspeed.util.files import write_bytes_atomic

QUARANTINE_DIR = "quarantine"
_PARSE_BATCH = 256


@dataclasses.dataclass
class ShardCheck:
    """What verifying one shard found.

    Attributes:
      split: the split the shard belongs to.
      shard: the shard as ``schema.json`` describes it.
      records: the intact, parseable records, in file order.
      bad: byte spans holding no usable record (framing damage or unparseable records).
      problems: one short phrase per problem besides the record count; empty when the
        shard is intact.
    """

    split: str
    shard: schema_lib.Shard
    records: list[integrity.Record]
    bad: list[integrity.BadSpan]
    problems: list[str]

    @property
    def damaged(self) -> bool:
        return bool(self.problems) or len(self.records) != self.shard.num_records

    @property
    def records_lost(self) -> int:
        return max(0, self.shard.num_records - len(self.records))


def check_shard(data_dir: str, split: str, shard: schema_lib.Shard, spec: dict) -> ShardCheck:
    """Verifies one shard against its ``schema.json`` entry.

    Args:
      data_dir: the dataset directory.
      split: the shard's split.
      shard: its ``schema.json`` entry.
      spec: ``Schema.parse_spec()``, every record must parse with it.

    Returns:
      A ``ShardCheck``.
    """
    path = os.path.join(data_dir, shard.file)
    if not os.path.exists(path):
        return ShardCheck(split, shard, [], [], ["file missing"])
    with open(path, "rb") as f:
        buf = f.read()
    records, bad = [], []
    for item in integrity.walk(buf):
        (records if isinstance(item, integrity.Record) else bad).append(item)
    unparseable = _unparseable(records, spec)
    if unparseable:
        bad = sorted(
            bad + [integrity.BadSpan(r.offset, r.size, "unparseable record") for r in unparseable],
            key=lambda s: s.offset,
        )
        records = [r for r in records if r not in unparseable]
    problems = [f"{s.reason} at bytes {s.offset}..{s.offset + s.length}" for s in bad]
    if len(buf) != shard.num_bytes or hashlib.sha256(buf).hexdigest() != shard.sha256:
        problems.append("sha256 differs from schema.json")
    return ShardCheck(split, shard, records, bad, problems)


def _unparseable(records: list[integrity.Record], spec: dict) -> list[integrity.Record]:
    """The records ``tf.io.parse_example`` rejects (parsed in batches, singly on failure)."""
    import tensorflow as tf

    def parses(batch):
        try:
            tf.io.parse_example(tf.constant([r.data for r in batch], dtype=tf.string), spec)
            return True
        except (tf.errors.InvalidArgumentError, ValueError):
            return False

    bad = []
    for i in range(0, len(records), _PARSE_BATCH):
        batch = records[i : i + _PARSE_BATCH]
        if not parses(batch):
            bad.extend(r for r in batch if not parses([r]))
    return bad


def repair_shard(data_dir: str, check: ShardCheck) -> schema_lib.Shard:
    """Rewrites a damaged shard with its intact records and quarantines the bad bytes.

    Returns:
      The shard's new ``schema.json`` entry.
    """
    path = os.path.join(data_dir, check.shard.file)
    if check.bad:
        with open(path, "rb") as f:
            buf = f.read()
        _quarantine(data_dir, check.shard.file, buf, check.bad)
    content = b"".join(integrity.frame(r.data) for r in check.records)
    write_bytes_atomic(path, content)
    return schema_lib.Shard(
        check.shard.file, len(check.records), len(content), hashlib.sha256(content).hexdigest()
    )


def _quarantine(data_dir: str, file: str, buf: bytes, bad: list[integrity.BadSpan]) -> None:
    folder = os.path.join(data_dir, QUARANTINE_DIR)
    os.makedirs(folder, exist_ok=True)
    bad_path = os.path.join(folder, f"{file}.bad")
    sidecar = f"{bad_path}.json"
    try:
        with open(sidecar) as f:
            entries = json.load(f)["spans"]
    except (OSError, ValueError, KeyError):
        entries = []
    with open(bad_path, "ab") as f:
        for span in bad:
            entries.append(
                {
                    "offset": span.offset,
                    "length": span.length,
                    "reason": span.reason,
                    "quarantine_offset": f.tell(),
                }
            )
            f.write(buf[span.offset : span.offset + span.length])
        f.flush()
        os.fsync(f.fileno())
    schema_lib.write_json_atomic(sidecar, {"shard": file, "spans": entries})


def _update_schema(data_dir: str, repaired: list[tuple[ShardCheck, schema_lib.Shard]]) -> None:
    """Writes the repaired shards' new entries and a ``repairs`` list into ``schema.json``."""
    path = os.path.join(data_dir, schema_lib.SCHEMA_FILE)
    with open(path) as f:
        raw = json.load(f)  # raw JSON: keeps keys the dataclasses do not model (``repairs``)
    for check, new in repaired:
        split = raw["splits"][check.split]
        for entry in split["shards"]:
            if entry["file"] == new.file:
                entry.update(dataclasses.asdict(new))
        split["num_records"] = sum(s["num_records"] for s in split["shards"])
        split.setdefault("repairs", []).append(
            {"shard": new.file, "records_lost": check.records_lost}
        )
    schema_lib.write_json_atomic(path, raw)


def verify(data_dir: str, repair: bool = False, out=None) -> int:
    """Verifies (and with ``repair`` repairs) every shard of ``data_dir``.

    Args:
      data_dir: a directory written by ``scripts/to_tfrecord.py``.
      repair: rewrite damaged shards and update ``schema.json``.
      out: where the report lines go (default stdout).

    Returns:
      The exit status: 0 if every shard was intact or got repaired, 1 if damage remains.
    """
    out = out or sys.stdout
    schema = schema_lib.read(data_dir)
    spec = schema.parse_spec()
    checks = [
        check_shard(data_dir, name, shard, spec)
        for name, split in schema.splits.items()
        for shard in split.shards
    ]
    damaged = [c for c in checks if c.damaged]
    repaired = []
    for c in damaged:
        line = (
            f"{c.shard.file} ({c.split}): {len(c.records)} of {c.shard.num_records} "
            f"records intact, {c.records_lost} lost; " + "; ".join(c.problems)
        )
        if repair:
            repaired.append((c, repair_shard(data_dir, c)))
            line = f"REPAIRED {line}; bad bytes in {QUARANTINE_DIR}/{c.shard.file}.bad"
        else:
            line = f"DAMAGED {line}"
        print(line, file=out)
    if repaired:
        _update_schema(data_dir, repaired)
    lost = sum(c.records_lost for c in damaged)
    summary = (
        f"{len(checks)} shards checked, {len(damaged)} damaged, {lost} records lost"
        f"{', repaired' if repair and damaged else ''}"
    )
    if damaged and not repair:
        summary += f"; repair with `python -m tfspeed.verify {data_dir} --repair`"
    print(summary, file=out)
    return 1 if damaged and not repair else 0


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit status 2, like every tfspeed error
        raise UsageError(f"{message}; usage: python -m tfspeed.verify DATA_DIR [--repair]")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m tfspeed.verify", description=__doc__,
                     formatter_class=_HelpFormatter)
    parser.add_argument("data_dir", help="a directory written by scripts/to_tfrecord.py")
    parser.add_argument(
        "--repair", action="store_true", help="rewrite damaged shards with their intact records"
    )
    return parser


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and each option's default."""


def main(argv: list[str] | None = None) -> int:
    """``python -m tfspeed.verify DATA_DIR [--repair]``; returns the exit status."""
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return verify(args.data_dir, repair=args.repair)


def run_main() -> None:
    exit_on_help(lambda: _parser().format_help())
    main_entry(main)


if __name__ == "__main__":
    run_main()
