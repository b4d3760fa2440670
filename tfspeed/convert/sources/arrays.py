"""A source over in-memory arrays, one row per record: what csv, npz and digits load into."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

import numpy as np

from tfspeed.convert.sources import base
from tfspeed.convert.sources.encoding import ImageStorage
from tfspeed.data.schema import Feature, standardize_stats


@dataclasses.dataclass(frozen=True)
class ArrayChunk:
    """Records from in-memory arrays (one row per record); ``image`` stored by ``storage``."""

    arrays: dict[str, np.ndarray]
    storage: ImageStorage | None = None

    def records(self) -> Iterator[dict | base.Skip]:
        for i in range(len(self.arrays["label"])):
            record = {name: array[i] for name, array in self.arrays.items()}
            if self.storage is not None:
                record[base.IMAGE] = self.storage.from_array(record[base.IMAGE])
            yield record


def array_source(
    arrays: dict[str, np.ndarray],
    *,
    features: tuple[Feature, ...],
    class_names: Sequence[str],
    identity: str,
    options: dict,
    opts: base.SourceOptions,
    label: Feature = base.LABEL,
    inputs: tuple[str, ...] | None = None,
) -> base.Source:
    """A source over in-memory arrays split into train/validation by ``opts``.

    Args:
      arrays: feature name -> array, one row per item, including ``label`` (int64 ids) and,
        for an image source, ``image`` (uint8 ``(N, H, W, C)``, stored as the converter says).
      features: the features besides the label and the image; without an image the first
        one is the model input.
      class_names: label ``i`` is ``class_names[i]``.
      identity: the content identity of what the arrays were loaded from.
      options: the kind's own record-shaping options (the split options are added).
      opts: the converter options.
      label: the label feature (class ids, or regression targets).
      inputs: the names of several named model inputs (default: the first feature alone).

    Returns:
      The `base.Source`; float features carry train-split mean/std in ``stats``.
    """
    n = len(arrays["label"])
    index = base.train_validation(n, opts.validation_fraction, opts.seed)
    per_record = sum(a[:1].nbytes for a in arrays.values()) + 16  # + Example framing
    train = index["train"]
    stats = {
        f.name: standardize_stats(arrays[f.name][train].reshape(len(train), -1))
        for f in features
        if f.encoding == "float"  # uint8 arrays are images: the reader scales them
    }
    has_image = base.IMAGE in arrays

    def make_chunk(split: str, start: int, stop: int, storage: ImageStorage | None = None) -> base.Chunk:
        rows = index[split][start:stop]
        chosen = {name: a[rows] for name, a in arrays.items()}
        return ArrayChunk(chosen, storage if has_image else None)

    return base.Source(
        features=(*features, label),
        inputs=base.IMAGE if has_image else (inputs or features[0].name),
        class_names=tuple(class_names),
        splits={s: len(idx) for s, idx in index.items()},
        split_bytes={s: len(idx) * per_record for s, idx in index.items()},
        identity=identity,
        options={**options, "validation_fraction": opts.validation_fraction, "seed": opts.seed},
        make_chunk=make_chunk,
        image_shape=(base.image_shape(opts, arrays[base.IMAGE].shape[1:]) if has_image
                     else None),
        stats=stats,
    )
