"""tfspeed.optimize on pipelines written the way the Keras and TF tutorials write them."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO, write_photos
from tfspeed.attach import graph
from tfspeed.attach.optimize import optimize
from tfspeed.errors import UsageError


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    return str(write_photos(tmp_path_factory.mktemp("photos"), classes=3, per_class=10))


def tutorial(folder, seed=1):
    """The Keras tutorial's pipeline: paths shuffled (buffer batch x 8), decoded, resized,
    batched, prefetched."""
    return keras.utils.image_dataset_from_directory(folder, image_size=(32, 32), batch_size=4,
                                                    seed=seed, verbose=False)


def elements(ds):
    return [tuple(np.asarray(t) for t in tf.nest.flatten(e)) for e in ds]


def same(a, b):
    return len(a) == len(b) and all(
        all(np.array_equal(x, y) for x, y in zip(p, q, strict=True)) for p, q in zip(a, b, strict=False))


def multiset(batches):
    """Every example of an epoch of (images, labels) batches, as sorted bytes."""
    out = []
    for images, labels in batches:
        images, labels = np.asarray(images), np.asarray(labels)
        out += [img.tobytes() + bytes([int(lab)]) for img, lab in zip(images, labels, strict=True)]
    return sorted(out)


def test_the_tutorial_pipeline_is_stored_then_replayed_with_the_same_elements_in_order(
        photo_folder, tmp_path):
    first = optimize(tutorial(photo_folder), cache_dir=str(tmp_path), quiet=True)
    report = first.tfspeed_report
    assert report.state == "writing"
    assert any("moved before the shuffle" in c for c in report.changed)
    assert first.class_names == ["class_0", "class_1", "class_2"]
    assert first.element_spec == tutorial(photo_folder).element_spec
    # A seeded shuffle gives the same order as written, epoch after epoch.
    original = tutorial(photo_folder)
    for _ in range(2):
        assert same(elements(first), elements(original))
    # A later run (a new object from the same code) reads the store it left.
    later = optimize(tutorial(photo_folder), cache_dir=str(tmp_path), quiet=True,
                     probe_seconds=0.2)
    assert later.tfspeed_report.state == "complete"
    assert later.tfspeed_report.before_per_s > 0 and later.tfspeed_report.after_per_s > 0
    assert same(elements(later), elements(tutorial(photo_folder)))
    # Timed once per store: every later run reads the figures instead of timing again.
    third = optimize(tutorial(photo_folder), cache_dir=str(tmp_path), quiet=True)
    assert (third.tfspeed_report.before_per_s, third.tfspeed_report.after_per_s) == (
        later.tfspeed_report.before_per_s, later.tfspeed_report.after_per_s)


VECTORISED = """
import keras, tensorflow as tf
texts = tf.constant(["the cat sat on the mat", "a dog barked", "the dog sat"])
vectorize = keras.layers.TextVectorization(output_sequence_length=4)
vectorize.adapt(texts)
ds = tf.data.Dataset.from_tensor_slices(texts).batch(2).map(vectorize)
"""


def test_the_key_is_the_same_in_every_process_for_a_pipeline_with_a_lookup_table():
    from tfspeed.attach import store

    script = VECTORISED + "from tfspeed.attach import store\nprint(store.fingerprint(ds)[0])\n"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": str(REPO)}
    theirs = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=120).stdout.split()[-1]
    scope = {}
    exec(VECTORISED, scope)
    assert store.fingerprint(scope["ds"])[0] == theirs


def test_an_unseeded_shuffle_keeps_the_multiset_of_an_epoch(photo_folder, tmp_path):
    def unseeded():
        files = tf.data.Dataset.list_files(os.path.join(photo_folder, "*", "*.jpg"))

        def load(path):
            image = tf.io.decode_jpeg(tf.io.read_file(path), channels=3)
            label = tf.strings.to_number(tf.strings.split(
                tf.strings.split(path, os.sep)[-2], "_")[-1], tf.int32)
            return tf.image.resize(image, (24, 24)), label

        return files.map(load, num_parallel_calls=tf.data.AUTOTUNE).batch(5).prefetch(1)

    fast = optimize(unseeded(), cache_dir=str(tmp_path), quiet=True)
    assert fast.tfspeed_report.state == "writing"
    assert graph.plan(unseeded()).moved == 1  # list_files shuffles the paths
    expected = multiset(unseeded())
    assert multiset(fast) == expected and multiset(fast) == expected
    assert len(expected) == 30


def test_augmentation_stays_random_and_is_never_stored(photo_folder, tmp_path):
    flip = keras.layers.RandomFlip("horizontal")

    def augmented():
        files = tf.data.Dataset.list_files(os.path.join(photo_folder, "*", "*.jpg"),
                                           shuffle=False)
        images = files.map(lambda p: tf.image.resize(tf.io.decode_jpeg(tf.io.read_file(p),
                                                                       channels=3), (16, 16)))
        return images.map(lambda x: flip(x, training=True)).batch(30)

    plan = graph.plan(augmented())
    assert "is random" in plan.reason and plan.suffix == ["Map", "Batch"]
    fast = optimize(augmented(), cache_dir=str(tmp_path), quiet=True)
    assert fast.tfspeed_report.state == "writing"
    epochs = [elements(fast)[0][0] for _ in range(4)]
    assert any(not np.array_equal(epochs[0], e) for e in epochs[1:])
    # The stored part is the decode alone: flipping it back gives one of two images each.
    plain = elements(augmented().map(lambda x: x))[0][0]  # any epoch of the original
    for e in epochs:
        assert all(np.array_equal(a, b) or np.array_equal(a, b[:, ::-1])
                   for a, b in zip(e, plain, strict=True))


@pytest.mark.parametrize("make, words", [
    (lambda: tf.data.Dataset.range(8).map(
        lambda i: tf.py_function(lambda v: v * 2, [i], tf.int64) + 1).batch(2),
     "does TensorFlow ops (AddV2"),
    (lambda: tf.data.Dataset.range(8).shuffle(8).batch(2), "nothing is worth storing"),
])
def test_a_pipeline_that_cannot_be_stored_is_left_as_written_with_one_line(
        make, words, tmp_path, capsys):
    given = make()
    out = optimize(given, cache_dir=str(tmp_path))
    assert out is given
    said = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tfspeed.optimize")]
    assert len(said) == 1 and said[0].startswith("tfspeed.optimize: left as written")
    assert words in said[0]


def interleaved_records(data_dir, deterministic=None):
    """The tf.data guide's TFRecord reading: shards interleaved, then parsed and decoded."""
    files = sorted(tf.io.gfile.glob(os.path.join(data_dir, "train-*.tfrecord")))
    spec = {"image": tf.io.FixedLenFeature([], tf.string),
            "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        image = tf.reshape(tf.io.decode_raw(example["image"], tf.uint8), (8, 8, 1))
        return tf.cast(image, tf.float32) / 16.0, example["label"]

    ds = tf.data.Dataset.from_tensor_slices(files).interleave(
        tf.data.TFRecordDataset, cycle_length=4, num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=deterministic)
    return ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE).shuffle(256, seed=3).batch(64)


@pytest.mark.parametrize("deterministic", [None, False])
def test_shards_read_through_an_interleave_are_stored_after_it(
        digits_dir, tmp_path, deterministic):
    # Left as written before: "ParallelInterleave comes first: nothing is worth storing".
    first = optimize(interleaved_records(digits_dir, deterministic), cache_dir=str(tmp_path),
                     quiet=True)
    assert first.tfspeed_report.state == "writing", first.tfspeed_report.verdict
    want = multiset(interleaved_records(digits_dir, deterministic))
    assert len(want) == 1617 and multiset(first) == want
    later = optimize(interleaved_records(digits_dir, deterministic), cache_dir=str(tmp_path),
                     quiet=True)
    assert later.tfspeed_report.state == "complete"
    assert multiset(later) == want
    if deterministic is None:  # the same orders as written, epoch after epoch
        again = optimize(interleaved_records(digits_dir), cache_dir=str(tmp_path), quiet=True)
        original = interleaved_records(digits_dir)
        for _ in range(2):
            assert same(elements(again), elements(original))


def test_a_changed_source_file_gets_a_new_store(tmp_path):
    text = tmp_path / "lines.txt"
    text.write_text("alpha beta\ngamma\n")

    def lines():
        return tf.data.TextLineDataset(str(text)).map(tf.strings.length).batch(2)

    one = optimize(lines(), cache_dir=str(tmp_path / "c"), quiet=True)
    assert elements(one)[0][0].tolist() == [10, 5]
    text.write_text("alpha beta delta\ngamma\n")
    two = optimize(lines(), cache_dir=str(tmp_path / "c"), quiet=True)
    assert two.tfspeed_report.store != one.tfspeed_report.store
    assert two.tfspeed_report.state == "writing"
    assert elements(two)[0][0].tolist() == [16, 5]


def test_a_killed_first_run_is_rebuilt_never_read_half_written(photo_folder, tmp_path):
    cache = tmp_path / "cache"
    script = textwrap.dedent(f"""
        import os, sys, signal
        sys.path.insert(0, {str(REPO)!r})
        import keras
        from tfspeed.attach.optimize import optimize
        ds = keras.utils.image_dataset_from_directory({photo_folder!r}, image_size=(32, 32),
                                                      batch_size=4, seed=1, verbose=False)
        it = iter(optimize(ds, cache_dir={str(cache)!r}, quiet=True))
        next(it); next(it)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    done = subprocess.run([sys.executable, "-c", script], env=env, timeout=120)
    assert done.returncode == -signal.SIGKILL
    again = optimize(tutorial(photo_folder), cache_dir=str(cache), quiet=True)
    assert again.tfspeed_report.state == "writing"  # the partial store was removed
    assert same(elements(again), elements(tutorial(photo_folder)))
    third = optimize(tutorial(photo_folder), cache_dir=str(cache), quiet=True,
                     probe_seconds=0.1)
    assert third.tfspeed_report.state == "complete", os.listdir(third.tfspeed_report.store)


def test_anything_but_a_dataset_is_one_line():
    with pytest.raises(UsageError, match="takes a tf.data.Dataset, got ndarray"):
        optimize(np.zeros((4, 2)))


def test_a_rebuilt_map_is_not_transpiled_again_by_autograph(capsys):
    # Its function is already traced: autograph's transpiling of the wrapper cost ~0.4 s a
    # process, more than a small pipeline's whole run.
    node = graph.chain(tf.data.Dataset.range(4).map(lambda x: x * 2))[1]
    tf.autograph.set_verbosity(10, alsologtostdout=True)
    try:
        out = graph.rebuild(node, tf.data.Dataset.range(3))
    finally:
        tf.autograph.set_verbosity(0)
    assert "Converted call" not in capsys.readouterr().out
    assert [int(x) for x in out] == [0, 2, 4]


def test_the_first_run_computes_nothing_before_the_user_iterates(tmp_path):
    # The first element of a missing file would fail if optimize computed one to size the
    # store: with static shapes, the size comes from the element_spec.
    def missing():
        paths = tf.data.Dataset.from_tensor_slices([str(tmp_path / "absent.jpg")] * 4)
        return paths.map(lambda p: tf.image.resize(tf.io.decode_jpeg(
            tf.io.read_file(p), channels=3), (8, 8))).batch(2)

    out = optimize(missing(), cache_dir=str(tmp_path / "c"), quiet=True)
    assert out.tfspeed_report.state == "writing"
    with pytest.raises(tf.errors.NotFoundError):
        next(iter(out))


def test_a_later_run_times_a_bounded_share_of_the_stored_part(tmp_path):
    def lines():
        return tf.data.Dataset.range(400).map(lambda i: tf.fill([64], i)).shuffle(
            50, seed=3).batch(8)

    first = optimize(lines(), cache_dir=str(tmp_path), quiet=True)
    expected = elements(lines())
    assert same(elements(first), expected)
    later = optimize(lines(), cache_dir=str(tmp_path), quiet=True)
    report = later.tfspeed_report
    assert report.state == "complete" and report.before_per_s > 0
    # The stored part (400 elements, before the shuffle), not whole epochs: at most a tenth.
    assert 0 < report.probe_elements <= 400 // 10
    assert same(elements(later), expected)


def test_a_batch_then_a_map_is_sized_from_its_spec_without_computing_an_element(tmp_path):
    # The text tutorial's shape: batch, then a map whose output has no static batch dimension.
    def missing():
        paths = tf.data.Dataset.from_tensor_slices([str(tmp_path / "absent.txt")] * 4)
        return paths.batch(2).map(lambda p: tf.strings.to_number(tf.strings.split(
            tf.io.read_file(p[0]))[:3])[tf.newaxis] * tf.ones((tf.shape(p)[0], 1)))

    assert missing().element_spec.shape.as_list() == [None, None]  # split: unknown width
    spec = tf.TensorSpec((None, 3), tf.float32)
    fixed = missing().map(lambda x: tf.ensure_shape(tf.reshape(x, (-1, 3)), spec.shape))
    out = optimize(fixed, cache_dir=str(tmp_path / "c"), quiet=True)
    assert out.tfspeed_report.state == "writing"
    with pytest.raises(tf.errors.NotFoundError):
        next(iter(out))


def test_an_array_held_in_the_graph_is_keyed_by_its_values():
    from tfspeed.attach import store

    def arrays(x):
        return tf.data.Dataset.from_tensor_slices(x).map(lambda v: v / 16.0).batch(8)

    digits = np.arange(4000, dtype="float32").reshape(500, 8)  # over CONSTANT_BYTES
    changed = digits.copy()
    changed[-1, -1] += 1
    key = store.fingerprint(arrays(digits))[0]
    assert store.fingerprint(arrays(digits.copy()))[0] == key
    assert store.fingerprint(arrays(changed))[0] != key


@pytest.mark.parametrize("buffer, kept", [(10, True), (100, False)])
def test_a_moved_shuffle_buffer_of_computed_elements_stays_within_the_ram_budget(
        buffer, kept, tmp_path):
    # 100 elements of 8 KB each: a buffer of all of them (list_files' own) is 800 KB.
    def rows():
        return tf.data.Dataset.range(100).shuffle(buffer, seed=1).map(
            lambda i: tf.fill([1000], i)).batch(10)

    given = rows()
    out = optimize(given, cache_dir=str(tmp_path), ram_budget_mb=0.5, quiet=True)
    if kept:
        assert out.tfspeed_report.state == "writing"
        assert any("moved before the shuffle" in c for c in out.tfspeed_report.changed)
    else:
        assert out is given and out.tfspeed_report.state == ""
        assert out.tfspeed_report.verdict.startswith("left as written")
        assert "over the RAM budget" in out.tfspeed_report.verdict
    assert same(elements(out), elements(rows()))


def test_a_pipeline_of_strings_is_stored_and_gives_the_same_strings(tmp_path):
    """Strings of unknown size are sized from one computed element: its characters (a scalar
    string's ``numpy()`` is ``bytes``, which has no ``nbytes``: optimize raised)."""
    text = tmp_path / "lines.txt"
    text.write_text("The first line\nA second line, With Words\nthird\n")

    def lines():
        return tf.data.TextLineDataset(str(text)).map(tf.strings.lower)

    for state in ("writing", "complete"):
        out = optimize(lines(), cache_dir=str(tmp_path / "c"), quiet=True)
        assert out.tfspeed_report.state == state
        assert list(out.as_numpy_iterator()) == [b"the first line", b"a second line, with words",
                                                 b"third"]


def test_your_cache_in_memory_is_replaced_by_the_store_and_a_file_cache_is_kept(tmp_path):
    """The text tutorial ends with ``.map(vectorize).cache().prefetch()``: the cache in memory
    ends the deterministic part, which is stored (no second copy in RAM); a cache to a file
    is the user's own state, rebuilt as written after the store."""
    def tutorial(cache=""):
        ds = tf.data.Dataset.range(40).map(lambda i: tf.fill([3], i * 2)).batch(4)
        return ds.map(lambda x: x + 1).cache(cache).prefetch(2)

    expected = elements(tutorial())
    for state in ("writing", "complete"):
        out = optimize(tutorial(), cache_dir=str(tmp_path / "c"), quiet=True)
        report = out.tfspeed_report
        assert report.state == state and same(elements(out), expected)
        assert any("your .cache() in memory replaced" in c for c in report.changed), report
        # One copy in RAM: tfspeed's (after the store's file, or alone where the later run
        # timed computing faster than reading the file), not the user's as well.
        in_ram = [n for n in graph.chain(out)
                  if type(n).__name__ == "CacheDataset" and not n._filename.numpy()]
        assert len(in_ram) == 1
    # A later run that timed computing faster than reading the file keeps RAM only, and
    # says the same of the user's cache (the timing kept beside the store says so).
    from tfspeed.attach import store

    folder = out.tfspeed_report.store
    with open(os.path.join(folder, store.TIMING), "w") as f:
        json.dump({"before_per_s": 2000.0, "after_per_s": 1000.0, "elements": 4}, f)
    ram = optimize(tutorial(), cache_dir=str(tmp_path / "c"), quiet=True)
    assert "kept in RAM" in ram.tfspeed_report.verdict and same(elements(ram), expected)
    assert any("your .cache() in memory replaced" in c for c in ram.tfspeed_report.changed)
    on_file = optimize(tutorial(str(tmp_path / "mine")), cache_dir=str(tmp_path / "f"),
                       quiet=True)
    assert same(elements(on_file), expected)
    assert not any("your .cache()" in c for c in on_file.tfspeed_report.changed)
    assert [n._filename.numpy() for n in graph.chain(on_file)
            if type(n).__name__ == "CacheDataset"][-1] == str(tmp_path / "mine").encode()
