"""One accelerator fed from real photos and real text: the ceilings, the TF guide, tfspeed.

    python benchmarks/accelerator.py [--models=resnet50,mobilenetv2] [--batch_size=256]
        [--image_size=224] [--steps=50] [--epochs=2] [--rounds=3] [--images=3000]
        [--text_datasets=pydocs] [--workdir=/tmp/tfspeed-bench-accelerator]

Runs on whatever Keras' backend sees: JAX with CUDA on a GPU host where TF has no GPU
(``KERAS_BACKEND=jax``; TF then only runs tf.data), TF where TF has the GPU, or the CPU
where there is none (shrink everything there: ``--image_size=64 --batch_size=16 --steps=3
--rounds=1 --images=200``). The recipe for the GPU host is in ``benchmarks/README.md``.

Photos: crops of the photographs bundled with scikit-learn and scikit-image
(``tfspeed.bench.make_photos``), converted by the real converter twice: JPEG at rest (the
default) and stored for ``--image_size`` (``--image_format=auto``). Models: Keras
applications (``weights=None``), mixed_bfloat16 where the hardware has it (``--precision``).
Contenders, per model, each in a process of its own, in ``--rounds`` interleaved rounds:

  ceiling_on_device       one uint8 batch already on the device, a compiled step of the
                          same model (a jitted stateless step on JAX, a tf.function on TF,
                          XLA where Keras' fit would use it): the step alone;
  ceiling_repeated        that batch repeated by tf.data (``from_tensors(batch).repeat()``)
                          into ``model.fit``: the step plus fit's feeding, no decode;
  ceiling_repeated_float32  the same batch as float32 into the model without the scaling
                          layer: what 4x the bytes costs (not in the default list);
  guide_float32           the TF guide's file pipeline (read, decode, resize, /255,
                          AUTOTUNE) into ``model.fit``;
  tfspeed_cold_jpeg       ``tfspeed.data.build(..., image_dtype="uint8", cache="none")``
                          from JPEG at rest, ``tfspeed.data.scaling_layer()`` first in the model;
  tfspeed_stored          the same from the shards stored for ``--image_size``.

fit runs one untimed epoch of ``--steps`` steps (compiles, fills buffers), then ``--epochs``
timed epochs; a round's figure is its best timed epoch (images/s; fit syncs at each epoch's
end). The record keeps every round and the median with min-max over rounds.

Text: ``benchmarks/sequences.py`` itself, in a process of its own on the same backend (its
peers are stock Keras ``fit``, its tfspeed contenders ``python -m tfspeed.train``):
``padded_batch`` (the guide's) against tfspeed's bucket and pack, in real tokens/s, on the
converter's built-in corpora (``--text_datasets``). Prints one JSON record (after
``tfspeed.bench.RESULT``) and writes it to ``--results_dir``.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfspeed import bench  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-accelerator",
                               "Photos, shards and text runs.")
_IMAGES = flags.DEFINE_integer("images", 3000, "Photos to cut from the sample photographs.")
_CLASSES = flags.DEFINE_integer("classes", 10, "Class folders (the models' outputs).")
_SIZE = flags.DEFINE_integer("image_size", 224, "Image side the models take.")
_BATCH = flags.DEFINE_integer("batch_size", 256, "Images per step.")
_STEPS = flags.DEFINE_integer("steps", 50, "Steps per epoch (one untimed, then --epochs timed).")
_EPOCHS = flags.DEFINE_integer("epochs", 2, "Timed epochs per contender and round.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds over every contender.")
_MODELS = flags.DEFINE_list("models", ["resnet50", "mobilenetv2"], "Keras applications.")
_CONTENDERS = flags.DEFINE_list(
    "contenders", ["ceiling_on_device", "ceiling_repeated", "guide_float32",
                   "tfspeed_cold_jpeg", "tfspeed_stored"], "Image contenders to run.")
_PRECISION = flags.DEFINE_enum("precision", "auto", ["auto", "float32", "mixed_bfloat16"],
                               "auto: mixed_bfloat16 where the hardware computes in bf16.")
_TEXT = flags.DEFINE_list("text_datasets", ["pydocs"], "benchmarks/sequences.py datasets "
                          "(pystdlib, pydoc_lm, pydocs); empty: no text part.")
_TEXT_CONTENDERS = flags.DEFINE_list(
    "text_contenders", ["guide_padded_batch", "tfspeed_bucket", "tfspeed_pack"],
    "benchmarks/sequences.py contenders.")
_TEXT_FLAGS = flags.DEFINE_list(
    "text_flags", ["--width=256", "--depth=4", "--heads=4", "--batch_size=64", "--epochs=2"],
    "More flags for benchmarks/sequences.py (model size, batch, passes, --items).")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the record's file name.")
_RESULTS = flags.DEFINE_string("results_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the record is written ('' = print only).")
_CONTENDER = flags.DEFINE_string("contender", "", "Internal: run this contender alone.")
_MODEL = flags.DEFINE_string("model", "", "Internal: the contender's model.")

APPLICATIONS = {"resnet50": "ResNet50", "mobilenetv2": "MobileNetV2"}
UINT8 = ("ceiling_on_device", "ceiling_repeated", "tfspeed_cold_jpeg", "tfspeed_stored")


# ------------------------------------------------------------------ data (the parent)
def prepare() -> dict:
    """Photos and their two conversions, once per workdir; returns where they are."""
    root = _WORKDIR.value
    photos = os.path.join(root, f"photos-{_IMAGES.value}-{_CLASSES.value}")
    bench.make_photos(photos, _IMAGES.value, _CLASSES.value)
    out = {"photos": photos,
           "jpeg": os.path.join(root, f"shards-jpeg-{_IMAGES.value}"),
           "stored": os.path.join(root, f"shards-stored{_SIZE.value}-{_IMAGES.value}")}
    for name, extra in (("jpeg", []), ("stored", [f"--image_size={_SIZE.value}",
                                                  "--image_format=auto"])):
        if not os.path.exists(os.path.join(out[name], "schema.json")):
            out[f"{name}_conversion"] = bench.run_converter(f"imagefolder:{photos}", out[name],
                                                            *extra)["summary"]
    return out


# ------------------------------------------------------------------ one contender (a child)
def precision() -> str:
    """``--precision``, auto resolved as tfspeed's runtime would: bf16 where the backend's
    hardware computes in it (GPU compute capability >= 8.0, TPU, a CPU with AVX512_BF16)."""
    if _PRECISION.value != "auto":
        return _PRECISION.value
    from tfspeed import runtime

    hw = runtime.detect_hardware()
    bf16 = (hw.tpus or any(cc >= runtime.BFLOAT16_MIN_CC for cc in hw.gpus)
            or (not hw.gpus and hw.cpu_has_bf16))
    return "mixed_bfloat16" if bf16 else "float32"


def build_model(name: str, uint8: bool):
    """The application (``weights=None``), compiled as a user would; with ``uint8``,
    ``tfspeed.data.scaling_layer()`` first."""
    import keras

    import tfspeed.data

    size = _SIZE.value
    base = getattr(keras.applications, APPLICATIONS[name])(
        weights=None, input_shape=(size, size, 3), classes=_CLASSES.value)
    inputs = keras.Input((size, size, 3), dtype="uint8" if uint8 else "float32")
    outputs = base(tfspeed.data.scaling_layer()(inputs) if uint8 else inputs)
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss="sparse_categorical_crossentropy")
    return model


def one_batch(data: dict, dtype: str):
    """A real batch (the stored shards' first, uint8) as NumPy, and its labels."""
    import numpy as np

    import tfspeed.data

    ds = tfspeed.data.build(data["stored"], "train", _BATCH.value, training=True,
                            image_dtype="uint8", cache="none")
    x, y = next(iter(ds))
    x = x.numpy()
    return (x if dtype == "uint8" else (x / 255).astype(np.float32)), y.numpy()


def dataset(contender: str, data: dict):
    """The tf.data input of a fit contender."""
    import tensorflow as tf

    import tfspeed.data

    if contender.startswith("ceiling_repeated"):
        x, y = one_batch(data, "float32" if contender.endswith("float32") else "uint8")
        return tf.data.Dataset.from_tensors((x, y)).repeat()
    if contender == "guide_float32":
        items = bench.make_photos(data["photos"], _IMAGES.value, _CLASSES.value)
        return bench.guide_files_pipeline(items, _SIZE.value, _BATCH.value,
                                          drop_remainder=True).repeat()
    source = data["jpeg"] if contender == "tfspeed_cold_jpeg" else data["stored"]
    return tfspeed.data.build(source, "train", _BATCH.value, training=True,
                              image_size=_SIZE.value, image_dtype="uint8", cache="none")


def time_fit(model, ds) -> list[float]:
    """Images/s of each timed epoch of ``model.fit``, after one untimed epoch."""
    import keras

    class Clock(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):  # fit has synced on the epoch's logs
            self.seconds.append(time.perf_counter() - self.start)

    clock = Clock()
    model.fit(ds, epochs=1 + _EPOCHS.value, steps_per_epoch=_STEPS.value, verbose=0,
              callbacks=[clock])
    return [_STEPS.value * _BATCH.value / s for s in clock.seconds[1:]]


def time_on_device(model, data: dict) -> list[float]:
    """Images/s of ``--epochs`` spans of ``--steps`` compiled steps on one batch already on
    the device (after one untimed span, which compiles)."""
    import keras

    x, y = one_batch(data, "uint8")
    if keras.backend.backend() == "jax":
        step, state, x, y, sync = _jax_step(model, x, y)
    else:
        step, state, x, y, sync = _tf_step(model, x, y)
    rates = []
    for _ in range(1 + _EPOCHS.value):
        start = time.perf_counter()
        for _ in range(_STEPS.value):
            state, loss = step(state, x, y)
        sync(loss)
        rates.append(_STEPS.value * _BATCH.value / (time.perf_counter() - start))
    return rates[1:]


def _jax_step(model, x, y):
    """Keras 3's stateless training step, jitted (the JAX backend's own recipe)."""
    import jax
    import keras

    optimizer, loss_fn = model.optimizer, keras.losses.sparse_categorical_crossentropy
    optimizer.build(model.trainable_variables)

    def loss_and_state(trainable, non_trainable, x, y):
        out, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return loss_fn(y, out.astype("float32")).mean(), non_trainable

    grad = jax.value_and_grad(loss_and_state, has_aux=True)

    @jax.jit
    def step(state, x, y):
        trainable, non_trainable, opt = state
        (loss, non_trainable), grads = grad(trainable, non_trainable, x, y)
        trainable, opt = optimizer.stateless_apply(opt, grads, trainable)
        return (trainable, non_trainable, opt), loss

    state = ([v.value for v in model.trainable_variables],
             [v.value for v in model.non_trainable_variables],
             [v.value for v in optimizer.variables])
    return step, state, jax.device_put(x), jax.device_put(y), lambda loss: loss.block_until_ready()


def _tf_step(model, x, y):
    """A tf.function step on TF's device (XLA where TF has a GPU, as Keras' auto does)."""
    import keras
    import tensorflow as tf

    optimizer, loss_fn = model.optimizer, keras.losses.sparse_categorical_crossentropy
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=bool(tf.config.list_physical_devices("GPU")))
    def step(state, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(loss_fn(y, tf.cast(model(x, training=True), tf.float32)))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables, strict=True))
        return state, loss

    x, y = tf.identity(tf.constant(x)), tf.identity(tf.constant(y))  # on TF's default device
    return step, 0, x, y, lambda loss: float(loss)


def run_contender(contender: str, model_name: str, data: dict) -> dict:
    import keras

    policy = precision()
    keras.mixed_precision.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    model = build_model(model_name, uint8=contender in UINT8)
    start = time.perf_counter()
    if contender == "ceiling_on_device":
        rates = time_on_device(model, data)
    else:
        rates = time_fit(model, dataset(contender, data))
    return {"images_per_sec": max(rates), "epochs_images_per_sec": rates,
            "seconds": time.perf_counter() - start, "precision": policy,
            "backend": keras.backend.backend(), "devices": _devices(),
            "peak_rss_mb": bench.peak_rss_mb()}


def _devices() -> list[str]:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return [str(d) for d in jax.devices()]
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices() if d.device_type != "CPU"] or [
        "CPU"]


# ------------------------------------------------------------------ rounds and the record
def summary(values: list) -> dict | None:
    values = [v for v in values if isinstance(v, int | float)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def image_rounds(data: dict, save) -> dict:
    """Every (model, contender) in a process of its own, ``--rounds`` rounds, the order
    rotated each round."""
    pairs = [(m, c) for m in _MODELS.value for c in _CONTENDERS.value]
    results = {m: {c: [] for c in _CONTENDERS.value} for m in _MODELS.value}
    for r in range(_ROUNDS.value):
        for model, contender in pairs[r % len(pairs):] + pairs[:r % len(pairs)]:
            result = bench.run_contender(
                [sys.executable, os.path.abspath(__file__), f"--contender={contender}",
                 f"--model={model}", *_shared_flags()], f"{model} {contender}", check=False)
            results[model][contender].append({"round": r, **result})
            print(f"round {r} {model} {contender}: {result.get('images_per_sec')} "
                  f"{result.get('error', '')[-300:]}", file=sys.stderr, flush=True)
            save(results, None)
    return results


def _shared_flags() -> list[str]:
    return [f"--{f.name}={f.value}" for f in (_WORKDIR, _IMAGES, _CLASSES, _SIZE, _BATCH,
                                              _STEPS, _EPOCHS, _PRECISION)]


def text_part() -> dict | None:
    """``benchmarks/sequences.py`` in a process of its own, on this backend; its record."""
    if not _TEXT.value:
        return None
    out = os.path.join(_WORKDIR.value, "text-record")
    command = [sys.executable, os.path.join(REPO, "benchmarks", "sequences.py"),
               f"--datasets={','.join(_TEXT.value)}",
               f"--contenders={','.join(_TEXT_CONTENDERS.value)}",
               f"--rounds={_ROUNDS.value}", f"--workdir={os.path.join(_WORKDIR.value, 'text')}",
               f"--results_dir={out}", "--tag=accelerator", *_TEXT_FLAGS.value]
    for old in glob.glob(os.path.join(out, "*.json")):
        os.remove(old)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False)
    records = sorted(glob.glob(os.path.join(out, "*.json")))
    if proc.returncode or not records:
        return {"failed": " ".join(command[1:]), "error": proc.stderr.strip()[-2000:]}
    with open(records[-1]) as f:
        record = json.load(f)
    return {"command": " ".join(command[1:]), "wall_seconds": time.perf_counter() - start,
            "config": record["config"], "figures": record["figures"],
            "ratios": record["ratios"]}


def make_record(data: dict, results: dict, text: dict | None) -> dict:
    figures, ratios = {}, {}
    for model, per in results.items():
        figures[model] = {}
        for contender, rounds in per.items():
            usable = [r for r in rounds if "failed" not in r]
            figures[model][contender] = {"rounds": rounds,
                                         "failed_rounds": len(rounds) - len(usable),
                                         "images_per_sec": summary(
                                             [r["images_per_sec"] for r in usable])}
        median = {c: (f["images_per_sec"] or {}).get("median")
                  for c, f in figures[model].items()}
        for ours in ("tfspeed_cold_jpeg", "tfspeed_stored"):
            for other in ("ceiling_on_device", "ceiling_repeated", "guide_float32"):
                if median.get(ours) and median.get(other):
                    ratios[f"{model}: {ours}/{other}"] = median[ours] / median[other]
        if median.get("ceiling_repeated") and median.get("ceiling_repeated_float32"):
            ratios[f"{model}: ceiling_repeated uint8/float32"] = (
                median["ceiling_repeated"] / median["ceiling_repeated_float32"])
    if text and "ratios" in text:
        ratios.update({f"text {k}": v for k, v in text["ratios"].items()})
    config = {"models": _MODELS.value, "contenders": _CONTENDERS.value,
              "image_size": _SIZE.value, "batch_size": _BATCH.value, "steps": _STEPS.value,
              "timed_epochs": _EPOCHS.value, "rounds": _ROUNDS.value, "images": _IMAGES.value,
              "classes": _CLASSES.value, "precision_flag": _PRECISION.value,
              "data": data, "complete": text is not None or not _TEXT.value,
              "photos": "crops of scikit-learn/scikit-image samples, 256-512 px, JPEG q90",
              "timing": "images/s: a round's best timed epoch of --steps steps after one "
                        "untimed epoch; median and min-max over rounds"}
    return bench.record("accelerator", config, {"images": figures, "text": text}, ratios)


def main(argv):
    del argv
    if _CONTENDER.value:  # one contender, in a process of its own
        data = prepare()
        result = run_contender(_CONTENDER.value, _MODEL.value, data)
        print(bench.RESULT + json.dumps(result))
        return
    data = prepare()
    name = f"accelerator-{datetime.date.today().isoformat()}{'-' + _TAG.value if _TAG.value else ''}"
    path = os.path.join(_RESULTS.value, name + ".json") if _RESULTS.value else None

    def save(results: dict, text: dict | None) -> dict:
        record = make_record(data, results, text)
        if path:
            os.makedirs(_RESULTS.value, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(record, f, indent=2)
            os.replace(path + ".tmp", path)
        return record

    results = image_rounds(data, save)
    record = save(results, text_part() or {})
    print(bench.RESULT + json.dumps(record))


if __name__ == "__main__":
    app.run(main)
