"""Users' own tf.data pipelines, as the tutorials and public issues write them, against the same
pipelines through ``tfspeed.optimize`` (one line changed).

    python benchmarks/your_pipelines.py [--rounds=3] [--epochs=3] [--images=600]

Real data only: crops of the photographs bundled with scikit-learn/scikit-image
(``tfspeed.bench.make_photos``), scikit-learn's handwritten digits, Python's own standard
library source as text (pystdlib) and scikit-learn's diabetes table as a CSV.

For each pipeline, in interleaved rounds, each contender in a process of its own, the input
alone over ``--epochs`` whole epochs (a run), in elements/s including everything the run does
(``optimize``'s own timing and storing included):
  original   the pipeline as written;
  first      ``tfspeed.optimize(ds)`` with an empty store (the first run: it stores as it goes);
  later      ``tfspeed.optimize(ds)`` on the store the first run left: the second run, which
             also times the store against the pipeline as written (once per store);
  again      a third run, which reads that timing instead.
Each contender also keeps its first epoch's batches, as NumPy arrays, and hashes every example
of them once the run is timed: the multisets must be equal (for the augmented pipeline, which
is random by design, the element counts). tfspeed's bytecode is written before the rounds, as
an installed copy has it (``bench.compile_package``).
End-to-end timings with a model are not part of this benchmark yet. Prints one JSON record.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402  -- imported before any timing, as a script has it
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
# tfspeed.bench is imported where it is used, not here: importing tfspeed sets its host
# allocator (tfspeed.runtime.hostmem), and benchmarks/your_scripts.py imports these pipelines
# into scripts as written, which must run as stock TensorFlow does.

_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds over every pipeline.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Epochs in one timed run.")
_IMAGES = flags.DEFINE_integer("images", 600, "Photos cut from the sample photographs.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-your-pipelines", "Data and stores.")
_ONLY = flags.DEFINE_list("pipelines", [], "Run only these pipelines.")
_RUN = flags.DEFINE_string("run", "", "Internal: PIPELINE:MODE:STORE in this process.")

AUTOTUNE = tf.data.AUTOTUNE
SIZE = 160


def _photos(root):
    return os.path.join(root, "photos")


def keras_tutorial(root):
    """keras.utils.image_dataset_from_directory, as the image classification tutorial."""
    return keras.utils.image_dataset_from_directory(_photos(root), image_size=(SIZE, SIZE),
                                                    batch_size=32, seed=123, verbose=False)


def _load(path):
    image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
    return tf.image.resize(image, (SIZE, SIZE)) / 255.0


def _label(path):
    folder = tf.strings.split(path, os.sep)[-2]  # class0, class1, ...
    return tf.strings.to_number(tf.strings.substr(folder, 5, 3), tf.int32)


def list_files_map(root):
    """The tf.data guide's first pipeline: list_files, map(load), batch, prefetch."""
    files = tf.data.Dataset.list_files(os.path.join(_photos(root), "*", "*.jpg"))
    ds = files.map(lambda p: (_load(p), _label(p)), num_parallel_calls=AUTOTUNE)
    return ds.batch(32).prefetch(AUTOTUNE)


def list_files_augment(root):
    """The same with a random flip and crop after the decode (the augmentation tutorial)."""
    files = tf.data.Dataset.list_files(os.path.join(_photos(root), "*", "*.jpg"))
    ds = files.map(lambda p: (_load(p), _label(p)), num_parallel_calls=AUTOTUNE)
    ds = ds.map(lambda x, y: (tf.image.random_crop(tf.image.random_flip_left_right(x),
                                                   (SIZE - 16, SIZE - 16, 3)), y),
                num_parallel_calls=AUTOTUNE)
    return ds.batch(32).prefetch(AUTOTUNE)


def _shards(root):
    return sorted(glob.glob(os.path.join(root, "records", "*.tfrecord")))


def _parse_photo(record):
    """A record's JPEG decoded and resized (floats) and its label."""
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}
    ex = tf.io.parse_single_example(record, spec)
    return tf.image.resize(tf.io.decode_jpeg(ex["image"], channels=3), (SIZE, SIZE)), ex["label"]


def tfrecord_parse(root):
    """TFRecordDataset -> map(parse + decode) -> shuffle -> batch, as TFRecord tutorials."""
    def parse(record):
        image, label = _parse_photo(record)
        return tf.cast(image, tf.uint8), label

    ds = tf.data.TFRecordDataset(_shards(root)).map(parse, num_parallel_calls=AUTOTUNE)
    return ds.shuffle(256, seed=0).batch(32).prefetch(AUTOTUNE)


def tfrecord_interleave(root):
    """The tf.data performance guide's reading: shards interleaved in parallel, then parsed."""
    def parse(record):
        image, label = _parse_photo(record)
        return image / 255.0, label

    ds = tf.data.Dataset.from_tensor_slices(_shards(root)).interleave(
        tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=AUTOTUNE)
    return ds.map(parse, num_parallel_calls=AUTOTUNE).batch(32).prefetch(AUTOTUNE)


def digits_arrays(root):
    """NumPy arrays through from_tensor_slices, normalised in a map: cheap work."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    ds = tf.data.Dataset.from_tensor_slices((digits.images.astype("float32"), digits.target))
    ds = ds.map(lambda x, y: (tf.reshape(x / 16.0, (8, 8, 1)), y))
    return ds.shuffle(2000).batch(64).prefetch(AUTOTUNE)


def text_vectorize(root):
    """The text classification tutorial: texts batched, then a TextVectorization map."""
    texts, labels = _stdlib_texts()
    vectorize = keras.layers.TextVectorization(max_tokens=20000, output_sequence_length=256)
    vectorize.adapt(tf.data.Dataset.from_tensor_slices(texts).batch(256))
    ds = tf.data.Dataset.from_tensor_slices((texts, labels)).batch(32)
    return ds.map(lambda x, y: (vectorize(x), y), num_parallel_calls=AUTOTUNE).prefetch(
        AUTOTUNE)


def csv_lines(root):
    """TextLineDataset over a CSV, decode_csv per line, batch (the CSV loading guide)."""
    path = os.path.join(root, "diabetes.csv")
    defaults = [[0.0]] * 11

    def parse(line):
        fields = tf.io.decode_csv(line, defaults)
        return tf.stack(fields[:10]), fields[10]

    return tf.data.TextLineDataset(path).skip(1).map(parse).shuffle(500).batch(32)


def generator_pil(root):
    """from_generator over PIL: Python in the pipeline, one element at a time."""
    from PIL import Image

    paths = sorted(glob.glob(os.path.join(_photos(root), "*", "*.jpg")))

    def gen():
        for p in paths:
            yield np.asarray(Image.open(p).convert("RGB").resize((SIZE, SIZE)), np.uint8), 0

    sig = (tf.TensorSpec((SIZE, SIZE, 3), tf.uint8), tf.TensorSpec((), tf.int32))
    return tf.data.Dataset.from_generator(gen, output_signature=sig).batch(32)


def numpy_function_pil(root):
    """Paths and labels, map(numpy_function(PIL decode + resize), AUTOTUNE), batch, prefetch:
    the way issues load images TF cannot decode (PIL's formats, custom readers)."""
    from PIL import Image

    paths = sorted(glob.glob(os.path.join(_photos(root), "*", "*.jpg")))
    labels = [int(Path(p).parent.name[5:]) for p in paths]

    def load(path):
        return np.asarray(Image.open(path.decode()).convert("RGB").resize((SIZE, SIZE)),
                          np.uint8)

    def decode(path, label):
        image = tf.numpy_function(load, [path], tf.uint8)
        image.set_shape((SIZE, SIZE, 3))  # as scripts add once fit says "unknown rank"
        return image, label

    ds = tf.data.Dataset.from_tensor_slices((paths, labels))
    ds = ds.map(decode, num_parallel_calls=AUTOTUNE)
    return ds.batch(32).prefetch(AUTOTUNE)


PIPELINES = {f.__name__: f for f in (keras_tutorial, list_files_map, list_files_augment,
                                      tfrecord_parse, tfrecord_interleave, digits_arrays,
                                      text_vectorize, csv_lines, generator_pil,
                                      numpy_function_pil)}


MODES = ("original", "first", "later", "again")
RANDOM = {"list_files_augment"}  # random ops after the decode: elements differ every epoch


def _stdlib_texts():
    import sysconfig

    lib = sysconfig.get_paths()["stdlib"]
    texts, labels = [], []
    for k, package in enumerate(("json", "email", "asyncio", "unittest", "logging")):
        for path in sorted(glob.glob(os.path.join(lib, package, "*.py"))):
            with open(path, encoding="utf-8") as f:
                texts.append(f.read())
            labels.append(k)
    return texts, labels


def prepare(root: str, images: int) -> None:
    """The data every pipeline reads, written once."""
    from tfspeed import bench

    items = bench.make_photos(_photos(root), images, 4)
    records = os.path.join(root, "records")
    if not os.path.isdir(records):
        os.makedirs(records)
        for shard in range(4):
            with tf.io.TFRecordWriter(os.path.join(records, f"{shard}.tfrecord")) as w:
                for path, label in items[shard::4]:
                    feature = {"image": tf.train.Feature(bytes_list=tf.train.BytesList(
                        value=[Path(path).read_bytes()])),
                        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[label]))}
                    w.write(tf.train.Example(features=tf.train.Features(
                        feature=feature)).SerializeToString())
    csv = os.path.join(root, "diabetes.csv")
    if not os.path.exists(csv):
        from sklearn.datasets import load_diabetes

        d = load_diabetes()
        np.savetxt(csv, np.column_stack([d.data, d.target]), delimiter=",", fmt="%.6g",
                   header=",".join([*d.feature_names, "target"]), comments="")


def run_one(name: str, mode: str, store: str) -> dict:
    """One contender: ``--epochs`` epochs of the pipeline, timed whole."""
    from tfspeed.attach.optimize import optimize

    ds = PIPELINES[name](_WORKDIR.value)  # the user's own code: the same for both
    start = time.perf_counter()
    if mode != "original":
        ds = optimize(ds, cache_dir=store)
    first, elements = [], 0
    for epoch in range(_EPOCHS.value):
        for batch in ds:
            parts = [np.asarray(t) for t in tf.nest.flatten(batch)]
            elements += len(parts[0])
            if epoch == 0:
                first.append(parts)
    seconds = time.perf_counter() - start  # the check below is the benchmark's, not the run's
    hashes = [hashlib.sha1(b"".join(p[i].tobytes() for p in parts)).hexdigest()
              for parts in first for i in range(len(parts[0]))]
    report = getattr(ds, "tfspeed_report", None)
    return {"elements_per_sec": elements / seconds, "seconds": seconds, "elements": elements,
            "multiset": hashlib.sha1("".join(sorted(hashes)).encode()).hexdigest(),
            "verdict": report.verdict if report else ""}


def main(argv):
    del argv
    from tfspeed import bench

    root = _WORKDIR.value
    if _RUN.value:
        name, mode, store = _RUN.value.split(":", 2)
        print(bench.RESULT + json.dumps(run_one(name, mode, store)))
        return
    prepare(root, _IMAGES.value)
    bench.compile_package()
    names = _ONLY.value or list(PIPELINES)
    runs = {n: {m: [] for m in MODES} for n in names}
    for r in range(_ROUNDS.value):
        for name in names:
            store = os.path.join(root, f"store-{name}-{r}")
            shutil.rmtree(store, ignore_errors=True)  # the first run starts from no store
            for mode in MODES:  # first, later and again on one store
                runs[name][mode].append(bench.run_contender(
                    [sys.executable, os.path.abspath(__file__), f"--run={name}:{mode}:{store}",
                     f"--workdir={root}", f"--epochs={_EPOCHS.value}"], f"{name}/{mode}"))
    figures, ratios = {}, {}
    for name, modes in runs.items():
        rates = {m: [x["elements_per_sec"] for x in xs] for m, xs in modes.items()}
        figures[name] = {m: {"median": statistics.median(v), "min": min(v), "max": max(v),
                             "rounds": v} for m, v in rates.items()}
        if name in RANDOM:  # augmented anew every epoch: only the counts can agree
            figures[name]["same_count"] = len({x["elements"] for xs in modes.values()
                                               for x in xs}) == 1
        else:
            figures[name]["same_multiset"] = len({x["multiset"] for xs in modes.values()
                                                  for x in xs}) == 1
        figures[name]["verdicts"] = sorted({x["verdict"] for xs in modes.values() for x in xs
                                            if x["verdict"]})
        for m in MODES[1:]:
            ratios[f"{name}: {m}/original"] = (figures[name][m]["median"]
                                               / figures[name]["original"]["median"])
    for m in ("later", "again"):
        ratios[f"median over pipelines: {m}/original"] = statistics.median(
            ratios[f"{n}: {m}/original"] for n in names)
    config = {"rounds": _ROUNDS.value, "epochs_per_run": _EPOCHS.value,
              "images": _IMAGES.value, "image_size": SIZE,
              "data": "photos cut from scikit-learn/scikit-image samples (256-512 px, JPEG q90), "
                      "scikit-learn digits and diabetes, Python stdlib source"}
    print(json.dumps(bench.record("your_pipelines", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
