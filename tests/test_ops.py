"""Each preprocessing op, eagerly and inside tf.data (they run differently there)."""

import io

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tfspeed.data import ops
from tfspeed.data.schema import Feature


def _png(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "PNG")
    return buffer.getvalue()


def _jpeg(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, "JPEG", quality=95)
    return buffer.getvalue()


def _eager_and_in_dataset(op, element, *extra):
    """Runs ``op`` eagerly and as a tf.data map; returns both results as numpy dicts."""
    eager = op(element, *extra)
    ds = tf.data.Dataset.from_tensors((element, *extra)).map(lambda *args: op(*args))
    in_dataset = next(iter(ds))
    return ({k: v.numpy() for k, v in eager.items()},
            {k: v.numpy() for k, v in in_dataset.items()})


RNG = np.random.default_rng(0)
IMAGE = RNG.integers(0, 256, size=(12, 10, 3), dtype=np.uint8)


@pytest.mark.parametrize(
    "feature, stored, expected",
    [
        (Feature("image", "uint8", (None, None, 3), "png"), _png(IMAGE), IMAGE),
        (Feature("image", "uint8", (12, 10, 3), "raw"), IMAGE.tobytes(), IMAGE),
        (Feature("x", "float32", (4,), "float"), np.arange(4, dtype=np.float32),
         np.arange(4, dtype=np.float32)),
    ],
    ids=["png", "raw", "float"],
)
def test_decode_restores_what_was_stored(feature, stored, expected):
    element = {"inputs": tf.constant(stored), "label": tf.constant(3, tf.int64)}
    eager, in_dataset = _eager_and_in_dataset(ops.make_decode(feature), element)
    for out in (eager, in_dataset):
        np.testing.assert_array_equal(out["inputs"], expected)
        assert out["label"] == 3


def test_decode_raw_works_on_a_batch_of_records():
    feature = Feature("image", "uint8", (12, 10, 3), "raw")
    batch = {"inputs": tf.constant([IMAGE.tobytes(), IMAGE[::-1].tobytes()]),
             "label": tf.constant([1, 2], tf.int64)}
    eager, in_dataset = _eager_and_in_dataset(ops.make_decode(feature), batch)
    for out in (eager, in_dataset):
        np.testing.assert_array_equal(out["inputs"], np.stack([IMAGE, IMAGE[::-1]]))


def test_decode_jpeg_is_close_to_the_source():
    smooth = np.repeat(np.linspace(0, 255, 16, dtype=np.uint8)[None, :, None], 16, 0)
    smooth = np.repeat(smooth, 3, axis=2)
    feature = Feature("image", "uint8", (None, None, 3), "jpeg")
    element = {"inputs": tf.constant(_jpeg(smooth)), "label": tf.constant(0, tf.int64)}
    eager, in_dataset = _eager_and_in_dataset(ops.make_decode(feature), element)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])
    assert eager["inputs"].shape == (16, 16, 3)
    assert np.abs(eager["inputs"].astype(int) - smooth).max() <= 8


def test_resize_keeps_uint8_and_gives_the_size():
    element = {"inputs": tf.constant(IMAGE), "label": tf.constant(1)}
    eager, in_dataset = _eager_and_in_dataset(ops.make_resize(6), element)
    for out in (eager, in_dataset):
        assert out["inputs"].shape == (6, 6, 3) and out["inputs"].dtype == np.uint8
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])
    constant = {"inputs": tf.fill([9, 7, 3], tf.constant(77, tf.uint8)), "label": tf.constant(1)}
    assert (ops.make_resize(4)(constant)["inputs"].numpy() == 77).all()


@pytest.mark.parametrize("name", ops.AUGMENTATIONS)
def test_random_ops_are_reproducible_from_the_seed(name):
    op = ops.OPS[name][1]()
    element = {"inputs": tf.constant(IMAGE[:10, :10]), "label": tf.constant(1)}
    seed = tf.constant([7, 1], tf.int64)
    eager, in_dataset = _eager_and_in_dataset(op, element, seed)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])
    assert eager["inputs"].shape == (10, 10, 3)
    outputs = {op(element, tf.constant([7, i], tf.int64))["inputs"].numpy().tobytes()
               for i in range(16)}
    assert len(outputs) > 1, f"{name} never changed the image over 16 seeds"


def test_flip_mirrors_the_image():
    element = {"inputs": tf.constant(IMAGE), "label": tf.constant(1)}
    flip = ops.make_flip()
    seen = {op_out.tobytes() for op_out in
            (flip(element, tf.constant([0, i], tf.int64))["inputs"].numpy() for i in range(16))}
    assert seen == {IMAGE.tobytes(), IMAGE[:, ::-1].tobytes()}


def test_normalize_and_standardize_work_on_batches():
    batch = {"inputs": tf.constant(np.stack([IMAGE, IMAGE])), "label": tf.constant([1, 2])}
    eager, in_dataset = _eager_and_in_dataset(ops.make_normalize(), batch)
    expected = np.stack([IMAGE, IMAGE]).astype(np.float32) / 255
    np.testing.assert_allclose(eager["inputs"], expected, rtol=1e-6)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])

    x = RNG.normal(5.0, 3.0, size=(64, 4)).astype(np.float32)
    stats = {"mean": x.mean(0).tolist(), "std": x.std(0).tolist()}
    op = ops.make_standardize(stats["mean"], stats["std"])
    eager, in_dataset = _eager_and_in_dataset(op, {"inputs": tf.constant(x), "label": tf.zeros(64)})
    np.testing.assert_allclose(eager["inputs"].mean(0), 0, atol=1e-5)
    np.testing.assert_allclose(eager["inputs"].std(0), 1, atol=1e-4)
    np.testing.assert_allclose(eager["inputs"], in_dataset["inputs"], rtol=1e-6)
