"""The dataset schema: one description shared by the converter (writer) and the pipeline (reader).

A converted dataset directory holds ``<split>-NNNNN-of-MMMMM.tfrecord`` shards of
``tf.train.Example`` and a ``schema.json`` that says what each record holds, how many
records each shard has and its checksum. The converter writes ``schema.json`` last, so
its presence means the conversion finished.

Feature encodings:
  ``jpeg`` / ``png``: an encoded image in a bytes feature; decoded in the pipeline.
  ``raw``: ``ndarray.tobytes()`` (little-endian) in a bytes feature; fixed shape.
  ``float``: a float_list of fixed shape (tabular features).
  ``int``: an int64_list of fixed shape (labels are ``int`` with shape ``[]``).
  ``tokens``: an int64_list of any length (token ids of a text), dtype int64, shape
    ``(None,)``; parsed as a ``tf.io.RaggedFeature``: one 1-D tensor per record.

A text dataset's ``schema.json`` also has a ``text`` section (tokeniser file and kind,
vocabulary size, special ids, task, max_length and long policy) and, per split, a ``text``
entry: token-count statistics and histogram, and the truncated, split and skipped counts.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tfspeed.errors import UsageError
from tfspeed.util.files import write_json_atomic

FORMAT_VERSION = 1
SCHEMA_FILE = "schema.json"
ENCODINGS = ("jpeg", "png", "raw", "float", "int", "tokens")
DTYPES = ("uint8", "float32", "int64")


def shard_name(split: str, index: int, count: int) -> str:
    """The file name of shard ``index`` of ``count`` in ``split``."""
    return f"{split}-{index:05d}-of-{count:05d}.tfrecord"


@dataclasses.dataclass(frozen=True)
class Feature:
    """One feature of a record.

    Attributes:
      name: key in the ``tf.train.Example``.
      dtype: dtype of the decoded tensor (``uint8``, ``float32`` or ``int64``).
      shape: decoded shape; ``None`` for a dimension that varies (image height/width).
      encoding: how the value is stored (see module docstring).
    """

    name: str
    dtype: str
    shape: tuple[int | None, ...]
    encoding: str

    def __post_init__(self):
        if self.encoding not in ENCODINGS:
            raise ValueError(f"feature {self.name!r}: unknown encoding {self.encoding!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"feature {self.name!r}: unknown dtype {self.dtype!r}")
        if self.encoding == "tokens" and (self.dtype, tuple(self.shape)) != ("int64", (None,)):
            raise ValueError(f"feature {self.name!r}: tokens are int64 of shape (None,)")
        if self.encoding not in ("jpeg", "png", "tokens") and None in self.shape:
            raise ValueError(f"feature {self.name!r}: {self.encoding} needs a fixed shape")

    @property
    def is_image(self) -> bool:
        return self.encoding in ("jpeg", "png")

    def parse_spec(self):
        """The ``tf.io.FixedLenFeature`` that parses this feature (before decoding), or for
        ``tokens`` a ``tf.io.RaggedFeature`` (a 1-D tensor per record, ragged per batch)."""
        import tensorflow as tf

        if self.encoding == "tokens":
            return tf.io.RaggedFeature(tf.int64, row_splits_dtype=tf.int64)
        if self.encoding in ("jpeg", "png", "raw"):
            return tf.io.FixedLenFeature([], tf.string)
        if self.encoding == "float":
            return tf.io.FixedLenFeature(list(self.shape), tf.float32)
        return tf.io.FixedLenFeature(list(self.shape), tf.int64)

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "encoding": self.encoding}

    @classmethod
    def from_json(cls, name: str, d: Mapping) -> Feature:
        return cls(name, d["dtype"], tuple(d["shape"]), d["encoding"])


@dataclasses.dataclass(frozen=True)
class Shard:
    """One finished shard: its file name (relative to the data dir), records, bytes, sha256."""

    file: str
    num_records: int
    num_bytes: int
    sha256: str


@dataclasses.dataclass(frozen=True)
class Split:
    """A split: its shards, and the source items skipped while converting it.

    ``skipped`` holds ``{"item": ..., "reason": ...}`` dicts (e.g. an undecodable image).
    ``image_sides`` is ``(shortest, longest)``: the smallest of the stored images' short
    sides and the largest of their long sides (None without images), so a reader can pick
    a reduced JPEG decode (``ratio``) that still leaves enough pixels.
    """

    name: str
    shards: tuple[Shard, ...]
    skipped: tuple[dict, ...] = ()
    image_sides: tuple[int, int] | None = None
    text: Mapping[str, Any] | None = None  # token counts (tfspeed.convert.sources.lengths)

    @property
    def num_records(self) -> int:
        return sum(s.num_records for s in self.shards)

    def to_json(self) -> dict:
        d = {
            "num_records": self.num_records,
            "num_skipped": len(self.skipped),
            "shards": [dataclasses.asdict(s) for s in self.shards],
            "skipped": list(self.skipped),
        }
        if self.image_sides:
            d["image_sides"] = {"min": self.image_sides[0], "max": self.image_sides[1]}
        if self.text is not None:
            d["text"] = dict(self.text)
        return d

    @classmethod
    def from_json(cls, name: str, d: Mapping) -> Split:
        shards = tuple(Shard(**s) for s in d["shards"])
        sides = d.get("image_sides")
        sides = (sides["min"], sides["max"]) if sides else None
        return cls(name, shards, tuple(d.get("skipped", ())), sides, d.get("text"))


@dataclasses.dataclass(frozen=True)
class Schema:
    """What a converted dataset holds.

    Attributes:
      features: the record's features, by name.
      inputs: name of the feature the model takes as input, or the names of several named
        inputs (a CSV converted with ``--named_columns``).
      label: name of the integer class label feature.
      class_names: class names; label ``i`` is ``class_names[i]``.
      splits: the splits, by name.
      source: the converter's ``--source`` (e.g. ``imagefolder:/data/photos``).
      options: the converter options that shaped the records.
      fingerprint: a hash of the source's content and the options; equal fingerprints
        mean equal records, so it keys caches and resumption.
      stats: per-feature statistics of the train split, e.g. ``{"x": {"mean": [...],
        "std": [...]}}`` for numeric features (used by the ``standardize`` op).
      storage: how the images are stored and why, e.g. ``{"image_format": "raw",
        "requested": "auto", "reason": "...", "read_ms": ..., "decode_ms": ...}``; empty
        without images.
      text: a text dataset's tokeniser and limits: ``task`` (``classification`` or ``lm``),
        ``tokenizer`` (``file`` beside schema.json, ``kind``, ``vocab_size``,
        ``special_ids``), ``max_length``, ``long``; empty without text.
    """

    features: Mapping[str, Feature]
    inputs: str | tuple[str, ...]
    label: str
    class_names: tuple[str, ...]
    splits: Mapping[str, Split]
    source: str = ""
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fingerprint: str = ""
    stats: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    storage: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    text: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def task(self) -> str:
        """``classification`` (integer class labels), ``regression`` (float targets) or
        ``lm`` (language modelling: token ids only)."""
        if self.text.get("task") == "lm":
            return "lm"
        return "regression" if self.features[self.label].dtype == "float32" else "classification"

    @property
    def num_outputs(self) -> int:
        """The outputs a model needs: the classes, the regression targets or the vocabulary."""
        if self.task == "lm":
            return int(self.text["tokenizer"]["vocab_size"])
        if self.task == "regression":
            shape = self.features[self.label].shape
            return int(shape[0]) if shape else 1
        return self.num_classes

    @property
    def input_feature(self) -> Feature:
        return self.features[self.input_names[0]]

    @property
    def input_names(self) -> tuple[str, ...]:
        """The model inputs' feature names (one, or several named ones)."""
        return (self.inputs,) if isinstance(self.inputs, str) else tuple(self.inputs)

    @property
    def named_inputs(self) -> bool:
        """The model takes a dict of several named inputs."""
        return not isinstance(self.inputs, str)

    def split(self, name: str) -> Split:
        """The split called ``name``, or a UsageError listing the ones there are."""
        if name not in self.splits:
            raise UsageError(
                f"the dataset has no split {name!r}; it has: {', '.join(sorted(self.splits))}"
            )
        return self.splits[name]

    def shard_paths(self, data_dir: str, split: str) -> list[str]:
        return [os.path.join(data_dir, s.file) for s in self.split(split).shards]

    def parse_spec(self) -> dict:
        """The feature spec for ``tf.io.parse_example`` / ``parse_single_example``."""
        return {name: f.parse_spec() for name, f in self.features.items()}

    def to_json(self) -> dict:
        return {
            "format_version": self.format_version,
            "features": {n: f.to_json() for n, f in self.features.items()},
            "inputs": self.inputs if isinstance(self.inputs, str) else list(self.inputs),
            "label": self.label,
            "class_names": list(self.class_names),
            "num_classes": self.num_classes,
            "splits": {n: s.to_json() for n, s in self.splits.items()},
            "source": self.source,
            "options": dict(self.options),
            "fingerprint": self.fingerprint,
            "stats": dict(self.stats),
            "storage": dict(self.storage),
            **({"text": dict(self.text)} if self.text else {}),
        }

    @classmethod
    def from_json(cls, d: Mapping) -> Schema:
        return cls(
            features={n: Feature.from_json(n, f) for n, f in d["features"].items()},
            inputs=d["inputs"] if isinstance(d["inputs"], str) else tuple(d["inputs"]),
            label=d["label"],
            class_names=tuple(d["class_names"]),
            splits={n: Split.from_json(n, s) for n, s in d["splits"].items()},
            source=d.get("source", ""),
            options=d.get("options", {}),
            fingerprint=d.get("fingerprint", ""),
            stats=d.get("stats", {}),
            storage=d.get("storage", {}),
            format_version=d["format_version"],
            text=d.get("text", {}),
        )

    def write(self, data_dir: str) -> str:
        """Writes ``schema.json`` atomically (temporary file, fsync, rename); returns its path."""
        path = os.path.join(data_dir, SCHEMA_FILE)
        write_json_atomic(path, self.to_json())
        return path


def read(data_dir: str) -> Schema:
    """Reads ``data_dir/schema.json``; every problem is a one-line UsageError naming the fix."""
    path = os.path.join(data_dir, SCHEMA_FILE)
    if not os.path.isdir(data_dir):
        raise UsageError(
            f"data dir {data_dir} does not exist; convert a dataset into it with "
            f"`python scripts/to_tfrecord.py --source=KIND:PATH --output={data_dir}`"
        )
    if not os.path.exists(path):
        # Only on this error path: what source files look like (shared with the converter).
        from tfspeed.data import source_files

        found = source_files.find(data_dir)
        if found:
            out = source_files.separate_output(found.path)
            raise UsageError(
                f"{data_dir} looks like a source, not a converted dataset: it holds "
                f"{found.example} and no {SCHEMA_FILE}; convert it into a separate directory "
                f"with `python scripts/to_tfrecord.py --source={found.spec} --output={out}`, "
                f"then pass --data_dir={out}"
            )
        raise UsageError(
            f"{path} not found: {data_dir} is not a finished tfspeed conversion; run "
            f"`python scripts/to_tfrecord.py --source=KIND:PATH --output={data_dir}` "
            "(rerunning an interrupted conversion resumes it)"
        )
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"cannot read {path}: {e}; reconvert with --overwrite") from None
    version = d.get("format_version") if isinstance(d, dict) else None
    if version != FORMAT_VERSION:
        raise UsageError(
            f"{path} has schema format {version!r}, this tfspeed reads format {FORMAT_VERSION}; "
            "reconvert the dataset with this version's scripts/to_tfrecord.py --overwrite"
        )
    try:
        return Schema.from_json(d)
    except (KeyError, TypeError, ValueError) as e:
        raise UsageError(f"{path} is malformed ({e!r}); reconvert with --overwrite") from None


def standardize_stats(array: np.ndarray) -> dict[str, list[float]]:
    """Mean and std per feature column (std 1 where a column is constant)."""
    array = np.asarray(array, dtype=np.float64)
    mean = array.mean(axis=0)
    std = array.std(axis=0)
    std = np.where(std > 1e-12, std, 1.0)
    return {"mean": mean.tolist(), "std": std.tolist()}


def names_of(features: Sequence[Feature]) -> dict[str, Feature]:
    return {f.name: f for f in features}
