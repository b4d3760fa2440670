"""Shared helpers for ``benchmarks/``: timing a dataset, and one JSON record format.

Every benchmark prints one record::

    {"name": ..., "config": {...}, "figures": {...}, "ratios": {...},
     "versions": {...}, "machine": {...}}

Figures are compared as ratios within one run: these machines are shared and noisy.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

from tfspeed.util import system
from tfspeed.util.system import peak_rss_mb  # noqa: F401 -- benchmarks use it from here


def time_dataset(ds, batches: int, warmup: int, batch_size: int) -> dict:
    """Iterates ``warmup`` batches untimed, then times ``batches`` batches.

    Returns:
      ``{"images_per_sec", "batches_per_sec", "seconds", "batches", "peak_rss_mb"}``.
    """
    iterator = iter(ds)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    seconds = time.perf_counter() - start
    return {
        "images_per_sec": batches * batch_size / seconds,
        "batches_per_sec": batches / seconds,
        "seconds": seconds,
        "batches": batches,
        "peak_rss_mb": peak_rss_mb(),
    }


RESULT = "RESULT "  # a contender process prints its result as this prefix and one JSON line


def compile_package() -> None:
    """Writes tfspeed's bytecode, as ``pip install`` does, before contenders are timed.

    tfspeed imports most of its modules where they are first used (inside ``optimize``, in
    a timed run). From a source checkout, with ``PYTHONDONTWRITEBYTECODE`` set (as many
    containers set it), every contender would compile them again: 0.2 s of a 0.3 s run,
    which no installed copy pays."""
    import compileall

    compileall.compile_dir(os.path.dirname(os.path.abspath(__file__)), quiet=1)


def run_contender(command: list[str], name: str, check: bool = True, **popen) -> dict:
    """Runs one contender's process (``command``) and returns the JSON it printed after
    ``RESULT``. If it failed: exits naming ``name`` with its stderr's tail, or (``check``
    false, to keep the other rounds) returns ``{"failed": name, "error": that tail}``."""
    proc = subprocess.run(command, capture_output=True, text=True, check=False, **popen)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(RESULT)]
    if lines and not proc.returncode:
        return json.loads(lines[-1][len(RESULT):])
    if check:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-3000:]}")
    return {"failed": name, "error": proc.stderr.strip()[-1500:]}


def train_job(repo: str, source: str, extra: list[str], data_dir: str, model_dir: str,
          env: dict) -> dict:
    """``python -m tfspeed.train`` of the checkout at ``repo`` in a fresh process and a fresh
    ``model_dir``; its report's figures and the process's wall seconds."""
    shutil.rmtree(model_dir, ignore_errors=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONPATH": repo, **env}
    command = [sys.executable, "-m", "tfspeed.train", *extra, f"--prepare_source={source}",
               f"--data_dir={data_dir}", f"--model_dir={model_dir}"]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=repo, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    path = os.path.join(model_dir, "report.json")
    if proc.returncode or not os.path.exists(path):
        return {"failed": " ".join(command[1:]), "error": proc.stderr.strip()[-1500:],
                "wall_seconds": wall}
    with open(path) as f:
        report = json.load(f)
    text = "real_tokens_per_sec" in report
    throughput = report.get("batch_examples_per_sec", report.get("examples_per_sec"))
    return {
        "throughput": report["real_tokens_per_sec"] if text else throughput,
        "unit": "real tokens/s" if text else "examples/s",
        "step_time_ms": report["step_time_ms"], "too_few_steps": report["too_few_steps"],
        "eval_accuracy": report.get("eval_accuracy"), "eval_loss": report.get("eval_loss"),
        "wall_seconds": wall, "updates": report["optimizer_updates"],
        "precision": report["runtime"]["precision"], "xla": report["runtime"]["xla"],
        "placement": report["input"]["placement"]["where"],
        "batching": (report["input"].get("batching") or {}).get("mode"),
        "steps_per_execution": report["steps_per_execution"].get("value"),
        "compiled_programs": report.get("compiled_programs"),
    }


def summary(values: list) -> dict | None:
    """Median, min and max of the numbers in ``values`` (None where there are none)."""
    values = [v for v in values if isinstance(v, int | float)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def round_figures(rounds: list[dict], keys) -> dict:
    """A contender's figures over its rounds: every round, how many failed, and the
    ``summary`` of each of ``keys`` over the others."""
    usable = [r for r in rounds if "failed" not in r]
    return {"rounds": rounds, "failed_rounds": len(rounds) - len(usable),
            **{k: summary([r.get(k) for r in usable]) for k in keys}}


def commit(tree: str) -> str:
    """The short commit of the checkout at ``tree`` ('?' where it is not a git checkout)."""
    import subprocess

    done = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True)
    return done.stdout.strip() or "?"


def machine() -> dict:
    return {"cpus": os.cpu_count(), "machine": platform.machine(), "node": platform.node()}


def record(name: str, config: dict, figures: dict, ratios: dict) -> dict:
    """The one JSON record every benchmark prints."""
    return {"name": name, "config": config, "figures": figures, "ratios": ratios,
            "versions": system.versions(), "machine": machine()}


def accuracy_target(peers: dict[str, list[dict]], metric: str) -> dict | None:
    """Time-to-accuracy's target: what the best stock peer reaches after its first pass.

    Args:
      peers: each peer's rounds, each with ``eval_history`` (one evaluation per pass).
      metric: ``accuracy`` (higher is better) or ``loss`` (lower is better).

    Returns:
      ``{"metric", "value", "set_by"}``: the best peer's median over its rounds; None where
      no peer has an evaluation.
    """
    sense = -1 if metric == "loss" else 1
    firsts = {}
    for peer, rounds in peers.items():
        values = [r["eval_history"][0][metric] for r in rounds if r.get("eval_history")]
        if values:
            firsts[peer] = statistics.median(values)
    if not firsts:
        return None
    best = max(firsts, key=lambda peer: sense * firsts[peer])
    return {"metric": metric, "value": firsts[best], "set_by": f"{best} after one pass"}


def seconds_to(target: dict, history: list[dict] | None) -> float:
    """Training seconds (``train_seconds``: evaluations left out) to the first evaluation of
    ``history`` that reaches ``target``; inf where none does."""
    sense = -1 if target["metric"] == "loss" else 1
    for entry in history or []:
        if sense * (entry[target["metric"]] - target["value"]) >= -1e-12:
            return entry["train_seconds"]
    return math.inf


def seconds_to_target(target: dict, histories: list) -> dict:
    """Time-to-target over rounds: the median with min-max. A round that never reaches the
    target counts as infinitely slow: a median (or max) that is infinite reads None, and
    ``reached`` says how many rounds got there."""
    seconds = [seconds_to(target, history) for history in histories]
    finite = [t for t in seconds if math.isfinite(t)]
    median = statistics.median(seconds) if seconds else math.inf
    return {"median": median if math.isfinite(median) else None,
            "min": min(finite, default=None),
            "max": max(finite) if finite and len(finite) == len(seconds) else None,
            "reached": len(finite), "rounds": len(seconds)}


# Photographs bundled with scikit-learn and scikit-image (no download): varied real scenes,
# colour and grey, 300 to 1,411 px a side.
SKLEARN_PHOTOS = ("china.jpg", "flower.jpg")
SKIMAGE_PHOTOS = ("astronaut.png", "chelsea.png", "coffee.png", "hubble_deep_field.jpg",
                  "ihc.png", "motorcycle_left.png", "motorcycle_right.png", "retina.jpg",
                  "rocket.jpg", "brick.png", "camera.png", "grass.png", "gravel.png", "moon.png")


def sample_photos() -> list:
    """The bundled sample photographs as RGB PIL images."""
    from PIL import Image

    try:
        import skimage
        import sklearn.datasets
    except ImportError as e:
        from tfspeed.errors import UsageError

        raise UsageError(f"the benchmarks' photographs come with scikit-image and scikit-learn "
                         f"({e}): pip install -e '.[bench]'") from None
    folders = [(os.path.join(os.path.dirname(sklearn.datasets.__file__), "images"), SKLEARN_PHOTOS),
               (os.path.join(os.path.dirname(skimage.__file__), "data"), SKIMAGE_PHOTOS)]
    return [Image.open(os.path.join(folder, name)).convert("RGB")
            for folder, names in folders for name in names]


def make_photos(root: str, count: int, classes: int, seed: int = 0,
                sides: tuple[int, int] = (256, 512), quality: int = 90) -> list[tuple[str, int]]:
    """Writes ``count`` JPEGs (``quality``) cut from real photographs: random crops of the
    bundled sample photos, resized to ``sides`` px a side and sometimes mirrored.

    Generated images (noise, smooth fields) decode and compress unlike photographs, and a
    win on them can be a loss on photos: benchmarks use these.

    Returns:
      ``[(path, label)]``; files already there are kept.
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    photos, items = None, []
    for i in range(count):
        label = i % classes
        path = os.path.join(root, f"class{label}", f"{i:05d}.jpg")
        items.append((path, label))
        draws = rng.uniform(size=5), rng.integers(0, 2**31, size=2), rng.integers(
            sides[0], sides[1] + 1, size=2)  # drawn even for a file that exists: same crops
        if os.path.exists(path):
            continue
        photos = photos or sample_photos()
        (pick, scale, sx, sy, flip), (ox, oy), (width, height) = draws
        photo = photos[int(pick * len(photos))]
        w, h = photo.size
        cw, ch = max(int(w * (0.35 + 0.65 * scale) * (0.8 + 0.2 * sx)), 32), max(int(
            h * (0.35 + 0.65 * scale) * (0.8 + 0.2 * sy)), 32)
        x, y = int(ox % (w - cw + 1)), int(oy % (h - ch + 1))
        crop = photo.crop((x, y, x + cw, y + ch)).resize((int(width), int(height)),
                                                          Image.Resampling.BICUBIC)
        if flip < 0.5:
            crop = crop.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        crop.save(path, "JPEG", quality=quality)
    return items


def guide_decode(jpeg, size: int):
    """The TF guide's per-image work ("Load and preprocess images"): decode, resize to
    ``size``, scale to [0, 1] in float32."""
    import tensorflow as tf

    return tf.image.resize(tf.io.decode_jpeg(jpeg, channels=3), [size, size]) / 255.0


def guide_files_pipeline(items: list[tuple[str, int]], size: int, batch_size: int,
                         drop_remainder: bool = False):
    """The TF guide's file pipeline over ``items`` (``make_photos``' paths and labels):
    from_tensor_slices(paths).map(read + decode + resize, AUTOTUNE).batch.prefetch."""
    import tensorflow as tf

    paths, labels = [p for p, _ in items], [label for _, label in items]
    ds = tf.data.Dataset.from_tensor_slices((paths, labels))
    ds = ds.map(lambda p, y: (guide_decode(tf.io.read_file(p), size), y),
                num_parallel_calls=tf.data.AUTOTUNE)
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


def run_converter(source: str, output: str, *extra: str) -> dict:
    """Runs ``scripts/to_tfrecord.py`` as users do, into a fresh ``output`` (what an earlier
    run left there is deleted first, untimed: a first conversion writes into nothing).

    Returns:
      ``{"records_per_sec", "summary", "storage", "shards"}``: the rate as the converter
      reports it, its last line, and what ``schema.json`` records.
    """
    import json
    import shutil
    import subprocess
    import sys

    shutil.rmtree(output, ignore_errors=True)
    os.sync()  # the deletion's disk work done before the clock starts
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "scripts", "to_tfrecord.py")
    proc = subprocess.run([sys.executable, script, f"--source={source}", f"--output={output}",
                           "--validation_fraction=0", "--noprogress", *extra],
                          capture_output=True, text=True, check=False)
    if proc.returncode:
        raise SystemExit(f"to_tfrecord.py {' '.join(extra)} failed:\n{proc.stderr[-3000:]}")
    line = proc.stdout.strip().splitlines()[-1]
    with open(os.path.join(output, "schema.json")) as f:
        schema = json.load(f)
    return {"records_per_sec": float(line.rsplit("(", 1)[1].split()[0]), "summary": line,
            "storage": schema.get("storage"),
            "shards": len([n for n in os.listdir(output) if n.endswith(".tfrecord")])}


# ---------------------------------------------------------------- comparing two records
LOWER_IS_BETTER = ("_ms", "seconds", "rss", "_mb", "memory", "time")
HIGHER_IS_BETTER = ("per_sec", "throughput", "steps_per", "images_per", "examples_per")


def direction(name: str) -> int:
    """+1 when a larger value is better, -1 when smaller is better, 0 when unknown."""
    lowered = name.lower()
    if any(key in lowered for key in HIGHER_IS_BETTER):
        return 1
    if any(key in lowered for key in LOWER_IS_BETTER):
        return -1
    return 0


def flatten(figures: dict, prefix: str = "") -> dict[str, float]:
    """{"a": {"b": 1.0}} -> {"a/b": 1.0}, numbers only."""
    flat = {}
    for key, value in figures.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "/"))
        elif isinstance(value, int | float) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


def compare(old: dict, new: dict, threshold: float = 0.10) -> list[dict]:
    """Figures of ``new`` worse than ``old`` by more than ``threshold`` (a fraction).

    Only figures with a known direction (throughput up, time/memory down) are judged.
    Returns one row per judged figure: name, old, new, change, regression.
    """
    old_flat, new_flat = flatten(old.get("figures", {})), flatten(new.get("figures", {}))
    rows = []
    for name in sorted(old_flat.keys() & new_flat.keys()):
        sign = direction(name.rsplit("/", 1)[-1])
        before, after = old_flat[name], new_flat[name]
        if not sign or before == 0:
            continue
        change = (after - before) / abs(before)
        rows.append({"name": name, "old": before, "new": after, "change": change,
                     "regression": sign * change < -threshold})
    return rows


def _load(path: str) -> dict:
    import json

    from tfspeed.errors import UsageError

    try:
        with open(path) as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot read benchmark record {path}: {e}") from None
    if not isinstance(record, dict) or "figures" not in record:
        raise UsageError(f"{path} is not a tfspeed benchmark record (no 'figures')")
    return record


def compare_main(argv: list[str]) -> int:
    """``python -m tfspeed.bench compare OLD.json NEW.json [--threshold=0.1]``.

    Prints every judged figure and exits 1 when any regressed beyond the threshold.
    """
    import argparse

    from tfspeed.errors import UsageError

    parser = argparse.ArgumentParser(
        prog="python -m tfspeed.bench compare",
        description="Compares two JSON records of one benchmark (benchmarks/*.py print them) "
                    "and exits 1 when a figure regressed beyond --threshold.")
    parser.add_argument("old", metavar="OLD.json")
    parser.add_argument("new", metavar="NEW.json")
    parser.add_argument("--threshold", type=float, default=0.10,
                        help="relative change counted as a regression (default 0.10)")
    args = parser.parse_args(argv)
    if not 0 < args.threshold < 10:
        raise UsageError(f"--threshold={args.threshold} must be a fraction such as 0.1")
    old, new = _load(args.old), _load(args.new)
    if old.get("name") != new.get("name"):
        raise UsageError(f"{args.old} is benchmark {old.get('name')!r} but {args.new} is "
                         f"{new.get('name')!r}: compare records of the same benchmark")
    if old.get("config") != new.get("config"):
        print("note: the two records ran with different configs")
    rows = compare(old, new, args.threshold)
    for row in rows:
        flag = "REGRESSION" if row["regression"] else "ok"
        print(f"{flag:10s} {row['name']}: {row['old']:.4g} -> {row['new']:.4g} "
              f"({row['change']:+.1%})")
    regressions = sum(row["regression"] for row in rows)
    print(f"{regressions} regression(s) beyond {args.threshold:.0%} in {len(rows)} figures")
    return 1 if regressions else 0


def main(argv: list[str] | None = None) -> int:
    import sys

    from tfspeed.errors import UsageError, exit_on_usage_error
    from tfspeed.util.cli import HELP_ARGS, HELPFULL_ARGS

    argv = sys.argv[1:] if argv is None else argv
    if any(arg in HELP_ARGS + HELPFULL_ARGS for arg in argv):
        return compare_main(["--help"])  # the one subcommand's help; argparse exits 0
    if not argv or argv[0] != "compare":
        print("usage: python -m tfspeed.bench compare OLD.json NEW.json [--threshold=0.1]",
              file=sys.stderr)
        return 2

    def run() -> int:
        if len(argv) < 3:
            raise UsageError("compare needs two records: OLD.json NEW.json")
        return compare_main(argv[1:])

    return exit_on_usage_error(run)


if __name__ == "__main__":
    raise SystemExit(main())
