"""The pipeline builder on datasets written by the real converter."""

import dataclasses
import glob
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tfspeed.data
from tfspeed.config import DataConfig
from tfspeed.data import inputs, ops, pipeline
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError


def _all(ds):
    xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in ds), strict=True)
    return np.concatenate(xs), np.concatenate(ys)


def test_eval_split_yields_every_record_once_with_source_values(digits_dir):
    schema = schema_lib.read(digits_dir)
    x, y = _all(tfspeed.data.build(digits_dir, "validation", 64))
    assert len(x) == schema.split("validation").num_records
    assert x.shape[1:] == (8, 8, 1) and x.dtype == np.float32 and y.dtype == np.int32
    # Every example is one of the real digits with its own label (pixels scaled to [0, 1]).
    digits = load_digits()
    source = {np.round(img * 255 / 16).astype(np.uint8).tobytes(): label
              for img, label in zip(digits.images, digits.target, strict=True)}
    for image, label in zip(x, y, strict=True):
        key = np.round(image[..., 0] * 255).astype(np.uint8).tobytes()
        assert source[key] == label


def test_training_batches_are_full_shuffled_and_repeat(digits_dir):
    num_train = schema_lib.read(digits_dir).split("train").num_records
    ds = tfspeed.data.build(digits_dir, "train", 100, training=True, seed=3)
    assert ds.element_spec[0].shape.as_list() == [100, 8, 8, 1]
    batches = num_train // 100 + 3  # more than one epoch: the dataset must repeat
    labels = [y.numpy() for _, y in ds.take(batches)]
    assert len(labels) == batches
    eval_labels = _all(tfspeed.data.build(digits_dir, "train", 100))[1]
    assert not np.array_equal(np.concatenate(labels)[:num_train], eval_labels)


def test_deterministic_runs_match_and_augment_changes_pixels(digits_dir):
    options = dict(training=True, deterministic=True, seed=5, augment=("crop",), cache="none")
    first = [x.numpy() for x, _ in tfspeed.data.build(digits_dir, "train", 32, **options).take(3)]
    again = [x.numpy() for x, _ in tfspeed.data.build(digits_dir, "train", 32, **options).take(3)]
    np.testing.assert_array_equal(first, again)
    plain = dict(options, augment=())
    unaugmented = [x.numpy() for x, _ in tfspeed.data.build(digits_dir, "train", 32, **plain).take(3)]
    assert not np.array_equal(first, unaugmented)


def test_parse_modes_give_the_same_elements(digits_dir, tabular_dir, raw_images_dir):
    for data_dir in (digits_dir, tabular_dir, raw_images_dir):
        single = _all(tfspeed.data.build(data_dir, "validation", 16, parse="single"))
        batched = _all(tfspeed.data.build(data_dir, "validation", 16, parse="batched"))
        np.testing.assert_array_equal(single[0], batched[0])
        np.testing.assert_array_equal(single[1], batched[1])


def test_raw_images_come_back_as_stored(raw_images_dir, tmp_path):
    x, y = _all(tfspeed.data.build(raw_images_dir, "validation", 8))
    assert x.shape == (20, 6, 6, 3) and x.dtype == np.float32
    source = np.load(os.path.join(os.path.dirname(raw_images_dir), "data.npz"))
    by_bytes = {img.tobytes(): label for img, label in zip(source["x"], source["y"], strict=True)}
    for image, label in zip(x, y, strict=True):
        assert by_bytes[np.round(image * 255).astype(np.uint8).tobytes()] == label


def test_tabular_features_are_standardized(tabular_dir):
    x, y = _all(tfspeed.data.build(tabular_dir, "train", 50))
    assert x.shape[1:] == (5,)
    np.testing.assert_allclose(x.mean(0), 0, atol=1e-4)
    np.testing.assert_allclose(x.std(0), 1, atol=1e-3)
    assert set(np.unique(y)) == {0, 1, 2}


def test_images_of_varying_size_need_image_size(photos_dir):
    with pytest.raises(UsageError, match="--image_size"):
        tfspeed.data.build(photos_dir, "train", 4)
    x, _ = _all(tfspeed.data.build(photos_dir, "validation", 4, image_size=16))
    assert x.shape[1:] == (16, 16, 3) and x.min() >= 0 and x.max() <= 1


@pytest.mark.parametrize("shards_in_split", ["train", "validation"])  # 4 shards vs 1 shard
def test_input_contexts_split_the_data_disjointly(digits_dir, shards_in_split):
    """Two pipelines read disjoint parts whose union is the whole split (by file or record)."""
    parts = []
    for pipeline_id in range(2):
        context = tf.distribute.InputContext(2, pipeline_id, 2)
        ds = tfspeed.data.build(digits_dir, shards_in_split, 2, input_context=context)
        assert ds.element_spec[0].shape.as_list()[0] in (1, None)  # per-replica batch: 2 / 2
        parts.append({img.tobytes() for img in _all(ds)[0]})
    whole = _all(tfspeed.data.build(digits_dir, shards_in_split, 64))[0]
    assert parts[0].isdisjoint(parts[1])
    assert len(parts[0]) + len(parts[1]) == len({img.tobytes() for img in whole})


def test_disk_cache_name_changes_with_source_and_settings(digits_dir, tmp_path):
    schema = schema_lib.read(digits_dir)
    config = DataConfig(data_dir=digits_dir, cache="disk", cache_dir=str(tmp_path))
    base = pipeline.cache_path(config, schema, "train")
    assert base == pipeline.cache_path(config, schema, "train")
    resized = DataConfig(data_dir=digits_dir, cache="disk", cache_dir=str(tmp_path), image_size=6)
    assert pipeline.cache_path(resized, schema, "train") != base
    changed = schema_lib.Schema(**{**schema.__dict__, "fingerprint": "another source"})
    assert pipeline.cache_path(config, changed, "train") != base
    assert pipeline.cache_path(config, schema, "validation") != base


def test_disk_cache_is_written_then_reused(digits_dir, tmp_path):
    options = dict(cache="disk", cache_dir=str(tmp_path))
    first = _all(tfspeed.data.build(digits_dir, "validation", 64, **options))
    assert glob.glob(str(tmp_path / "validation-*.index"))
    again = _all(tfspeed.data.build(digits_dir, "validation", 64, **options))
    np.testing.assert_array_equal(first[0], again[0])


def test_lock_left_by_a_killed_run_does_not_wedge_the_next(digits_dir, tmp_path):
    """A real process is killed while writing the cache; the next run still works."""
    code = (
        "import os, signal, tfspeed.data as d\n"
        f"ds = d.build({digits_dir!r}, 'validation', 8, cache='disk', cache_dir={str(tmp_path)!r})\n"
        "it = iter(ds); next(it)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -9
    assert glob.glob(str(tmp_path / "*.lockfile")), "the killed run should leave its lock"
    x, _ = _all(tfspeed.data.build(digits_dir, "validation", 64, cache="disk",
                                   cache_dir=str(tmp_path)))
    assert len(x) == schema_lib.read(digits_dir).split("validation").num_records
    assert glob.glob(str(tmp_path / "validation-*.index"))


def test_cache_being_written_by_a_live_process_is_left_alone(digits_dir, tmp_path):
    config = DataConfig(data_dir=digits_dir, cache="disk", cache_dir=str(tmp_path))
    path = pipeline.cache_path(config, schema_lib.read(digits_dir), "validation")
    schema_lib.write_json_atomic(path + ".owner", {"host": os.uname().nodename, "pid": os.getppid()})
    lock = path + "_0.lockfile"
    open(lock, "w").close()
    x, _ = _all(tfspeed.data.build(digits_dir, "validation", 64, cache="disk",
                                   cache_dir=str(tmp_path)))
    assert len(x) == schema_lib.read(digits_dir).split("validation").num_records
    assert os.path.exists(lock), "a live writer's lock must not be removed"


def test_bad_settings_are_one_line_usage_errors(digits_dir, tmp_path):
    with pytest.raises(UsageError, match="--cache='ram'"):
        tfspeed.data.build(digits_dir, "train", 8, cache="ram")
    with pytest.raises(UsageError, match="--augment='rotate'"):
        tfspeed.data.build(digits_dir, "train", 8, augment=("rotate",))
    with pytest.raises(UsageError, match="no split 'test'"):
        tfspeed.data.build(digits_dir, "test", 8)
    with pytest.raises(UsageError, match="schema.json not found"):
        tfspeed.data.build(str(tmp_path), "train", 8)


def test_cache_auto_fits_the_split_to_the_ram_budget(digits_dir):
    """The digits' train split cached takes ~0.5 MB (1617 records of 8x8 uint8 + overhead)."""
    from tfspeed.data import plan

    schema = schema_lib.read(digits_dir)

    def choose(budget_mb, cache="auto", training=True, passes=None):
        config = DataConfig(data_dir=digits_dir, cache=cache, ram_budget_mb=budget_mb)
        return plan.plan_cache(config, schema, "train", training, passes)

    roomy = choose(64)
    assert roomy.mode == "memory" and 0.4 < roomy.estimate_mb < 0.6
    assert roomy.reason.startswith("auto: 'train' cached takes ~0 MB, the budget is 64 MB")
    assert choose(1).mode == "memory" and choose(0).budget_mb > 1000  # half of what is free
    tight = DataConfig(data_dir=digits_dir, ram_budget_mb=1, image_size=64)  # ~7 MB at 64x64
    assert plan.plan_cache(tight, schema, "train", True).mode == "disk"
    assert plan.plan_cache(tight, schema, "train", True, passes=1).mode == "none"
    assert choose(64, training=False).mode == "none"  # an eval split is read once
    with pytest.raises(UsageError, match=r"--cache=memory cannot hold the data: 'train' "
                                         r"cached takes ~7 MB, the budget is 1 MB.*--cache=disk"):
        plan.plan_cache(dataclasses.replace(tight, cache="memory"), schema, "train", True)
    # An explicit mode that fits is kept as given.
    assert choose(64, cache="disk").mode == "disk" and choose(64, cache="none").mode == "none"


def test_uint8_batches_are_the_float_batches_times_255(digits_dir, photos_dir):
    for data_dir, options in ((digits_dir, {}), (photos_dir, {"image_size": 12})):
        floats = _all(tfspeed.data.build(data_dir, "validation", 16, **options))
        uint8 = _all(tfspeed.data.build(data_dir, "validation", 16, image_dtype="uint8",
                                        **options))
        assert uint8[0].dtype == np.uint8 and floats[0].dtype == np.float32
        np.testing.assert_allclose(uint8[0] / 255, floats[0], atol=0.5 / 255 + 1e-6)
        np.testing.assert_array_equal(uint8[1], floats[1])


def test_cold_and_cached_pipelines_give_the_same_pixels(photos_dir, tmp_path):
    """No cache keeps float32 from the resize; a cache stores uint8: within rounding."""
    options = dict(image_size=12, deterministic=True, shuffle=False)
    cold = _all(tfspeed.data.build(photos_dir, "train", 8, cache="none", **options))
    cached = _all(tfspeed.data.build(photos_dir, "train", 8, cache="memory", **options))
    np.testing.assert_allclose(cold[0], cached[0], atol=0.5 / 255 + 1e-6)
    np.testing.assert_array_equal(cold[1], cached[1])


def test_mixed_size_jpegs_are_each_decoded_at_their_own_ratio(photos_dir):
    """The photos are 20-40 px a side: at 13 px the smallest allow no ratio, those with both
    sides >= 26 allow 2 (none allows 4). Every image comes out as decode_jpeg at its own
    ratio, resized."""
    schema = schema_lib.read(photos_dir)
    parse_one = ops.make_group_parser(schema)[1]
    records = tf.data.TFRecordDataset(schema.shard_paths(photos_dir, "validation"))
    expected, ratios = [], []
    for record in records:
        jpeg = parse_one(record)["inputs"]
        short_side = int(min(tf.io.extract_jpeg_shape(jpeg)[:2]))
        ratios.append(2 if short_side >= 26 else 1)
        image = tf.io.decode_jpeg(jpeg, channels=3, ratio=ratios[-1])
        expected.append(tf.image.resize(image, [13, 13]).numpy() / 255)
    assert set(ratios) == {1, 2}
    got = _all(tfspeed.data.build(photos_dir, "validation", 64, image_size=13, cache="none",
                                  deterministic=True, shuffle=False))
    np.testing.assert_allclose(got[0], np.stack(expected), atol=1e-6)


def test_random_resized_crop_trains_from_encoded_images(photos_dir):
    ds = tfspeed.data.build(photos_dir, "train", 4, training=True, image_size=16,
                            augment=("random_resized_crop", "flip"), cache="memory", seed=1)
    x, y = next(iter(ds))
    assert x.shape == (4, 16, 16, 3) and 0 <= float(tf.reduce_min(x)) <= float(
        tf.reduce_max(x)) <= 1
    with pytest.raises(UsageError, match="random_resized_crop resizes its crop to --image_size"):
        tfspeed.data.build(photos_dir, "train", 4, training=True,
                           augment=("random_resized_crop",))


def test_groups_of_big_records_hold_about_two_megabytes():
    from tfspeed.data.reader import GROUP, MIN_GROUP, group_size

    assert group_size(224 * 224 * 3) == 13  # raw 224 px photos: 150 KB each
    assert group_size(31_000) == GROUP  # JPEGs: the most records per group
    assert group_size(64) == GROUP  # the digits
    assert group_size(50 << 20) == MIN_GROUP  # huge records: still a few per group


def test_finite_splits_have_a_known_cardinality_and_keras_fit_does_not_run_out(digits_dir):
    """180 validation records in batches of 64: 3 batches, known before reading (Keras then
    does not end each validation pass on OutOfRange with "Your input ran out of data")."""
    import warnings

    import keras

    val = tfspeed.data.build(digits_dir, "validation", 64)
    assert int(val.cardinality()) == 3 == len(list(val))
    halves = [tfspeed.data.build(digits_dir, "validation", 16,
                                 input_context=tf.distribute.InputContext(2, i, 2))
              for i in range(2)]  # one shard, sharded by record: 90 each, per-replica 8
    assert [int(ds.cardinality()) for ds in halves] == [12, 12] == [len(list(ds)) for ds in halves]
    train = tfspeed.data.build(digits_dir, "train", 64, training=True)
    assert int(train.cardinality()) == tf.data.INFINITE_CARDINALITY
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(train, steps_per_epoch=2, epochs=2, validation_data=val, verbose=0)
    assert not [w for w in caught if "ran out of data" in str(w.message)]
    assert len(history.history["val_loss"]) == 2


def test_a_damaged_validation_shard_ends_the_pass_early_without_an_error(digits_dir, tmp_path):
    """A flipped byte loses the rest of the shard (counted by the reader): the pass has
    fewer batches than declared and ends cleanly, not with a cardinality error."""
    import shutil

    from tfspeed.data import integrity

    data = shutil.copytree(digits_dir, tmp_path / "data", ignore=shutil.ignore_patterns("cache"))
    path = schema_lib.read(data).shard_paths(data, "validation")[0]
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    frames = integrity.record_offsets(bytes(buf))
    buf[frames[100][0] + integrity.HEADER_BYTES + 3] ^= 0xFF  # inside record 100's data
    with open(path, "wb") as f:
        f.write(buf)
    pipeline.reset_corruption_report()
    try:
        val = tfspeed.data.build(data, "validation", 64, cache="none")
        x, _ = _all(val)
        assert int(val.cardinality()) == 3 and len(list(val)) == 2  # 100 records: 2 batches
        assert len(x) == 100 and pipeline.corruption_report() == {path: 160}  # 2 passes
    finally:
        pipeline.reset_corruption_report()


def test_upscaling_every_stored_image_warns_once_per_split(photos_dir, digits_dir, caplog):
    """The photos are stored at 20-40 px a side, the digits at 8 px."""
    import logging

    shortest, longest = schema_lib.read(photos_dir).split("validation").image_sides
    assert longest == 40 and shortest < 32
    inputs._upscale_warned.clear()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            tfspeed.data.build(photos_dir, "validation", 4, image_size=48)
        tfspeed.data.build(photos_dir, "validation", 4, image_size=32)  # 40 px ones: no
        tfspeed.data.build(digits_dir, "validation", 4, image_size=28)
    lines = [r.getMessage() for r in caplog.records if "upscales" in r.getMessage()]
    assert lines == [
        f"--image_size=48 upscales every image of split 'validation' of {photos_dir}, stored "
        f"at {shortest}-40 px a side (1.4× the pixels of the largest, no new detail): convert with "
        "--image_size=48, or lower --image_size to 40",
        f"--image_size=28 upscales every image of split 'validation' of {digits_dir}, stored "
        "at 8 px a side (12× the pixels of the largest, no new detail): convert with "
        "--image_size=28, or lower --image_size to 8",
    ]
