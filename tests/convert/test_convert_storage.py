"""Storage for the training size: ``--image_size=N`` stores the pixels TF's guide pipeline
computes, ``raw`` stores them as uint8, ``auto`` picks by measurement, and ``schema.json``
says what was chosen, why, and the stored images' sides. Real photos (scikit-learn's)."""

import os
from pathlib import Path

import numpy as np
import pytest
import sklearn.datasets
import tensorflow as tf
from PIL import Image

from tfspeed.convert import convert, storage
from tfspeed.convert.sources.resize import resize_bilinear
from tfspeed.data import schema as schema_lib

SIZE = 48
_SAMPLES = os.path.join(os.path.dirname(sklearn.datasets.__file__), "images")


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    """Two real 640x427 photos as they are, crops of them (JPEG q90, some smaller than SIZE),
    a grayscale JPEG and a PNG: path -> the bytes TF's pipeline would read."""
    root = tmp_path_factory.mktemp("real") / "src"
    rng = np.random.default_rng(0)
    for c, name in enumerate(["china", "flower"]):
        folder = root / f"class{c}"
        folder.mkdir(parents=True)
        original = Image.open(os.path.join(_SAMPLES, f"{name}.jpg"))
        original.save(folder / "whole.jpg", quality=90)
        for i in range(4):
            w, h = (int(v) for v in rng.integers(30, 400, size=2))
            x, y = int(rng.integers(0, 640 - w)), int(rng.integers(0, 427 - h))
            original.crop((x, y, x + w, y + h)).save(folder / f"crop{i}.jpg", quality=90)
        original.convert("L").resize((200, 150)).save(folder / "gray.jpg", quality=90)
        original.resize((90, 60)).save(folder / "small.png")
    return root


def _tf_pipeline(data: bytes) -> np.ndarray:
    """The TF guide's pipeline: decode (3 channels), resize to SIZE x SIZE, float."""
    return tf.image.resize(tf.io.decode_image(data, channels=3), [SIZE, SIZE]).numpy()


def _stored(out, schema) -> list[tuple[np.ndarray, np.ndarray]]:
    """(stored pixels, the TF pipeline's float pixels of the same source file), per record."""
    root = schema.source.partition(":")[2]
    expected = {
        (int(path.parent.name[-1]), path.name): _tf_pipeline(path.read_bytes())
        for path in Path(root).glob("*/*")
    }
    feature = schema.features["image"]
    pairs = []
    for split in schema.splits:
        for record in tf.data.TFRecordDataset(schema.shard_paths(str(out), split)):
            parsed = tf.io.parse_single_example(record, schema.parse_spec())
            value = parsed["image"].numpy()
            if feature.encoding == "raw":
                pixels = np.frombuffer(value, np.uint8).reshape(feature.shape)
            else:
                pixels = tf.io.decode_jpeg(value, channels=3).numpy()
            pairs.append((int(parsed["label"]), pixels))
    # Records carry no file name: match each stored image to its source by nearest pixels.
    matched = []
    for label, pixels in pairs:
        candidates = [v for (c, _), v in expected.items() if c == label]
        reference = min(candidates, key=lambda v: np.abs(v - pixels).mean())
        matched.append((pixels, reference))
    assert len(matched) == len(expected) == 14
    return matched


def test_resize_equals_tensorflows_exactly():
    rng = np.random.default_rng(0)
    for shape, out in [((7, 5, 3), (13, 4)), ((427, 640, 3), (48, 48)), ((9, 9, 1), (9, 2))]:
        image = rng.integers(0, 256, shape, dtype=np.uint8)
        expected = tf.image.resize(image, out).numpy()  # bilinear, half-pixel centres
        np.testing.assert_array_equal(resize_bilinear(image, *out), expected)


def test_image_size_raw_stores_the_tf_pipelines_pixels(photo_folder, tmp_path):
    result = convert(
        f"imagefolder:{photo_folder}", str(tmp_path), image_size=SIZE, image_format="raw"
    )
    schema = result.schema
    assert schema.features["image"] == schema_lib.Feature("image", "uint8", (SIZE, SIZE, 3), "raw")
    assert schema.options["image_size"] == SIZE and schema.options["image_format"] == "raw"
    assert schema.storage == {
        "image_format": "raw",
        "requested": "raw",
        "reason": "--image_format=raw",
    }
    assert all(split.image_sides == (SIZE, SIZE) for split in schema.splits.values())
    for pixels, reference in _stored(tmp_path, schema):
        # JPEGs decoded as TF decodes them (fast integer DCT), resized as TF resizes: only
        # the rounding to uint8 differs.
        assert np.abs(pixels - reference).max() <= 0.5


def test_image_size_jpeg_is_close_to_the_tf_pipeline(photo_folder, tmp_path):
    schema = convert(
        f"imagefolder:{photo_folder}", str(tmp_path), image_size=SIZE, image_format="jpeg"
    ).schema
    assert schema.features["image"] == schema_lib.Feature("image", "uint8", (SIZE, SIZE, 3), "jpeg")
    errors = [np.abs(pixels - reference).mean() for pixels, reference in _stored(tmp_path, schema)]
    # JPEG quality 95 (4:2:0 chroma) of the resized pixels: measured 3.8 on this 48-px set
    # (0-255 scale) and 2.0 on 224-px photos; a wrong resize is off by tens.
    assert np.mean(errors) < 5.0, errors


def test_auto_measures_records_why_and_honours_the_budget(photo_folder, tmp_path):
    source = f"imagefolder:{photo_folder}"
    auto = convert(source, str(tmp_path / "auto"), image_size=SIZE).schema
    figures = auto.storage
    assert figures["requested"] == "auto" and figures["raw_budget_mb"] > 0
    assert figures["read_ms"] > 0 and figures["decode_ms"] > 0 and figures["reason"]
    chosen = "raw" if figures["read_ms"] < figures["decode_ms"] else "jpeg"
    assert figures["image_format"] == auto.features["image"].encoding == chosen

    tight = convert(source, str(tmp_path / "tight"), image_size=SIZE, raw_budget_mb=0.01)
    assert tight.schema.features["image"].encoding == "jpeg"
    assert tight.schema.storage["jpeg_quality"] == 95
    assert "over --raw_budget_mb" in tight.schema.storage["reason"]

    varying = convert(source, str(tmp_path / "varying")).schema  # sides vary: never raw
    assert varying.features["image"] == schema_lib.Feature(
        "image", "uint8", (None, None, 3), "jpeg"
    )
    assert "sides vary" in varying.storage["reason"]
    sides = [Image.open(p).size for p in photo_folder.glob("*/*")]
    shortest, longest = min(min(s) for s in sides), max(max(s) for s in sides)
    splits = varying.splits.values()
    assert min(s.image_sides[0] for s in splits) == shortest
    assert max(s.image_sides[1] for s in splits) == longest


def test_choose_without_measuring():
    def no_sample():
        raise AssertionError("measured although the answer was known")

    common = dict(raw_mb=10.0, budget_mb=100.0, sample=no_sample, probe_dir="/nonexistent")
    assert storage.choose("png", (8, 8, 1), **common)["image_format"] == "png"
    assert storage.choose("auto", (None, None, 3), **common)["image_format"] == "jpeg"
    over = storage.choose("auto", (224, 224, 3), **{**common, "budget_mb": 5.0})
    assert over["image_format"] == "jpeg" and over["raw_mb"] == 10.0
