"""TensorFlow's host allocator and the input pipeline, on real photographs.

    python benchmarks/host_allocator.py [--rounds=3] [--workdir=/tmp/tfspeed-bench]

Without oneDNN, TensorFlow allocates CPU tensors with malloc. On Linux oneDNN is off by
default on CPUs without VNNI or AMX (Skylake and older, Zen 1-3), and everywhere with
TF_ENABLE_ONEDNN_OPTS=0. ``import tfspeed`` then asks for TensorFlow's BFC allocator
instead (``tfspeed.runtime.hostmem``). This runs pipelines of ``benchmarks/input_pipeline.py``
(the same photos, conversions and timing: best epoch, median CPU-ms and page faults per image,
a process per pipeline, interleaved rounds) with oneDNN off, as on such a CPU:

  malloc   TF_CPU_ALLOCATOR_USE_BFC=0: TensorFlow's own choice there (the plain TF way);
  tfspeed  the allocator left to tfspeed (a BFC pool);
  onednn   TF_ENABLE_ONEDNN_OPTS=1 (oneDNN's pool; the default on CPUs with VNNI or AMX, as
           on the machine these figures were taken on), for reference.

The peers run in the same three settings: the pool speeds up the plain tf.data pipelines as
well, and a plain TF user can set the variable too. The ratios say both: tfspeed against
the peers as TensorFlow runs them on such a CPU, and each pipeline with the pool against
malloc. Prints one JSON record.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import input_pipeline as ip  # noqa: E402  (its flags: --workdir, --images, --rounds, ...)

from tfspeed import bench  # noqa: E402

PIPELINES = ("peer_files", "peer_tfrecord", "tfspeed_cold_jpeg", "tfspeed_cold_storage",
             "tfspeed_warm_float32", "tfspeed_warm_uint8")


def environments() -> dict[str, dict]:
    """label -> a process environment (this one's, with the allocator settings replaced)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("TF_CPU_") and k != "TF_ENABLE_ONEDNN_OPTS"}
    return {"malloc": {**base, "TF_ENABLE_ONEDNN_OPTS": "0", "TF_CPU_ALLOCATOR_USE_BFC": "0"},
            "tfspeed": {**base, "TF_ENABLE_ONEDNN_OPTS": "0"},
            "onednn": {**base, "TF_ENABLE_ONEDNN_OPTS": "1"}}


def main(argv):
    del argv
    root = ip._WORKDIR.value
    photos = os.path.join(root, "photos")
    items = bench.make_photos(photos, ip._IMAGES.value, ip._CLASSES.value)
    converted = {name: os.path.join(root, f"tfspeed-{name}", "schema.json")
                 for name in ("jpeg_at_rest", "storage_224")}
    if not all(os.path.exists(path) for path in converted.values()):
        ip.conversions(root, photos, rounds=1)
    ip.write_plain_tfrecords(items, os.path.join(root, "plain"))
    figures = ip.run_rounds(PIPELINES, ip._ROUNDS.value, environments())
    ips = {name: f["images_per_sec"] for name, f in figures.items()}

    def best_peer(label):
        return max(ips[f"peer_files:{label}"], ips[f"peer_tfrecord:{label}"])

    ratios = {
        # What a user on a CPU without VNNI/AMX sees: tfspeed against plain TensorFlow there.
        "cold_jpeg (tfspeed) / best peer (malloc)": ips["tfspeed_cold_jpeg:tfspeed"]
        / best_peer("malloc"),
        "cold_storage (tfspeed) / best peer (malloc)": ips["tfspeed_cold_storage:tfspeed"]
        / best_peer("malloc"),
        # The same with the pool on both sides.
        "cold_jpeg / best peer, both pooled": ips["tfspeed_cold_jpeg:tfspeed"]
        / best_peer("tfspeed"),
        # Each pipeline with tfspeed's pool against malloc, and against oneDNN's pool.
        **{f"{name}: pool / malloc": ips[f"{name}:tfspeed"] / ips[f"{name}:malloc"]
           for name in PIPELINES},
        **{f"{name}: pool / onednn pool": ips[f"{name}:tfspeed"] / ips[f"{name}:onednn"]
           for name in PIPELINES},
    }
    config = {"images": ip._IMAGES.value, "image_size": ip.SIZE, "batch_size": ip.BATCH,
              "rounds": ip._ROUNDS.value, "epochs_per_round": ip._EPOCHS.value,
              "environments": {label: {k: v for k, v in env.items()
                                       if k.startswith(("TF_CPU_", "TF_ENABLE_ONEDNN"))}
                               for label, env in environments().items()},
              "photos": "crops of scikit-learn/scikit-image samples, 256-512 px, JPEG q90"}
    print(json.dumps(bench.record("host_allocator", config, figures, ratios), indent=2))


if __name__ == "__main__":
    app.run(main)
