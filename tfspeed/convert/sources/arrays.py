"""A source over in-memory arrays, one row per record: what csv, npz and digits load into."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from tfspeed.convert.sources.base import (
    LABEL,
    Chunk,
    Skip,
    Source,
    SourceOptions,
    train_validation,
)
from tfspeed.convert.sources.encoding import encode_array
from tfspeed.data.schema import Feature, standardize_stats


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


def array_source(
    arrays: dict[str, np.ndarray],
    *,
    features: tuple[Feature, ...],
    class_names: Sequence[str],
    identity: str,
    options: dict,
    opts: SourceOptions,
    images: Mapping[str, str] | None = None,
) -> Source:
    """A source over in-memory arrays split into train/validation by ``opts``.

    Args:
      arrays: feature name -> array, one row per item, including ``label`` (int64 ids).
      features: the features besides the label; the first is the model input.
      class_names: label ``i`` is ``class_names[i]``.
      identity: the content identity of what the arrays were loaded from.
      options: the kind's own record-shaping options (the split options are added).
      opts: the converter options.
      images: feature name -> image format, for uint8 arrays stored as encoded images.

    Returns:
      The `Source`; float features carry train-split mean/std in ``stats``.
    """
    n = len(arrays["label"])
    index = train_validation(n, opts.validation_fraction, opts.seed)
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
        features=(*features, LABEL),
        inputs=features[0].name,
        class_names=tuple(class_names),
        splits={s: len(idx) for s, idx in index.items()},
        split_bytes={s: len(idx) * per_record for s, idx in index.items()},
        identity=identity,
        options={**options, "validation_fraction": opts.validation_fraction, "seed": opts.seed},
        make_chunk=make_chunk,
        stats=stats,
    )
