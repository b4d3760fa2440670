"""How the converter writes records without TensorFlow: its ``tf.train.Example`` bytes equal
TF's on every feature kind, and a conversion with workers runs where TF cannot be imported."""

import os
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from tests.conftest import REPO as REPO_PATH
from tfspeed.convert import convert, example
from tfspeed.data.schema import Feature

REPO = str(REPO_PATH)

FEATURES = {
    "image": Feature("image", "uint8", (None, None, 3), "jpeg"),
    "png": Feature("png", "uint8", (None, None, 1), "png"),
    "raw": Feature("raw", "uint8", (2, 3, 1), "raw"),
    "vector": Feature("vector", "float32", (2, 3), "float"),
    "label": Feature("label", "int64", (), "int"),
    "ids": Feature("ids", "int64", (4,), "int"),
    "empty": Feature("empty", "float32", (0,), "float"),
}


def _tf_example(values) -> bytes:
    """The same record built with TensorFlow's own classes."""

    def feature(name, value):
        f = FEATURES[name]
        if f.encoding in ("jpeg", "png"):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value]))
        array = np.asarray(value, f.dtype)
        if f.encoding == "raw":
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[array.tobytes()]))
        if f.encoding == "float":
            return tf.train.Feature(float_list=tf.train.FloatList(value=array.ravel()))
        return tf.train.Feature(int64_list=tf.train.Int64List(value=array.ravel()))

    features = {name: feature(name, v) for name, v in values.items()}
    message = tf.train.Example(features=tf.train.Features(feature=features))
    return message.SerializeToString(deterministic=True)


@pytest.mark.parametrize("seed", range(3))
def test_example_bytes_equal_tensorflows_on_every_feature_kind(seed):
    rng = np.random.default_rng(seed)
    values = {
        "image": rng.bytes(int(rng.integers(0, 300))),  # > 127 bytes: a 2-byte length varint
        "png": b"",
        "raw": rng.integers(0, 256, (2, 3, 1), dtype=np.uint8),
        # negative zero, a subnormal, infinities and NaN keep their bit patterns
        "vector": np.array([[-0.0, 1e-40, np.inf], [-np.inf, np.nan, rng.normal()]], np.float32),
        "label": int(rng.integers(0, 10)),
        "ids": [-1, 2**63 - 1, -(2**63), int(rng.integers(-1000, 1000))],  # 10-byte varints
        "empty": np.zeros(0, np.float32),
    }
    ours = example.serialize(FEATURES, values)
    assert ours == _tf_example(values)
    # TF parses it back to the same values.
    parsed = tf.train.Example.FromString(ours).features.feature
    assert parsed["ids"].int64_list.value == values["ids"]
    subset = {k: values[k] for k in ("label", "image")}  # map order must not matter
    assert example.serialize(FEATURES, subset) == _tf_example(subset)


def test_a_value_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="'ids': value of shape \\(3,\\), schema says \\(4,\\)"):
        example.serialize(FEATURES, {"ids": [1, 2, 3]})


def test_conversion_with_workers_never_imports_tensorflow(tmp_path):
    """The parent and its spawned workers run where `import tensorflow` fails."""
    poison = tmp_path / "poison" / "tensorflow"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('the converter imported TensorFlow')\n")
    out = tmp_path / "spawned"
    code = (
        "import sys; from tfspeed.convert import convert\n"
        f"convert('digits', {str(out)!r}, shards=3, workers=2, image_format='png')\n"
        "print('tensorflow' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison.parent), REPO])}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False"]
    here = convert("digits", str(tmp_path / "here"), shards=3, workers=1, image_format="png")
    for split in here.schema.splits.values():  # the same bytes as TF-free spawned workers wrote
        for shard in split.shards:
            data = (out / shard.file).read_bytes()
            assert data == (tmp_path / "here" / shard.file).read_bytes()
            assert sum(1 for _ in tf.data.TFRecordDataset(str(out / shard.file))) > 0


def test_a_failing_shard_stops_the_writers_and_leaves_no_temporary_file(tmp_path):
    from tfspeed.convert import pool
    from tfspeed.convert.sources import ArrayChunk
    from tfspeed.convert.writer import ShardTask
    from tfspeed.data.schema import Schema

    features = {"ids": FEATURES["ids"], "label": FEATURES["label"]}
    template = Schema(features=features, inputs="ids", label="label", class_names=(), splits={})
    tasks = [ShardTask("train", f"train-{i}.tfrecord", i, i + 1) for i in range(6)]

    def make_chunk(split, start, stop):  # 3 ids where the schema says 4: every shard fails
        return ArrayChunk({"ids": np.zeros((1, 3), np.int64), "label": np.zeros(1, np.int64)})

    written = []
    with pytest.raises(ValueError, match="schema says"):
        pool.write_shards(
            str(tmp_path), tasks, make_chunk, template, workers=2, on_result=written.append
        )
    assert written == [] and not [n for n in os.listdir(tmp_path) if n.endswith(".tfrecord")]
    deadline = time.monotonic() + 10  # a spawned writer may still be removing its temporary file
    while os.listdir(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert os.listdir(tmp_path) == []
