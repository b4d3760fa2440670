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


def test_float_resize_gives_the_peers_pixels_exactly():
    """The resize casts to float32 first (cheaper for TF's kernel): the same pixels as
    ``tf.image.resize`` of the uint8 image, the TF guide's way, to the last bit."""
    photo = tf.io.decode_jpeg(_jpeg(RNG.integers(0, 256, (37, 53, 3), dtype=np.uint8)))
    expected = tf.image.resize(photo, [16, 16]).numpy()
    element = {"inputs": photo, "label": tf.constant(1)}
    eager, in_dataset = _eager_and_in_dataset(ops.make_resize(16, keep_uint8=False), element)
    for out in (eager, in_dataset):
        assert out["inputs"].dtype == np.float32
        np.testing.assert_array_equal(out["inputs"], expected)


@pytest.mark.parametrize("name", ["flip", "crop"])
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


def test_normalize_works_on_batches():
    batch = {"inputs": tf.constant(np.stack([IMAGE, IMAGE])), "label": tf.constant([1, 2])}
    eager, in_dataset = _eager_and_in_dataset(ops.make_normalize(), batch)
    expected = np.stack([IMAGE, IMAGE]).astype(np.float32) / 255
    np.testing.assert_allclose(eager["inputs"], expected, rtol=1e-6)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])


def _photo(side: int) -> np.ndarray:
    """A real photograph (scikit-learn's sample), cropped to ``side`` pixels square."""
    from sklearn.datasets import load_sample_image

    return load_sample_image("china.jpg")[:side, 100:100 + side]


def test_random_resized_crop_decodes_only_its_window():
    photo = _photo(400)
    feature = Feature("image", "uint8", (None, None, 3), "jpeg")
    op = ops.make_random_resized_crop(feature, 32)
    element = {"inputs": tf.constant(_jpeg(photo)), "label": tf.constant(1)}
    seed = tf.constant([3, 9], tf.int64)
    eager, in_dataset = _eager_and_in_dataset(op, element, seed)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])
    assert eager["inputs"].shape == (32, 32, 3) and eager["inputs"].dtype == np.float32
    # The same window taken from the fully decoded image, resized the same way.
    begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
        [400, 400, 3], tf.zeros([1, 0, 4]), seed=seed, min_object_covered=0.0,
        aspect_ratio_range=(3 / 4, 4 / 3), area_range=(0.08, 1.0), max_attempts=10,
        use_image_if_no_bounding_boxes=True)
    full = tf.io.decode_jpeg(_jpeg(photo), channels=3)
    window = tf.slice(full, begin, size)
    expected = tf.image.resize(window, [32, 32]).numpy()
    assert np.abs(eager["inputs"] - expected).mean() < 1.0
    windows = {op(element, tf.constant([3, i], tf.int64))["inputs"].numpy().tobytes()
               for i in range(8)}
    assert len(windows) == 8  # a new window per seed


def test_random_resized_crop_of_raw_and_png_images():
    photo = _photo(64)
    for feature, stored in [(Feature("image", "uint8", (64, 64, 3), "raw"), photo),
                            (Feature("image", "uint8", (None, None, 3), "png"), _png(photo))]:
        op = ops.make_random_resized_crop(feature, 16)
        out = op({"inputs": tf.constant(stored), "label": tf.constant(0)},
                 tf.constant([1, 2], tf.int64))["inputs"].numpy()
        assert out.shape == (16, 16, 3) and out.min() >= 0 and out.max() <= 255


@pytest.mark.parametrize("ratio", [2, 4])
def test_ratio_decoding_is_close_to_a_full_decode_then_resize(ratio):
    """decode_jpeg(ratio=r) downscales in the DCT domain: fewer pixels to produce. It averages
    like an area resize; the TF guide's bilinear resize of a full decode samples instead
    (aliasing): ~7-10 levels from either on this photo."""
    photo = _photo(400)
    size = 400 // ratio // 2  # the decoded side is still twice the target
    feature = Feature("image", "uint8", (None, None, 3), "jpeg")
    element = {"inputs": tf.constant(_jpeg(photo)), "label": tf.constant(0)}
    fast = ops.compose([ops.make_decode(feature, ratio=ratio), ops.make_resize(size)])
    eager, in_dataset = _eager_and_in_dataset(fast, element)
    np.testing.assert_array_equal(eager["inputs"], in_dataset["inputs"])
    assert eager["inputs"].shape == (size, size, 3)
    full = tf.io.decode_jpeg(element["inputs"], channels=3)
    area = tf.image.resize(full, [size, size], method="area").numpy()
    assert np.abs(eager["inputs"] - area).mean() < 1.5  # levels of 255
    assert ops.ratio_for(400, 400 // ratio) == ratio and ops.ratio_for(400, 201) == 1


def test_each_jpeg_is_decoded_at_its_own_ratio():
    """With ``fit``, an image's header decides its ratio: the largest that leaves ``fit``
    pixels on its shorter side. The pixels are exactly decode_jpeg's at that ratio."""
    feature = Feature("image", "uint8", (None, None, 3), "jpeg")
    op = ops.make_decode(feature, fit=50)
    photo = _photo(400)
    # (stored image, the ratio it allows): 400 // 8 = 50; 120 // 2 = 60 but 120 // 4 = 30.
    for image, ratio in ((photo, 8), (photo[:120], 2), (photo[:80, :300], 1)):
        element = {"inputs": tf.constant(_jpeg(image)), "label": tf.constant(0)}
        eager, in_dataset = _eager_and_in_dataset(op, element)
        expected = tf.io.decode_jpeg(element["inputs"], channels=3, ratio=ratio).numpy()
        np.testing.assert_array_equal(eager["inputs"], expected)
        np.testing.assert_array_equal(in_dataset["inputs"], expected)
    # A floor of ratio 2 (the split's smallest image allows it) is kept for every image.
    small = {"inputs": tf.constant(_jpeg(photo[:120])), "label": tf.constant(0)}
    at_least_4 = ops.make_decode(feature, ratio=4, fit=50)(small)["inputs"]
    assert at_least_4.shape == (30, 100, 3)


def test_group_parse_drops_a_bad_payload_alone(digits_dir):
    from tfspeed.data import schema as schema_lib

    schema = schema_lib.read(digits_dir)
    parse_group, parse_one = ops.make_group_parser(schema)
    records = [r.numpy() for r in tf.data.TFRecordDataset(
        schema.shard_paths(digits_dir, "validation")).take(5)]
    group = parse_group(tf.constant(records))
    for i, record in enumerate(records):
        one = parse_one(tf.constant(record))
        np.testing.assert_array_equal(group["inputs"][i], one["inputs"])
        assert int(group["label"][i]) == int(one["label"])
    with pytest.raises(tf.errors.InvalidArgumentError):
        parse_group(tf.constant([*records[:2], b"not an Example", *records[2:]]))
