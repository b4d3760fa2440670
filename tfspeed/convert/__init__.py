"""tfspeed.convert: the write side. Converts a dataset into TFRecord shards plus ``schema.json``.

    from tfspeed.convert import convert
    convert("imagefolder:/data/photos", "data/photos", image_max_side=256)

  converter.py  convert(): source -> shards -> schema.json
  cli.py        its command line (scripts/to_tfrecord.py, tfspeed-convert)
  runners.py    who writes the shards: this machine (a process pool) or an Apache Beam pipeline
  writer.py     shard counts and tasks, atomic shard writing
  pool.py       many shards at once: this process and forked or spawned workers
  plan.py       the conversion's state on disk (the plan), what makes it resumable
  storage.py    how images are stored (--image_format=auto measures it)
  example.py    tf.train.Example records without TensorFlow
  tokenizer.py  text sources' tokenisers: a byte-level BPE trained here, or the user's file
  sources/      the source kinds (imagefolder, csv, npz, tfds, digits; textfolder, jsonl,
                pystdlib, pydocstrings) and image encoding

The format they write (``tfspeed.data.schema``, ``tfspeed.data.integrity``) and what source
files look like (``tfspeed.data.source_files``: keeps ``--output`` apart from the source) are
shared with the read side in ``tfspeed.data``.
"""

from __future__ import annotations

import importlib

# Imported on first use (PEP 562): a worker process that unpickles a shard task imports
# tfspeed.convert.writer, and must not pay for the whole converter (or TensorFlow) to do so.
_LAZY = {
    "convert": "tfspeed.convert.converter",
    "ConvertResult": "tfspeed.convert.converter",
    "main": "tfspeed.convert.cli",
    "run": "tfspeed.convert.cli",
    "summary_line": "tfspeed.convert.cli",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name]), name)


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
