"""The source kinds the converter reads, each opened into the same shape: a `Source`.

A `Source` says what its records hold (features, class names), how many items each split
has, and hands out chunks: picklable slices of a split that a writer process turns into
records. Listing happens once, in the parent; reading and encoding happen in the chunks,
so they run in parallel, one chunk per shard.

Kinds: ``imagefolder:PATH``, ``csv:PATH``, ``npz:PATH``, ``tfds:NAME``, ``digits``; text:
``textfolder:PATH``, ``jsonl:PATH``, ``csv:PATH`` with ``--text_column``, ``pystdlib``,
``pydocstrings``.

  base.py      Source, Chunk, Skip, SourceOptions; split and identity helpers
  encoding.py  how images are stored: ImageStorage (jpeg, png, raw; resized), or a Skip
  resize.py    TF's bilinear resize in numpy (for --image_size)
  arrays.py    a Source over in-memory arrays (what csv, npz and digits load into)
  images.py    imagefolder, digits
  tables.py    csv, npz
  tfds.py      tfds
  text.py      textfolder, pystdlib, pydocstrings, and what every text source shares: tokenised
               in the chunks
  text_tables.py  jsonl, csv with a text column
  lengths.py   token ids and skipped texts as chunks yield them; token counts per shard, split
  charsets.py  bytes to text: UTF-8, else --encoding or the charset detected; binary skipped
  pystdlib.py  the pystdlib corpus: Python's standard library, one text per function/class
  pydocstrings.py  the pydocstrings corpus: its docstrings, one short text each
"""

from __future__ import annotations

import os

from tfspeed.convert.sources import text
from tfspeed.convert.sources.arrays import ArrayChunk
from tfspeed.convert.sources.base import (
    IMAGE,
    Chunk,
    Skip,
    Source,
    SourceOptions,
    StoredImage,
    TextOptions,
)
from tfspeed.convert.sources.encoding import FORMATS, JPEG_QUALITY, ImageStorage
from tfspeed.convert.sources.images import (
    IMAGE_EXTENSIONS,
    ImageFilesChunk,
    open_digits,
    open_imagefolder,
)
from tfspeed.convert.sources.tables import open_csv, open_npz
from tfspeed.convert.sources.text import open_pydocstrings, open_pystdlib, open_textfolder
from tfspeed.convert.sources.text_tables import open_csv_text, open_jsonl
from tfspeed.convert.sources.tfds import TfdsChunk, open_tfds
from tfspeed.errors import UsageError

__all__ = [
    "FORMATS",
    "IMAGE",
    "IMAGE_EXTENSIONS",
    "JPEG_QUALITY",
    "KINDS",
    "ArrayChunk",
    "Chunk",
    "ImageFilesChunk",
    "ImageStorage",
    "Skip",
    "Source",
    "SourceOptions",
    "StoredImage",
    "TextOptions",
    "TfdsChunk",
    "open_source",
]

KINDS = ("imagefolder:PATH", "csv:PATH", "npz:PATH", "tfds:NAME", "digits", "textfolder:PATH",
         "jsonl:PATH", "pystdlib[:PACKAGES]", "pydocstrings[:PACKAGES]")
_OPENERS = {
    "imagefolder": open_imagefolder,
    "csv": open_csv,
    "npz": open_npz,
    "tfds": open_tfds,
    "digits": open_digits,
    "textfolder": open_textfolder,
    "jsonl": open_jsonl,
    "pystdlib": open_pystdlib,
    "pydocstrings": open_pydocstrings,
}


def open_source(spec: str, options: SourceOptions) -> Source:
    """Opens (lists) a source; the items are read later, by the chunks.

    Args:
      spec: ``KIND:PATH`` (or ``tfds:NAME``, ``digits``), the converter's ``--source``.
      options: the options that shape the records.

    Returns:
      The `Source`. Raises UsageError naming the problem and the fix if it is unusable.
    """
    kind, _, arg = spec.partition(":")
    if kind not in _OPENERS:
        raise UsageError(
            f"unknown source kind {kind!r} in --source={spec}; use one of {', '.join(KINDS)}"
        )
    if kind in ("imagefolder", "csv", "npz", "textfolder", "jsonl"):
        if not arg:
            raise UsageError(f"--source={spec} names no path; write --source={kind}:PATH")
        if not os.path.exists(arg):
            raise UsageError(f"source path {arg} does not exist; fix the path in --source={spec}")
    if kind == "tfds" and not arg:
        raise UsageError(f"--source={spec} names no dataset; write --source=tfds:NAME")
    text.check_options(kind, spec, options)
    if kind == "csv" and options.text and options.text.text_column:
        return open_csv_text(arg, options)
    return _OPENERS[kind](arg, options)
