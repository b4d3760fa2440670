"""``tfds:NAME``: an image classification dataset already prepared by TensorFlow Datasets."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Iterator

from tfspeed.convert.sources import base
from tfspeed.convert.sources.encoding import ImageStorage, image_or_skip
from tfspeed.errors import UsageError


@dataclasses.dataclass(frozen=True)
class TfdsChunk:
    """Examples ``[start, stop)`` of a split of a prepared TFDS dataset."""

    name: str
    data_dir: str | None
    keys: tuple[str, str]  # (image, label)
    split: str
    start: int
    stop: int
    storage: ImageStorage

    def records(self) -> Iterator[dict | base.Skip]:
        import tensorflow_datasets as tfds

        image_key, label_key = self.keys
        dataset = _tfds_builder(self.name, self.data_dir).as_dataset(
            split=f"{self.split}[{self.start}:{self.stop}]",  # reads only this slice
            shuffle_files=False,
            decoders={image_key: tfds.decode.SkipDecoding()},  # keep the encoded bytes
            read_config=tfds.ReadConfig(interleave_cycle_length=1, try_autocache=False),
        )
        for i, example in enumerate(dataset.as_numpy_iterator()):
            item = f"tfds:{self.name}/{self.split}[{self.start + i}]"
            image = image_or_skip(item, example[image_key], self.storage)
            if isinstance(image, base.Skip):
                yield image
            else:
                yield {base.IMAGE: image, "label": int(example[label_key])}


def open_tfds(name: str, opts: base.SourceOptions) -> base.Source:
    """Opens the prepared dataset ``name`` in ``opts.tfds_data_dir``; its splits are kept."""
    builder = _tfds_builder(name, opts.tfds_data_dir)
    info = builder.info
    image_key, label_key = _tfds_keys(name, info)
    shape = tuple(info.features[image_key].shape)
    if shape[-1] not in (1, 3):
        raise UsageError(
            f"TFDS dataset {name}: image {image_key!r} has {shape[-1]} channels; 1 or 3 convert"
        )
    splits = {s: info.splits[s].num_examples for s in base.ordered_splits(info.splits)}
    splits = {s: n for s, n in splits.items() if n}
    files = [(f, os.stat(os.path.join(builder.data_dir, f))) for f in os.listdir(builder.data_dir)]
    return base.Source(
        features=(base.LABEL,),
        inputs=base.IMAGE,
        class_names=tuple(info.features[label_key].names),
        splits=splits,
        split_bytes={s: int(info.splits[s].num_bytes) for s in splits},
        identity=base.content_hash([name, sorted((f, st.st_size, st.st_mtime_ns) for f, st in files)]),
        options={"tfds_data_dir": opts.tfds_data_dir},
        make_chunk=functools.partial(TfdsChunk, name, opts.tfds_data_dir, (image_key, label_key)),
        image_shape=base.image_shape(opts, shape),
    )


@functools.lru_cache(maxsize=4)
def _tfds_builder(name: str, data_dir: str | None):
    """The builder of a prepared TFDS dataset; never downloads (UsageError if unprepared)."""
    from tfspeed.util.system import import_tensorflow_quietly

    import_tensorflow_quietly()  # TFDS imports TF; keep its start-up banner off stderr
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


def _tfds_keys(name: str, info) -> tuple[str, str]:
    """The (image, label) feature keys: the supervised keys if they fit, else the first ones."""
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
