"""What every source kind shares: the `Source` it opens into, its chunks, and split helpers."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

import numpy as np

from tfspeed.config import LONG_DEFAULT, MAX_LENGTH_CAP
from tfspeed.convert.sources.charsets import AUTO
from tfspeed.data.schema import Feature

LABEL = Feature("label", "int64", (), "int")  # every classification source's label feature


def target(shape: tuple[int, ...] = ()) -> Feature:
    """The label feature of a regression source: float targets of ``shape`` per record."""
    return Feature("label", "float32", tuple(shape), "float")
IMAGE = "image"  # the image feature of every image source
_SPLIT_ORDER = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The converter options that shape the records (see `tfspeed.convert.convert`)."""

    image_format: str = "auto"
    image_max_side: int = 0
    image_size: int = 0
    label_column: str = "label"
    validation_fraction: float = 0.1
    seed: int = 0
    tfds_data_dir: str | None = None
    task: str = "classification"
    named_columns: bool = False
    text: TextOptions | None = None  # text sources (textfolder, jsonl, csv text, pystdlib, ...)


@dataclasses.dataclass(frozen=True)
class TextOptions:
    """The converter options of text sources (see `tfspeed.convert.sources.text`).

    Attributes:
      tokenizer: ``bpe:N`` (train a byte-level BPE of N ids on the train split) or the path
        of a ``tokenizer.json`` (HF tokenizers) or SentencePiece ``.model``.
      max_length: the most tokens a record holds (bos/eos included); 0 = no limit. The
        default is the driver's cap (``config.MAX_LENGTH_CAP``).
      long: what happens to a longer text: ``truncate``, ``split`` (several records) or
        ``skip``; the default is the driver's (``config.LONG_DEFAULT``).
      text_field: the JSON field holding the text (``jsonl:``).
      label_field: the JSON field holding the label (``jsonl:``); empty = ``label`` where
        every line has one, else no labels.
      text_column: the CSV column holding the text (``csv:``); empty = a numeric CSV.
      max_items: use only this many items, a seeded sample in source order; 0 = all.
      encoding: the charset of files that are not UTF-8 (a Python codec name), or ``auto``:
        detect each one's (`tfspeed.convert.sources.charsets`).
      data_dir: the output directory, where the workers find the tokeniser (not an option
        that shapes the records: the converter sets it).
    """

    tokenizer: str = "bpe:8000"
    max_length: int = MAX_LENGTH_CAP
    long: str = LONG_DEFAULT
    text_field: str = "text"
    label_field: str = ""
    text_column: str = ""
    max_items: int = 0
    encoding: str = AUTO
    data_dir: str = ""


@dataclasses.dataclass(frozen=True)
class Skip:
    """A source item that yields no record, and why (e.g. an undecodable image)."""

    item: str
    reason: str

    def to_json(self) -> dict:
        return {"item": self.item, "reason": self.reason}


@dataclasses.dataclass(frozen=True)
class StoredImage:
    """An image as a record stores it, and its size (the writer gathers min/max sides).

    Attributes:
      value: the encoded image (jpeg, png), or the uint8 ``(H, W, C)`` array (raw).
      height: its height in pixels.
      width: its width in pixels.
    """

    value: bytes | np.ndarray
    height: int
    width: int


class Chunk(Protocol):
    """A picklable slice of one split; ``records()`` yields record dicts or `Skip`s."""

    def records(self) -> Iterator[dict | Skip]: ...


@dataclasses.dataclass
class Source:
    """An opened source.

    Attributes:
      features: the record's features but the image; the label is always ``label`` (int64,
        shape []).
      inputs: name of the model-input feature.
      class_names: label ``i`` is ``class_names[i]``.
      splits: split name -> number of items, in output order.
      split_bytes: split name -> estimated encoded bytes (for the automatic shard count).
      identity: sha256 of the source's content identity (paths, sizes, mtimes).
      options: the options this kind used (they shape the records).
      make_chunk: ``(split, start, stop, storage) -> Chunk`` over items ``[start, stop)`` of
        a split, its images stored as the `ImageStorage` says (ignored without images).
      image_shape: the shape of the stored ``image`` feature, ``None`` where sides vary;
        None for a source without images.
      stats: per-feature mean/std of the train split for numeric features.
      text: a text source's ``text`` section of ``schema.json`` (tokeniser, task, limits).
      files: name -> bytes of files the converter saves beside ``schema.json`` before the
        shards (a text source's tokeniser, which the workers load from there).
    """

    features: tuple[Feature, ...]
    inputs: str | tuple[str, ...]
    class_names: tuple[str, ...]
    splits: dict[str, int]
    split_bytes: dict[str, int]
    identity: str
    options: dict[str, Any]
    make_chunk: Callable[..., Chunk]
    image_shape: tuple[int | None, ...] | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    text: dict[str, Any] = dataclasses.field(default_factory=dict)
    files: dict[str, bytes] = dataclasses.field(default_factory=dict)

    def features_with(self, image_format: str) -> tuple[Feature, ...]:
        """All the record's features, the image (if any) first, stored as ``image_format``."""
        if self.image_shape is None:
            return self.features
        return (Feature(IMAGE, "uint8", self.image_shape, image_format), *self.features)


def image_shape(opts: SourceOptions, shape: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """The stored shape of images of ``shape`` (H, W, C) under the image options."""
    if opts.image_size:
        return (opts.image_size, opts.image_size, shape[-1])
    if None in shape or (opts.image_max_side and max(shape[:2]) > opts.image_max_side):
        return (None, None, shape[-1])
    return tuple(shape)


def ordered_splits(names: Iterable[str]) -> list[str]:
    """Split names in output order: train, validation, test, then the rest sorted."""
    return sorted(names, key=lambda s: (_SPLIT_ORDER.index(s) if s in _SPLIT_ORDER else 3, s))


def train_validation(n: int, fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Splits ``n`` items by a seeded permutation, which also shuffles each split.

    Args:
      n: the number of items.
      fraction: the share held out as ``validation``, in [0, 1).
      seed: seeds the permutation.

    Returns:
      ``{"train": indices}``, plus ``"validation"`` unless it would be empty.
    """
    order = np.random.default_rng(seed).permutation(n)
    n_val = round(n * fraction)
    if fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)  # a requested validation split is never empty
    splits = {"train": order[n_val:]}
    if n_val:
        splits["validation"] = order[:n_val]
    return splits


def content_hash(obj: Any) -> str:
    """The sha256 of ``obj``'s canonical JSON: a source's content identity."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def file_identity(path: str) -> str:
    """A single file's identity: its absolute path, size and mtime."""
    st = os.stat(path)
    return content_hash([os.path.abspath(path), st.st_size, st.st_mtime_ns])
