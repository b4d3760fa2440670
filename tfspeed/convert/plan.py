"""A conversion's state on disk: which shards are planned and which are finished (`Manifest`).

An output directory holds:
  ``<split>-NNNNN-of-MMMMM.tfrecord``  the shards;
  ``schema.json``                      written last: its presence means the conversion finished;
  ``.tfspeed-plan.jsonl``              the plan: a header line (fingerprint, planned shard
                                       files, how images are stored), then one line per
                                       finished shard (records, bytes, sha256, skipped items);
  ``.<shard>.tmp-<pid>``               a shard being written;
  ``.tfspeed-lock``                    while a conversion runs: its lock (``tfspeed.util.locks``).

Crash safety: a shard is written under its temporary name, fsynced, renamed into place, and
only then recorded in the plan (append + fsync). After a kill at any moment a rerun keeps
the shards the plan records whose sha256 still matches, deletes everything else of ours
(temporary files, unrecorded shards) and writes what is missing. Records are deterministic,
so the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence

from absl import logging

from tfspeed.convert.writer import ShardResult, fsync_dir
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

PLAN_FILE = ".tfspeed-plan.jsonl"
PROBE_FILE = ".tfspeed-probe"  # storage.measure's read-back test file (+ .tmp-PID)
# Temporary files of ours: shards, plan rewrites, schema.json rewrites (write_json_atomic),
# the storage probe.
_TEMP = re.compile(
    r"^(\..+\.tfrecord|\.tfspeed-plan\.jsonl|schema\.json|\.tfspeed-probe)\.tmp-\d+$"
)


def verify(out_dir: str, shard: ShardResult | schema_lib.Shard) -> bool:
    """Whether ``shard``'s file exists with the recorded size and sha256."""
    path = os.path.join(out_dir, shard.file)
    try:
        if os.path.getsize(path) != shard.num_bytes:
            return False
        return _sha256(path) == shard.sha256
    except OSError:
        return False


class Manifest:
    """The conversion's state on disk: which shards are planned and which are finished."""

    def __init__(
        self, out_dir: str, fingerprint: str, files: Sequence[str], storage: Mapping | None = None
    ):
        self.out_dir = out_dir
        self.fingerprint = fingerprint
        self.files = list(files)
        self.storage = dict(storage or {})  # how images are stored and why: kept for a rerun
        self.path = os.path.join(out_dir, PLAN_FILE)
        self.schema_path = os.path.join(out_dir, schema_lib.SCHEMA_FILE)

    def finished(self) -> schema_lib.Schema | None:
        """The schema of this very conversion if it finished and all its shards verify."""
        if _read_json(self.schema_path).get("fingerprint") != self.fingerprint:
            return None
        try:
            schema = schema_lib.read(self.out_dir)
        except UsageError:
            return None
        shards = [s for split in schema.splits.values() for s in split.shards]
        if sorted(s.file for s in shards) != sorted(self.files) or self._strays():
            return None
        return schema if all(verify(self.out_dir, s) for s in shards) else None

    def prepare(self, overwrite: bool) -> dict[str, ShardResult]:
        """Makes the directory ready to write; returns the verified shards to keep.

        Args:
          overwrite: remove our files even if they belong to another conversion.

        Returns:
          file -> result of the finished shards that are kept.
        """
        reason = self._foreign()
        if reason and not overwrite:
            raise UsageError(
                f"{self.out_dir} holds another dataset ({reason}); pass --overwrite "
                "to replace it, or choose another --output"
            )
        if overwrite:
            self._remove(lambda name: name.endswith(".tfrecord"))
            self._remove(lambda name: name == PLAN_FILE)
        self._remove(lambda name: bool(_TEMP.match(name)) or name == schema_lib.SCHEMA_FILE)
        kept = {f: r for f, r in self.recorded().items() if verify(self.out_dir, r)}
        unverified = set(self.files) - set(kept)  # half-written or unrecorded: rewrite them
        self._remove(lambda name: name in unverified)
        self._rewrite(kept)  # before any shard is written: from now on the plan is ours
        return kept

    def record(self, result: ShardResult) -> None:
        """Appends a finished (renamed) shard to the plan; safe from concurrent processes."""
        line = (json.dumps(dataclasses.asdict(result)) + "\n").encode()
        # One write() under O_APPEND: lines of concurrent writers (Beam workers) never interleave.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)

    def recorded(self) -> dict[str, ShardResult]:
        """The finished shards the plan records (a torn last line, from a kill, is ignored)."""
        if self._header().get("fingerprint") != self.fingerprint:
            return {}
        results = {}
        with open(self.path) as f:
            for line in list(f)[1:]:
                try:
                    d = json.loads(line)
                    result = ShardResult(**{**d, "skipped": tuple(d["skipped"])})
                except (ValueError, TypeError, KeyError):
                    continue
                if result.file in self.files:
                    results[result.file] = result
        return results

    def finish(self, schema: schema_lib.Schema, results: Mapping[str, ShardResult]) -> None:
        """Writes the plan in canonical order, then ``schema.json`` (last)."""
        self._rewrite(results)
        schema.write(self.out_dir)
        fsync_dir(self.out_dir)

    def _foreign(self) -> str | None:
        """Why the directory holds another conversion's files, or None."""
        theirs = _read_json(self.schema_path).get("fingerprint")
        if os.path.exists(self.schema_path) and theirs != self.fingerprint:
            return f"its schema.json has fingerprint {str(theirs)[:12]}, this conversion {self.fingerprint[:12]}"
        header = self._header()
        if os.path.exists(self.path) and header.get("fingerprint") != self.fingerprint:
            return f"{PLAN_FILE} of an unfinished conversion of another source or options"
        strays = self._strays()
        if strays:
            return f"{len(strays)} .tfrecord files this conversion did not plan, e.g. {strays[0]}"
        return None

    def _strays(self) -> list[str]:
        ours = os.path.exists(self.path) or os.path.exists(self.schema_path)
        planned = set(self.files) if ours else set()
        return [
            n
            for n in sorted(os.listdir(self.out_dir))
            if n.endswith(".tfrecord") and n not in planned
        ]

    def _header(self) -> dict:
        try:
            with open(self.path) as f:
                return json.loads(f.readline())
        except (OSError, ValueError):
            return {}

    def _rewrite(self, results: Mapping[str, ShardResult]) -> None:
        """Atomically replaces the plan: header and ``results`` in planned order."""
        header = {"fingerprint": self.fingerprint, "files": self.files, "storage": self.storage}
        lines = [json.dumps(header)]
        lines += [json.dumps(dataclasses.asdict(results[f])) for f in self.files if f in results]
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)

    def _remove(self, match: Callable[[str], bool]) -> None:
        for name in os.listdir(self.out_dir):
            path = os.path.join(self.out_dir, name)
            if match(name) and os.path.isfile(path):
                logging.debug("removing %s", path)
                os.remove(path)


def earlier(out_dir: str) -> tuple[str, dict]:
    """The fingerprint and ``storage`` entry of the conversion ``out_dir`` holds (finished or
    not); empty if none. A rerun adopts its measured choice of storage, to resume it."""
    for path, line in ((schema_lib.SCHEMA_FILE, False), (PLAN_FILE, True)):
        try:
            with open(os.path.join(out_dir, path)) as f:
                d = json.loads(f.readline()) if line else json.load(f)
        except (OSError, ValueError):
            continue
        if isinstance(d, dict) and isinstance(d.get("storage"), dict):
            return str(d.get("fingerprint", "")), d["storage"]
    return "", {}


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _sha256(path: str) -> str:
    """The sha256 of the file at ``path``."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
