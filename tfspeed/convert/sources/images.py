"""Image sources: ``imagefolder:PATH`` (a folder per class, optionally per split) and ``digits``."""

from __future__ import annotations

import dataclasses
import os
import pathlib
import zlib
from collections.abc import Iterable, Iterator

import numpy as np

from tfspeed.convert.sources.arrays import array_source
from tfspeed.convert.sources.base import (
    IMAGE,
    LABEL,
    Chunk,
    Skip,
    Source,
    SourceOptions,
    content_hash,
    image_shape,
    ordered_splits,
    train_validation,
)
from tfspeed.convert.sources.encoding import ImageStorage, image_or_skip
from tfspeed.data.source_files import IMAGE_EXTENSIONS
from tfspeed.errors import UsageError

_SPLIT_DIRS = {"train": "train", "val": "validation", "valid": "validation", "test": "test"}
_SPLIT_DIRS["validation"] = "validation"


@dataclasses.dataclass(frozen=True)
class ImageFilesChunk:
    """Image files (paths relative to ``root``) with their labels, stored by ``storage``."""

    root: str
    items: tuple[tuple[str, int], ...]
    storage: ImageStorage

    def records(self) -> Iterator[dict | Skip]:
        for relpath, label in self.items:
            path = os.path.join(self.root, relpath)
            image = image_or_skip(path, pathlib.Path(path), self.storage)
            yield image if isinstance(image, Skip) else {IMAGE: image, "label": label}


def open_imagefolder(root: str, opts: SourceOptions) -> Source:
    """Lists ``root/[<split>/]<class>/<images>``; a split-less folder is split by ``opts``."""
    class_names, files = _list_imagefolder(root)
    everything = sorted(f for fs in files.values() for f in fs)
    if "" in files:
        order = train_validation(len(files[""]), opts.validation_fraction, opts.seed)
        items = {s: [files[""][i] for i in idx] for s, idx in order.items()}
        options = {"validation_fraction": opts.validation_fraction}
    else:
        items = {s: [fs[i] for i in _shuffled(len(fs), opts.seed, s)] for s, fs in files.items()}
        options = {}
    items = {s: items[s] for s in ordered_splits(items) if items[s]}

    def make_chunk(split: str, start: int, stop: int, storage: ImageStorage) -> Chunk:
        chosen = tuple((rel, label) for rel, label, _ in items[split][start:stop])
        return ImageFilesChunk(root, chosen, storage)

    return Source(
        features=(LABEL,),
        inputs=IMAGE,
        class_names=class_names,
        splits={s: len(v) for s, v in items.items()},
        split_bytes={s: sum(st.st_size for _, _, st in v) for s, v in items.items()},
        identity=content_hash([[rel, st.st_size, st.st_mtime_ns] for rel, _, st in everything]),
        options={**options, "seed": opts.seed},
        make_chunk=make_chunk,
        image_shape=image_shape(opts, (None, None, 3)),
    )


def open_digits(arg: str, opts: SourceOptions) -> Source:
    """scikit-learn's 8x8 digits as images, split into train/validation by ``opts``."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = np.round(digits.images * 255 / 16).astype(np.uint8)[..., None]
    return array_source(
        {IMAGE: images, "label": digits.target.astype(np.int64)},
        features=(),
        class_names=[str(i) for i in range(10)],
        identity=content_hash("sklearn-digits-v1"),  # bundled with scikit-learn: constant content
        options={},
        opts=opts,
    )


def _shuffled(n: int, seed: int, split: str) -> np.ndarray:
    # Items of a split are mixed so that every shard holds every class: the reader
    # shuffles at shard level and relies on it.
    return np.random.default_rng([seed, zlib.crc32(split.encode())]).permutation(n)


def _visible(names: Iterable[str]) -> list[str]:
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
    _check_has_images(root, [rel.lower() for fs in files.values() for rel, _, _ in fs])
    return class_names, files


def _check_has_images(root: str, names: list[str]) -> None:
    """Raises a UsageError if the class folders of ``root`` hold no image file at all."""
    if not names:
        raise UsageError(
            f"the class folders in {root} hold no files; put images in {root}/<class>/"
        )
    if not any(name.endswith(IMAGE_EXTENSIONS) for name in names):
        raise UsageError(
            f"no image files in the class folders of {root} (looked for "
            f"{', '.join(IMAGE_EXTENSIONS)}); point --source at a folder of images"
        )
