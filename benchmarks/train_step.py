"""Training-step benchmark: plain Keras as a user writes it vs tfspeed, same model and data.

    python benchmarks/train_step.py [--workdir=/tmp/tfspeed-bench-train] [--steps=300]

Cases (each variant runs in its own process, so peak RSS belongs to it alone):
  mlp:    a tiny MLP on the digits (Python-overhead bound): keras vs tfspeed auto;
  cnn:    a small CNN on 32x32 RGB images: keras vs tfspeed auto;
  accum:  tfspeed with grad_accum_steps=4 vs 1 at the same micro-batch (overhead of accumulation);
  remat:  16 convs at 64x64 in 4 blocks, tfspeed with --remat vs without (peak memory saved).
"Plain Keras" is compile() with its defaults plus fit() on the same tfspeed pipeline; tfspeed
is ``tfspeed.train.run`` with strategy/precision/xla/steps_per_execution all on auto.
Prints one JSON record with figures per variant and the ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
from absl import app, flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-train", "Data and runs.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per variant (after warm-up).")
_VARIANT = flags.DEFINE_string("variant", "", "Internal: run one variant and print its JSON.")

CASES = {
    # name: (data, model, width, batch, steps as a multiple of --steps)
    # The tiny MLP's steps take well under a millisecond: many more of them.
    "mlp": ("digits", "mlp", 32, 32, 20.0),
    "cnn": ("images32", "cnn", 32, 64, 1.0),
    "accum": ("images32", "cnn", 32, 64, 1.0),
    # Memory is the point here, and each step is heavy: fewer steps.
    "remat": ("images64", "cnn_deep", 32, 64, 0.1),
}
VARIANTS = {
    "mlp": ("keras", "tfspeed"),
    "cnn": ("keras", "tfspeed"),
    "accum": ("tfspeed_k1", "tfspeed_k4"),
    "remat": ("tfspeed_noremat", "tfspeed_remat"),
}


def prepare(workdir: str) -> dict[str, str]:
    """Converts the benchmark datasets once (digits; random RGB images of 32 and 64 px)."""
    from tfspeed.convert import convert

    dirs = {}
    for name, side in (("images32", 32), ("images64", 64)):
        npz = os.path.join(workdir, f"{name}.npz")
        if not os.path.exists(npz):
            rng = np.random.default_rng(0)
            x = rng.integers(0, 256, size=(4096, side, side, 3), dtype=np.uint8)
            np.savez(npz, x=x, y=rng.integers(0, 10, size=4096))
        dirs[name] = os.path.join(workdir, name)
        convert(f"npz:{npz}", dirs[name], shards=8, validation_fraction=0.05)
    dirs["digits"] = os.path.join(workdir, "digits")
    convert("digits", dirs["digits"], shards=4)
    return dirs


def run_keras(data_dir: str, model_name: str, width: int, batch: int, steps: int) -> dict:
    """What a user writes: compile() defaults, fit() on the same pipeline."""
    import keras

    import tfspeed.data
    from tfspeed import models
    from tfspeed.config import ModelConfig
    from tfspeed.data import pipeline

    schema = tfspeed.data.read_schema(data_dir)
    config = tfspeed.data.DataConfig(data_dir=data_dir, batch_size=batch)
    ds = tfspeed.data.build(data_dir, "train", batch, training=True)
    model = models.build(ModelConfig(name=model_name, width=width),
                         pipeline.input_shape(schema, config), schema.num_classes)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seconds = []

        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds.append(time.perf_counter() - self.start)

    timer = EpochTimer()
    per_epoch = max(steps // 4, 1)
    model.fit(ds, epochs=5, steps_per_epoch=per_epoch, callbacks=[timer], verbose=0)
    step_s = statistics.median(timer.seconds[1:]) / per_epoch  # epoch 1 holds tracing
    return {"examples_per_sec": batch / step_s, "step_time_ms": 1000 * step_s,
            "jit_compile": str(model.jit_compile)}


def run_tfspeed(data_dir: str, model_name: str, width: int, batch: int, steps: int,
                accum: int = 1, remat: bool = False, steps_per_execution: int = 0) -> dict:
    from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
    from tfspeed.train import run

    config = Config(
        data=DataConfig(data_dir=data_dir, batch_size=batch, eval_split=""),
        model=ModelConfig(name=model_name, width=width, remat=remat),
        runtime=RuntimeConfig(strategy="auto", precision="auto", xla="auto"),
        train=TrainConfig(train_steps=(steps + steps // 4) // accum, grad_accum_steps=accum,
                          steps_per_execution=steps_per_execution,
                          log_every=max(steps // 6, 5)),
        model_dir=os.path.join(_WORKDIR.value, "runs", f"{model_name}-{accum}-{remat}-{time.time()}"),
    ).validate()
    report = run(config)
    return {"examples_per_sec": report["examples_per_sec"], "step_time_ms": report["step_time_ms"],
            "precision": report["runtime"]["precision"], "xla": report["runtime"]["xla"],
            "steps_per_execution": report["steps_per_execution"]}


def run_variant(case: str, variant: str) -> dict:
    import resource

    from tfspeed import models

    models.MODELS.setdefault("cnn_deep", _deep_cnn)
    data, model, width, batch, fraction = CASES[case]
    data_dir = os.path.join(_WORKDIR.value, data)
    steps = max(int(_STEPS.value * fraction), 30)  # fraction: steps relative to --steps
    if variant == "keras":
        figures = run_keras(data_dir, model, width, batch, steps)
    else:
        # The accumulation pair shares one steps_per_execution, so only K differs.
        figures = run_tfspeed(data_dir, model, width, batch, steps,
                              accum=4 if variant == "tfspeed_k4" else 1,
                              remat=variant == "tfspeed_remat",
                              steps_per_execution=4 if case == "accum" else 0)
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def _deep_cnn(config, input_shape, num_classes):
    """Sixteen convs at full resolution in 4 blocks: activations dominate memory (remat's case)."""
    import keras

    from tfspeed.models import block

    inputs = keras.Input(tuple(input_shape))
    x = inputs
    for i in range(4):
        convs = [keras.layers.Conv2D(config.width or 32, 3, padding="same", activation="relu")
                 for _ in range(4)]
        x = block(convs, config.remat, f"block{i}")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    outputs = keras.layers.Dense(num_classes, dtype="float32")(x)
    return keras.Model(inputs, outputs, name="cnn_deep")


def main(argv):
    del argv
    if _VARIANT.value:
        case, variant = _VARIANT.value.split(":")
        print("RESULT " + json.dumps(run_variant(case, variant)))
        return
    from tfspeed import bench

    os.makedirs(_WORKDIR.value, exist_ok=True)
    prepare(_WORKDIR.value)
    figures = {}
    for case, variants in VARIANTS.items():
        for variant in variants:
            proc = subprocess.run(
                [sys.executable, __file__, f"--variant={case}:{variant}",
                 f"--workdir={_WORKDIR.value}", f"--steps={_STEPS.value}"],
                capture_output=True, text=True, check=False)
            lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
            if proc.returncode or not lines:
                raise SystemExit(f"{case}:{variant} failed:\n{proc.stderr[-3000:]}")
            figures[f"{case}/{variant}"] = json.loads(lines[-1][len("RESULT "):])
    eps = {name: f["examples_per_sec"] for name, f in figures.items()}
    ratios = {
        "mlp tfspeed/keras": eps["mlp/tfspeed"] / eps["mlp/keras"],
        "cnn tfspeed/keras": eps["cnn/tfspeed"] / eps["cnn/keras"],
        "accum k4/k1 throughput": eps["accum/tfspeed_k4"] / eps["accum/tfspeed_k1"],
        "remat peak_rss remat/noremat": figures["remat/tfspeed_remat"]["peak_rss_mb"]
        / figures["remat/tfspeed_noremat"]["peak_rss_mb"],
        "remat throughput remat/noremat": eps["remat/tfspeed_remat"] / eps["remat/tfspeed_noremat"],
    }
    config = {"steps": _STEPS.value, "cases": {k: list(v[:4]) for k, v in CASES.items()}}
    print(json.dumps(bench.record("train_step", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
