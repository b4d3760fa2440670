"""The converter's Python API: every source kind round-trips, and writing is deterministic,
atomic and resumable. Real TensorFlow, real files in tmp_path."""

import collections
import dataclasses
import hashlib
import io
import json
import os
import re

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from tfspeed.convert import convert, writer
from tfspeed.convert import plan as plan_lib
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

# ---------------------------------------------------------------- helpers


def _pixels(h, w, channels=3, seed=0):
    shape = (h, w) if channels == 1 else (h, w, channels)
    return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.uint8)


def _save(path, pixels, fmt, **kwargs):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path, fmt, **kwargs)
    return path


def _records(out, split):
    """All records of ``split``, parsed with the schema's spec: feature -> numpy array."""
    schema = schema_lib.read(str(out))
    ds = tf.data.TFRecordDataset(schema.shard_paths(str(out), split)).batch(100_000)
    batches = [tf.io.parse_example(b, schema.parse_spec()) for b in ds]
    return {name: np.concatenate([b[name].numpy() for b in batches]) for name in schema.features}


def _snapshot(out):
    """The shards' bytes and schema.json: what must be identical run to run. The figures of an
    auto storage choice are left out: they are a measurement, taken again by a new run."""
    names = [n for n in os.listdir(out) if n.endswith(".tfrecord")]
    snapshot = {n: (out / n).read_bytes() for n in sorted(names)}
    if (out / "schema.json").exists():
        schema = json.loads((out / "schema.json").read_text())
        schema["storage"] = _choice(schema["storage"])
        snapshot["schema.json"] = schema
    return snapshot


def _choice(storage):
    return {k: storage[k] for k in ("image_format", "requested") if k in storage}


def _unmeasured(schema):
    return dataclasses.replace(schema, storage=_choice(schema.storage))


def _check_shards(out, schema):
    """Each shard file matches its recorded size, sha256 and record count."""
    for split in schema.splits.values():
        for shard in split.shards:
            data = (out / shard.file).read_bytes()
            assert len(data) == shard.num_bytes
            assert hashlib.sha256(data).hexdigest() == shard.sha256
            assert (
                sum(1 for _ in tf.data.TFRecordDataset(str(out / shard.file))) == shard.num_records
            )


def _decode(images, channels=0):
    return [tf.io.decode_image(b, channels=channels).numpy() for b in images]


def _pixels_of(records, feature):
    """The stored images of ``records`` as uint8 arrays, whatever their encoding."""
    if feature.encoding == "raw":
        return [np.frombuffer(b, np.uint8).reshape(feature.shape) for b in records[feature.name]]
    return _decode(records[feature.name], feature.shape[-1])


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("image_format", ["auto", "png"])
def test_digits_round_trip(tmp_path, image_format):
    from sklearn.datasets import load_digits

    result = convert(
        "digits", str(tmp_path), shards=3, validation_fraction=0.2, image_format=image_format
    )
    schema = result.schema
    assert schema.inputs == "image" and schema.label == "label"
    assert schema.class_names == tuple(str(i) for i in range(10))
    # auto stores 8x8 images raw: reading 64 bytes is measured faster than decoding a JPEG.
    stored = "raw" if image_format == "auto" else image_format
    assert schema.features["image"] == schema_lib.Feature("image", "uint8", (8, 8, 1), stored)
    assert schema.storage["image_format"] == schema.options["image_format"] == stored
    assert schema.storage["requested"] == image_format
    if image_format == "auto":
        assert schema.storage["read_ms"] < schema.storage["decode_ms"], schema.storage
    assert {n: len(s.shards) for n, s in schema.splits.items()} == {"train": 3, "validation": 1}
    assert all(split.image_sides == (8, 8) for split in schema.splits.values())
    assert schema.splits["validation"].num_records == round(1797 * 0.2)
    assert result.summary["records"] == 1797 and result.summary["skipped"] == 0
    _check_shards(tmp_path, schema)
    assert schema_lib.read(str(tmp_path)) == schema

    digits = load_digits()
    expected = np.array([round(v * 255 / 16) for v in digits.images.ravel()], np.uint8)
    expected = expected.reshape(-1, 8, 8, 1)
    got = collections.Counter()
    for split in schema.splits:
        records = _records(tmp_path, split)
        images = _pixels_of(records, schema.features["image"])
        for image, label in zip(images, records["label"], strict=True):
            got[(int(label), image.tobytes())] += 1
    assert got == collections.Counter(
        (int(y), x.tobytes()) for x, y in zip(expected, digits.target, strict=True)
    )
    # Records are mixed within a split, so every shard holds many classes.
    for path in schema.shard_paths(str(tmp_path), "train"):
        labels = [
            tf.io.parse_single_example(r, schema.parse_spec())["label"].numpy()
            for r in tf.data.TFRecordDataset(path)
        ]
        assert len(set(labels)) == 10


def _photo_folder(root):
    """3 classes: RGB JPEGs (copied), a PNG, a grayscale JPEG, an RGBA PNG, and junk."""
    copied = {}
    for c, name in enumerate(["ant", "bee", "cat"]):
        for i in range(3):
            path = _save(root / name / f"{i}.jpg", _pixels(20 + i, 30 - i, seed=10 * c + i), "JPEG")
            copied[path.read_bytes()] = c
    _save(root / "ant" / "wide.png", _pixels(16, 40, seed=1), "PNG")
    _save(root / "ant" / "sub" / "gray.jpg", _pixels(24, 24, 1, seed=2), "JPEG")
    _save(root / "bee" / "alpha.png", _pixels(18, 18, 4, seed=3), "PNG")
    good = (root / "cat" / "0.jpg").read_bytes()
    (root / "ant" / "broken.jpg").write_bytes(good[: len(good) // 2])  # truncated
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "cat" / ".hidden.jpg").write_bytes(b"ignored: hidden")
    (root / "README").write_text("outside the class folders: ignored")
    return copied


def test_imagefolder_round_trip_copies_converts_and_skips(tmp_path):
    src = tmp_path / "photos"
    copied = _photo_folder(src)
    out = tmp_path / "out"
    result = convert(f"imagefolder:{src}", str(out), shards=2, validation_fraction=0.25)
    schema = result.schema
    assert schema.class_names == ("ant", "bee", "cat")
    assert schema.features["image"] == schema_lib.Feature("image", "uint8", (None, None, 3), "jpeg")
    assert schema.source == f"imagefolder:{src}"
    assert schema.options["image_format"] == "jpeg" and schema.options["shards"] == 2
    assert list(schema.splits) == ["train", "validation"]
    assert sum(s.num_records for s in schema.splits.values()) == 12  # 9 JPEGs + 3 converted
    skipped = [s for split in schema.splits.values() for s in split.skipped]
    assert sorted(s["item"] for s in skipped) == [
        str(src / "ant" / "broken.jpg"),
        str(src / "cat" / "notes.txt"),
    ]
    assert all(s["reason"] for s in skipped) and result.summary["skipped"] == 2
    on_disk = json.loads((out / "schema.json").read_text())
    assert sum(s["num_skipped"] for s in on_disk["splits"].values()) == 2
    _check_shards(out, schema)

    images, labels = [], []
    for split in schema.splits:
        records = _records(out, split)
        images += list(records["image"])
        labels += list(records["label"])
    found = {image: label for image, label in zip(images, labels, strict=True) if image in copied}
    assert found == copied  # already RGB JPEGs within the size limit: stored byte for byte
    assert all(image.ndim == 3 and image.shape[2] == 3 for image in _decode(images))


def test_imagefolder_png_with_resize(tmp_path):
    src = tmp_path / "src"
    small = _save(src / "a" / "small.png", _pixels(10, 12, seed=1), "PNG")
    big = _save(src / "a" / "big.png", _pixels(20, 40, seed=2), "PNG")
    photo = _save(src / "b" / "photo.jpg", _pixels(30, 30, seed=3), "JPEG")
    convert(
        f"imagefolder:{src}",
        str(tmp_path / "out"),
        image_format="png",
        image_max_side=16,
        validation_fraction=0,
    )
    records = _records(tmp_path / "out", "train")
    by_label = collections.defaultdict(list)
    for image, label in zip(records["image"], records["label"], strict=True):
        by_label[int(label)].append(image)
    assert small.read_bytes() in by_label[0]  # small enough: copied
    lanczos = Image.Resampling.LANCZOS
    expected = {
        np.asarray(Image.open(big).resize((16, 8), lanczos)).tobytes(),
        np.asarray(Image.open(small)).tobytes(),
    }
    assert {x.tobytes() for x in _decode(by_label[0])} == expected
    (decoded,) = _decode(by_label[1])
    assert decoded.tobytes() == np.asarray(Image.open(photo).resize((16, 16), lanczos)).tobytes()


def test_imagefolder_split_folders(tmp_path):
    src = tmp_path / "src"
    for split, classes in {"train": "ab", "val": "a", "test": "bc"}.items():
        for c in classes:
            for i in range(2):
                _save(src / split / c / f"{i}.png", _pixels(8, 8, seed=i), "PNG")
    schema = convert(f"imagefolder:{src}", str(tmp_path / "out"), validation_fraction=0.5).schema
    assert schema.class_names == ("a", "b", "c")
    assert {n: s.num_records for n, s in schema.splits.items()} == {
        "train": 4,
        "validation": 2,
        "test": 4,
    }
    assert list(schema.splits) == ["train", "validation", "test"]
    assert sorted(_records(tmp_path / "out", "test")["label"]) == [1, 1, 2, 2]


def test_csv_round_trip_with_string_labels(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 2)).round(3)
    names = rng.choice(["dog", "cat", "ant"], size=40)
    lines = ["f1,label,f2"] + [f"{a},{n},{b}" for (a, b), n in zip(x, names, strict=True)]
    (tmp_path / "t.csv").write_text("\n".join(lines) + "\n")
    schema = convert(f"csv:{tmp_path / 't.csv'}", str(tmp_path / "out"), shards=2).schema
    assert schema.class_names == ("ant", "cat", "dog")
    assert schema.features["features"] == schema_lib.Feature("features", "float32", (2,), "float")
    assert schema.inputs == "features" and schema.options["label_column"] == "label"
    rows = {}
    for split in schema.splits:
        records = _records(tmp_path / "out", split)
        for f, y in zip(records["features"], records["label"], strict=True):
            rows[f.tobytes()] = schema.class_names[y]
    assert rows == {f.astype(np.float32).tobytes(): n for f, n in zip(x, names, strict=True)}
    train = _records(tmp_path / "out", "train")["features"]
    stats = schema.stats["features"]
    np.testing.assert_allclose(stats["mean"], train.mean(axis=0), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(stats["std"], train.std(axis=0), rtol=1e-5, atol=1e-6)


def test_csv_integer_labels_and_label_column(tmp_path):
    lines = ["a,b,y"] + [f"{i},{i * 2},{i % 3}" for i in range(9)]
    (tmp_path / "t.csv").write_text("\n".join(lines))
    out = tmp_path / "out"
    schema = convert(
        f"csv:{tmp_path / 't.csv'}", str(out), label_column="y", validation_fraction=0
    ).schema
    assert schema.class_names == ("0", "1", "2")
    records = _records(out, "train")
    assert all(
        int(f[0]) % 3 == y for f, y in zip(records["features"], records["label"], strict=True)
    )


def test_npz_float_and_uint8_keep_their_shape(tmp_path):
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, size=20)
    floats = rng.normal(size=(20, 3, 2))
    np.savez(tmp_path / "f.npz", x=floats, y=y, class_names=np.array(["r", "g", "b"]))
    schema = convert(
        f"npz:{tmp_path / 'f.npz'}", str(tmp_path / "f"), validation_fraction=0.25
    ).schema
    assert schema.features["x"] == schema_lib.Feature("x", "float32", (3, 2), "float")
    assert schema.class_names == ("r", "g", "b")
    assert len(schema.stats["x"]["mean"]) == 6
    got = {}
    for split in schema.splits:
        records = _records(tmp_path / "f", split)
        got.update(zip([x.tobytes() for x in records["x"]], records["label"], strict=True))
    assert got == dict(zip([x.astype(np.float32).tobytes() for x in floats], y, strict=True))

    pixels = rng.integers(0, 256, size=(20, 6, 5), dtype=np.uint8)
    np.savez(tmp_path / "u.npz", x=pixels, y=y)
    schema = convert(f"npz:{tmp_path / 'u.npz'}", str(tmp_path / "u"), validation_fraction=0).schema
    assert schema.features["x"] == schema_lib.Feature("x", "uint8", (6, 5), "raw")
    assert schema.class_names == ("0", "1", "2")
    records = _records(tmp_path / "u", "train")
    decoded = tf.reshape(tf.io.decode_raw(records["x"], tf.uint8), (-1, 6, 5)).numpy()
    got = sorted(
        (int(label), x.tobytes()) for x, label in zip(decoded, records["label"], strict=True)
    )
    assert got == sorted((int(label), x.tobytes()) for x, label in zip(pixels, y, strict=True))


def _prepare_tfds(data_dir, images):
    """Prepares a tiny TFDS image dataset offline (as `tfds build` would); returns its name."""
    import tensorflow_datasets as tfds

    class TfspeedTinyImages(tfds.core.GeneratorBasedBuilder, skip_registration=True):
        VERSION = tfds.core.Version("1.0.0")

        def _info(self):
            features = {
                "image": tfds.features.Image(shape=(12, 10, 3)),
                "label": tfds.features.ClassLabel(names=["ant", "bee", "cat"]),
            }
            return tfds.core.DatasetInfo(
                builder=self,
                features=tfds.features.FeaturesDict(features),
                supervised_keys=("image", "label"),
            )

        def _split_generators(self, dl_manager):
            return {split: self._generate_examples(split) for split in images}

        def _generate_examples(self, split):
            for i, image in enumerate(images[split]):
                yield i, {"image": image, "label": i % 3}

    TfspeedTinyImages(data_dir=str(data_dir)).download_and_prepare()
    return "tfspeed_tiny_images"


def test_tfds_round_trip_keeps_splits_and_reads_slices(tmp_path):
    rng = np.random.default_rng(0)
    images = {
        "train": rng.integers(0, 256, (11, 12, 10, 3), dtype=np.uint8),
        "test": rng.integers(0, 256, (4, 12, 10, 3), dtype=np.uint8),
    }
    name = _prepare_tfds(tmp_path / "tfds", images)
    out = tmp_path / "out"
    schema = convert(
        f"tfds:{name}", str(out), tfds_data_dir=str(tmp_path / "tfds"), shards=3, image_format="png"
    ).schema
    assert schema.class_names == ("ant", "bee", "cat")
    assert {n: len(s.shards) for n, s in schema.splits.items()} == {"train": 3, "test": 1}
    assert schema.features["image"] == schema_lib.Feature("image", "uint8", (12, 10, 3), "png")
    _check_shards(out, schema)
    for split, expected in images.items():
        records = _records(out, split)
        got = sorted(
            (int(y), x.tobytes())
            for x, y in zip(_decode(records["image"]), records["label"], strict=True)
        )
        assert got == sorted((i % 3, x.tobytes()) for i, x in enumerate(expected))

    with pytest.raises(UsageError, match="not prepared"):
        convert(
            "tfds:no_such_dataset_xyz", str(tmp_path / "x"), tfds_data_dir=str(tmp_path / "tfds")
        )


# ---------------------------------------------------------------- determinism, resume, refusal


def test_same_command_gives_identical_bytes_in_process_and_with_two_workers(tmp_path):
    src = tmp_path / "photos"
    _photo_folder(src)
    a = convert(f"imagefolder:{src}", str(tmp_path / "a"), shards=3)
    b = convert(f"imagefolder:{src}", str(tmp_path / "b"), shards=3)
    assert a.schema.fingerprint == b.schema.fingerprint
    assert _snapshot(tmp_path / "a") == _snapshot(tmp_path / "b")

    one = convert("digits", str(tmp_path / "one"), shards=4, workers=1)
    two = convert("digits", str(tmp_path / "two"), shards=4, workers=2)  # spawned processes
    assert _unmeasured(one.schema) == _unmeasured(two.schema)
    assert _snapshot(tmp_path / "one") == _snapshot(tmp_path / "two")


def _plan_lines(out):
    return (out / plan_lib.PLAN_FILE).read_text().splitlines()


def test_resume_keeps_verified_shards_and_rewrites_the_rest(tmp_path):
    clean, out = tmp_path / "clean", tmp_path / "out"
    convert("digits", str(clean), shards=6)
    first = convert("digits", str(out), shards=6)
    files = [s.file for s in first.schema.splits["train"].shards]
    # Make `out` look like a run killed mid-way: schema.json not written yet, shard 2 never
    # written, shard 3 half-written under its temporary name, shard 4 renamed into place but
    # not yet recorded in the plan, and the plan's last line torn.
    (out / "schema.json").unlink()
    (out / files[2]).unlink()
    (out / f".{files[3]}.tmp-4242").write_bytes(b"partial")
    (out / files[3]).unlink()
    header, *lines = _plan_lines(out)
    lines = [header] + [ln for ln in lines if not any(f in ln for f in files[2:])]
    (out / plan_lib.PLAN_FILE).write_text("\n".join(lines) + '\n{"file": "' + files[5][:6])
    (out / files[5]).unlink()
    kept = os.stat(out / files[0])
    os.link(out / files[4], tmp_path / "unrecorded")  # pins its inode: no reuse by a new file

    result = convert("digits", str(out), shards=6)
    assert not result.already_converted
    assert result.summary["resumed_shards"] == 3  # train 0, 1 and the validation shard
    assert _snapshot(out) == _snapshot(clean)
    assert _unmeasured(result.schema) == _unmeasured(schema_lib.read(str(clean)))
    assert result.schema.storage == first.schema.storage  # the plan's measurement, kept
    again = os.stat(out / files[0])
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # not rewritten
    assert os.stat(out / files[4]).st_ino != os.stat(tmp_path / "unrecorded").st_ino  # rewritten
    assert not [n for n in os.listdir(out) if ".tmp-" in n]


def test_finished_conversion_is_not_redone_and_a_damaged_shard_is(tmp_path):
    first = convert("digits", str(tmp_path), shards=2)
    stats = {n: os.stat(tmp_path / n).st_mtime_ns for n in _snapshot(tmp_path)}
    again = convert("digits", str(tmp_path), shards=2)
    assert again.already_converted and again.schema == first.schema
    assert again.summary["resumed_shards"] == 3 and again.summary["records"] == 1797
    assert {n: os.stat(tmp_path / n).st_mtime_ns for n in stats} == stats

    before = _snapshot(tmp_path)
    path = tmp_path / first.schema.splits["train"].shards[1].file
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    repaired = convert("digits", str(tmp_path), shards=2)
    assert not repaired.already_converted and repaired.summary["resumed_shards"] == 2
    assert _snapshot(tmp_path) == before


def test_output_of_another_dataset_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    convert("digits", str(out), shards=2)
    (out / "notes.txt").write_text("mine")
    (out / "sub").mkdir()
    (out / "sub" / "keep.tfrecord").write_text("mine too")
    with pytest.raises(
        UsageError, match=f"{re.escape(str(out))} holds another dataset.*--overwrite"
    ):
        convert("digits", str(out), shards=2, seed=1)  # other options: another dataset
    with pytest.raises(UsageError, match="--overwrite"):
        convert("digits", str(out), shards=3)

    result = convert("digits", str(out), shards=3, overwrite=True)
    assert result.summary["resumed_shards"] == 0
    expected = {s.file for split in result.schema.splits.values() for s in split.shards}
    assert {n for n in os.listdir(out) if n.endswith(".tfrecord")} == expected
    assert (out / "notes.txt").read_text() == "mine"
    assert (out / "sub" / "keep.tfrecord").read_text() == "mine too"

    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "someone-else.tfrecord").write_bytes(b"x")
    with pytest.raises(UsageError, match="someone-else.tfrecord"):
        convert("digits", str(stray))
    convert("digits", str(stray), overwrite=True)
    assert not (stray / "someone-else.tfrecord").exists()


def _cats_and_dogs(root):
    """root/<cat|dog>/<0|1>.jpg: a source folder, not a converted dataset."""
    for name in ("cat", "dog"):
        for i in range(2):
            _save(root / name / f"{i}.jpg", _pixels(8, 8, seed=i), "JPEG")
    return root


def test_an_output_that_is_near_or_holds_source_files_is_refused(tmp_path):
    """Shards written among photos would mix with them (and be listed as a class next time)."""
    photos = _cats_and_dogs(tmp_path / "photos")
    table = tmp_path / "tables" / "t.csv"
    table.parent.mkdir()
    table.write_text("a,label\n1,x\n2,y\n")
    before = sorted(tmp_path.rglob("*"))
    cases = [
        (f"imagefolder:{photos}", photos, "is the source itself", "data/photos"),
        (f"imagefolder:{photos}", photos / "cat" / "tf", "lies inside the source", "data/photos"),
        (f"imagefolder:{photos}", tmp_path, "contains the source", "data/photos"),
        (f"csv:{table}", table.parent, "contains the source", "data/t"),
        ("digits", photos, f"holds source files ({photos / 'cat' / '0.jpg'})", "data/photos"),
        ("digits", table.parent, f"holds source files ({table})", "data/tables"),
    ]
    for source, output, relation, suggestion in cases:
        with pytest.raises(UsageError) as error:
            convert(source, str(output), shards=1)
        message = str(error.value)
        assert message.startswith(f"--output={output} {relation}") and "\n" not in message
        assert "separate" in message and message.endswith(f"e.g. --output={suggestion}")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written anywhere
    # Next to the source, not in it: converts.
    result = convert(f"imagefolder:{photos}", str(tmp_path / "data"), shards=1)
    assert result.summary["records"] == 4


def test_a_data_dir_of_source_files_names_the_conversion_it_needs(tmp_path):
    photos = _cats_and_dogs(tmp_path / "photos")
    with pytest.raises(UsageError) as error:
        schema_lib.read(str(photos))
    message = str(error.value)
    assert message.startswith(f"{photos} looks like a source, not a converted dataset")
    assert (f"`python scripts/to_tfrecord.py --source=imagefolder:{photos} "
            "--output=data/photos`, then pass --data_dir=data/photos") in message
    assert f"--output={photos}" not in message
    np.savez(tmp_path / "arrays.npz", x=np.zeros((2, 3)), y=np.zeros(2))
    with pytest.raises(UsageError, match=re.escape(
            f"--source=npz:{tmp_path / 'arrays.npz'} --output=data/arrays`")):
        schema_lib.read(str(tmp_path))
    (tmp_path / "empty").mkdir()  # no source files: the conversion may have been interrupted
    with pytest.raises(UsageError, match="is not a finished tfspeed conversion"):
        schema_lib.read(str(tmp_path / "empty"))


def test_shard_counts_and_tasks():
    sizes = {"train": 100, "validation": 10, "test": 3}
    est = {"train": 300 << 20, "validation": 30 << 20, "test": 1}
    assert writer.shard_counts(sizes, est, 8, 128) == {"train": 8, "validation": 1, "test": 1}
    assert writer.shard_counts(sizes, est, 500, 128) == {"train": 100, "validation": 10, "test": 3}
    # Automatic: at least 16 train shards, or ~target_shard_mb each if that gives more.
    assert writer.shard_counts(sizes, est, 0, 128) == {"train": 16, "validation": 2, "test": 1}
    assert writer.shard_counts(sizes, est, 0, 10) == {"train": 30, "validation": 3, "test": 1}
    assert writer.shard_counts({"train": 5, "test": 2}, est, 0, 128) == {"train": 5, "test": 2}
    no_train = {"test": 40, "extra": 400}
    assert writer.shard_counts(no_train, {"extra": 1}, 0, 128) == {"test": 2, "extra": 16}
    tasks = writer.plan_tasks({"train": 10, "test": 3}, {"train": 3, "test": 1})
    assert [(t.file, t.start, t.stop) for t in tasks] == [
        ("train-00000-of-00003.tfrecord", 0, 3),
        ("train-00001-of-00003.tfrecord", 3, 6),
        ("train-00002-of-00003.tfrecord", 6, 10),
        ("test-00000-of-00001.tfrecord", 0, 3),
    ]


def test_validation_fraction_zero_gives_train_only(tmp_path):
    schema = convert("digits", str(tmp_path), validation_fraction=0).schema
    assert list(schema.splits) == ["train"] and schema.splits["train"].num_records == 1797


def test_image_storage_is_deterministic_and_flattens_modes():
    from tfspeed.convert.sources import ImageStorage

    buffer = io.BytesIO()
    Image.fromarray(_pixels(9, 7, 4)).save(buffer, "PNG")
    storage = ImageStorage("jpeg", max_side=5)
    out = storage.from_bytes(buffer.getvalue())
    assert out == storage.from_bytes(buffer.getvalue())
    assert (out.height, out.width) == (5, 4)
    image = Image.open(io.BytesIO(out.value))
    assert (image.format, image.mode, image.size) == ("JPEG", "RGB", (4, 5))
