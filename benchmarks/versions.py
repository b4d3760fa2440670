"""The same jobs at two checkouts of tfspeed, on this machine: did a change lose speed?

    python benchmarks/versions.py --base=/path/to/an/older/checkout [--rounds=3]
        [--jobs=digits,text] [--workdir=/tmp/tfspeed-bench-versions]

Each job is ``python -m tfspeed.train`` with the product's own flag files, once with the
checkout at ``--base`` and once with this one (``PYTHONPATH`` and the working directory set
to each), each in a process of its own, in ``--rounds`` interleaved rounds (the order
alternates). Each checkout converts its own copy of the data once. Real data only:

  digits  pipelines/digits.flags: scikit-learn's handwritten digits, the small CNN, 30 epochs
          (--epochs=6 here), everything else auto.
  text    pipelines/text.flags: the Python standard library's code (``pystdlib``), the
          transformer, batching auto, cut to 150 steps (``--train_steps``).

Per job and checkout: the report's median throughput over its measured steps (examples/s,
real tokens/s for text), the evaluation metric and the process's wall seconds; medians with
min-max over the rounds; the ratio is this checkout over the base. Prints one JSON record
and writes it to ``benchmarks/results/versions-DATE.json``.
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

_BASE = flags.DEFINE_string("base", None, "An older checkout of tfspeed to compare with.")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-versions", "Data and runs.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds over every job and checkout.")
_JOBS = flags.DEFINE_list("jobs", ["digits", "text"], "Jobs to run.")
_RESULTS = flags.DEFINE_string("results_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the record is written ('' = print only).")

JOBS = {"digits": ("digits", ["--flagfile=pipelines/digits.flags", "--epochs=6"]),
        "text": ("pystdlib", ["--flagfile=pipelines/text.flags", "--train_steps=150"])}


def main(argv):
    del argv
    if not _BASE.value or not os.path.isdir(os.path.join(_BASE.value, "tfspeed")):
        raise app.UsageError("--base must be a checkout of tfspeed (a folder holding tfspeed/)")
    trees = {"base": os.path.abspath(_BASE.value), "head": REPO}
    results = {job: {tree: [] for tree in trees} for job in _JOBS.value}
    for r in range(_ROUNDS.value):
        for job in _JOBS.value:
            source, extra = JOBS[job]
            for tree in (list(trees) if r % 2 == 0 else list(trees)[::-1]):
                root = os.path.join(_WORKDIR.value, tree)
                result = bench.train_job(trees[tree], source, extra,
                                        os.path.join(root, "data", source),
                                        os.path.join(root, "runs", f"{job}-{r}"), {})
                results[job][tree].append({"round": r, **result})
                print(f"round {r} {job} {tree}: {result.get('throughput')} "
                      f"{result.get('error', '')[-300:]}", file=sys.stderr, flush=True)
    figures, ratios = {}, {}
    for job, per in results.items():
        figures[job] = {}
        for tree, rounds in per.items():
            figures[job][tree] = bench.round_figures(
                rounds, ("throughput", "eval_accuracy", "wall_seconds", "step_time_ms"))
        medians = [(figures[job][t]["throughput"] or {}).get("median") for t in trees]
        if all(medians):
            ratios[f"{job}: head/base throughput"] = medians[1] / medians[0]
    config = {"rounds": _ROUNDS.value, "commits": {t: bench.commit(p) for t, p in trees.items()},
              "jobs": {job: {"prepare_source": s, "flags": e} for job, (s, e) in JOBS.items()
                       if job in results},
              "timing": "the report's median throughput over its measured steps; "
                        "wall_seconds: the whole process"}
    record = bench.record("versions", config, figures, ratios)
    if _RESULTS.value:
        path = os.path.join(_RESULTS.value,
                            f"versions-{datetime.date.today().isoformat()}.json")
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    print(bench.RESULT + json.dumps(record))


if __name__ == "__main__":
    app.run(main)
