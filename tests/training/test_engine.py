"""Tests for the TensorFlow engine (tfspeed.training.backends.tensorflow) on real TF: 1 replica
and MirroredStrategy over 2 logical CPUs; and the same exactness checks on each backend's
engine (engine_checks.py, JAX in a process of its own).

Tiny model (Dense(8)->Dense(3)), fixed weights, fixed data order, no shuffling. Max abs weight
differences measured on the 2-core CPU box (TF 2.21, Keras 3.15) are noted next to each tolerance.
"""

import functools
import itertools
import json
import os
import sys

import pytest

from tests import forked
from tests.conftest import REPO
from tests.training import engine_checks
from tests.training import jax_runs as jr
from tfspeed.runtime import mirrored_strategy
from tfspeed.training.backends import tensorflow as eng_lib

eng_lib.ensure_cpu_devices(2)  # before any op runs in this process

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

N_IN, N_CLASSES = 4, 3


@pytest.fixture(autouse=True)
def _float32_policy():
    keras.mixed_precision.set_global_policy("float32")
    yield
    keras.mixed_precision.set_global_policy("float32")


@functools.cache
def _strategy(name: str) -> tf.distribute.Strategy:
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    assert len(tf.config.list_logical_devices("CPU")) >= 2, "needs ensure_cpu_devices(2) first"
    return mirrored_strategy(tuple(d.name for d in tf.config.list_logical_devices("CPU")[:2]))


@functools.cache
def _data(n: int = 96) -> tuple[np.ndarray, np.ndarray]:
    """A learnable task: the label is the argmax of a fixed linear map of x."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, N_IN)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(N_IN, N_CLASSES)), axis=1).astype(np.int32)
    return x, y


@functools.cache
def _initial_weights() -> list[np.ndarray]:
    rng = np.random.default_rng(1)
    shapes = [(N_IN, 8), (8,), (8, N_CLASSES), (N_CLASSES,)]
    return [(0.5 * rng.normal(size=s)).astype(np.float32) for s in shapes]


def _loss_from_logits(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


_OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.01),
}


def _model(softmax: bool = False) -> keras.Model:
    """Dense(8)->Dense(3) with an L2 penalty, so the regularisation path is exercised."""
    model = keras.Sequential(
        [
            keras.Input((N_IN,)),
            keras.layers.Dense(
                8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)
            ),
            # float32 output under mixed precision, as Keras recommends for the last layer.
            keras.layers.Dense(
                N_CLASSES, activation="softmax" if softmax else None, dtype="float32"
            ),
        ]
    )
    model.set_weights(_initial_weights())
    return model


def _engine(
    strategy_name="default",
    optimizer="sgd_momentum",
    policy="float32",
    *,
    global_batch_size,
    loss_fn=_loss_from_logits,
    **options,
) -> eng_lib.TensorFlowEngine:
    keras.mixed_precision.set_global_policy(policy)
    strategy = _strategy(strategy_name)
    with strategy.scope():
        model, opt = _model(), _OPTIMIZERS[optimizer]()
    return eng_lib.TensorFlowEngine(
        model,
        opt,
        strategy,
        loss_fn,
        eng_lib.EngineOptions(**options),
        global_batch_size=global_batch_size,
    )


def _iterator(engine: eng_lib.TensorFlowEngine, batch: int, data=None):
    x, y = _data() if data is None else data
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat()
    return iter(engine.strategy.experimental_distribute_dataset(ds))


def _train(engine: eng_lib.TensorFlowEngine, micro_steps: int, data=None) -> dict:
    spe = engine.options.steps_per_execution
    assert micro_steps % spe == 0
    it = _iterator(engine, engine._global_batch_size, data)
    return [engine.train(it) for _ in range(micro_steps // spe)]


def _weights(engine: eng_lib.TensorFlowEngine) -> list[np.ndarray]:
    """The weights, after checking that every replica holds the same copy."""
    out = []
    for v in engine.model.trainable_variables:
        copies = [c.numpy() for c in getattr(v.value, "values", [v.value])]
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])
        out.append(copies[0])
    return out


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b, strict=True))


def _tape_reference(optimizer: str, batch: int, updates: int) -> list[np.ndarray]:
    """Plain GradientTape loop on one device: the trustworthy baseline."""
    model, opt = _model(), _OPTIMIZERS[optimizer]()
    x, y = _data()
    for i in range(updates):
        xb, yb = x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(_loss_from_logits(yb, model(xb, training=True)))
            loss += tf.add_n(model.losses)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
    return [v.numpy() for v in model.trainable_variables]


# 1. Accumulation equivalence ------------------------------------------------------------------
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_accumulation_matches_big_batch_and_tape(strategy, optimizer):
    k, b, updates = 4, 8, 3
    big = _engine(strategy, optimizer, global_batch_size=k * b)
    _train(big, updates)
    # steps_per_execution=3 is not a multiple of K=4: accumulation spans train() calls.
    acc = _engine(
        strategy, optimizer, global_batch_size=b, grad_accum_steps=k, steps_per_execution=3
    )
    _train(acc, k * updates)

    reference = _tape_reference(optimizer, k * b, updates)
    # 1e-6 ~ 8 float32 ulps of weights of size ~1. Measured max abs diff: big vs tape 0 (1
    # replica) / 6e-8 (2 replicas), accumulated vs big <= 6e-8 (float32 summation order).
    assert _max_diff(_weights(big), reference) < 1e-6
    assert _max_diff(_weights(acc), _weights(big)) < 1e-6
    assert int(acc.optimizer.iterations.numpy()) == updates == int(big.optimizer.iterations.numpy())
    assert int(acc.micro_steps) == k * updates


def test_accumulation_one_device_strategy():
    k, b, updates = 2, 8, 2
    acc = _engine("one_device", global_batch_size=b, grad_accum_steps=k)
    _train(acc, k * updates)
    assert _max_diff(_weights(acc), _tape_reference("sgd_momentum", k * b, updates)) < 1e-6


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_accumulation_mixed_precision(strategy, policy):
    k, b, updates = 4, 8, 3
    loss_scale = policy == "mixed_float16"
    big = _engine(strategy, policy=policy, global_batch_size=k * b, loss_scale=loss_scale)
    _train(big, updates)
    acc = _engine(
        strategy, policy=policy, global_batch_size=b, grad_accum_steps=k, loss_scale=loss_scale
    )
    _train(acc, k * updates)
    assert int(acc.skipped_updates) == 0 == int(big.skipped_updates)

    # Both runs compute in 16 bits but round different partial sums (4 micro-batches vs one
    # batch), so each gradient carries a relative error of a few units of the format's
    # precision (2^-8 for bfloat16, 2^-11 for float16). The weights move by `moved`; the
    # difference stays within one ulp of that move (eps * moved). Measured diff / (eps * moved):
    # bfloat16 0.23 (1.4e-4 abs) / 0.18 mirrored; float16 0.30 (2.3e-5 abs) / 0.25 mirrored.
    eps = 2.0**-8 if policy == "mixed_bfloat16" else 2.0**-11
    moved = _max_diff(_weights(big), _initial_weights())
    diff = _max_diff(_weights(acc), _weights(big))
    assert diff < eps * moved, f"diff {diff:.2e} vs bound {eps * moved:.2e}"


# 2. XLA and steps_per_execution do not change the numbers -------------------------------------
@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_xla_and_steps_per_execution_give_same_weights(strategy):
    runs = {}
    for xla, spe in [(False, 1), (True, 1), (False, 3), (True, 3)]:
        engine = _engine(
            strategy,
            "adam",
            global_batch_size=8,
            grad_accum_steps=2,
            steps_per_execution=spe,
            xla=xla,
        )
        _train(engine, 6)
        runs[xla, spe] = _weights(engine)
        assert int(engine.optimizer.iterations.numpy()) == 3
        if xla:  # XLA really ran: one jit_compile trace per replica, each on its own device.
            replicas = engine.strategy.num_replicas_in_sync
            assert engine._forward_backward.experimental_get_tracing_count() == replicas
    # Measured max abs diff: exactly 0 for spe 3 vs 1; 6e-8 (default) / 3e-8 (mirrored) for
    # XLA, which fuses and orders float32 sums differently.
    for key, weights in runs.items():
        assert _max_diff(weights, runs[False, 1]) < 1e-6, key


# 3. The matrix --------------------------------------------------------------------------------
_AXES = {
    "strategy": ["default", "mirrored"],
    "policy": ["float32", "mixed_bfloat16", "mixed_float16"],
    "xla": [False, True],
    "accum": [1, 2],
    "spe": [1, 3],
}
# Six rows in which every pair of values of any two of policy/xla/accum/spe occurs (a strength-2
# covering array), run under both strategies: 12 cases instead of 48, and mirrored meets every
# pair of the other axes. TFSPEED_FULL_MATRIX=1 runs all 48 (measured: all pass, 56 s).
_PAIRWISE = [
    ("float32", False, 1, 1),
    ("float32", True, 2, 3),
    ("mixed_bfloat16", False, 1, 3),
    ("mixed_bfloat16", True, 2, 1),
    ("mixed_float16", False, 2, 1),
    ("mixed_float16", True, 1, 3),
]
_MATRIX = (
    list(itertools.product(*_AXES.values()))
    if os.environ.get("TFSPEED_FULL_MATRIX")
    else [(strategy, *row) for strategy in _AXES["strategy"] for row in _PAIRWISE]
)


def test_pairwise_rows_cover_all_pairs():
    axes = list(_AXES.values())[1:]
    for (i, a), (j, b) in itertools.combinations(enumerate(axes), 2):
        assert {(r[i], r[j]) for r in _PAIRWISE} == set(itertools.product(a, b))


@pytest.mark.parametrize("strategy,policy,xla,accum,spe", _MATRIX)
def test_matrix_trains(strategy, policy, xla, accum, spe):
    micro_steps = 12
    engine = _engine(
        strategy,
        "adam",
        policy,
        global_batch_size=8,
        grad_accum_steps=accum,
        steps_per_execution=spe,
        xla=xla,
        loss_scale=policy == "mixed_float16",
    )
    x, y = _data()
    eval_ds = engine.strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    )
    before = engine.evaluate(eval_ds)["loss"]
    logs = _train(engine, micro_steps)
    after = engine.evaluate(eval_ds)["loss"]
    assert after < before
    assert int(engine.optimizer.iterations.numpy()) == micro_steps // accum
    assert int(logs[-1]["updates"]) == micro_steps // accum
    assert int(logs[-1]["skipped"]) == 0
    assert int(engine.micro_steps) == micro_steps
    assert all(np.isfinite(float(log["loss"])) for log in logs)


# 4. Loss scaling with non-finite gradients ----------------------------------------------------
def test_overflow_is_skipped_and_scale_drops():
    # 2^20 * dL/dlogits overflows float16 (max 65504): the first updates must be skipped.
    engine = _engine(
        "mirrored",
        "adam",
        "mixed_float16",
        global_batch_size=8,
        grad_accum_steps=2,
        steps_per_execution=6,
        loss_scale=True,
        initial_loss_scale=2.0**20,
    )
    logs = _train(engine, 36)
    skipped, updates = int(logs[-1]["skipped"]), int(logs[-1]["updates"])
    assert skipped >= 1
    assert updates + skipped == 36 // 2
    assert updates >= 10  # training went on after the scale came down
    assert float(engine.loss_scale) == 2.0**20 / 2**skipped
    assert float(logs[-1]["loss"]) < float(logs[0]["loss"])
    assert all(np.isfinite(w).all() for w in _weights(engine))


def test_nan_micro_batch_skips_exactly_its_update():
    """A NaN on replica 1 in micro-batch 3 of 6 (K=2) must drop update 2 and nothing else."""
    x, y = _data()
    x, y = x[:48].copy(), y[:48]
    x[8 * 2 + 6, 0] = np.nan  # micro-batch 2 (0-based), second half: replica 1 under mirrored
    good = np.r_[0:16, 32:48]  # the same run without micro-batches 2 and 3 (update 2)
    clean = _engine("mirrored", "adam", global_batch_size=8, grad_accum_steps=2, loss_scale=True)
    _train(clean, 4, data=(x[good], y[good]))
    noisy = _engine("mirrored", "adam", global_batch_size=8, grad_accum_steps=2, loss_scale=True)
    _train(noisy, 6, data=(x, y))
    assert int(noisy.skipped_updates) == 1
    assert int(noisy.optimizer.iterations.numpy()) == 2
    assert float(noisy.loss_scale) == 2.0**14
    # Loss scales are powers of two, exact in float32: the weights must agree bit for bit.
    assert _max_diff(_weights(noisy), _weights(clean)) < 1e-7


def test_loss_scale_grows_after_finite_updates():
    engine = _engine(
        global_batch_size=8,
        loss_scale=True,
        initial_loss_scale=4.0,
        loss_scale_growth_interval=2,
        steps_per_execution=5,
    )
    _train(engine, 5)
    assert float(engine.loss_scale) == 16.0
    assert int(engine.optimizer.iterations.numpy()) == 5


# Checkpoints, evaluation, argument checks ------------------------------------------------------
@pytest.mark.parametrize("restore_into", ["mirrored", "default"])
def test_checkpoint_mid_accumulation(tmp_path, restore_into):
    """Saved after 6 micro-steps with K=4: one update plus half an accumulated one."""
    first = _engine(
        "mirrored", "adam", global_batch_size=8, grad_accum_steps=4, steps_per_execution=3
    )
    it = _iterator(first, 8)
    first.train(it), first.train(it)
    path = tf.train.Checkpoint(**first.checkpoint_items).write(str(tmp_path / "ckpt"))
    first.train(it), first.train(it)

    second = _engine(
        restore_into, "adam", global_batch_size=8, grad_accum_steps=4, steps_per_execution=3
    )
    tf.train.Checkpoint(**second.checkpoint_items).read(path).assert_consumed()
    assert int(second.micro_steps) == 6 and int(second.optimizer.iterations.numpy()) == 1
    x, y = _data()
    it = _iterator(second, 8, data=(x[48:], y[48:]))
    second.train(it), second.train(it)
    assert int(second.optimizer.iterations.numpy()) == 3
    assert _max_diff(_weights(second), _weights(first)) < 1e-6  # measured 0 / 3e-8


@pytest.mark.parametrize("strategy", ["default", "mirrored"])
def test_evaluate_matches_keras_on_partial_batches(strategy):
    keras.mixed_precision.set_global_policy("float32")
    s = _strategy(strategy)
    with s.scope():  # a softmax model and a loss on probabilities this time
        model, opt = _model(softmax=True), keras.optimizers.SGD(0.1)
    engine = eng_lib.TensorFlowEngine(
        model, opt, s, keras.losses.sparse_categorical_crossentropy, global_batch_size=8
    )
    x, y = _data(20)  # batches of 8, 8, 4: the last one is split 2+2 (or 4) over replicas
    result = engine.evaluate(
        s.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    )
    probs = model(x)
    expected_loss = np.mean(keras.losses.sparse_categorical_crossentropy(y, probs))
    expected_loss += float(tf.add_n(model.losses))
    assert result["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert result["accuracy"] == pytest.approx(np.mean(np.argmax(probs, 1) == y))


def test_rejects_what_fails_under_tf_distribute():
    mirrored = _strategy("mirrored")
    with mirrored.scope():
        model = _model()
        stock_accum = keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)
        lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    outside = keras.optimizers.SGD(0.1)
    for opt, message in [
        (stock_accum, "keras#20582"),
        (lso, "LossScaleOptimizer"),
        (outside, "strategy.scope"),
    ]:
        with pytest.raises(ValueError, match=message):
            eng_lib.TensorFlowEngine(model, opt, mirrored, _loss_from_logits, global_batch_size=8)
    with pytest.raises(ValueError, match="grad_accum_steps"):
        eng_lib.EngineOptions(grad_accum_steps=0)


def test_loss_fn_must_not_reduce():
    reducing = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    engine = _engine(global_batch_size=8, loss_fn=reducing)
    with pytest.raises(ValueError, match="one loss per example"):
        _train(engine, 1)


# The same checks on each backend's engine adapter -------------------------------------------
@functools.cache
def _checks(backend: str) -> dict:
    """``engine_checks.run()`` on ``backend``: here for TensorFlow, a JAX process for JAX."""
    if backend == "tensorflow":
        return engine_checks.run()
    done = forked.run([sys.executable, "-m", "tests.training.engine_checks"], cwd=REPO,
                      env=jr.env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["tensorflow", "jax"])
def test_each_backend_accumulates_exactly_and_records_the_first_nonfinite_loss(backend):
    checks = _checks(backend)
    assert checks["backend"] == backend and checks["is_engine"]
    # Measured: 3e-8 on both backends (float32 summation order).
    assert checks["accumulated_vs_big"] < 1e-6
    assert checks["updates"] == 3 and checks["micro_steps"] == 12
    assert checks["nonfinite_step"] == 3 and not checks["nonfinite_loss_finite"]


def test_jax_steps_on_the_cpu_run_one_loopless_program():
    """Steps per call on the CPU: one program for 12 micro-steps in calls of 3, with no
    device loop in it (XLA:CPU ran a loop body's convolutions 6-10x slower)."""
    checks = _checks("jax")
    assert checks["platform"] == "cpu"
    assert checks["while_loops"] == 0
    assert checks["programs"] == 1


def test_backends_train_and_evaluate_alike():
    """One step written once: both backends' engines give the same evaluation after the
    same training (float32, same data order)."""
    tf_eval, jax_eval = _checks("tensorflow")["evaluate"], _checks("jax")["evaluate"]
    assert tf_eval.keys() == jax_eval.keys() == {"loss", "accuracy"}
    assert jax_eval["loss"] == pytest.approx(tf_eval["loss"], rel=1e-5)
    assert jax_eval["accuracy"] == tf_eval["accuracy"]
