"""Input-pipeline benchmark on real photographs: JPEGs -> 224x224 batches of 64.

    python benchmarks/input_pipeline.py [--images=3000] [--workdir=/tmp/tfspeed-bench]

The images are crops of the photographs bundled with scikit-learn and scikit-image,
256-512 px a side, JPEG q90 (``tfspeed.bench.make_photos``): never generated images, which
decode and compress unlike photos. In one run, each pipeline timed for a whole epoch, best
of ``--rounds`` interleaved rounds (this machine is shared):

  peers    the TF guide's file pipeline (from_tensor_slices(paths).map(read + decode +
           resize, AUTOTUNE).batch.prefetch), and plain TFRecords + interleave + AUTOTUNE;
  limit    a bare decode+resize loop over the same JPEG bytes held in memory;
  tfspeed  cold (cache="none", training defaults: shuffled) from JPEG at rest (the default
           conversion) and from the storage the converter picks for 224 px
           (--image_size=224 --image_format=auto);
  warm     tfspeed from its memory cache as float32 and as uint8, each next to a bare
           in-memory loop over the same images (cache -> batch -> cast, or uint8 batches).

Also the conversion itself: --workers=1 against the default. Prints one JSON record.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfspeed import bench  # noqa: E402
from tfspeed.convert import convert  # noqa: E402
from tfspeed.data import DataConfig, build, build_from_config  # noqa: E402

_IMAGES = flags.DEFINE_integer("images", 3000, "Photos to cut from the sample photographs.")
_CLASSES = flags.DEFINE_integer("classes", 4, "Class folders.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench", "Images, shards and caches.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds; each pipeline's best counts.")

SIZE, BATCH = 224, 64
AUTOTUNE = tf.data.AUTOTUNE


def guide_decode(jpeg: tf.Tensor) -> tf.Tensor:
    """The TF guide's per-image work: decode, resize, scale to [0, 1]."""
    return tf.image.resize(tf.io.decode_jpeg(jpeg, channels=3), [SIZE, SIZE]) / 255.0


def files_pipeline(items) -> tf.data.Dataset:
    paths, labels = [p for p, _ in items], [label for _, label in items]
    ds = tf.data.Dataset.from_tensor_slices((paths, labels))
    ds = ds.map(lambda p, y: (guide_decode(tf.io.read_file(p)), y), num_parallel_calls=AUTOTUNE)
    return ds.batch(BATCH).prefetch(AUTOTUNE)


def write_plain_tfrecords(items, root: str, shards: int = 16) -> list[str]:
    """The same JPEG bytes in plain TFRecords, as the TF guide writes them."""
    paths = [os.path.join(root, f"plain-{i:02d}.tfrecord") for i in range(shards)]
    if all(os.path.exists(p) for p in paths):
        return paths
    os.makedirs(root, exist_ok=True)
    for i, path in enumerate(paths):
        with tf.io.TFRecordWriter(path + ".tmp") as writer:
            for image_path, label in items[i::shards]:
                with open(image_path, "rb") as f:
                    feature = {
                        "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f.read()])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                    }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                             .SerializeToString())
        os.replace(path + ".tmp", path)
    return paths


def tfrecord_pipeline(paths) -> tf.data.Dataset:
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return guide_decode(example["image"]), example["label"]

    ds = tf.data.Dataset.from_tensor_slices(paths).interleave(
        tf.data.TFRecordDataset, cycle_length=len(paths), num_parallel_calls=AUTOTUNE)
    return ds.map(parse, num_parallel_calls=AUTOTUNE).batch(BATCH).prefetch(AUTOTUNE)


def decode_limit(items) -> tf.data.Dataset:
    """Decode + resize (no file reads, no parsing) over the same JPEG bytes in memory."""
    blobs = []
    for path, _ in items:
        with open(path, "rb") as f:
            blobs.append(f.read())
    ds = tf.data.Dataset.from_tensor_slices((blobs, [label for _, label in items]))
    ds = ds.map(lambda j, y: (tf.image.resize(tf.io.decode_jpeg(j, channels=3), [SIZE, SIZE]),
                              y), num_parallel_calls=AUTOTUNE)
    return ds.batch(BATCH).map(lambda x, y: (x * (1 / 255), y)).prefetch(AUTOTUNE)


def bare_memory_loop(data_dir: str, dtype: str) -> tf.data.Dataset:
    """The same decoded uint8 images in a plain in-memory cache -> batch (-> cast)."""
    config = DataConfig(data_dir=data_dir, batch_size=BATCH, cache="none")
    ds = build_from_config(config, "train", training=False, until="decode")
    ds = ds.map(lambda e: (e["inputs"], e["label"])).cache().repeat().batch(BATCH)
    if dtype == "float32":
        ds = ds.map(lambda x, y: (tf.cast(x, tf.float32) * (1 / 255), y))
    return ds.prefetch(AUTOTUNE)


class Timed:
    """One pipeline's iterator; ``epoch()`` times one epoch of batches and keeps the best."""

    def __init__(self, ds: tf.data.Dataset, batches: int, warm_epochs: int = 0):
        self.iterator = iter(ds.repeat())
        self.batches, self.best, self.epochs = batches, 0.0, []
        for _ in range(warm_epochs * batches + 2):  # fill caches; start the threads
            next(self.iterator)

    def epoch(self) -> None:
        start = time.perf_counter()
        for _ in range(self.batches):
            next(self.iterator)
        rate = self.batches * BATCH / (time.perf_counter() - start)
        self.epochs.append(rate)
        self.best = max(self.best, rate)

    def figures(self) -> dict:
        return {"images_per_sec": self.best, "epochs_images_per_sec": self.epochs,
                "peak_rss_mb": bench.peak_rss_mb()}


def conversions(root: str, photos: str) -> dict:
    """The default conversion and the 224-px storage one, the latter with 1 and all workers."""
    figures = {}
    for name, options in (("jpeg_at_rest", {}),
                          ("storage_224_workers_1", {"image_size": SIZE, "workers": 1}),
                          ("storage_224", {"image_size": SIZE, "image_format": "auto"})):
        out = os.path.join(root, f"tfspeed-{name}")
        result = convert(f"imagefolder:{photos}", out, validation_fraction=0.0, overwrite=True,
                         **{"workers": os.cpu_count() or 1, **options})
        figures[name] = {**result.summary, "storage": result.schema.to_json().get("storage"),
                         "data_dir": out}
    return figures


def main(argv):
    del argv
    root = _WORKDIR.value
    photos = os.path.join(root, "photos")
    items = bench.make_photos(photos, _IMAGES.value, _CLASSES.value)
    converted = conversions(root, photos)
    at_rest = converted["jpeg_at_rest"]["data_dir"]
    stored = converted["storage_224"]["data_dir"]
    batches = _IMAGES.value // BATCH
    cold = dict(batch_size=BATCH, training=True, cache="none")
    warm = dict(batch_size=BATCH, training=True, cache="memory")
    pipelines = {
        "peer_files": Timed(files_pipeline(items), batches),
        "peer_tfrecord": Timed(tfrecord_pipeline(write_plain_tfrecords(
            items, os.path.join(root, "plain"))), batches),
        "limit_decode_resize": Timed(decode_limit(items), batches),
        "tfspeed_cold_jpeg": Timed(build(at_rest, "train", image_size=SIZE, **cold), batches),
        "tfspeed_cold_storage": Timed(build(stored, "train", **cold), batches),
        "tfspeed_warm_float32": Timed(build(stored, "train", **warm), batches, warm_epochs=1),
        "bare_memory_float32": Timed(bare_memory_loop(stored, "float32"), batches, 1),
        "tfspeed_warm_uint8": Timed(build(stored, "train", image_dtype="uint8", **warm), batches,
                                    warm_epochs=1),
        "bare_memory_uint8": Timed(bare_memory_loop(stored, "uint8"), batches, 1),
    }
    for _ in range(_ROUNDS.value):
        for timed in pipelines.values():
            timed.epoch()
    figures = {name: timed.figures() for name, timed in pipelines.items()}
    ips = {name: f["images_per_sec"] for name, f in figures.items()}
    best_peer = max(ips["peer_files"], ips["peer_tfrecord"])
    storage = converted["storage_224"]
    ratios = {
        "cold_jpeg/best_peer": ips["tfspeed_cold_jpeg"] / best_peer,
        "cold_jpeg/limit_decode_resize": ips["tfspeed_cold_jpeg"] / ips["limit_decode_resize"],
        "cold_storage/best_peer": ips["tfspeed_cold_storage"] / best_peer,
        "warm_float32/bare_memory_float32": (ips["tfspeed_warm_float32"]
                                             / ips["bare_memory_float32"]),
        "warm_uint8/best_peer": ips["tfspeed_warm_uint8"] / best_peer,
        "warm_uint8/bare_memory_uint8": ips["tfspeed_warm_uint8"] / ips["bare_memory_uint8"],
        "conversion_default_workers/1_worker": (
            storage["records_per_sec"] / converted["storage_224_workers_1"]["records_per_sec"]),
    }
    config = {"images": _IMAGES.value, "image_size": SIZE, "batch_size": BATCH,
              "rounds": _ROUNDS.value, "photos": "crops of scikit-learn/scikit-image samples, "
              "256-512 px, JPEG q90", "conversions": converted}
    print(json.dumps(bench.record("input_pipeline", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
