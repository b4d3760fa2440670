"""Conversion benchmark: how the converter scales with workers and shards, on real photos.

    python benchmarks/conversion.py [--images=3000] [--rounds=2] [--workdir=/tmp/tfspeed-bench-conv]

The images are crops of the photographs bundled with scikit-learn and scikit-image, 256-512 px
a side, JPEG q90 (``tfspeed.bench.make_photos``). Each case runs ``scripts/to_tfrecord.py``
as users do, into a fresh directory, in ``--rounds`` interleaved rounds (the fastest round
counts), at the rate the converter reports:

  storage_224   --image_size=224 --image_format=auto (decode, resize, store what reads
                fastest) with --workers=1, 2, 4, ... up to the CPUs available;
  max_side_256  --image_max_side=256 --shards=16 (decode, shrink, re-encode) with --workers=1,
                4 and all CPUs;
  pass_through  the default conversion (the JPEG bytes kept) into --shards=1 and 16;
  shards        --image_size=224 with the default workers into 16, 64 and 256 shards.

Next to them, the plain TF ways in one process: the JPEG bytes written into 16 files with
``tf.io.TFRecordWriter`` (what the TF guide shows), and the same with decode + resize to
224 + cast to uint8 in a parallel ``tf.data`` map before the writer (raw pixels, as
--image_format=auto stores them). Prints one JSON record.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402  (here, so that no plain round times its import)
from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfspeed import bench  # noqa: E402

_IMAGES = flags.DEFINE_integer("images", 3000, "Photos to cut from the sample photographs.")
_CLASSES = flags.DEFINE_integer("classes", 4, "Class folders.")
_ROUNDS = flags.DEFINE_integer("rounds", 2, "Interleaved rounds over all cases.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-conv", "Photos and shards.")

SIZE = 224


def worker_counts(cpus: int) -> list[int]:
    """1, 2, 4, ... and ``cpus`` itself."""
    counts, n = [], 1
    while n < cpus:
        counts.append(n)
        n *= 2
    return [*counts, cpus]


def cases(cpus: int) -> dict[str, list[str]]:
    """Case name -> the converter's flags."""
    runs = {f"storage_224_workers_{w}": [f"--image_size={SIZE}", "--image_format=auto",
                                         f"--workers={w}"] for w in worker_counts(cpus)}
    runs.update({f"max_side_256_workers_{w}": ["--image_max_side=256", "--shards=16",
                                               f"--workers={w}"]
                 for w in sorted({1, min(4, cpus), cpus})})
    runs.update({f"pass_through_shards_{s}": [f"--shards={s}"] for s in (1, 16)})
    runs.update({f"shards_{s}": [f"--image_size={SIZE}", "--image_format=auto", f"--shards={s}"]
                 for s in (16, 64, 256)})
    return runs


def plain_writer(items, out: str, resize: bool, shards: int = 16) -> float:
    """Records/s of the plain TF way in this process: each file's records through one
    ``tf.io.TFRecordWriter``, the JPEG bytes as they are, or (``resize``) decoded, resized to
    224, cast to uint8 in a parallel ``tf.data`` map and stored raw."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    os.sync()
    start = time.perf_counter()
    os.makedirs(out)
    paths, labels = [p for p, _ in items], [label for _, label in items]

    def load(path, label):
        data = tf.io.read_file(path)
        if resize:
            image = tf.image.resize(tf.io.decode_jpeg(data, channels=3), [SIZE, SIZE])
            data = tf.io.serialize_tensor(tf.cast(tf.round(image), tf.uint8))
        return data, label

    for i in range(shards):
        ds = tf.data.Dataset.from_tensor_slices((paths[i::shards], labels[i::shards]))
        ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
        with tf.io.TFRecordWriter(os.path.join(out, f"plain-{i:03d}.tfrecord")) as writer:
            for data, label in ds.as_numpy_iterator():
                feature = {
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[data])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label])),
                }
                writer.write(tf.train.Example(features=tf.train.Features(feature=feature))
                             .SerializeToString())
    return len(items) / (time.perf_counter() - start)


def main(argv):
    del argv
    root = _WORKDIR.value
    photos = os.path.join(root, "photos")
    items = bench.make_photos(photos, _IMAGES.value, _CLASSES.value)
    cpus = len(os.sched_getaffinity(0))
    runs = cases(cpus)
    figures = {name: {"rounds_records_per_sec": []} for name in
               [*runs, "plain_tf_writer", "plain_tf_resize_224"]}
    out = os.path.join(root, "out")
    for _ in range(_ROUNDS.value):
        for name, extra in runs.items():
            run = bench.run_converter(f"imagefolder:{photos}", out, *extra)
            figures[name]["rounds_records_per_sec"].append(run["records_per_sec"])
            figures[name].update(storage=run["storage"], shards=run["shards"],
                                 flags=" ".join(extra))
        for name, resize in (("plain_tf_writer", False), ("plain_tf_resize_224", True)):
            figures[name]["rounds_records_per_sec"].append(plain_writer(items, out, resize))
    for f in figures.values():
        f["records_per_sec"] = max(f["rounds_records_per_sec"])
    rate = {name: f["records_per_sec"] for name, f in figures.items()}
    one = rate["storage_224_workers_1"]
    ratios = {f"storage_224: workers_{w}/workers_1": rate[f"storage_224_workers_{w}"] / one
              for w in worker_counts(cpus)[1:]}
    ratios.update({
        f"max_side_256: workers_{cpus}/workers_1": (rate[f"max_side_256_workers_{cpus}"]
                                                    / rate["max_side_256_workers_1"]),
        "pass_through: shards_16/shards_1": (rate["pass_through_shards_16"]
                                             / rate["pass_through_shards_1"]),
        "pass_through_shards_16/plain_tf_writer": (rate["pass_through_shards_16"]
                                                   / rate["plain_tf_writer"]),
        f"storage_224_workers_{cpus}/plain_tf_resize_224": (rate[f"storage_224_workers_{cpus}"]
                                                           / rate["plain_tf_resize_224"]),
        "shards_64/shards_16": rate["shards_64"] / rate["shards_16"],
        "shards_256/shards_16": rate["shards_256"] / rate["shards_16"],
    })
    config = {"images": _IMAGES.value, "rounds": _ROUNDS.value, "cpus": cpus,
              "photos": "crops of scikit-learn/scikit-image samples, 256-512 px, JPEG q90"}
    print(json.dumps(bench.record("conversion", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
