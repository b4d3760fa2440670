"""Training-step benchmark: the main job as users run it vs plain Keras vs the in-graph ceiling.

    python benchmarks/train_step.py [--workdir=/tmp/tfspeed-bench-train] [--repeats=3]

Every figure comes from a separate process (so peak RSS is its own), in one run:
  mlp:    the main job's command with --model=mlp --batch_size=32 --epochs=20 (auto settings,
          and what auto chose in each round), plain `model.fit(x, y,
          batch_size=32)` of the same 256-256 MLP, and the in-graph ceiling: the split held
          as tensors, one call per epoch of gather -> forward -> backward -> apply, no
          metrics (float32 and mixed_bfloat16, the faster counts; its best of 7 epochs,
          and its median epoch, the statistic the job reports over its windows). Also the engine's
          bookkeeping (metrics, wait meter, loss-scale and accumulation state) against that
          bare loop: the engine on the same in-graph data, one epoch per call. The ceiling
          runs with TensorFlow's default threads (as filed), and again with one intra-op
          thread, what the job's --intra_op_threads=auto picks for this tiny step: like
          for like.
  cnn:    the digits main job itself (pipelines/digits.flags, unchanged): input wait.
  cnn32:  the small CNN on 32x32 crops of real photographs: plain fit vs tfspeed auto.
  accum:  tfspeed with --grad_accum_steps=4 vs 1 at the same micro-batch (cnn32).
  remat:  16 convs at 64x64 in 4 blocks, tfspeed with --remat vs without (peak memory).
Each variant runs in ``--repeats`` rounds over all of them (this machine is shared); the
median counts. Prints one JSON record with the figures and the ratios.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-train", "Data and runs.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Rounds over all variants; medians count.")
_VARIANT = flags.DEFINE_string("variant", "", "Internal: run one variant and print its JSON.")

MLP_JOB = ["--flagfile=pipelines/digits.flags", "--model=mlp", "--batch_size=32", "--epochs=20"]


def prepare(workdir: str) -> dict[str, str]:
    """Converts the digits and 32/64-px crops of real photographs (once)."""
    from tfspeed import bench
    from tfspeed.convert import convert

    dirs = {"digits": os.path.join(workdir, "digits")}
    convert("digits", dirs["digits"])
    for side in (32, 64):
        photos = os.path.join(workdir, f"photos{side}")
        bench.make_photos(photos, 4096, 10, sides=(2 * side, 3 * side))
        dirs[f"photos{side}"] = os.path.join(workdir, f"data{side}")
        convert(f"imagefolder:{photos}", dirs[f"photos{side}"], image_size=side,
                validation_fraction=0.05)
    return dirs


def arrays(data_dir: str):
    """The train split as float32 arrays in [0, 1] and int labels (what `fit` users hold)."""
    import numpy as np

    import tfspeed.data

    xs, ys = zip(*((x.numpy(), y.numpy()) for x, y in
                   tfspeed.data.build(data_dir, "train", 256, cache="none")), strict=True)
    return np.concatenate(xs), np.concatenate(ys)


def run_fit(data_dir: str, model_name: str, batch: int, epochs: int) -> dict:
    """Plain Keras: compile() defaults, fit() on the arrays."""
    import keras

    import tfspeed.data
    from tfspeed.config import ModelConfig
    from tfspeed.training import models

    x, y = arrays(data_dir)
    schema = tfspeed.data.read_schema(data_dir)
    model = models.build(ModelConfig(name=model_name), x.shape[1:], schema.num_classes)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    seconds = []

    class EpochTimer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            seconds.append(time.perf_counter() - self.start)

    model.fit(x, y, batch_size=batch, epochs=epochs, callbacks=[EpochTimer()], verbose=0)
    steps = len(x) // batch + (len(x) % batch > 0)
    step_s = statistics.median(seconds[1:]) / steps  # epoch 1 holds tracing
    return {"examples_per_sec": batch / step_s, "step_time_ms": 1000 * step_s}


def run_ceiling(data_dir: str, batch: int) -> dict:
    """The in-graph loop without metrics, and the engine on the same in-graph data."""
    import keras
    import tensorflow as tf

    import tfspeed.data
    from tfspeed import runtime
    from tfspeed.config import ModelConfig, RuntimeConfig, TrainConfig
    from tfspeed.data import ingraph
    from tfspeed.training import models, objectives, trainer

    schema = tfspeed.data.read_schema(data_dir)
    source = ingraph.load(tfspeed.data.DataConfig(data_dir=data_dir, batch_size=batch), schema,
                          "train", global_batch_size=batch)
    per_epoch = source.num_records // batch
    figures = {}
    for policy in ("float32", "mixed_bfloat16"):
        keras.mixed_precision.set_global_policy(policy)
        keras.utils.set_random_seed(0)
        model = models.build(ModelConfig(name="mlp"), (8, 8, 1), 10)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        x = tf.cast(source.inputs, tf.float32) / 255

        @tf.function
        def epoch(model=model, optimizer=optimizer, x=x):
            order = tf.random.shuffle(tf.range(source.num_records))
            for i in tf.range(per_epoch):
                rows = order[i * batch:(i + 1) * batch]
                with tf.GradientTape() as tape:
                    logits = model(tf.gather(x, rows), training=True)
                    loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                        tf.gather(source.labels, rows), logits, from_logits=True))
                grads = tape.gradient(loss, model.trainable_variables)
                optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
            return loss

        rates = _rates(lambda: epoch().numpy(), per_epoch * batch)
        figures[f"ceiling_{policy}"] = max(rates)
        figures[f"ceiling_{policy}_median"] = statistics.median(rates)
        rt = runtime.setup(RuntimeConfig(strategy="default", precision=policy, xla="off"))
        model = models.build(ModelConfig(name="mlp"), (8, 8, 1), 10)
        goals = objectives.resolve("", None, "classification", model)
        engine = trainer.make_engine(
            model, goals, TrainConfig(), rt, batch, 10**6,
            preprocess=lambda v: tf.cast(v, tf.float32) * (1 / 255))
        figures[f"engine_{policy}"] = max(_rates(
            lambda e=engine: e.train(source, per_epoch)["loss"].numpy(), per_epoch * batch))
    return {"examples_per_sec": max(figures["ceiling_float32"], figures["ceiling_mixed_bfloat16"]),
            "median_examples_per_sec": max(figures["ceiling_float32_median"],
                                           figures["ceiling_mixed_bfloat16_median"]),
            **figures}


def _rates(call, examples: int, rounds: int = 7) -> list[float]:
    """Examples/s of ``rounds`` timed calls, after one that traces."""
    call()
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        call()
        rates.append(examples / (time.perf_counter() - start))
    return rates


def run_job(args: list[str], model_dir: str) -> dict:
    """The driver's command line, as a user runs it; its report.json."""
    import shutil

    shutil.rmtree(model_dir, ignore_errors=True)
    from tfspeed.config import flags as tfspeed_flags
    from tfspeed.training.run import run

    tfspeed_flags.parse(["tfspeed.train", *args, f"--model_dir={model_dir}"])
    report = run(tfspeed_flags.to_config())
    return {"examples_per_sec": report["batch_examples_per_sec"],
            "step_time_ms": report["step_time_ms"], "input_wait_pct": report["input_wait_pct"],
            "eval_accuracy": report["eval_accuracy"],
            "precision": report["runtime"]["precision"],
            "precision_reason": report["runtime"]["reasons"]["precision"],
            "steps_per_execution": report["steps_per_execution"],
            "placement": report["input"]["placement"]["where"],
            "intra_op_threads": report["runtime"]["intra_op_threads"]}


def run_variant(name: str) -> dict:
    import resource

    work = _WORKDIR.value
    dirs = {k: os.path.join(work, v) for k, v in
            (("digits", "digits"), ("photos32", "data32"), ("photos64", "data64"))}
    runs = os.path.join(work, "runs")
    case, _, variant = name.partition("/")
    if case == "mlp" and variant == "fit":
        figures = run_fit(dirs["digits"], "mlp", 32, 20)
    elif case == "mlp" and variant.startswith("ceiling"):
        if variant == "ceiling_1thread":
            import tensorflow as tf

            tf.config.threading.set_intra_op_parallelism_threads(1)  # before any op runs
        figures = run_ceiling(dirs["digits"], 32)
    elif case == "mlp":
        figures = run_job([*MLP_JOB, f"--data_dir={dirs['digits']}"], os.path.join(runs, "mlp"))
    elif case == "cnn":
        figures = run_job(["--flagfile=pipelines/digits.flags", f"--data_dir={dirs['digits']}"],
                          os.path.join(runs, "cnn"))
    elif case == "cnn32" and variant == "fit":
        figures = run_fit(dirs["photos32"], "cnn", 64, 6)
    else:
        figures = run_job(_tfspeed_args(case, variant, dirs), os.path.join(runs, name))
    figures["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return figures


def _tfspeed_args(case: str, variant: str, dirs: dict) -> list[str]:
    common = ["--eval_split=", "--log_every=25"]
    if case == "cnn32":
        return [f"--data_dir={dirs['photos32']}", "--model=cnn", "--batch_size=64",
                "--epochs=6", *common]
    if case == "accum":
        k = 4 if variant == "k4" else 1
        return [f"--data_dir={dirs['photos32']}", "--model=cnn", "--batch_size=64",
                f"--grad_accum_steps={k}", f"--train_steps={240 // k}",
                "--steps_per_execution=4", *common]
    return [f"--data_dir={dirs['photos64']}", "--model=cnn_deep", "--batch_size=64",  # remat
            f"--remat={variant == 'remat'}", "--train_steps=30", "--steps_per_execution=5",
            "--log_every=5", "--eval_split="]


def _deep_cnn(config, input_shape, num_classes):
    """Sixteen convs at full resolution in 4 blocks: activations dominate memory (remat's case)."""
    import keras

    from tfspeed.training.models import block

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
    from tfspeed import bench

    if _VARIANT.value:
        from tfspeed.training import models

        models.MODELS.setdefault("cnn_deep", _deep_cnn)
        print(bench.RESULT + json.dumps(run_variant(_VARIANT.value)))
        return
    os.makedirs(_WORKDIR.value, exist_ok=True)
    prepare(_WORKDIR.value)
    names = ["mlp/job", "mlp/fit", "mlp/ceiling", "mlp/ceiling_1thread", "cnn/job", "cnn32/fit", "cnn32/tfspeed",
             "accum/k1", "accum/k4", "remat/plain", "remat/remat"]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for _ in range(_REPEATS.value):  # rounds over all variants: the machine's noise spreads
        for name in names:
            runs[name].append(_subprocess(name))
    figures = {name: _median_run(results) for name, results in runs.items()}
    eps = {name: f["examples_per_sec"] for name, f in figures.items()}
    ceiling = figures["mlp/ceiling"]
    ratios = {
        "mlp job/ceiling": eps["mlp/job"] / eps["mlp/ceiling"],
        # Like for like: the job reports the median of its windows, the ceiling above its
        # best epoch; here the ceiling's median epoch.
        "mlp job/ceiling median epoch": eps["mlp/job"] / ceiling["median_examples_per_sec"],
        # The job runs its ops on one thread each (--intra_op_threads=auto): the same here.
        "mlp job/ceiling with one intra-op thread": (
            eps["mlp/job"] / eps["mlp/ceiling_1thread"]),
        "mlp job/ceiling with one intra-op thread, median epoch": (
            eps["mlp/job"] / figures["mlp/ceiling_1thread"]["median_examples_per_sec"]),
        "mlp job/fit": eps["mlp/job"] / eps["mlp/fit"],
        "mlp engine/bare loop float32 (bookkeeping)": (ceiling["engine_float32"]
                                                       / ceiling["ceiling_float32"]),
        "cnn32 tfspeed/fit": eps["cnn32/tfspeed"] / eps["cnn32/fit"],
        "accum k4/k1 throughput": eps["accum/k4"] / eps["accum/k1"],
        "remat peak_rss remat/plain": (figures["remat/remat"]["peak_rss_mb"]
                                       / figures["remat/plain"]["peak_rss_mb"]),
        "remat throughput remat/plain": eps["remat/remat"] / eps["remat/plain"],
    }
    config = {"mlp_job": " ".join(MLP_JOB), "repeats": _REPEATS.value,
              "auto_chose_mlp": [(run["steps_per_execution"]["value"], run["precision"],
                                  run["intra_op_threads"])
                                 for run in runs["mlp/job"]],
              "auto_chose_cnn": [(run["steps_per_execution"]["value"], run["precision"])
                                 for run in runs["cnn/job"]],
              "photos": "crops of scikit-learn/scikit-image samples, stored at 32/64 px"}
    print(json.dumps(bench.record("train_step", config, figures, ratios), indent=2))


def _median_run(results: list[dict]) -> dict:
    """The run with the median throughput, and every run's throughput."""
    ordered = sorted(results, key=lambda r: r["examples_per_sec"])
    return {**ordered[len(ordered) // 2],
            "runs_examples_per_sec": [r["examples_per_sec"] for r in results]}


def _subprocess(name: str) -> dict:
    from tfspeed import bench

    return bench.run_contender([sys.executable, __file__, f"--variant={name}",
                                f"--workdir={_WORKDIR.value}"], name, cwd=REPO)


if __name__ == "__main__":
    app.run(main)
