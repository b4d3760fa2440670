"""``python -m tfspeed.tune`` against an exhaustive grid, on three real workloads.

    python benchmarks/tune.py [--workdir=/tmp/tfspeed-bench-tune] [--tune_budget_s=90]

Workloads, each with the flags a user would write:
  digits:   the main job, pipelines/digits.flags as shipped (a small CNN on the real digits);
  photos64: 3,000 crops of real photographs (256-512 px JPEGs, converted as they are), the
            small CNN at 64 px, --cache=none --input_placement=host (uncached);
  csv:      the digits' 64 pixels as a CSV table, an MLP, the driver's defaults.

For each: the tune as a user runs it (its own process, its budget), then in one further
process the grid: every combination of the same knobs that the tune predicts (placement,
cache, parse, input threads, precision, XLA, steps per execution 1 or the cost model's N),
each measured the way the tune verifies (a short real run of the driver, its steady-state
median window). The best of many single noisy runs is inflated, so the grid's top 2, the
user's flags and the tuned flags (measured again here, sharing the machine's state) then run
in 5 interleaved rounds (each round in a rotated order), and their medians are compared. Prints
one JSON record: per workload
user / tuned / grid-best examples/s, tuned ÷ grid-best, tuned ÷ user, and the prediction
error of the chosen candidate.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-tune", "Data and runs.")
_BUDGET = flags.DEFINE_float("tune_budget_s", 90.0, "The tune's --budget_s.")
_ONLY = flags.DEFINE_list("workloads", ["digits", "photos64", "csv"], "Which to run.")
_GRID = flags.DEFINE_string("grid", "", "Internal: measure one workload's grid, print JSON.")
ROUNDS = 5  # interleaved rounds over the finalists: medians of 3 swung by the ~10% noise


def prepare(workdir: str) -> dict[str, list[str]]:
    """The data (once) and each workload's user flagfile."""
    import numpy as np
    from sklearn.datasets import load_digits

    from tfspeed import bench
    from tfspeed.convert import convert

    os.makedirs(workdir, exist_ok=True)
    photos = os.path.join(workdir, "photos")
    bench.make_photos(photos, 3000, 10)
    convert(f"imagefolder:{photos}", os.path.join(workdir, "photos-data"))
    x, y = load_digits(return_X_y=True)
    table = os.path.join(workdir, "digits.csv")
    if not os.path.exists(table):
        header = ",".join([*(f"p{i}" for i in range(64)), "label"])
        np.savetxt(table, np.column_stack([x, y]), delimiter=",", header=header,
                   comments="", fmt="%d")
    convert(f"csv:{table}", os.path.join(workdir, "csv-data"), label_column="label")
    jobs = {
        "digits": [f"--flagfile={os.path.join(REPO, 'pipelines', 'digits.flags')}",
                   f"--data_dir={os.path.join(workdir, 'digits-data')}"],
        "photos64": [f"--data_dir={os.path.join(workdir, 'photos-data')}", "--model=cnn",
                     "--image_size=64", "--batch_size=64", "--epochs=10", "--cache=none",
                     "--input_placement=host"],
        "csv": [f"--data_dir={os.path.join(workdir, 'csv-data')}", "--model=mlp",
                "--batch_size=64", "--epochs=20"],
    }
    for name, args in jobs.items():
        with open(os.path.join(workdir, f"{name}.flags"), "w") as f:
            f.write("\n".join(args) + "\n")
    return jobs


def tune_workload(workdir: str, name: str) -> dict:
    """The tune as a user runs it; its tune.json, and its wall time."""
    flagfile = os.path.join(workdir, f"{name}.flags")
    tune_dir = os.path.join(workdir, "tune", name)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "tfspeed.tune", f"--flagfile={flagfile}",
         f"--model_dir={os.path.join(workdir, 'runs', name)}", f"--tune_dir={tune_dir}",
         f"--budget_s={_BUDGET.value:g}"], cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"tune {name} failed: {done.stderr[-3000:]}")
    with open(os.path.join(tune_dir, "tune.json")) as f:
        result = json.load(f)
    result["wall_s"] = time.perf_counter() - start
    result["stdout"] = done.stdout
    return result


def grid(workdir: str, name: str) -> dict:
    """Measures every grid cell, the user's flags and the tuned flags (in this process)."""
    from tfspeed.config import flags as tfspeed_flags
    from tfspeed.tuning.measurements import Measurements
    from tfspeed.tuning.predict import Candidate, candidates, predict, rate, rate_key
    from tfspeed.tuning.verify import knob_values, plan_run, verify

    with open(os.path.join(workdir, "tune", name, "tune.json")) as f:
        tuned = json.load(f)
    m = Measurements.from_json(tuned["measurements"])

    def config(flagfile):
        tfspeed_flags.parse(["grid", f"--flagfile={flagfile}",
                             f"--model_dir={os.path.join(workdir, 'runs', name)}"])
        return tfspeed_flags.to_config()

    user = config(os.path.join(workdir, f"{name}.flags"))
    cells = candidates(m)
    out = {"cells": [], "user": None, "tuned": None}
    slowest = min(rate(predict(c, m)) for c in cells)

    def plan(config, c, rate_if_unknown=slowest):
        if c is None:  # the flags as they are: run as long as the finalists' cells
            return plan_run(config, None, m, rate_if_unknown, slowest)
        cold = rate(predict(Candidate(**{**knob_values(c), "input_placement": "host",
                                         "cache": "none"}), m))
        speed = rate(predict(c, m))
        return plan_run(config, c, m, speed, min(cold, speed))

    for i, c in enumerate(cells):
        measured = verify(user, c, os.path.join(workdir, "grid", name, str(i)),
                               plan(user, c))
        out["cells"].append({"label": c.label(), "flags": c.flags(), **measured})
    # The best of many single noisy runs is inflated (the winner's curse): the grid's top 2,
    # the user's flags and the tuned flags are measured again, in interleaved rounds, and
    # those medians are what the ratios compare.
    tuned_config = config(tuned["tuned_flags"]["path"])
    top = sorted(range(len(cells)), key=lambda i: -rate(out["cells"][i]))[:2]
    finals = {**{f"grid{i}": (user, cells[i]) for i in top}, "user": (user, None),
              "tuned": (tuned_config, None)}
    # One length for the user's and the tuned flags, that of the grid's best cell: a run
    # planned for the slowest prediction would be shorter, and count its log points more.
    final_rate = rate(predict(cells[top[0]], m))
    rounds = {key: [] for key in finals}
    order = list(finals)
    for r in range(ROUNDS):
        # Each round starts one further along: a process that has run many trainings runs
        # later ones slower, and no finalist should always come last.
        for key in order[r % len(order):] + order[:r % len(order)]:
            cfg, c = finals[key]
            rounds[key].append(verify(cfg, c, os.path.join(workdir, "grid", name,
                                                                f"{key}-{r}"),
                                           plan(cfg, c, final_rate)))
    for key, runs in rounds.items():
        eps = sorted(rate(run) for run in runs)
        out[key] = {**runs[0], rate_key(runs[0]): eps[len(eps) // 2], "rounds": eps,
                    **({"label": cells[int(key[4:])].label()} if key.startswith("grid") else {})}
    out["top"] = [f"grid{i}" for i in top]
    return out


def main(argv):
    del argv
    workdir = _WORKDIR.value
    if _GRID.value:
        print(json.dumps(grid(workdir, _GRID.value)))
        return
    from tfspeed import bench
    from tfspeed.tuning.predict import rate

    prepare(workdir)
    figures, ratios, details = {}, {}, {}
    for name in _ONLY.value:
        tuned = tune_workload(workdir, name)
        done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--workdir={workdir}",
                               f"--grid={name}"], cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"grid {name} failed: {done.stderr[-3000:]}")
        cells = json.loads(done.stdout.strip().splitlines()[-1])
        best = max((cells[key] for key in cells["top"]), key=rate)
        user, again = rate(cells["user"]), rate(cells["tuned"])
        figures[name] = {
            "user_examples_per_sec": user, "tuned_examples_per_sec": again,
            "tuned_in_tune_examples_per_sec": rate(tuned),
            "grid_best_examples_per_sec": rate(best),
            "grid_best_single_run_examples_per_sec": max(rate(r)
                                                          for r in cells["cells"]),
            "predicted_examples_per_sec": tuned["predicted"], "tune_seconds": tuned["seconds"],
            "tune_wall_seconds": tuned["wall_s"], "grid_cells": len(cells["cells"]),
            # The same settings measured twice: their ratio is the machine's noise.
            "tuned_is_grid_best": cells["tuned"]["resolved"] == best["resolved"]}
        ratios[name] = {"tuned_vs_grid_best": again / rate(best),
                        "tuned_vs_user": again / user,
                        "grid_best_vs_user": rate(best) / user,
                        "prediction_error": tuned["prediction_error"]}
        details[name] = {"grid_best": best["label"], "rounds": {
                             key: cells[key]["rounds"] for key in ["user", "tuned", *cells["top"]]}, "chosen": tuned["chosen"]["label"],
                         "changed": tuned["tuned_flags"]["changed"], "skipped":
                         tuned["skipped"], "tune_output": tuned["stdout"],
                         "grid": sorted(((r["label"], round(rate(r)))
                                         for r in cells["cells"]), key=lambda r: -r[1])}
        print(json.dumps({name: [figures[name], ratios[name]]}), file=sys.stderr)
    config = {"workloads": _ONLY.value, "tune_budget_s": _BUDGET.value, "details": details}
    print(json.dumps(bench.record("tune", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
