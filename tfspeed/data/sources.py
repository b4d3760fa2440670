"""The source kinds the converter reads, each opened into the same shape: a `Source`.

A `Source` says what its records hold (features, class names), how many items each split
has, and hands out chunks: picklable slices of a split that a writer process turns into
records. Listing happens once, in the parent; reading and encoding happen in the chunks,
so they run in parallel, one chunk per shard.

Kinds: ``imagefolder:PATH``, ``csv:PATH``, ``npz:PATH``, ``tfds:NAME``, ``digits``.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import struct
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
from PIL import Image, UnidentifiedImageError

from tfspeed.data.schema import Feature, standardize_stats
from tfspeed.errors import UsageError

KINDS = ("imagefolder:PATH", "csv:PATH", "npz:PATH", "tfds:NAME", "digits")
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
JPEG_QUALITY = 95  # fixed, so re-encoded images are byte-identical run to run
_PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG"}
_SPLIT_DIRS = {"train": "train", "val": "validation", "valid": "validation", "test": "test"}
_SPLIT_DIRS["validation"] = "validation"
_SPLIT_ORDER = ("train", "validation", "test")


@dataclasses.dataclass(frozen=True)
class SourceOptions:
    """The converter options that shape the records (see `tfspeed.data.convert.convert`)."""

    image_format: str = "jpeg"
    image_max_side: int = 0
    label_column: str = "label"
    validation_fraction: float = 0.1
    seed: int = 0
    tfds_data_dir: str | None = None


@dataclasses.dataclass(frozen=True)
class Skip:
    """A source item that yields no record, and why (e.g. an undecodable image)."""

    item: str
    reason: str

    def to_json(self) -> dict:
        return {"item": self.item, "reason": self.reason}


class Chunk(Protocol):
    """A picklable slice of one split; ``records()`` yields record dicts or `Skip`s."""

    def records(self) -> Iterator[dict | Skip]: ...


@dataclasses.dataclass
class Source:
    """An opened source.

    Attributes:
      features: the record's features; the label is always ``label`` (int64, shape []).
      inputs: name of the model-input feature.
      class_names: label ``i`` is ``class_names[i]``.
      splits: split name -> number of items, in output order.
      split_bytes: split name -> estimated encoded bytes (for the automatic shard count).
      identity: sha256 of the source's content identity (paths, sizes, mtimes).
      options: the options this kind used (they shape the records).
      make_chunk: ``(split, start, stop) -> Chunk`` over items ``[start, stop)`` of a split.
      stats: per-feature mean/std of the train split for numeric features.
    """

    features: tuple[Feature, ...]
    inputs: str
    class_names: tuple[str, ...]
    splits: dict[str, int]
    split_bytes: dict[str, int]
    identity: str
    options: dict[str, Any]
    make_chunk: Callable[[str, int, int], Chunk]
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)


def open_source(spec: str, options: SourceOptions) -> Source:
    """Opens (lists) a source; the items are read later, by the chunks.

    Args:
      spec: ``KIND:PATH`` (or ``tfds:NAME``, ``digits``), the converter's ``--source``.
      options: the options that shape the records.

    Returns:
      The `Source`. Raises UsageError naming the problem and the fix if it is unusable.
    """
    kind, _, arg = spec.partition(":")
    openers = dict(
        imagefolder=_open_imagefolder,
        csv=_open_csv,
        npz=_open_npz,
        tfds=_open_tfds,
        digits=_open_digits,
    )
    if kind not in openers:
        raise UsageError(
            f"unknown source kind {kind!r} in --source={spec}; use one of {', '.join(KINDS)}"
        )
    if kind in ("imagefolder", "csv", "npz"):
        if not arg:
            raise UsageError(f"--source={spec} names no path; write --source={kind}:PATH")
        if not os.path.exists(arg):
            raise UsageError(f"source path {arg} does not exist; fix the path in --source={spec}")
    if kind == "tfds" and not arg:
        raise UsageError(f"--source={spec} names no dataset; write --source=tfds:NAME")
    return openers[kind](arg, options)


# ---------------------------------------------------------------- splits and labels


def _ordered(names) -> list[str]:
    """Split names in output order: train, validation, test, then the rest sorted."""
    return sorted(names, key=lambda s: (_SPLIT_ORDER.index(s) if s in _SPLIT_ORDER else 3, s))


def _train_validation(n: int, fraction: float, seed: int) -> dict[str, np.ndarray]:
    """Splits ``n`` items by a seeded permutation, which also shuffles each split."""
    order = np.random.default_rng(seed).permutation(n)
    n_val = round(n * fraction)
    if fraction > 0 and n >= 2:
        n_val = min(max(n_val, 1), n - 1)  # a requested validation split is never empty
    splits = {"train": order[n_val:]}
    if n_val:
        splits["validation"] = order[:n_val]
    return splits


def _shuffled(n: int, seed: int, split: str) -> np.ndarray:
    # Items of a split are mixed so that every shard holds every class: the reader
    # shuffles at shard level and relies on it.
    return np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(n)


def _encode_labels(values: Sequence[str]) -> tuple[np.ndarray, tuple[str, ...]]:
    """Label strings -> ids: ints 0..n-1 stay as they are, anything else maps sorted values."""
    try:
        ints = [int(v) for v in values]
    except ValueError:
        ints = None
    if ints is not None and set(ints) == set(range(len(set(ints)))):
        return np.asarray(ints, np.int64), tuple(str(i) for i in range(len(set(ints))))
    names = sorted(set(values), key=(lambda v: (int(v), v)) if ints is not None else None)
    ids = {name: i for i, name in enumerate(names)}
    return np.asarray([ids[v] for v in values], np.int64), tuple(names)


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()


def _file_identity(path: str) -> str:
    st = os.stat(path)
    return _hash([os.path.abspath(path), st.st_size, st.st_mtime_ns])


# ---------------------------------------------------------------- images


# What PIL raises for a file that is no (complete) image.
_IMAGE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    struct.error,
    Image.DecompressionBombError,
)


def encode_image(data: bytes, image_format: str, max_side: int = 0, channels: int = 3) -> bytes:
    """Returns ``data`` as a ``channels``-channel image in ``image_format``, long side <= max_side.

    A file already in that format and mode, 8-bit and small enough is returned byte for byte
    (fast, lossless). EXIF orientation is ignored on both paths, as TF's decoders ignore it.

    Args:
      data: the encoded image.
      image_format: ``jpeg`` or ``png``.
      max_side: the longest side allowed; 0 keeps the size.
      channels: 3 (RGB) or 1 (grayscale).

    Returns:
      The encoded image. Raises one of ``_IMAGE_ERRORS`` if ``data`` is no decodable image.
    """
    image = Image.open(io.BytesIO(data))
    image.load()  # decode it all: a truncated file must fail here, not in the training input
    mode = "RGB" if channels == 3 else "L"
    fits = max_side == 0 or max(image.size) <= max_side
    # PNG's IHDR bit depth is byte 24; PIL shows 16-bit RGB as 8-bit "RGB". A transparency
    # chunk would give the file an alpha channel for decoders that honour it.
    plain = image_format != "png" or (data[24:25] == b"\x08" and "transparency" not in image.info)
    if fits and plain and image.mode == mode and image.format == _PIL_FORMATS[image_format]:
        return data
    image = image.convert(mode)
    if not fits:
        scale = max_side / max(image.size)
        size = tuple(max(1, round(side * scale)) for side in image.size)
        image = image.resize(size, Image.Resampling.LANCZOS)
    return _save(image, image_format)


def _save(image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    if image_format == "jpeg":
        image.save(buffer, "JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buffer, "PNG")
    return buffer.getvalue()


def _skip_reason(error: Exception) -> str:
    if isinstance(error, UnidentifiedImageError):
        return "not a decodable image (unknown format)"
    # PIL names in-memory buffers by address; drop it so schema.json stays deterministic.
    message = re.sub(r" at 0x[0-9a-fA-F]+", "", " ".join(str(error).split()))
    return f"undecodable image: {type(error).__name__}: {message}"


@dataclasses.dataclass(frozen=True)
class ImageFilesChunk:
    """Image files (paths relative to ``root``) with their labels."""

    root: str
    items: tuple[tuple[str, int], ...]
    image_format: str
    max_side: int

    def records(self) -> Iterator[dict | Skip]:
        for relpath, label in self.items:
            path = os.path.join(self.root, relpath)
            try:
                with open(path, "rb") as f:
                    image = encode_image(f.read(), self.image_format, self.max_side)
            except _IMAGE_ERRORS as e:
                yield Skip(path, _skip_reason(e))
                continue
            yield {"image": image, "label": label}


def _visible(names) -> list[str]:
    return sorted(n for n in names if not n.startswith("."))


def _subdirs(path: str) -> list[str]:
    return [d for d in _visible(os.listdir(path)) if os.path.isdir(os.path.join(path, d))]


def _split_dirs(root: str) -> dict[str, str]:
    """``{split: dir}`` when ``root`` holds split folders of class folders, else ``{"": root}``."""
    subdirs = _subdirs(root)
    named = subdirs and all(d.lower() in _SPLIT_DIRS for d in subdirs)
    if not named or not all(_subdirs(os.path.join(root, d)) for d in subdirs):
        return {"": root}
    splits: dict[str, str] = {}
    for d in subdirs:
        split = _SPLIT_DIRS[d.lower()]
        if split in splits:
            raise UsageError(f"{root} has two {split} folders ({splits[split]}, {d}); keep one")
        splits[split] = d
    return splits


def _list_class_files(folder: str, root: str) -> dict[str, list[tuple[str, os.stat_result]]]:
    """``{class: [(relpath, stat)]}`` for the visible files under each class folder."""
    classes = {}
    for name in _subdirs(folder):
        files = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(folder, name)):
            dirnames[:] = _visible(dirnames)  # hidden folders (.ipynb_checkpoints...) too
            for filename in _visible(filenames):
                path = os.path.join(dirpath, filename)
                files.append((os.path.relpath(path, root), os.stat(path)))
        classes[name] = files
    return classes


def _list_imagefolder(root: str) -> tuple[tuple[str, ...], dict[str, list]]:
    """Class names and ``{split: sorted [(relpath, label, stat)]}`` (split "" if none)."""
    if not os.path.isdir(root):
        raise UsageError(f"{root} is not a folder; imagefolder:PATH needs PATH/<class>/<images>")
    listing = {
        s: _list_class_files(os.path.join(root, d), root) for s, d in _split_dirs(root).items()
    }
    class_names = tuple(sorted({c for classes in listing.values() for c in classes}))
    if not class_names:
        raise UsageError(
            f"{root} has no class folders; put images in {root}/<class>/ (one folder per class)"
        )
    labels = {name: i for i, name in enumerate(class_names)}
    files = {
        s: sorted((rel, labels[c], st) for c, fs in classes.items() for rel, st in fs)
        for s, classes in listing.items()
    }
    names = [rel.lower() for fs in files.values() for rel, _, _ in fs]
    if not names:
        raise UsageError(
            f"the class folders in {root} hold no files; put images in {root}/<class>/"
        )
    if not any(name.endswith(IMAGE_EXTENSIONS) for name in names):
        raise UsageError(
            f"no image files in the class folders of {root} (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)}); point --source at a folder of images"
        )
    return class_names, files


def _open_imagefolder(root: str, opts: SourceOptions) -> Source:
    class_names, files = _list_imagefolder(root)
    everything = sorted(f for fs in files.values() for f in fs)
    if "" in files:
        order = _train_validation(len(files[""]), opts.validation_fraction, opts.seed)
        items = {s: [files[""][i] for i in idx] for s, idx in order.items()}
        options = {"validation_fraction": opts.validation_fraction}
    else:
        items = {s: [fs[i] for i in _shuffled(len(fs), opts.seed, s)] for s, fs in files.items()}
        options = {}
    items = {s: items[s] for s in _ordered(items) if items[s]}

    def make_chunk(split: str, start: int, stop: int) -> Chunk:
        chosen = tuple((rel, label) for rel, label, _ in items[split][start:stop])
        return ImageFilesChunk(root, chosen, opts.image_format, opts.image_max_side)

    return Source(
        features=(Feature("image", "uint8", (None, None, 3), opts.image_format), _LABEL),
        inputs="image",
        class_names=class_names,
        splits={s: len(v) for s, v in items.items()},
        split_bytes={s: sum(st.st_size for _, _, st in v) for s, v in items.items()},
        identity=_hash([[rel, st.st_size, st.st_mtime_ns] for rel, _, st in everything]),
        options={
            **options,
            "seed": opts.seed,
            "image_format": opts.image_format,
            "image_max_side": opts.image_max_side,
        },
        make_chunk=make_chunk,
    )


# ---------------------------------------------------------------- arrays: csv, npz, digits

_LABEL = Feature("label", "int64", (), "int")


@dataclasses.dataclass(frozen=True)
class ArrayChunk:
    """Records from in-memory arrays (one row per record); ``images`` maps feature -> format."""

    arrays: dict[str, np.ndarray]
    images: dict[str, str] = dataclasses.field(default_factory=dict)

    def records(self) -> Iterator[dict | Skip]:
        for i in range(len(self.arrays["label"])):
            record = {name: array[i] for name, array in self.arrays.items()}
            for name, image_format in self.images.items():
                record[name] = encode_array(record[name], image_format)
            yield record


def encode_array(array: np.ndarray, image_format: str) -> bytes:
    """Encodes a uint8 ``(H, W, C)`` array (C = 1 or 3) as ``image_format`` bytes."""
    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    return _save(image, image_format)


def _array_source(
    arrays: dict[str, np.ndarray],
    *,
    features,
    class_names,
    identity: str,
    options: dict,
    opts: SourceOptions,
    images=None,
) -> Source:
    """A source over in-memory arrays split into train/validation by ``opts``."""
    n = len(arrays["label"])
    index = _train_validation(n, opts.validation_fraction, opts.seed)
    per_record = sum(a[:1].nbytes for a in arrays.values()) + 16  # + Example framing
    train = index["train"]
    stats = {
        f.name: standardize_stats(arrays[f.name][train].reshape(len(train), -1))
        for f in features
        if f.encoding == "float"  # uint8 arrays are images: the reader scales them
    }

    def make_chunk(split: str, start: int, stop: int) -> Chunk:
        rows = index[split][start:stop]
        return ArrayChunk({name: a[rows] for name, a in arrays.items()}, dict(images or {}))

    return Source(
        features=(*features, _LABEL),
        inputs=features[0].name,
        class_names=tuple(class_names),
        splits={s: len(idx) for s, idx in index.items()},
        split_bytes={s: len(idx) * per_record for s, idx in index.items()},
        identity=identity,
        options={**options, "validation_fraction": opts.validation_fraction, "seed": opts.seed},
        make_chunk=make_chunk,
        stats=stats,
    )


def _read_csv(path: str) -> list[tuple[int, list[str]]]:
    """``[(line number, cells)]`` of the non-blank rows of a CSV file."""
    try:
        with open(path, newline="", encoding="utf-8-sig") as f:
            reader = csv.reader(f)
            return [(reader.line_num, row) for row in reader if any(c.strip() for c in row)]
    except (OSError, UnicodeDecodeError, csv.Error) as e:
        raise UsageError(
            f"cannot read CSV {path}: {e}; pass a UTF-8 CSV file with a header row"
        ) from None


def _open_csv(path: str, opts: SourceOptions) -> Source:
    rows = _read_csv(path)
    if len(rows) < 2:
        raise UsageError(f"CSV {path} is empty; it needs a header row and at least one data row")
    header = [c.strip() for c in rows[0][1]]
    column = opts.label_column
    if column not in header:
        raise UsageError(
            f"CSV {path} has no label column {column!r} (columns: {', '.join(header)}); "
            "pass --label_column=NAME"
        )
    if len(header) < 2:
        raise UsageError(f"CSV {path} has only the label column; it needs numeric feature columns")
    label_at = header.index(column)
    features, labels = [], []
    for row, (line, cells) in enumerate(rows[1:], start=1):
        if len(cells) != len(header):
            raise UsageError(
                f"CSV {path} line {line} has {len(cells)} cells, the header has {len(header)}; fix that row"
            )
        labels.append(cells[label_at].strip())
        if not labels[-1]:
            raise UsageError(
                f"CSV {path} line {line} has an empty {column!r}; every row needs a label"
            )
        features.append(
            [
                _number(c, header[i], f"row {row} (line {line})", path)
                for i, c in enumerate(cells)
                if i != label_at
            ]
        )
    x = np.asarray(features, np.float32)
    y, class_names = _encode_labels(labels)
    return _array_source(
        {"features": x, "label": y},
        features=(Feature("features", "float32", (x.shape[1],), "float"),),
        class_names=class_names,
        identity=_file_identity(path),
        options={"label_column": column},
        opts=opts,
    )


def _number(cell: str, column: str, where: str, path: str) -> float:
    try:
        value = float(cell)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value):
        raise UsageError(
            f"CSV {path}: column {column!r}, {where} holds {cell!r}, not a finite "
            "number; every column except the label column must be numeric"
        )
    return value


def _open_npz(path: str, opts: SourceOptions) -> Source:
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = list(data.files)
            arrays = {k: data[k] for k in keys if k in ("x", "y", "class_names")}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise UsageError(
            f"cannot read {path} as .npz ({e}); save it with np.savez(path, x=..., y=...)"
        ) from None
    for key in ("x", "y"):
        if key not in arrays:
            raise UsageError(
                f"{path} has no array {key!r} (it has: {', '.join(keys) or 'none'}); "
                "save it with np.savez(path, x=inputs, y=labels)"
            )
    x, y = arrays["x"], arrays["y"]
    y = y.reshape(-1) if y.ndim == 2 and y.shape[1:] == (1,) else y
    if x.ndim < 1 or y.ndim != 1 or len(x) != len(y) or not len(y):
        raise UsageError(
            f"{path}: x has shape {x.shape} and y {y.shape}; they need the same, "
            "non-zero number of examples (y one label per example)"
        )
    if not np.issubdtype(y.dtype, np.number) or not np.array_equal(y, np.round(y)) or y.min() < 0:
        raise UsageError(f"{path}: y must hold integer class ids >= 0")
    y = y.astype(np.int64)
    n_classes = int(y.max()) + 1
    names = [
        n.decode() if isinstance(n, bytes) else str(n)
        for n in arrays.get("class_names", np.arange(n_classes))
    ]
    if len(names) < n_classes:
        raise UsageError(
            f"{path}: class_names has {len(names)} names but y goes up to {n_classes - 1}"
        )
    if x.dtype == np.uint8:
        feature = Feature("x", "uint8", x.shape[1:], "raw")
    elif np.issubdtype(x.dtype, np.number) or x.dtype == bool:
        feature, x = Feature("x", "float32", x.shape[1:], "float"), x.astype(np.float32)
    else:
        raise UsageError(f"{path}: x has dtype {x.dtype}; use a float or uint8 array")
    return _array_source(
        {"x": x, "label": y},
        features=(feature,),
        class_names=names,
        identity=_file_identity(path),
        options={},
        opts=opts,
    )


def _open_digits(arg: str, opts: SourceOptions) -> Source:
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * 255 / 16).astype(np.uint8)[..., None]
    return _array_source(
        {"image": images, "label": digits.target.astype(np.int64)},
        features=(Feature("image", "uint8", (8, 8, 1), "png"),),
        class_names=[str(i) for i in range(10)],
        identity=_hash("sklearn-digits-v1"),  # bundled with scikit-learn: constant content
        options={},
        opts=opts,
        images={"image": "png"},
    )


# ---------------------------------------------------------------- tfds


@functools.lru_cache(maxsize=4)
def _tfds_builder(name: str, data_dir: str | None):
    """The builder of a prepared TFDS dataset; never downloads (UsageError if unprepared)."""
    import tensorflow_datasets as tfds

    fix = (
        f"prepare it first, e.g. `tfds build {name} --data_dir={data_dir or '~/tensorflow_datasets'}` "
        f"or tfds.builder('{name}', data_dir=...).download_and_prepare(); this converter never downloads"
    )
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except (tfds.core.DatasetNotFoundError, ValueError):
        raise UsageError(f"TFDS dataset {name} is not prepared in {data_dir}; {fix}") from None
    if not os.path.exists(os.path.join(builder.data_dir, "dataset_info.json")):
        raise UsageError(f"TFDS dataset {name} is not prepared in {builder.data_dir}; {fix}")
    return builder


@dataclasses.dataclass(frozen=True)
class TfdsChunk:
    """Examples ``[start, stop)`` of a split of a prepared TFDS dataset."""

    name: str
    data_dir: str | None
    keys: tuple[str, str]  # (image, label)
    image_format: str
    max_side: int
    channels: int
    split: str
    start: int
    stop: int

    def records(self) -> Iterator[dict | Skip]:
        import tensorflow_datasets as tfds

        image_key, label_key = self.keys
        dataset = _tfds_builder(self.name, self.data_dir).as_dataset(
            split=f"{self.split}[{self.start}:{self.stop}]",  # reads only this slice
            shuffle_files=False,
            decoders={image_key: tfds.decode.SkipDecoding()},  # keep the encoded bytes
            read_config=tfds.ReadConfig(interleave_cycle_length=1, try_autocache=False),
        )
        for i, example in enumerate(dataset.as_numpy_iterator()):
            try:
                image = encode_image(
                    example[image_key], self.image_format, self.max_side, self.channels
                )
            except _IMAGE_ERRORS as e:
                yield Skip(f"tfds:{self.name}/{self.split}[{self.start + i}]", _skip_reason(e))
                continue
            yield {"image": image, "label": int(example[label_key])}


def _tfds_keys(name: str, info) -> tuple[str, str]:
    import tensorflow_datasets as tfds

    features = info.features
    images = [k for k in sorted(features) if isinstance(features[k], tfds.features.Image)]
    labels = [k for k in sorted(features) if isinstance(features[k], tfds.features.ClassLabel)]
    supervised = tuple(info.supervised_keys or ())[:2]
    if len(supervised) == 2 and supervised[0] in images and supervised[1] in labels:
        return supervised
    if not images or not labels:
        raise UsageError(
            f"TFDS dataset {name} has no Image and ClassLabel features "
            f"({', '.join(sorted(features))}); only image classification datasets convert"
        )
    return images[0], labels[0]


def _open_tfds(name: str, opts: SourceOptions) -> Source:
    builder = _tfds_builder(name, opts.tfds_data_dir)
    info = builder.info
    image_key, label_key = _tfds_keys(name, info)
    shape = tuple(info.features[image_key].shape)
    channels = shape[-1]
    if channels not in (1, 3):
        raise UsageError(
            f"TFDS dataset {name}: image {image_key!r} has {channels} channels; 1 or 3 convert"
        )
    if None in shape or (opts.image_max_side and max(shape[:2]) > opts.image_max_side):
        shape = (None, None, channels)
    splits = {s: info.splits[s].num_examples for s in _ordered(info.splits)}
    splits = {s: n for s, n in splits.items() if n}
    files = [(f, os.stat(os.path.join(builder.data_dir, f))) for f in os.listdir(builder.data_dir)]
    return Source(
        features=(Feature("image", "uint8", shape, opts.image_format), _LABEL),
        inputs="image",
        class_names=tuple(info.features[label_key].names),
        splits=splits,
        split_bytes={s: int(info.splits[s].num_bytes) for s in splits},
        identity=_hash([name, sorted((f, st.st_size, st.st_mtime_ns) for f, st in files)]),
        options={
            "image_format": opts.image_format,
            "image_max_side": opts.image_max_side,
            "tfds_data_dir": opts.tfds_data_dir,
        },
        make_chunk=functools.partial(
            TfdsChunk,
            name,
            opts.tfds_data_dir,
            (image_key, label_key),
            opts.image_format,
            opts.image_max_side,
            channels,
        ),
    )
