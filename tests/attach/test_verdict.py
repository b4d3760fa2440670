"""tfspeed.diagnose(dataset, model) from Python, and the verdict it draws from its timings."""

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tfspeed
from tfspeed.attach import graph, verdict


def digits_pipeline():
    digits = load_digits()
    ds = tf.data.Dataset.from_tensor_slices((digits.images.astype("float32"), digits.target))
    return ds.map(lambda x, y: (tf.reshape(x / 16.0, (8, 8, 1)), y)).shuffle(512).batch(64)


def test_diagnose_times_a_users_model_and_leaves_it_as_it_was(tmp_path):
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(),
                              keras.layers.Dense(10)])
    model.compile("adam", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    result = tfspeed.diagnose(digits_pipeline(), model, seconds=0.3, out_dir=str(tmp_path))
    assert set(result["ms_per_batch"]) == {"input_alone", "step_alone", "together",
                                           "step_alone_xla"}
    assert all(v > 0 for v in result["ms_per_batch"].values())
    assert result["pipeline"] == {"storable": True, "reason": "Batch"}
    assert (tmp_path / "diagnose.json").exists() and (tmp_path / "diagnose.png").exists()
    after = model.get_weights()
    assert all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))
    assert int(model.optimizer.iterations) == 0 and not model.jit_compile


def test_a_step_slower_than_its_input_is_compute_bound_with_the_step_side_figures():
    plan = graph.plan(digits_pipeline())
    ms = {"input_alone": 2.0, "step_alone": 10.0, "together": 10.4, "step_alone_xla": 6.0}
    result = verdict.decide(ms, plan, digits_pipeline().element_spec)
    assert result["verdict"] == verdict.COMPUTE_BOUND
    first = result["next_steps"][0]
    assert "jit_compile=True" in first["advice"] and first["expected_gain"] == "1.67x (measured)"
    assert not any("optimize" in s["advice"] for s in result["next_steps"])


def test_a_negligible_input_is_compute_bound_even_when_other_load_slowed_together():
    plan = graph.plan(digits_pipeline())
    ms = {"input_alone": 0.1, "step_alone": 50.0, "together": 80.0}
    result = verdict.decide(ms, plan, digits_pipeline().element_spec, cores=2)
    assert result["verdict"] == verdict.COMPUTE_BOUND
    assert "under 10% of a step: the rest is other load" in result["why"]
    # An input that could take a tenth of the step on the CPU's cores may be what slows it.
    ms = {"input_alone": 4.0, "step_alone": 50.0, "together": 80.0}
    shared = verdict.decide(ms, plan, digits_pipeline().element_spec, cores=2)
    assert shared["verdict"].startswith("input-bound")


def test_an_input_slower_than_its_step_is_input_bound_and_optimize_comes_first():
    plan = graph.plan(digits_pipeline())
    ms = {"input_alone": 30.0, "step_alone": 10.0, "together": 31.0, "step_alone_xla": 12.0}
    result = verdict.decide(ms, plan, digits_pipeline().element_spec)
    assert result["verdict"] == "input-bound (highly)"
    assert result["next_steps"][0]["advice"].startswith("train = tfspeed.optimize(train)")
    assert result["next_steps"][0]["expected_gain"] == "up to 3.1x (the step alone's pace)"
