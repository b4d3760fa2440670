"""Damaged shards on real converted data: the pipeline accounts for every lost record and
``tfspeed.verify --repair`` recovers every intact one. Real bytes are flipped, zeroed and cut."""

import glob
import io
import json
import logging
import os
import re
import shutil
import sys

import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tests import forked
from tfspeed import verify
from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.data import integrity, pipeline
from tfspeed.data import schema as schema_lib
from tfspeed.training.run import run

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD = "train-00001-of-00004.tfrecord"
OTHER = "train-00002-of-00004.tfrecord"


def _copy(digits_dir, tmp_path, name="data") -> str:
    return shutil.copytree(digits_dir, tmp_path / name, ignore=shutil.ignore_patterns("cache"))


def _frames(path) -> list[tuple[int, int]]:
    with open(path, "rb") as f:
        return integrity.record_offsets(f.read())


def _damage(path, edit) -> None:
    with open(path, "rb") as f:
        buf = bytearray(f.read())
    buf = edit(buf)
    with open(path, "wb") as f:
        f.write(buf)


def _flip(path, at) -> None:
    def edit(buf):
        buf[at] ^= 0xFF
        return buf

    _damage(path, edit)


def _cut(path, at) -> None:
    _damage(path, lambda buf: buf[:at])


def _count(data_dir, **options) -> int:
    ds = tfspeed.data.build(data_dir, "train", 64, training=False, cache="none", **options)
    return sum(int(y.shape[0]) for _, y in ds)


def _read_records(data_dir) -> list[bytes]:
    config = tfspeed.data.DataConfig(data_dir=data_dir, batch_size=64, cache="none")
    ds = pipeline.build_from_config(config, "train", training=False, until="read")
    return [r.numpy() for r in ds]


def _records(path) -> list[bytes]:
    with open(path, "rb") as f:
        return [r.data for r in integrity.walk(f.read()) if isinstance(r, integrity.Record)]


@pytest.fixture(autouse=True)
def _fresh_report():
    pipeline.reset_corruption_report()
    yield
    pipeline.reset_corruption_report()


def test_flipped_byte_loses_the_rest_of_the_shard_accounted_and_fail_names_it(
    digits_dir, tmp_path, caplog
):
    data = _copy(digits_dir, tmp_path)
    path = os.path.join(data, SHARD)
    frames = _frames(path)
    original = _records(path)
    bad = len(frames) // 2
    _flip(path, frames[bad][0] + integrity.HEADER_BYTES + 3)  # inside record `bad`'s data
    total = schema_lib.read(data).split("train").num_records

    with caplog.at_level(logging.WARNING):
        read = _count(data)
    lost = len(frames) - bad
    assert read == total - lost
    assert pipeline.corruption_report() == {path: lost}
    warnings = [r.getMessage() for r in caplog.records if SHARD in r.getMessage()]
    assert len(warnings) == 1
    assert f"{bad} of {len(frames)} records, {lost} lost" in warnings[0]
    assert f"python -m tfspeed.verify {data} --repair" in warnings[0]
    # Every record before the damage reaches the pipeline, none after it.
    records = set(_read_records(data))
    assert set(original[:bad]) <= records and not records & set(original[bad:])

    with pytest.raises(tf.errors.InvalidArgumentError) as error:
        _count(data, on_corrupt="fail")
    message = pipeline.corruption_error(error.value)
    assert message.startswith(f"tfspeed: shard {path} ended after {bad} of {len(frames)}")
    assert message.endswith(f"`python -m tfspeed.verify {data} --repair`")


def test_cut_inside_a_record_header_is_counted_not_silent(digits_dir, tmp_path):
    data = _copy(digits_dir, tmp_path)
    path = os.path.join(data, OTHER)
    frames = _frames(path)
    kept = len(frames) - 3
    _cut(path, frames[kept][0] + 5)  # TF reads this as a clean end of file
    total = schema_lib.read(data).split("train").num_records

    assert _count(data) == total - 3
    assert pipeline.corruption_report() == {path: 3}


def test_verify_finds_damage_and_repair_recovers_every_intact_record(digits_dir, tmp_path):
    data = _copy(digits_dir, tmp_path)
    flipped, cut = os.path.join(data, SHARD), os.path.join(data, OTHER)
    n_flipped, n_cut = len(_frames(flipped)), len(_frames(cut))
    _flip(flipped, _frames(flipped)[10][0] + integrity.HEADER_BYTES + 1)
    _cut(cut, _frames(cut)[n_cut - 3][0] + 5)
    total = schema_lib.read(data).split("train").num_records

    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    run = forked.run([sys.executable, "-m", "tfspeed.verify", data], cwd=REPO, env=env,
                     timeout=120)
    assert run.returncode == 1, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 3 and run.stderr == ""
    assert lines[0].startswith(f"DAMAGED {SHARD}") and "1 lost" in lines[0]
    assert lines[1].startswith(f"DAMAGED {OTHER}") and "3 lost" in lines[1]
    assert "2 damaged, 4 records lost" in lines[2] and "--repair" in lines[2]

    out = io.StringIO()
    assert verify.verify(data, repair=True, out=out) == 0
    assert len(_records(flipped)) == n_flipped - 1 and len(_records(cut)) == n_cut - 3
    for shard in (SHARD, OTHER):
        assert os.path.getsize(os.path.join(data, "quarantine", f"{shard}.bad")) > 0
    with open(os.path.join(data, "quarantine", f"{SHARD}.bad.json")) as f:
        assert [s["reason"] for s in json.load(f)["spans"]] == ["bad data crc"]
    schema = schema_lib.read(data)
    assert schema.split("train").num_records == total - 4
    with open(os.path.join(data, "schema.json")) as f:
        assert json.load(f)["splits"]["train"]["repairs"] == [
            {"shard": SHARD, "records_lost": 1},
            {"shard": OTHER, "records_lost": 3},
        ]

    out = io.StringIO()
    assert verify.verify(data, out=out) == 0  # idempotent: nothing left to find
    assert out.getvalue().splitlines() == ["5 shards checked, 0 damaged, 0 records lost"]
    assert _count(data) == total - 4
    assert pipeline.corruption_report() == {}


def _random_damage(rng, buf: bytearray) -> tuple[bytearray, int]:
    """1-3 random faults (flip, zeroed run, truncation); returns the damaged bytes, faults."""
    faults = int(rng.integers(1, 4))
    for _ in range(faults):
        kind = rng.choice(["flip", "zero", "cut"])
        at = int(rng.integers(0, len(buf)))
        if kind == "flip":
            buf[at] ^= int(rng.integers(1, 256))
        elif kind == "zero":
            end = min(len(buf), at + int(rng.integers(1, 64)))
            buf[at:end] = bytes(end - at)
        else:
            buf = buf[:at]
    return buf, faults


def _untouched(original: bytes, damaged: bytes, frames) -> list[int]:
    """Indices of records whose bytes are all still there, unchanged."""
    return [
        i
        for i, (offset, size) in enumerate(frames)
        if original[offset : offset + size] == damaged[offset : offset + size]
    ]


def test_random_damage_repair_recovers_exactly_the_untouched_records(digits_dir, tmp_path):
    rng = np.random.default_rng(20240611)
    with open(os.path.join(digits_dir, SHARD), "rb") as f:
        original = f.read()
    frames = _frames(os.path.join(digits_dir, SHARD))
    datas = _records(os.path.join(digits_dir, SHARD))
    total = schema_lib.read(digits_dir).split("train").num_records
    tally = {"rounds": 0, "faults": 0, "recovered": 0, "lost": 0, "reported": 0}
    for round_ in range(10):
        data = _copy(digits_dir, tmp_path, f"round{round_}")
        path = os.path.join(data, SHARD)
        damaged, faults = _random_damage(rng, bytearray(original))
        with open(path, "wb") as f:
            f.write(damaged)
        intact = _untouched(original, bytes(damaged), frames)
        leading = next(i for i in range(len(frames) + 1) if i not in intact)

        pipeline.reset_corruption_report()
        read = _count(data)
        reported = pipeline.corruption_report().get(path, 0)
        assert read + reported == total  # nothing silently dropped
        assert reported == len(frames) - leading  # TF stops at the first damaged record

        expect_damage = len(intact) < len(frames)
        assert verify.verify(data, out=io.StringIO()) == int(expect_damage)
        assert verify.verify(data, repair=True, out=io.StringIO()) == 0
        assert _records(path) == [datas[i] for i in intact]
        assert verify.verify(data, out=io.StringIO()) == 0
        assert schema_lib.read(data).split("train").num_records == total - len(frames) + len(intact)
        tally["rounds"] += 1
        tally["faults"] += faults
        tally["recovered"] += len(intact)
        tally["lost"] += len(frames) - len(intact)
        tally["reported"] += reported
    print(f"fuzz: {tally}")


# ---------------------------------------------------------------- the disk cache


def _cache_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("disk cache")]


@pytest.mark.parametrize("damage", ["flipped byte", "truncated"])
def test_a_damaged_disk_cache_is_rebuilt_with_one_warning(digits_dir, tmp_path, caplog, damage):
    """The cache is derived data: damaged (here before its first use, so it is read through
    TF), it is deleted, written again from the shards, and every record still arrives."""
    options = dict(cache="disk", cache_dir=str(tmp_path), deterministic=True)

    def images():
        ds = tfspeed.data.build(digits_dir, "validation", 64, **options)
        return np.concatenate([x.numpy() for x, _ in ds])

    written = images()
    [data] = glob.glob(str(tmp_path / "validation-*.data-*"))
    cache = data.split(".data-")[0]
    if damage == "truncated":
        _cut(data, os.path.getsize(data) // 2)
    else:
        _flip(data, os.path.getsize(data) // 2)
    with caplog.at_level(logging.WARNING):
        rebuilt = images()
    reason = {"flipped byte": ".*Checksum does not match.*", "truncated": ".+"}[damage]
    assert [re.fullmatch(rf"disk cache {re.escape(cache)} is damaged \(reading it failed: "
                         rf"{reason}\); deleted it, this run writes it again from the shards",
                         w) is not None for w in _cache_warnings(caplog)] == [True]
    np.testing.assert_array_equal(rebuilt, written)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        np.testing.assert_array_equal(images(), written)  # the rebuilt one, read whole
    assert not _cache_warnings(caplog) and os.path.exists(cache + ".verified.json")


def test_a_run_goes_on_past_damaged_disk_caches_of_train_and_eval(digits_dir, tmp_path,
                                                                   caplog):
    """A run finishes both caches and records their checksums; a byte flipped in each, the
    next run says so once per cache, rebuilds them and trains and evaluates the same."""
    data_dir = str(_copy(digits_dir, tmp_path))

    def run_once(model_dir):
        return run(Config(
            data=DataConfig(data_dir=data_dir, batch_size=64, cache="disk", shuffle=False,
                            input_placement="host"),  # the train split read through tf.data
            model=ModelConfig(name="mlp", width=16),
            runtime=RuntimeConfig(strategy="default", precision="float32", xla="off"),
            train=TrainConfig(epochs=2, steps_per_execution=1, log_every=50),
            model_dir=str(tmp_path / model_dir)).validate())

    first = run_once("first")
    caches = sorted(p.removesuffix(".index")
                    for p in glob.glob(os.path.join(data_dir, "cache", "*.index")))
    assert [os.path.basename(c).split("-")[0] for c in caches] == ["train", "validation"]
    for data in (cache + ".data-00000-of-00001" for cache in caches):
        _flip(data, os.path.getsize(data) // 2)
    with caplog.at_level(logging.WARNING):
        second = run_once("second")
    warnings = sorted(_cache_warnings(caplog))
    assert len(warnings) == 2, warnings
    for cache, warning in zip(caches, warnings, strict=True):
        # Found by the checksums the first run recorded, without reading it through TF.
        assert warning.startswith(f"disk cache {cache} is damaged ({os.path.basename(cache)}"
                                  ".data-00000-of-00001 no longer has the size and crc32c")
        assert os.path.exists(cache + ".verified.json")  # rebuilt and recorded again
    assert second["optimizer_updates"] == first["optimizer_updates"]
    assert second["eval_loss"] == pytest.approx(first["eval_loss"], abs=1e-6)


def test_a_damaged_disk_cache_of_a_live_writer_is_left_to_it(digits_dir, tmp_path, caplog):
    """The process that wrote a cache may still be reading it: it is not deleted under it;
    this run reads the shards instead."""
    ds = tfspeed.data.build(digits_dir, "validation", 64, cache="disk", cache_dir=str(tmp_path))
    expected = sum(int(y.shape[0]) for _, y in ds)
    [index] = glob.glob(str(tmp_path / "validation-*.index"))
    cache = index.removesuffix(".index")
    schema_lib.write_json_atomic(cache + ".owner", {"host": os.uname().nodename,
                                                    "pid": os.getppid()})
    _cut(cache + ".data-00000-of-00001", 10)
    with caplog.at_level(logging.WARNING):
        ds = tfspeed.data.build(digits_dir, "validation", 64, cache="disk",
                                cache_dir=str(tmp_path))
        assert sum(int(y.shape[0]) for _, y in ds) == expected
    [warning] = _cache_warnings(caplog)
    assert warning.startswith(f"disk cache {cache} is damaged (reading it failed: ")
    assert warning.endswith(f"but pid {os.getppid()}, which wrote it, still runs: this run "
                            "reads without it")
    assert os.path.getsize(cache + ".data-00000-of-00001") == 10  # untouched
