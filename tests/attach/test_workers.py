"""A pipeline's Python (from_generator, numpy_function maps) in worker processes, in order."""

import glob
import os
import sys
import threading
import time

import cloudpickle
import numpy as np
import psutil
import pytest
import tensorflow as tf
from PIL import Image

from tests.conftest import write_photos
from tfspeed.attach import pool, workers
from tfspeed.attach.optimize import optimize

SIZE = 24
# This module's functions travel by value, as a script's own (__main__) do: by reference, each
# worker would import this module, and TensorFlow with it.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def photo_paths(tmp_path_factory):
    root = write_photos(tmp_path_factory.mktemp("photos"), classes=2, per_class=6)
    return sorted(glob.glob(os.path.join(root, "*", "*.jpg")))


def load(path):
    """PIL decode and resize, as users write it for numpy_function."""
    path = path.decode() if isinstance(path, bytes) else path
    return np.asarray(Image.open(path).convert("RGB").resize((SIZE, SIZE)), np.uint8)


def photo_generator(paths):
    def gen():
        for k, p in enumerate(paths):
            yield load(p), k % 2
    sig = (tf.TensorSpec((SIZE, SIZE, 3), tf.uint8), tf.TensorSpec((), tf.int32))
    return tf.data.Dataset.from_generator(gen, output_signature=sig).batch(4)


def photo_generator_with_args(paths):
    """The paths and a number given as from_generator(args=...): the generator receives them
    as TensorFlow converts them (an array of bytes, a NumPy integer), in a worker too."""
    def gen(given, classes):
        assert isinstance(given, np.ndarray) and isinstance(given[0], bytes), type(given)
        for k, p in enumerate(given):
            yield load(p), k % int(classes)
    sig = (tf.TensorSpec((SIZE, SIZE, 3), tf.uint8), tf.TensorSpec((), tf.int32))
    return tf.data.Dataset.from_generator(gen, args=(paths, 2), output_signature=sig).batch(4)


def numpy_map(paths):
    ds = tf.data.Dataset.from_tensor_slices((paths, np.arange(len(paths)) % 2))
    return ds.map(lambda p, y: (tf.numpy_function(load, [p], tf.uint8), y)).batch(4)


def elements(ds):
    return [[np.asarray(t) for t in tf.nest.flatten(e)] for e in ds]


def same(a, b):
    return len(a) == len(b) and all(
        all(np.array_equal(x, y) for x, y in zip(p, q, strict=True))
        for p, q in zip(a, b, strict=True))


def children() -> list:
    """This process's live worker processes (other tests in the same pytest worker may have
    left processes of their own, such as servers, running beside it)."""
    found = []
    for c in psutil.Process().children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE and pool._CHILD in c.cmdline():
                found.append(c)
        except psutil.NoSuchProcess:
            pass
    return found


def wait_for_no_children(seconds: float) -> list:
    deadline = time.monotonic() + seconds
    while children() and time.monotonic() < deadline:
        time.sleep(0.1)
    return children()


@pytest.mark.parametrize("build", [photo_generator, photo_generator_with_args, numpy_map])
def test_the_same_photos_in_the_same_order_from_worker_processes(photo_paths, build):
    original = build(photo_paths)
    rewritten, moved = workers.rewrite(original)
    assert rewritten is not None, moved
    assert rewritten.element_spec == original.element_spec
    want = elements(original)
    assert len(want) == 3
    for _ in range(2):  # the second epoch reuses the first one's workers
        assert same(elements(rewritten), want)
    assert children(), "the elements came from this process, not from workers"
    # Idle workers end a few seconds after the last pass, and an abandoned pass ends its own.
    assert wait_for_no_children(pool.IDLE_SECONDS + 10) == []
    it = iter(rewritten)
    next(it)
    del it
    assert wait_for_no_children(5) == []


def test_optimize_runs_the_map_in_workers_or_says_why_not(photo_paths, tmp_path):
    out = optimize(numpy_map(photo_paths), cache_dir=str(tmp_path), quiet=True,
                   probe_seconds=0.2)
    report = out.tfspeed_report
    assert report.before_per_s and report.after_per_s
    if report.after_per_s >= workers.KEEP_MARGIN * report.before_per_s:
        assert report.verdict.startswith("running the pipeline's Python in worker processes")
        assert any("load runs in" in c for c in report.changed)
    else:
        assert report.verdict == ("left as written: its Python measured no faster in worker "
                                  "processes on this machine")
    assert same(elements(out), elements(numpy_map(photo_paths)))


CALLS = {"n": 0}


def counted_load(path):
    CALLS["n"] += 1  # in this process only: a worker counts in its own copy
    return load(path)


def test_the_probe_runs_the_map_alone_on_the_inputs_it_times_and_ends_its_workers(
        photo_paths, tmp_path):
    """A first run times the Python map alone, as written and in workers, each over the
    inputs the timing needs (its workers' elements read here, not through from_generator,
    whose use made a numpy_function pipeline as written stall at the end of later epochs).
    Where the workers measure slower there, that is all, and no worker of the probe is left
    running; where faster, the whole rewrite is timed against the pipeline before it is kept."""
    paths = photo_paths * 17  # 204 paths, 51 batches of 4: a tenth is 5 batches after the first
    ds = tf.data.Dataset.from_tensor_slices((paths, np.arange(len(paths)) % 2))
    ds = ds.map(lambda p, y: (tf.numpy_function(counted_load, [p], tf.uint8), y),
                num_parallel_calls=tf.data.AUTOTUNE).batch(4).prefetch(tf.data.AUTOTUNE)
    CALLS["n"] = 0
    out = optimize(ds, cache_dir=str(tmp_path), quiet=True)
    report = out.tfspeed_report
    rates = (f"{report.before_per_s:,.0f} -> {report.after_per_s:,.0f} elements/s "
             f"({report.after_per_s / report.before_per_s:.1f}x)")
    if report.timed.startswith("its Python map"):
        assert CALLS["n"] == 24, CALLS  # (5 + 1) batches of 4, computed once here
        assert out is ds and children() == []
        assert report.line().endswith(f"; its Python map, in this process -> in workers, {rates}")
    else:  # faster alone: the pipeline as written ran here again, against the rewrite
        assert CALLS["n"] > 24, CALLS
        assert report.line().endswith(f"; the pipeline, in this process -> in workers, {rates}")
    assert same(elements(out), elements(ds))


def slow_load(path):
    """A reader that waits (a network share, a slow disk): workers overlap its waits."""
    CALLS["n"] += 1
    time.sleep(0.02)
    return load(path)


def test_a_map_faster_alone_in_workers_is_kept_only_after_the_whole_rewrite_measures_faster(
        photo_paths, tmp_path):
    """Workers overlap a slow reader's waits, so alone they usually measure faster; then
    the whole rewrite, from_generator and all, is timed against the pipeline as written
    before it is kept. (On a loaded machine, or after a from_generator ran in the process,
    TF can stall an iterator's end for a second or two, and the map alone may measure slower:
    then that alone decides, as in the test above.)"""
    paths = photo_paths * 2  # 24 paths, 6 batches of 4: the timing needs 3 batches, 12 paths
    ds = tf.data.Dataset.from_tensor_slices((paths, np.arange(len(paths)) % 2))
    ds = ds.map(lambda p, y: (tf.numpy_function(slow_load, [p], tf.uint8), y)).batch(4)
    CALLS["n"] = 0
    out = optimize(ds, cache_dir=str(tmp_path), quiet=True)
    report = out.tfspeed_report
    if report.timed.startswith("the pipeline"):
        assert CALLS["n"] > 12, CALLS  # the map alone (12 here), then the pipeline as written
        kept = report.after_per_s >= workers.KEEP_MARGIN * report.before_per_s
        assert (out is not ds) == kept, report.line()
    else:
        assert CALLS["n"] == 12 and out is ds, (CALLS, report.line())
    CALLS["n"] = 0
    assert same(elements(out), elements(ds))
    # The pipeline as written, once, where the rewrite's Python runs in workers.
    assert CALLS["n"] == (24 if out is not ds else 48), CALLS


def augmented_load(path):
    """A map that calls another function the script also maps on its own."""
    return load(path)[::-1]


def test_a_function_autograph_has_seen_travels_without_tensorflow(photo_paths):
    """Once ``load`` has been given to numpy_function, autograph leaves a wrapper on it
    (``ag_dnc_wrapper__``); a later map's function that calls ``load`` still reaches the
    workers without TensorFlow in its payload, or each worker would import TensorFlow
    (seconds of CPU each) to unpickle it."""
    tf.data.Dataset.from_tensor_slices(photo_paths).map(
        lambda p: tf.numpy_function(load, [p], tf.uint8))
    assert any(k.startswith("ag_") for k in load.__dict__)
    ds = tf.data.Dataset.from_tensor_slices(photo_paths).map(
        lambda p: tf.numpy_function(augmented_load, [p], tf.uint8))
    rewritten, moved = workers.rewrite(ds)
    assert rewritten is not None, moved
    assert b"tensorflow" not in rewritten._tfspeed_workers.payload
    assert same(elements(rewritten), elements(ds))
    assert any(k.startswith("ag_") for k in load.__dict__)  # the user's function untouched


def test_an_unpicklable_function_leaves_the_pipeline_as_written(photo_paths, tmp_path):
    lock = threading.Lock()  # a closure over a lock: cloudpickle cannot send it

    def locked_load(path):
        with lock:
            return load(path)
    ds = tf.data.Dataset.from_tensor_slices(photo_paths)
    ds = ds.map(lambda p: tf.numpy_function(locked_load, [p], tf.uint8))
    out = optimize(ds, cache_dir=str(tmp_path), quiet=True)
    assert out is ds
    verdict = out.tfspeed_report.verdict
    assert verdict.startswith("left as written: ")
    assert "locked_load cannot be pickled for a worker process" in verdict
    assert "\n" not in verdict


def test_a_map_with_tf_work_around_its_python_says_why_it_stays(photo_paths, tmp_path):
    ds = tf.data.Dataset.from_tensor_slices(photo_paths)
    ds = ds.map(lambda p: tf.cast(tf.numpy_function(load, [p], tf.uint8), tf.float32) / 255)
    out = optimize(ds, cache_dir=str(tmp_path), quiet=True)
    assert out is ds
    assert "TensorFlow ops (Cast" in out.tfspeed_report.verdict


def bad_load(path):
    if path.endswith(b"img_002.jpg"):
        raise ValueError(f"cannot read {os.path.basename(path.decode())}")
    return load(path)


def test_a_worker_raising_reaches_the_user_as_one_line_naming_the_function(photo_paths):
    ds = tf.data.Dataset.from_tensor_slices(photo_paths)
    ds = ds.map(lambda p: tf.numpy_function(bad_load, [p], tf.uint8))
    rewritten, _ = workers.rewrite(ds)
    with pytest.raises(tf.errors.OpError) as raised:
        elements(rewritten)
    lines = [x for x in str(raised.value).splitlines() if "worker process" in x]
    assert lines and lines[0].endswith(
        "WorkerError: bad_load raised in a worker process: ValueError: cannot read img_002.jpg")
    assert wait_for_no_children(5) == []


def test_a_py_function_map_gets_its_tensors_in_the_workers():
    ds = tf.data.Dataset.range(6).map(lambda x: tf.py_function(lambda v: v * 2, [x], tf.int64))
    rewritten, moved = workers.rewrite(ds.batch(2))
    # The inner lambda is autograph's copy, in a generated file: named without its place.
    assert moved == ["the map's Python function <lambda> runs in "
                     f"{workers.cores()} worker processes, in order"]
    assert same(elements(rewritten), elements(ds.batch(2)))


EXITS = """
import numpy as np, tensorflow as tf, psutil
from tfspeed.attach import workers
def double(x):
    return x * 2
ds = tf.data.Dataset.range(6).map(lambda x: tf.numpy_function(double, [x], tf.int64))
fast, _ = workers.rewrite(ds)
assert [int(v) for v in fast] == [0, 2, 4, 6, 8, 10]
print("pids", *[c.pid for c in psutil.Process().children()])
"""


def test_idle_workers_end_when_the_program_exits(tmp_path):
    import subprocess

    script = tmp_path / "exits.py"
    script.write_text(EXITS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=300, check=True)
    pids = [int(p) for p in done.stdout.split("pids", 1)[1].split()]
    assert len(pids) == workers.cores()  # its pool was idle, not yet expired, at exit
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
