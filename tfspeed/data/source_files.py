"""Tells a folder of source files (images, CSV, NPZ, JSONL) from a converted dataset, and keeps them apart.

Shards written into a photo folder would mix with the photos: a rerun of the conversion
would list the output as a class folder, and a trainer pointed at the folder finds no
``schema.json``. The converter refuses such an ``--output`` (`check_output`); the read side
(`tfspeed.data.schema.read`) names the conversion a source folder needs (`find`).

Imports nothing of the converter's sources (PIL, numpy): the read side calls it on errors.
"""

from __future__ import annotations

import dataclasses
import os

from tfspeed.errors import UsageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
TABLE_KINDS = {".csv": "csv", ".npz": "npz", ".jsonl": "jsonl"}
PATH_KINDS = ("imagefolder", "csv", "npz", "textfolder", "jsonl")  # --source=KIND:PATH
# Images are looked for down to <root>/<split>/<class>/<image>; a huge tree is not walked
# through: after this many entries the folder counts as holding no source files.
_IMAGE_DEPTH = 3
_MAX_ENTRIES = 20_000


@dataclasses.dataclass(frozen=True)
class SourceFiles:
    """Source files found in a folder: ``--source=kind:path`` converts them."""

    kind: str  # imagefolder, csv or npz
    path: str  # the folder (imagefolder) or the table file
    example: str  # one of the files, to name in a message

    @property
    def spec(self) -> str:
        return f"{self.kind}:{self.path}"


def find(folder: str) -> SourceFiles | None:
    """The source files in ``folder``, or None (also when it is not a readable folder).

    Args:
      folder: a directory: images count down to ``folder/<split>/<class>/``, tables (CSV,
        NPZ, JSONL) at its top only. Hidden files and folders are ignored.

    Returns:
      What converts them: ``imagefolder:folder`` for images, ``KIND:file`` for a table.
    """
    level, seen = [folder], 0
    for depth in range(_IMAGE_DEPTH + 1):
        deeper = []
        for directory in level:
            try:
                entries = sorted(os.scandir(directory), key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                seen += 1
                if seen > _MAX_ENTRIES:
                    return None
                name = entry.name.lower()
                if name.startswith("."):
                    continue
                if entry.is_dir():
                    deeper.append(entry.path)
                elif name.endswith(IMAGE_EXTENSIONS):
                    return SourceFiles("imagefolder", folder, entry.path)
                elif depth == 0 and os.path.splitext(name)[1] in TABLE_KINDS:
                    kind = TABLE_KINDS[os.path.splitext(name)[1]]
                    return SourceFiles(kind, entry.path, entry.path)
        level = deeper
    return None


def separate_output(source_path: str) -> str:
    """Where to convert ``source_path`` to: ``data/<name>``, or a sibling of the source if
    that would overlap it."""
    base = os.path.basename(os.path.normpath(source_path))
    name = os.path.splitext(base)[0] or "dataset"
    parent = os.path.dirname(os.path.abspath(source_path))
    for candidate in (os.path.join("data", name), os.path.join(parent, f"{name}-tfrecord")):
        if not _relation(candidate, source_path):
            return candidate
    return os.path.join(parent, f"{name}-tfrecord")


def check_output(output: str, source: str) -> None:
    """Raises a one-line UsageError if ``output`` would mix shards with source files: it is,
    lies inside or contains the source's file or folder, or it holds source files.

    Args:
      output: the converter's ``--output``.
      source: its ``--source``, e.g. ``imagefolder:PATH``.
    """
    kind, _, source_path = source.partition(":")
    relation = _relation(output, source_path) if kind in PATH_KINDS and source_path else ""
    if relation:
        raise UsageError(
            f"--output={output} {relation} (--source={source}): the shards would mix with the "
            f"source's files; write them to a separate directory, e.g. "
            f"--output={separate_output(source_path)}"
        )
    found = find(output) if os.path.isdir(output) else None
    if found:
        raise UsageError(
            f"--output={output} holds source files ({found.example}), not a converted dataset: "
            "the shards would mix with them; write them to a separate, empty directory, e.g. "
            f"--output={separate_output(output)}"
        )


def _relation(output: str, source_path: str) -> str:
    """How ``output`` overlaps ``source_path`` in words ("is", "lies inside", "contains"),
    or "" if they are apart."""
    out, src = os.path.realpath(output), os.path.realpath(source_path)
    if out == src:
        return "is the source itself"
    if os.path.commonpath([out, src]) == src:
        return "lies inside the source"
    if os.path.commonpath([out, src]) == out:
        return "contains the source"
    return ""
