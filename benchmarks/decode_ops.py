"""What one photo's decode and resize cost: CPU-ms per image on one thread (or --threads),

    python benchmarks/decode_ops.py [--images=1500] [--rounds=6] [--threads=1]

The photos are the ones ``benchmarks/input_pipeline.py`` uses (256-512 px JPEG crops of
scikit-learn's and scikit-image's sample photos, ``tfspeed.bench.make_photos``), held in
memory. Each variant maps the JPEG bytes to a 224x224 image in a one-thread tf.data pipeline
(no intra-op parallelism), in ``--rounds`` alternating passes; the median pass counts:

  decode                 tf.io.decode_jpeg alone;
  resize_uint8           decode, then tf.image.resize of the uint8 image (the TF guide's way);
  resize_float32         decode, cast to float32, then tf.image.resize (what tfspeed does:
                         the same pixels, a cheaper kernel);
  resize_bfloat16        the same through a bfloat16 intermediate (exact for 0..255, the same
                         pixels again), half the bytes of the float32 one;
  passthrough            the bytes' length only: what tf.data and this loop cost per image.

Each pass reduces an image to one pixel inside the map, so that no copy of a batch is timed
and nothing is optimised away. Prints one JSON record.

This machine has slow spells (README, Benchmarks): for seconds to minutes some kernels cost
more CPU per image. Many short rounds show which ones: ``--images=600 --rounds=200``
(about ten minutes) passes each variant 200 times, and the record counts the rounds in which
resize_float32 ran over 1.25x its median and what every variant cost in those rounds,
against its own median.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfspeed import bench  # noqa: E402

_IMAGES = flags.DEFINE_integer("images", 1500, "Photos to time.")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Alternating passes over all variants.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench", "Where the photos are cut.")
_THREADS = flags.DEFINE_integer("threads", 1, "Threads of the map (and of its tf.data pool).")

SIZE = 224


def _decode(jpeg):
    return tf.io.decode_jpeg(jpeg, channels=3)


VARIANTS = {
    "passthrough": lambda jpeg: tf.reshape(tf.strings.length(jpeg), [1, 1, 1]),
    "decode": _decode,
    "resize_uint8": lambda jpeg: tf.image.resize(_decode(jpeg), [SIZE, SIZE]),
    "resize_float32": lambda jpeg: tf.image.resize(tf.cast(_decode(jpeg), tf.float32),
                                                   [SIZE, SIZE]),
    "resize_bfloat16": lambda jpeg: tf.image.resize(tf.cast(_decode(jpeg), tf.bfloat16),
                                                    [SIZE, SIZE]),
}

# A round in which resize_float32 costs this much over its median is counted as slow.
SLOW = 1.25


def _pass(blobs, fn, threads: int) -> float:
    """CPU-ms per image of one pass of ``fn`` over ``blobs`` on ``threads`` threads."""
    options = tf.data.Options()
    options.threading.private_threadpool_size = threads
    options.threading.max_intra_op_parallelism = 1
    ds = (tf.data.Dataset.from_tensor_slices(blobs)
          .map(lambda jpeg: tf.cast(fn(jpeg)[0, 0, 0], tf.float32),
               num_parallel_calls=threads if threads > 1 else None)
          .batch(64).with_options(options))
    start = time.process_time()
    for _ in ds:
        pass
    return 1e3 * (time.process_time() - start) / len(blobs)


def main(argv):
    del argv
    items = bench.make_photos(os.path.join(_WORKDIR.value, "photos"), _IMAGES.value, 4)
    blobs = []
    for path, _ in items:
        with open(path, "rb") as f:
            blobs.append(f.read())
    passes = {name: [] for name in VARIANTS}
    for _ in range(_ROUNDS.value):
        for name, fn in VARIANTS.items():
            passes[name].append(_pass(blobs, fn, _THREADS.value))
    figures = {name: {"cpu_ms_per_image": statistics.median(ms), "passes_cpu_ms": ms}
               for name, ms in passes.items()}
    ms = {name: f["cpu_ms_per_image"] for name, f in figures.items()}
    slow = [i for i, x in enumerate(passes["resize_float32"]) if x > SLOW * ms["resize_float32"]]
    ratios = {
        "rounds with resize_float32 slow": len(slow) / _ROUNDS.value,
        **{f"{name} in those rounds / its median": (
            statistics.median(passes[name][i] for i in slow) / ms[name] if slow else None)
           for name in VARIANTS},
        "resize_uint8 cost / resize_float32 cost": ((ms["resize_uint8"] - ms["decode"])
                                                    / (ms["resize_float32"] - ms["decode"])),
        "decode+resize_uint8 / decode+resize_float32": ms["resize_uint8"] / ms["resize_float32"],
    }
    config = {"images": len(blobs), "image_size": SIZE, "rounds": _ROUNDS.value,
              "threads": _THREADS.value, "slow_round": f"resize_float32 > {SLOW}x its median",
              "photos": "crops of scikit-learn/scikit-image samples, 256-512 px"}
    print(json.dumps(bench.record("decode_ops", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
