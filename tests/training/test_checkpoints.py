"""Resume arithmetic at every boundary: a finished run trains nothing more, a larger
--train_steps continues to the new total, a run cut after its last checkpoint finishes
exactly, under steps_per_execution (fixed and auto), accumulation, --epochs."""

import os
import shutil

import pytest
import tensorflow as tf

from tfspeed.config import Config, DataConfig, ModelConfig, RuntimeConfig, TrainConfig
from tfspeed.training.run import run

TRAIN_RECORDS = 1617  # the digits fixture's train split


def _config(data_dir, model_dir, *, steps=0, epochs=1, spe=1, accum=1, every=0, batch=32):
    return Config(
        data=DataConfig(data_dir=data_dir, batch_size=batch, shuffle=False, cache="memory",
                        eval_split=""),
        model=ModelConfig(name="mlp", width=16),
        runtime=RuntimeConfig(strategy="default", precision="float32", xla="off"),
        train=TrainConfig(train_steps=steps, epochs=epochs, steps_per_execution=spe,
                          grad_accum_steps=accum, checkpoint_every=every, log_every=5,
                          learning_rate=0.01),
        model_dir=str(model_dir),
    ).validate()


def _checkpoints(model_dir) -> list[str]:
    return sorted(name for name in os.listdir(os.path.join(model_dir, "checkpoints"))
                  if name.endswith(".index"))


@pytest.mark.parametrize(
    "settings, updates",
    [
        (dict(steps=40, spe="auto"), 40),  # steps_per_execution=auto: its tuner ran one step more
        (dict(steps=7, spe=3, accum=2, every=2), 7),  # executions end mid-accumulation
        (dict(epochs=2, spe="auto", accum=2, batch=128), 2 * (TRAIN_RECORDS // 128 // 2)),
    ],
    ids=["auto", "spe3-accum2", "epochs-accum2"],
)
def test_a_finished_run_rerun_trains_nothing_more(digits_dir, tmp_path, settings, updates):
    first = run(_config(digits_dir, tmp_path, **settings))
    assert first["optimizer_updates"] == updates
    assert first["micro_steps"] == updates * settings.get("accum", 1)
    saved = _checkpoints(tmp_path)
    again = run(_config(digits_dir, tmp_path, **settings))
    assert again["resumed_from_update"] == again["optimizer_updates"] == updates
    assert again["micro_steps"] == first["micro_steps"]
    assert again["weights_sha256"] == first["weights_sha256"]
    assert _checkpoints(tmp_path) == saved  # no ckpt-{updates + 1}


def test_cut_after_the_last_checkpoint_and_a_larger_total_both_finish_exactly(digits_dir,
                                                                                tmp_path):
    """Every way of arriving at 10 updates gives the weights of one straight run."""
    straight = run(_config(digits_dir, tmp_path / "straight", steps=10, spe=2, every=4))
    assert _checkpoints(tmp_path / "straight") == ["ckpt-10.index", "ckpt-4.index",
                                                   "ckpt-8.index"]

    # Killed after ckpt-8 was written and before ckpt-10: the state file lists 4 and 8.
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / "straight", cut)
    for name in os.listdir(cut / "checkpoints"):
        if name.startswith("ckpt-10."):
            os.remove(cut / "checkpoints" / name)
    tf.train.CheckpointManager(tf.train.Checkpoint(), str(cut / "checkpoints"), max_to_keep=3)
    prefix = str(cut / "checkpoints" / "ckpt-")
    tf.compat.v1.train.update_checkpoint_state(
        str(cut / "checkpoints"), prefix + "8", all_model_checkpoint_paths=[prefix + "4",
                                                                             prefix + "8"])
    resumed = run(_config(digits_dir, cut, steps=10, spe=2, every=4))
    assert resumed["resumed_from_update"] == 8
    assert resumed["optimizer_updates"] == resumed["micro_steps"] == 10
    assert resumed["weights_sha256"] == straight["weights_sha256"]

    # A finished 6-update run, rerun with --train_steps=10 (a constant rate: the same steps).
    run(_config(digits_dir, tmp_path / "longer", steps=6, spe="auto"))
    longer = run(_config(digits_dir, tmp_path / "longer", steps=10, spe="auto"))
    assert longer["resumed_from_update"] == 6
    assert longer["optimizer_updates"] == longer["micro_steps"] == 10
    assert longer["weights_sha256"] == straight["weights_sha256"]
