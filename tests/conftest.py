"""Shared, session-scoped fixtures: datasets written once by the real converter."""

import contextlib
import os
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# XLA's CPU backend compiles with LLVM at -O0 and without its expensive passes: the same
# programs, within every test's tolerance, compiled in about two thirds of the CPU time
# (the suite's JAX runs and XLA steps are mostly compile). A user's XLA_FLAGS wins, except
# in the JAX runs (jax_runs.env) and the XLA dump test, which set their own.
XLA_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ.setdefault("XLA_FLAGS", XLA_FLAGS)

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402
from PIL import Image  # noqa: E402

import tfspeed  # noqa: E402, F401  -- before any tensor, as users do: it picks the host allocator

REPO = Path(__file__).resolve().parents[1]

# Two logical CPU devices, so MirroredStrategy runs with 2 replicas; this has to happen
# before any op runs in the test process.
_cpus = tf.config.list_physical_devices("CPU")
tf.config.set_logical_device_configuration(_cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2)
# Start the runtime now: otherwise the first driver run in this process would fix its threads
# (--intra_op_threads=auto) for every test after it.
tf.config.list_logical_devices("CPU")


@contextlib.contextmanager
def importable(folder, module: str, source: str):
    """``source`` written to ``folder/module.py``, importable as ``module`` meanwhile."""
    (folder / f"{module}.py").write_text(textwrap.dedent(source))
    sys.path.insert(0, str(folder))
    try:
        yield folder
    finally:
        sys.path.remove(str(folder))


def write_photos(root: Path, classes: int = 3, per_class: int = 12, seed: int = 0) -> Path:
    """Small JPEGs of varying size (20-40 px), one folder per class."""
    rng = np.random.default_rng(seed)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            h, w = rng.integers(20, 41, size=2)
            pixels = rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(folder / f"img_{i:03d}.jpg", "JPEG", quality=90)
    return root


@pytest.fixture(scope="session")
def digits_dir(tmp_path_factory) -> str:
    """The digits demo, converted into 4 train shards (and 1 validation shard)."""
    from tfspeed.convert import convert

    out = tmp_path_factory.mktemp("digits") / "data"
    convert("digits", str(out), shards=4)
    return str(out)


@pytest.fixture(scope="session")
def photos_dir(tmp_path_factory) -> str:
    """A converted folder of 36 JPEGs of varying size in 3 classes."""
    from tfspeed.convert import convert

    root = write_photos(tmp_path_factory.mktemp("photos") / "src")
    out = root.parent / "data"
    convert(f"imagefolder:{root}", str(out), shards=3, validation_fraction=0.25)
    return str(out)


@pytest.fixture(scope="session")
def tabular_dir(tmp_path_factory) -> str:
    """A converted .npz of 300 float feature vectors with 3 classes."""
    from tfspeed.convert import convert

    rng = np.random.default_rng(1)
    y = rng.integers(0, 3, size=300)
    x = (rng.normal(size=(300, 5)) * 4 + 10 + y[:, None]).astype(np.float32)
    root = tmp_path_factory.mktemp("tabular")
    np.savez(root / "data.npz", x=x, y=y)
    out = root / "data"
    convert(f"npz:{root / 'data.npz'}", str(out), shards=2)
    return str(out)


@pytest.fixture(scope="session")
def raw_images_dir(tmp_path_factory) -> str:
    """A converted .npz of 80 uint8 6x6 RGB images (stored raw) with 4 classes."""
    from tfspeed.convert import convert

    rng = np.random.default_rng(2)
    root = tmp_path_factory.mktemp("raw")
    np.savez(root / "data.npz", x=rng.integers(0, 256, size=(80, 6, 6, 3), dtype=np.uint8),
             y=np.arange(80) % 4)
    out = root / "data"
    convert(f"npz:{root / 'data.npz'}", str(out), shards=2, validation_fraction=0.25)
    return str(out)


# The modules that hold the suite's longest runs (measured with --durations: real tunes,
# both backends side by side, the text driver's compiles), started first. pytest-xdist hands
# each worker whole files in collection order; the slowest last (tuning/ sorts last) left
# one core idle while the other ran them. Longest first shortens that tail.
LONGEST_FIRST = (
    "tests/tuning/test_tune_text.py", "tests/training/test_jax_jobs.py",
    "tests/training/test_text_driver.py", "tests/test_tune.py", "tests/training/test_jax.py",
    "tests/test_data_service.py", "tests/attach/test_scripts.py",
    "tests/data/test_text_long.py", "tests/test_multi_worker.py",
    "tests/diagnosis/test_diagnose_text.py", "tests/faults/test_training_faults.py",
    "tests/attach/test_run_adapted.py", "tests/test_defaults_tier.py")


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(autouse=True)
def _float32_policy():
    """Runs set a global Keras precision policy; every test starts from float32."""
    import keras

    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.fixture(scope="session")
def regression_dir(tmp_path_factory) -> str:
    """scikit-learn's diabetes table (442 real patients, a float target) converted from CSV
    with --task=regression."""
    from sklearn.datasets import load_diabetes

    from tfspeed.convert import convert

    root = tmp_path_factory.mktemp("diabetes")
    data = load_diabetes()
    columns = [c.replace(" ", "_") for c in data.feature_names]
    np.savetxt(root / "diabetes.csv", np.column_stack([data.data, data.target]), delimiter=",",
               header=",".join([*columns, "target"]), comments="", fmt="%.6g")
    out = root / "data"
    convert(f"csv:{root / 'diabetes.csv'}", str(out), label_column="target", task="regression",
            shards=2)
    return str(out)


USER_OBJECTIVES = '''
import keras


def halved_mse(labels, outputs):
    """A user's own loss: one value per example."""
    return keras.ops.mean(keras.ops.square(labels - outputs), axis=-1) / 2


def doubled_mae(labels, outputs):
    return 2 * keras.ops.mean(keras.ops.abs(labels - outputs), axis=-1)
'''


@pytest.fixture(scope="session")
def user_objectives(tmp_path_factory) -> str:
    """A module of the user's own loss and metric, importable here and in child processes
    (PYTHONPATH), as from a user's working directory."""
    folder = tmp_path_factory.mktemp("user_objectives")
    with importable(folder, "tfspeed_user_objectives", USER_OBJECTIVES):
        old = os.environ.get("PYTHONPATH")
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(folder), old) if p)
        yield "tfspeed_user_objectives"
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def _convert_text(out, *extra) -> str:
    import subprocess
    import sys

    subprocess.run([sys.executable, str(REPO / "scripts" / "to_tfrecord.py"),
                    "--source=pystdlib:json,logging", f"--output={out}", "--tokenizer=bpe:300",
                    "--max_length=64", "--long=split", *extra], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="session")
def text_dirs(tmp_path_factory) -> dict[str, str]:
    """Python's json and logging sources (real code) converted by the converter's command
    line with a 300-id BPE: by package (classification) and for causal language modelling."""
    root = tmp_path_factory.mktemp("text")
    return {"classification": _convert_text(root / "cls"),
            "lm": _convert_text(root / "lm", "--task=lm")}


@pytest.fixture(scope="session")
def short_texts(tmp_path_factory) -> str:
    """Short human-written prose: the docstrings of Python's tkinter, multiprocessing and
    importlib packages (the built-in ``pydocstrings`` corpus), classified by package, with
    a 2,000-id BPE: 1,167 train texts of median 19 tokens (mean 36, p90 77, max 791).
    Unlike the code of ``text_dirs``: most under 40 tokens, a few of hundreds, where padding
    and attention weigh differently."""
    from tfspeed.convert import convert
    from tfspeed.convert.sources.base import TextOptions

    out = tmp_path_factory.mktemp("short_texts") / "data"
    convert("pydocstrings:tkinter,multiprocessing,importlib", str(out), shards=4,
            text=TextOptions(tokenizer="bpe:2000"))
    return str(out)


# ---------------------------------------------------------------- text conversions


def paragraphs() -> list[str]:
    """Real English text that ships with Python: the language reference's paragraphs."""
    from pydoc_data.topics import topics

    found = []
    for name in sorted(topics):
        found += [p.strip() for p in topics[name].split("\n\n") if len(p.strip()) > 40]
    return found


def converter_cli(*args: str):
    """``scripts/to_tfrecord.py *args --noprogress`` in a process of its own (completed)."""
    import subprocess

    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    return subprocess.run([sys.executable, str(REPO / "scripts" / "to_tfrecord.py"), *args,
                           "--noprogress"], capture_output=True, text=True, env=env, timeout=120)


def token_records(out: str, split: str = "train") -> list[dict]:
    """The records of a split, parsed by tf.data with the schema's spec (RaggedFeature)."""
    from tfspeed.data import schema as schema_lib

    schema = schema_lib.read(out)
    ds = tf.data.TFRecordDataset(schema.shard_paths(out, split))
    ds = ds.map(lambda x: tf.io.parse_single_example(x, schema.parse_spec()))
    return [{k: v.numpy() for k, v in r.items()} for r in ds]
