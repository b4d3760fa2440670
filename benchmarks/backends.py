"""The same tfspeed jobs on Keras' TensorFlow and JAX backends, on this machine.

    python benchmarks/backends.py [--rounds=3] [--workdir=/tmp/tfspeed-bench-backends]
        [--jobs=digits_mlp,digits_cnn,text_short,text_code]

Each job is ``python -m tfspeed.train`` with the same flags, once with
``KERAS_BACKEND=tensorflow`` and once with ``KERAS_BACKEND=jax``, each in a process of its
own, in ``--rounds`` interleaved rounds (the order alternates). Real data only:

  digits_mlp  scikit-learn's handwritten digits (the Quick start's data), an MLP of width 256,
              in-step input, 20 epochs, everything else auto.
  digits_cnn  pipelines/digits.flags itself (the small CNN), 4 epochs.
  text_short  the built-in ``pydocstrings`` corpus (short docstrings, median ~19 tokens),
              the transformer (64 wide, 2 blocks), batching auto, 2 epochs.
  text_code   the built-in ``pystdlib`` corpus (code, up to 512 tokens a piece), the
              transformer, batching auto, 1 epoch.

Per job and backend: the report's median throughput (examples/s, real tokens/s for text)
over its measured steps, the evaluation metric, the wall seconds of the whole process and
what auto chose. The record keeps every round and the medians with min-max; the ratio is
JAX over TensorFlow. The accelerator's figures belong to ``benchmarks/accelerator.py``; this
runs on a GPU host unchanged.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from absl import app, flags

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfspeed import bench  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-backends", "Data and runs.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds over every job and backend.")
_JOBS = flags.DEFINE_list("jobs", ["digits_mlp", "digits_cnn", "text_short", "text_code"],
                          "Jobs to run.")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the record's file name.")
_RESULTS = flags.DEFINE_string("results_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the record is written ('' = print only).")

BACKENDS = ("tensorflow", "jax")
TEXT = ["--model=transformer", "--width=64", "--depth=2", "--heads=4", "--batch_size=32",
        "--learning_rate=0.002"]


def jobs(root: str) -> dict[str, tuple[str, list[str]]]:
    """Job name -> (--prepare_source, flags): each converts its data once into the workdir."""
    return {
        "digits_mlp": ("digits", ["--model=mlp", "--width=256", "--batch_size=32",
                                  "--epochs=20"]),
        "digits_cnn": ("digits", ["--flagfile=pipelines/digits.flags", "--epochs=4"]),
        "text_short": ("pydocstrings", [*TEXT, "--epochs=2"]),
        "text_code": ("pystdlib", [*TEXT, "--max_length=512", "--epochs=1"]),
    }


def run(job: str, backend: str, round_: int) -> dict:
    """One job on one backend in a fresh process; the report's figures."""
    source, extra = jobs(_WORKDIR.value)[job]
    model_dir = os.path.join(_WORKDIR.value, "runs", f"{job}-{backend}-{round_}")
    return bench.train_job(REPO, source, extra, os.path.join(_WORKDIR.value, "data", source),
                           model_dir, {"KERAS_BACKEND": backend})


def make_record(results: dict, complete: bool) -> dict:
    figures, ratios = {}, {}
    for job, per in results.items():
        figures[job] = {}
        for backend, rounds in per.items():
            figures[job][backend] = bench.round_figures(
                rounds, ("throughput", "eval_accuracy", "eval_loss", "wall_seconds",
                         "step_time_ms"))
        medians = {b: (figures[job][b]["throughput"] or {}).get("median") for b in BACKENDS}
        if all(medians.values()):
            ratios[f"{job}: jax/tensorflow"] = medians["jax"] / medians["tensorflow"]
    config = {"complete": complete, "rounds": _ROUNDS.value, "jobs": {
        job: {"prepare_source": source, "flags": extra}
        for job, (source, extra) in jobs(_WORKDIR.value).items() if job in results},
        "timing": "the report's median throughput over its measured steps (warm-up, "
                  "compiles and probes left out); wall_seconds: the whole process"}
    return bench.record("backends", config, figures, ratios)


def main(argv):
    del argv
    results = {job: {b: [] for b in BACKENDS} for job in _JOBS.value}
    name = f"backends-{datetime.date.today().isoformat()}{'-' + _TAG.value if _TAG.value else ''}"
    path = os.path.join(_RESULTS.value, name + ".json") if _RESULTS.value else None
    for r in range(_ROUNDS.value):
        for job in _JOBS.value:
            for backend in (BACKENDS if r % 2 == 0 else BACKENDS[::-1]):
                result = run(job, backend, r)
                results[job][backend].append({"round": r, **result})
                print(f"round {r} {job} {backend}: {result.get('throughput')} "
                      f"{result.get('error', '')[-300:]}", file=sys.stderr, flush=True)
                record = make_record(results, complete=False)
                if path:
                    os.makedirs(_RESULTS.value, exist_ok=True)
                    with open(path + ".tmp", "w") as f:
                        json.dump(record, f, indent=2)
                    os.replace(path + ".tmp", path)
    record = make_record(results, complete=True)
    if path:
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    print(bench.RESULT + json.dumps(record))


if __name__ == "__main__":
    app.run(main)
