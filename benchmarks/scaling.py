"""Scaling benchmark: the input pipeline local vs on the tf.data service, 1 vs 2 training workers.

    python benchmarks/scaling.py [--workdir=/tmp/tfspeed-bench-scaling] > benchmarks/results/scaling-DATE.json

Cases, each in its own processes, all on this machine (127.0.0.1):
  input: JPEG photos -> 224x224 float batches of 64 with flip augmentation, the training
    pipeline alone (no model), timed in the consuming process:
      local      the whole pipeline in the consuming process;
      service_1  read/decode/augment on 1 tf.data service worker process (dynamic sharding);
      service_2  the same on 2 worker processes.
  train: the small CNN on the digits, same global batch (64) and steps:
      one_worker   python -m tfspeed.train (one process, default strategy);
      two_workers  python -m tfspeed.launch --workers=2 (MultiWorkerMirroredStrategy, each
                   worker computes half of every batch, gradients all-reduced over gRPC);
      two_workers_accum4  the same with --grad_accum_steps=4: one all-reduce per 4 batches.
Prints one JSON record (figures and ratios); throughput in examples/s, peak RSS in MB.
Every process here shares the same CPU cores: see README "Scaling out" for what the ratios
mean on this machine and what to expect on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-scaling", "Data and runs.")
_IMAGES = flags.DEFINE_integer("images", 1000, "JPEG photos to generate.")
_BATCHES = flags.DEFINE_integer("batches", 40, "Timed input batches per variant.")
_STEPS = flags.DEFINE_integer("steps", 300, "Training steps per training variant.")
_VARIANT = flags.DEFINE_string("variant", "", "Internal: time one input variant, print JSON.")
_SERVICE = flags.DEFINE_string("service", "", "Internal: the dispatcher of that variant.")

BATCH, IMAGE_SIZE, WARMUP = 64, 224, 8


def prepare(workdir: str) -> dict[str, str]:
    """JPEG photos converted into 16 shards, and the digits."""
    from tfspeed.bench import make_photos
    from tfspeed.convert import convert

    photos = os.path.join(workdir, "photos")
    if not os.path.isdir(photos):
        make_photos(photos, _IMAGES.value, 10)
    dirs = {"photos": os.path.join(workdir, "photos_tfrecord"),
            "digits": os.path.join(workdir, "digits")}
    convert(f"imagefolder:{photos}", dirs["photos"], shards=16, image_max_side=256)
    convert("digits", dirs["digits"], shards=4)
    return dirs


def time_input(data_dir: str, service: str) -> dict:
    """Examples/s of the training input pipeline, consumed in this process."""
    from tfspeed import bench
    from tfspeed.config import DataConfig
    from tfspeed.data import pipeline

    config = DataConfig(data_dir=data_dir, batch_size=BATCH, image_size=IMAGE_SIZE,
                        cache="none", augment=("flip",), data_service=service).validate()
    ds = pipeline.build_from_config(config, "train", training=True)
    figures = bench.time_dataset(ds, _BATCHES.value, WARMUP, BATCH)
    figures["examples_per_sec"] = figures.pop("images_per_sec")
    return figures


class Server:
    """A ``python -m tfspeed.data_service`` process and the address it printed."""

    def __init__(self, *args: str):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tfspeed.data_service", *args], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        line = self.process.stdout.readline()
        self.address = re.search(r"listening on (grpc://\S+)", line).group(1)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(timeout=30)


def _variant(name: str, data_dir: str, service: str = "") -> dict:
    out = subprocess.run(
        [sys.executable, __file__, f"--variant={name}", f"--workdir={_WORKDIR.value}",
         f"--batches={_BATCHES.value}", f"--service={service}", f"--images={_IMAGES.value}"],
        capture_output=True, text=True, check=True, cwd=REPO)
    return json.loads(out.stdout.strip().splitlines()[-1])


def input_figures(data_dir: str) -> dict:
    figures = {"local": _variant("input", data_dir)}
    with tempfile.TemporaryDirectory() as journal:
        dispatcher = Server("dispatcher", "--port=0", f"--work_dir={journal}")
        workers = [Server("worker", f"--dispatcher={dispatcher.address}")]
        try:
            figures["service_1"] = _variant("input", data_dir, dispatcher.address)
            workers.append(Server("worker", f"--dispatcher={dispatcher.address}"))
            figures["service_2"] = _variant("input", data_dir, dispatcher.address)
        finally:
            for server in [*workers, dispatcher]:
                server.stop()
    return figures


def _train(data_dir: str, model_dir: str, launcher: list[str], accum: int = 1) -> dict:
    flags_ = [f"--data_dir={data_dir}", f"--model_dir={model_dir}", "--model=cnn",
              "--batch_size=64", f"--train_steps={_STEPS.value // accum}",
              f"--grad_accum_steps={accum}", "--steps_per_execution=4",
              "--log_every=20", "--eval_split=", "--cache=memory"]
    subprocess.run([*launcher, *flags_], cwd=REPO, check=True, capture_output=True, text=True)
    with open(os.path.join(model_dir, "report.json")) as f:
        report = json.load(f)
    return {"examples_per_sec": report["batch_examples_per_sec"],
            "step_time_ms": report["step_time_ms"],
            "peak_rss_mb": report["peak_host_rss_mb"],
            "workers": report["runtime"]["num_workers"],
            "precision": report["runtime"]["precision"]}


def train_figures(data_dir: str) -> dict:
    runs = os.path.join(_WORKDIR.value, "runs")
    subprocess.run(["rm", "-rf", runs], check=True)
    return {
        "one_worker": _train(data_dir, os.path.join(runs, "one"),
                             [sys.executable, "-m", "tfspeed.train"]),
        "two_workers": _train(data_dir, os.path.join(runs, "two"),
                              [sys.executable, "-m", "tfspeed.launch", "--workers=2", "--"]),
        # The same micro-batches, gradients all-reduced once per 4 of them.
        "two_workers_accum4": _train(
            data_dir, os.path.join(runs, "two_accum4"),
            [sys.executable, "-m", "tfspeed.launch", "--workers=2", "--"], accum=4),
    }


def main(argv):
    from tfspeed import bench

    if _VARIANT.value == "input":
        print(json.dumps(time_input(os.path.join(_WORKDIR.value, "photos_tfrecord"),
                                    _SERVICE.value)))
        return
    os.makedirs(_WORKDIR.value, exist_ok=True)
    dirs = prepare(_WORKDIR.value)
    inputs = input_figures(dirs["photos"])
    train = train_figures(dirs["digits"])
    eps = {name: f["examples_per_sec"] for name, f in inputs.items()}
    ratios = {
        "input service_1/local": eps["service_1"] / eps["local"],
        "input service_2/local": eps["service_2"] / eps["local"],
        "input service_2/service_1": eps["service_2"] / eps["service_1"],
        "train two_workers/one_worker": (train["two_workers"]["examples_per_sec"]
                                         / train["one_worker"]["examples_per_sec"]),
        "train two_workers_accum4/two_workers": (
            train["two_workers_accum4"]["examples_per_sec"]
            / train["two_workers"]["examples_per_sec"]),
    }
    config = {"batch": BATCH, "image_size": IMAGE_SIZE, "images": _IMAGES.value,
              "timed_batches": _BATCHES.value, "train_steps": _STEPS.value,
              "train_model": "cnn on digits, global batch 64"}
    figures = {"input": inputs, "train": train}
    print(json.dumps(bench.record("scaling", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
