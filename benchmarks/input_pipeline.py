"""Input-pipeline benchmark: JPEG folder -> 224x224 float batches of 64, four ways.

    python benchmarks/input_pipeline.py [--images=2000] [--workdir=/tmp/tfspeed-bench]

(a) files: the TF performance guide's pipeline read straight from the JPEG files
    (from_tensor_slices(paths).map(read+decode+resize, AUTOTUNE).batch.prefetch);
(b) tfrecord: the same records in plain TFRecords, read without tfspeed;
(c) tfspeed: the converter (--image_max_side, many shards) + tfspeed.data.build;
(d) ceiling: iterating already-preprocessed batches held in memory.
Prints one JSON record with images/s for each and the ratios c/a, c/b, c/d.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tfspeed import bench  # noqa: E402
from tfspeed.bench import make_photos  # noqa: E402
from tfspeed.convert import convert  # noqa: E402
from tfspeed.data import build  # noqa: E402

_IMAGES = flags.DEFINE_integer("images", 2000, "JPEG photos to generate.")
_CLASSES = flags.DEFINE_integer("classes", 4, "Class folders.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench", "Images, shards and caches.")
_BATCHES = flags.DEFINE_integer("batches", 60, "Timed batches per pipeline.")
_WARMUP = flags.DEFINE_integer("warmup", 8, "Untimed batches first.")
_IMAGE_MAX_SIDE = flags.DEFINE_integer("image_max_side", 256, "tfspeed's conversion-time resize.")
_SHARDS = flags.DEFINE_integer("shards", 16, "tfspeed shards.")

SIZE, BATCH = 224, 64


def decode_resize(jpeg: tf.Tensor) -> tf.Tensor:
    image = tf.io.decode_jpeg(jpeg, channels=3)
    return tf.image.resize(image, [SIZE, SIZE]) / 255.0


def files_pipeline(items) -> tf.data.Dataset:
    paths = [p for p, _ in items]
    labels = [label for _, label in items]
    ds = tf.data.Dataset.from_tensor_slices((paths, labels)).repeat()
    ds = ds.map(lambda p, y: (decode_resize(tf.io.read_file(p)), y),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def write_plain_tfrecord(items, path: str) -> None:
    if os.path.exists(path):
        return
    with tf.io.TFRecordWriter(path + ".tmp") as writer:
        for image_path, label in items:
            with open(image_path, "rb") as f:
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[f.read()])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                         .SerializeToString())
    os.replace(path + ".tmp", path)


def tfrecord_pipeline(path: str) -> tf.data.Dataset:
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        return decode_resize(example["image"]), example["label"]

    ds = tf.data.TFRecordDataset(path).repeat()
    ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(BATCH).prefetch(tf.data.AUTOTUNE)


def ceiling_pipeline(source: tf.data.Dataset, batches: int) -> tf.data.Dataset:
    held = list(source.take(batches))
    images = tf.stack([x for x, _ in held])
    labels = tf.stack([y for _, y in held])
    return tf.data.Dataset.from_tensor_slices((images, labels)).repeat().prefetch(tf.data.AUTOTUNE)


def main(argv):
    del argv
    root = _WORKDIR.value
    items = make_photos(os.path.join(root, "photos"), _IMAGES.value, _CLASSES.value)
    write_plain_tfrecord(items, os.path.join(root, "plain.tfrecord"))
    data_dir = os.path.join(root, f"tfspeed-{_IMAGE_MAX_SIDE.value}-{_SHARDS.value}")
    converted = convert(f"imagefolder:{os.path.join(root, 'photos')}", data_dir,
                        shards=_SHARDS.value, validation_fraction=0.0,
                        image_max_side=_IMAGE_MAX_SIDE.value, workers=os.cpu_count() or 1)
    timed = dict(batches=_BATCHES.value, warmup=_WARMUP.value, batch_size=BATCH)
    options = dict(image_size=SIZE, cache="none", shuffle_buffer=1000)
    figures = {
        "a_files": bench.time_dataset(files_pipeline(items), **timed),
        "b_plain_tfrecord": bench.time_dataset(
            tfrecord_pipeline(os.path.join(root, "plain.tfrecord")), **timed),
        "c_tfspeed": bench.time_dataset(
            build(data_dir, "train", BATCH, training=True, **options), **timed),
        "c_tfspeed_parse_batched": bench.time_dataset(
            build(data_dir, "train", BATCH, training=True, parse="batched", **options), **timed),
        # Epoch 2+ of a memory cache after decode+resize: what a multi-epoch job sees.
        "c_tfspeed_cached": bench.time_dataset(
            build(data_dir, "train", BATCH, training=True, **{**options, "cache": "memory"}),
            batches=_BATCHES.value, warmup=_IMAGES.value // BATCH + 1, batch_size=BATCH),
    }
    # Memory is fast: time 20x more batches so the figure is not a few milliseconds of noise.
    figures["d_ceiling"] = bench.time_dataset(
        ceiling_pipeline(build(data_dir, "train", BATCH, training=True, **options), 16),
        batches=20 * _BATCHES.value, warmup=_WARMUP.value, batch_size=BATCH)
    ips = {name: f["images_per_sec"] for name, f in figures.items()}
    ratios = {
        "c/a": ips["c_tfspeed"] / ips["a_files"],
        "c/b": ips["c_tfspeed"] / ips["b_plain_tfrecord"],
        "c/d": ips["c_tfspeed"] / ips["d_ceiling"],
        "c_cached/d": ips["c_tfspeed_cached"] / ips["d_ceiling"],
        "c_parse_batched/c": ips["c_tfspeed_parse_batched"] / ips["c_tfspeed"],
    }
    config = {"images": _IMAGES.value, "image_size": SIZE, "batch_size": BATCH,
              "image_max_side": _IMAGE_MAX_SIDE.value, "shards": _SHARDS.value,
              "timed_batches": _BATCHES.value, "conversion": converted.summary}
    print(json.dumps(bench.record("input_pipeline", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
