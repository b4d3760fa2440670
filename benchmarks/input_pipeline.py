"""Input-pipeline benchmark on real photographs: JPEGs -> 224x224 batches of 64.

    python benchmarks/input_pipeline.py [--images=3000] [--workdir=/tmp/tfspeed-bench]

The images are crops of the photographs bundled with scikit-learn and scikit-image,
256-512 px a side, JPEG q90 (``tfspeed.bench.make_photos``): never generated images, which
decode and compress unlike photos. In one run, each pipeline in a process of its own (no
other pipeline's threads or buffers), in ``--rounds`` rounds over all of them, timed for
``--epochs`` whole epochs each (the warm ones in spans of 8 or 32 epochs, ~1 s each, as a
cold epoch lasts); the best epoch counts (this machine is shared):

  peers    the TF guide's file pipeline (from_tensor_slices(paths).map(read + decode +
           resize, AUTOTUNE).batch.prefetch), and plain TFRecords + interleave + AUTOTUNE;
  limit    a bare decode+resize loop over the same JPEG bytes held in memory, as the peers
           resize (uint8) and as tfspeed does (cast to float32 first: the same pixels, a
           cheaper kernel);
  read     the read stage alone over the JPEG shards, records in batches: tfspeed's (each
           shard's records counted against schema.json) and a bare TFRecordDataset per file
           in a parallel interleave;
  tfspeed  cold (cache="none", training defaults: shuffled) from JPEG at rest (the default
           conversion) and from the storage the converter picks for 224 px
           (--image_size=224 --image_format=auto);
  warm     tfspeed from its memory cache as float32 and as uint8, each next to a bare
           in-memory loop over the same images (cache -> batch -> cast, or uint8 batches).

Each epoch also records the process's CPU-ms per image (the median counts): the work an
image costs, which other tenants' bursts disturb far less than wall time. On 2 cores a
pipeline that keeps both busy runs at about 2,000 / that figure images/s.

Also the conversion itself: --workers=1 against the default. Prints one JSON record.
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
from tfspeed.data import DataConfig, build, build_from_config, sizing  # noqa: E402

_IMAGES = flags.DEFINE_integer("images", 3000, "Photos to cut from the sample photographs.")
_CLASSES = flags.DEFINE_integer("classes", 4, "Class folders.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench", "Images, shards and caches.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Rounds over all pipelines (a process each) and conversions.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Timed epochs per pipeline and round.")
_PIPELINE = flags.DEFINE_string("pipeline", "", "Internal: time this pipeline alone.")

SIZE, BATCH = 224, 64
AUTOTUNE = tf.data.AUTOTUNE


def guide_decode(jpeg: tf.Tensor) -> tf.Tensor:
    return bench.guide_decode(jpeg, SIZE)


def files_pipeline(items) -> tf.data.Dataset:
    return bench.guide_files_pipeline(items, SIZE, BATCH)


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


def decode_limit(items, float_resize: bool = False) -> tf.data.Dataset:
    """Decode + resize (no file reads, no parsing) over the same JPEG bytes in memory; with
    ``float_resize`` the decoded image is cast to float32 before the resize, as tfspeed does
    (the same pixels, a cheaper kernel)."""
    blobs = []
    for path, _ in items:
        with open(path, "rb") as f:
            blobs.append(f.read())

    def decode(jpeg):
        image = tf.io.decode_jpeg(jpeg, channels=3)
        return tf.image.resize(tf.cast(image, tf.float32) if float_resize else image,
                               [SIZE, SIZE])

    ds = tf.data.Dataset.from_tensor_slices((blobs, [label for _, label in items]))
    ds = ds.map(lambda j, y: (decode(j), y), num_parallel_calls=AUTOTUNE)
    return ds.batch(BATCH).map(lambda x, y: (x * (1 / 255), y)).prefetch(AUTOTUNE)


def bare_memory_loop(data_dir: str, dtype: str) -> tf.data.Dataset:
    """The machine's limit for the warm path: the same decoded uint8 images in a plain
    in-memory cache -> batch (-> cast to float), each stage as parallel as tf.data allows,
    and nothing else (no shuffle, no accounting)."""
    config = DataConfig(data_dir=data_dir, batch_size=BATCH, cache="none")
    ds = build_from_config(config, "train", training=False, until="decode")
    ds = ds.map(lambda e: (e["inputs"], e["label"])).cache().repeat()
    ds = ds.batch(BATCH, num_parallel_calls=AUTOTUNE, deterministic=False)
    if dtype == "float32":
        ds = ds.map(lambda x, y: (tf.cast(x, tf.float32) * (1 / 255), y),
                    num_parallel_calls=AUTOTUNE, deterministic=False)
    return ds.prefetch(AUTOTUNE)


def read_stage(data_dir: str, bare: bool) -> tf.data.Dataset:
    """The read stage alone, over the shards of ``data_dir``, as training reads them
    (shuffled): tfspeed's (records counted against ``schema.json``, what is lost reported),
    or a bare ``TFRecordDataset`` per file in a parallel interleave. Records go out in
    batches of ``BATCH`` (a Python call per record would cost more than reading it)."""
    if bare:
        files = sorted(tf.io.gfile.glob(os.path.join(data_dir, "train-*.tfrecord")))
        ds = tf.data.Dataset.from_tensor_slices(files).interleave(
            tf.data.TFRecordDataset, cycle_length=min(len(files), 16),
            num_parallel_calls=AUTOTUNE, deterministic=False)
    else:
        config = DataConfig(data_dir=data_dir, batch_size=BATCH, cache="none", image_size=SIZE)
        ds = build_from_config(config, "train", training=True, until="read")
    return ds.batch(BATCH).prefetch(AUTOTUNE)


def time_epochs(ds: tf.data.Dataset, batches: int, epochs: int, warm_epochs: int,
                passes: int = 1) -> dict:
    """Images/s of each of ``epochs`` timed spans of ``passes`` epochs of ``batches``
    batches, after ``warm_epochs`` untimed ones (which fill a cache) and a few batches
    (which start the threads)."""
    import resource

    iterator = iter(ds.repeat())
    for _ in range(warm_epochs * batches + 4):
        next(iterator)
    rates, cpu, faults = [], [], []
    for _ in range(epochs):
        start, cpu_start = time.perf_counter(), time.process_time()
        faults_start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(batches * passes):
            next(iterator)
        images = batches * passes * BATCH
        rates.append(images / (time.perf_counter() - start))
        cpu.append(1000 * (time.process_time() - cpu_start) / images)
        faults.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_start)
                      / images)
    return {"epochs_images_per_sec": rates, "epochs_cpu_ms_per_image": cpu,
            "epochs_page_faults_per_image": faults, "peak_rss_mb": bench.peak_rss_mb()}


def pipeline(name: str, root: str, items) -> tuple[tf.data.Dataset, int]:
    """The pipeline called ``name`` and how many untimed epochs it needs (to fill a cache)."""
    at_rest, stored = (os.path.join(root, f"tfspeed-{n}") for n in ("jpeg_at_rest", "storage_224"))
    cold = dict(batch_size=BATCH, training=True, cache="none")
    warm = dict(batch_size=BATCH, training=True, cache="memory")
    makers = {
        "peer_files": lambda: (files_pipeline(items), 0),
        "peer_tfrecord": lambda: (tfrecord_pipeline(write_plain_tfrecords(
            items, os.path.join(root, "plain"))), 0),
        "limit_decode_resize": lambda: (decode_limit(items), 0),
        "limit_decode_float_resize": lambda: (decode_limit(items, float_resize=True), 0),
        "read_bare_tfrecord": lambda: (read_stage(at_rest, bare=True), 0),
        "read_tfspeed": lambda: (read_stage(at_rest, bare=False), 0),
        "tfspeed_cold_jpeg": lambda: (build(at_rest, "train", image_size=SIZE, **cold), 0),
        "tfspeed_cold_storage": lambda: (build(stored, "train", **cold), 0),
        # The many-core read sizes (tfspeed.data.sizing), measured against today's.
        "tfspeed_cold_jpeg_many_core": lambda: (
            _many_core(build)(at_rest, "train", image_size=SIZE, **cold), 0),
        "tfspeed_warm_float32": lambda: (build(stored, "train", **warm), 1),
        "bare_memory_float32": lambda: (bare_memory_loop(stored, "float32"), 1),
        "tfspeed_warm_uint8": lambda: (build(stored, "train", image_dtype="uint8", **warm), 1),
        "bare_memory_uint8": lambda: (bare_memory_loop(stored, "uint8"), 1),
    }
    return makers[name]()


def _many_core(builder):
    """``builder`` in this process (a contender's own) with the many-core read sizes."""
    os.environ[sizing.READ_SIZING_ENV] = "many_core"
    return builder


# Epochs per timed span for the pipelines that read from memory, so that each span lasts
# about a second, as a cold epoch does: a single warm epoch of 3,000 images takes 30-150 ms,
# and its best of nine swung 0.81-1.40x with the machine.
PASSES = {"tfspeed_warm_float32": 8, "bare_memory_float32": 8,
          "tfspeed_warm_uint8": 32, "bare_memory_uint8": 32,
          "read_bare_tfrecord": 8, "read_tfspeed": 8}

PIPELINES = ("peer_files", "peer_tfrecord", "limit_decode_resize", "limit_decode_float_resize",
             "read_bare_tfrecord", "read_tfspeed", "tfspeed_cold_jpeg", "tfspeed_cold_storage", "tfspeed_warm_float32",
             "bare_memory_float32", "tfspeed_warm_uint8", "bare_memory_uint8")


def conversions(root: str, photos: str, rounds: int) -> dict:
    """The converter's command line, as users run it: the default conversion (JPEG at rest)
    and the 224-px storage one with --workers=1 and with the default workers, those two in
    ``rounds`` interleaved rounds (the faster of each counts). Each writes into a fresh
    directory, as a first conversion does: the last round's output is deleted beforehand,
    untimed (an ``--overwrite`` would time deleting 450 MB of earlier shards, ~0.1 s)."""
    figures = {}
    runs = [("jpeg_at_rest", [])] + rounds * [
        ("storage_224_workers_1", [f"--image_size={SIZE}", "--workers=1"]),
        ("storage_224", [f"--image_size={SIZE}", "--image_format=auto"])]
    for name, extra in runs:
        out = os.path.join(root, f"tfspeed-{name}")
        run = bench.run_converter(f"imagefolder:{photos}", out, *extra)
        rate = run["records_per_sec"]
        seen = figures.get(name, {}).get("rounds_records_per_sec", [])
        if not seen or rate > max(seen):
            figures[name] = {"records_per_sec": rate, "summary": run["summary"],
                             "storage": run["storage"], "data_dir": out}
        figures[name]["rounds_records_per_sec"] = [*seen, rate]
    return figures


def main(argv):
    del argv
    root = _WORKDIR.value
    photos = os.path.join(root, "photos")
    items = bench.make_photos(photos, _IMAGES.value, _CLASSES.value)
    batches = _IMAGES.value // BATCH
    if _PIPELINE.value:  # one pipeline, in a process of its own
        ds, warm_epochs = pipeline(_PIPELINE.value, root, items)
        passes = PASSES.get(_PIPELINE.value, 1)
        print(bench.RESULT + json.dumps(time_epochs(ds, batches, _EPOCHS.value, warm_epochs,
                                                 passes)))
        return
    converted = conversions(root, photos, _ROUNDS.value)
    many = os.cpu_count() >= sizing.MANY_CORES  # below, both sizings are the same
    figures = run_rounds(PIPELINES + (("tfspeed_cold_jpeg_many_core",) if many else ()),
                         _ROUNDS.value)
    ips = {name: f["images_per_sec"] for name, f in figures.items()}
    cpu = {name: f["cpu_ms_per_image"] for name, f in figures.items()}
    best_peer = max(ips["peer_files"], ips["peer_tfrecord"])
    storage = converted["storage_224"]
    ratios = {
        "cold_jpeg/best_peer": ips["tfspeed_cold_jpeg"] / best_peer,
        "cold_jpeg/limit_decode_resize": ips["tfspeed_cold_jpeg"] / ips["limit_decode_resize"],
        # The work per image, robust to other tenants' bursts: images per CPU-second,
        # tfspeed over the peer with the fewest CPU-ms per image.
        "cold_jpeg/best_peer, per CPU-second": (min(cpu["peer_files"], cpu["peer_tfrecord"])
                                                / cpu["tfspeed_cold_jpeg"]),
        "cold_jpeg/limit_decode_resize, per CPU-second": (cpu["limit_decode_resize"]
                                                          / cpu["tfspeed_cold_jpeg"]),
        # What is left once the resize is as cheap as tfspeed's: reading, parsing, shuffling.
        "cold_jpeg/limit_decode_float_resize": (ips["tfspeed_cold_jpeg"]
                                                / ips["limit_decode_float_resize"]),
        # The read stage with its accounting against a bare TFRecordDataset (records/s).
        "read_stage/bare_tfrecord": ips["read_tfspeed"] / ips["read_bare_tfrecord"],
        "cold_storage/best_peer": ips["tfspeed_cold_storage"] / best_peer,
        **({"cold_jpeg_many_core/cold_jpeg": (ips["tfspeed_cold_jpeg_many_core"]
                                              / ips["tfspeed_cold_jpeg"]),
            "cold_jpeg_many_core/best_peer": ips["tfspeed_cold_jpeg_many_core"] / best_peer}
           if many else {}),
        "warm_float32/bare_memory_float32": (ips["tfspeed_warm_float32"]
                                             / ips["bare_memory_float32"]),
        "warm_uint8/best_peer": ips["tfspeed_warm_uint8"] / best_peer,
        "warm_uint8/bare_memory_uint8": ips["tfspeed_warm_uint8"] / ips["bare_memory_uint8"],
        "conversion_default_workers/1_worker": (
            storage["records_per_sec"] / converted["storage_224_workers_1"]["records_per_sec"]),
    }
    config = {"images": _IMAGES.value, "image_size": SIZE, "batch_size": BATCH,
              "rounds": _ROUNDS.value, "epochs_per_round": _EPOCHS.value,
              "passes_per_timed_epoch": PASSES,
              "photos": "crops of scikit-learn/scikit-image samples, 256-512 px, JPEG q90",
              "conversions": converted}
    print(json.dumps(bench.record("input_pipeline", config, figures, ratios), indent=2))


def run_rounds(names, rounds: int, envs: dict | None = None) -> dict:
    """Each pipeline of ``names`` in a process of its own, in ``rounds`` rounds over all of
    them (the machine's noise spreads), and in each environment of ``envs`` (label -> the
    process's environment; figures keyed "name:label") if given; figures per pipeline: every
    epoch's, the best epoch's images/s and the median CPU-ms and page faults per image."""
    envs = envs or {"": None}
    epochs = ("epochs_images_per_sec", "epochs_cpu_ms_per_image", "epochs_page_faults_per_image")
    keys = {(name, label): f"{name}:{label}" if label else name
            for name in names for label in envs}
    figures = {key: {**{e: [] for e in epochs}, "peak_rss_mb": 0.0} for key in keys.values()}
    for _ in range(rounds):
        for name in names:
            for label, env in envs.items():
                result = _in_process_of_its_own(name, env)
                f = figures[keys[name, label]]
                for e in epochs:
                    f[e] += result[e]
                f["peak_rss_mb"] = max(f["peak_rss_mb"], result["peak_rss_mb"])
    for f in figures.values():
        f["images_per_sec"] = max(f["epochs_images_per_sec"])
        f["cpu_ms_per_image"] = statistics.median(f["epochs_cpu_ms_per_image"])
        f["page_faults_per_image"] = statistics.median(f["epochs_page_faults_per_image"])
    return figures


def _in_process_of_its_own(name: str, env: dict | None = None) -> dict:
    """Runs one pipeline in a fresh process (no other pipeline's threads or buffers), in
    ``env`` if given."""
    return bench.run_contender([sys.executable, os.path.abspath(__file__), f"--pipeline={name}",
                                f"--workdir={_WORKDIR.value}", f"--images={_IMAGES.value}",
                                f"--classes={_CLASSES.value}", f"--epochs={_EPOCHS.value}"],
                               name, env=env)


if __name__ == "__main__":
    app.run(main)
