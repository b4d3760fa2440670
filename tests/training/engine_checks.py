"""The engine's exactness on whichever Keras backend runs this process, built as a job builds
it (``runtime.setup`` and ``trainer.make_engine``'s adapter): test_engine.py runs it in its
own TensorFlow process and, with ``KERAS_BACKEND=jax``, as ``python -m
tests.training.engine_checks`` (a process has one Keras backend).

Tiny Dense(8)->Dense(3) with an L2 penalty, Adam, fixed weights and data order."""

import json

import keras
import numpy as np

from tfspeed.config import RuntimeConfig
from tfspeed.runtime import backends, setup
from tfspeed.training.engine import Engine, EngineOptions


def _data(n=96):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, np.argmax(x @ rng.normal(size=(4, 3)), axis=1).astype(np.int32)


def _model():
    rng = np.random.default_rng(1)
    model = keras.Sequential([
        keras.Input((4,)),
        keras.layers.Dense(8, activation="relu", kernel_regularizer=keras.regularizers.L2(1e-3)),
        keras.layers.Dense(3)])
    model.set_weights([(0.5 * rng.normal(size=s)).astype(np.float32)
                       for s in [(4, 8), (8,), (8, 3), (3,)]])
    return model


def _loss(y, logits):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


def _train(runtime, batch, micro_steps, data=None, **options):
    """An engine trained on ``micro_steps`` batches of ``batch`` in order; its weights."""
    adapter = backends.engine_class(runtime.backend)
    with runtime.scope():
        model, optimizer = _model(), keras.optimizers.Adam(0.01)
    engine = adapter(model, optimizer, runtime.placement, _loss, EngineOptions(**options),
                     global_batch_size=batch)
    batches = iter(_batches(runtime, _data() if data is None else data, batch))
    logs = [engine.train(batches) for _ in range(micro_steps // engine.options.steps_per_execution)]
    engine.sync_model()
    return engine, [np.asarray(v.numpy()) for v in engine.model.trainable_variables], logs


def _batches(runtime, data, batch):
    """``data`` in batches of ``batch``, in order, as the job feeds the engine."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices(data).batch(batch)
    return runtime.distribute(ds)


def run() -> dict:
    """The figures test_engine.py checks, for this process's backend."""
    runtime = setup(RuntimeConfig(precision="float32", xla="off", intra_op_threads=0))
    big, big_weights, _ = _train(runtime, 32, 3)
    # steps_per_execution=3 is not a multiple of K=4: accumulation spans train() calls.
    acc, acc_weights, logs = _train(runtime, 8, 12, grad_accum_steps=4, steps_per_execution=3)
    x, y = _data()
    # micro-batch 3: its loss is not finite (an inf: relu(NaN) is 0 on TensorFlow's CPU kernel,
    # so a NaN input gives a finite loss there and NaN weights one step later)
    x[8 * 2, 0] = np.inf
    nan, _, _ = _train(runtime, 8, 4, data=(x, y))
    step, loss = nan.first_nonfinite_loss
    return {
        "backend": runtime.backend,
        "is_engine": isinstance(acc, Engine),
        "accumulated_vs_big": max(float(np.abs(a - b).max())
                                  for a, b in zip(acc_weights, big_weights, strict=True)),
        "updates": int(logs[-1]["updates"]), "micro_steps": int(acc.micro_steps),
        "nonfinite_step": int(step), "nonfinite_loss_finite": bool(np.isfinite(float(loss))),
        "evaluate": big.evaluate(_batches(runtime, _data(40), 16)),
        **(_cpu_program(acc, runtime) if runtime.backend == "jax" else {}),
    }


def _cpu_program(engine, runtime) -> dict:
    """The JAX engine's training program on the CPU, as ``train`` calls it (one batch):
    XLA:CPU ran a loop's convolutions as generic loops (6-10x slower steps), so steps run
    one dispatch each there, with no loop in the program."""
    import jax

    batch = next(iter(_batches(runtime, _data(), 8)))
    sums = [np.zeros([len(engine.metric_names) + 2], np.float32), np.zeros([3], np.int32)]
    lowered = engine._run.lower(engine._state, engine._placement.batches([batch]),
                                np.int32(1), *sums, np.float32(1))
    return {"platform": jax.devices()[0].platform,
            "while_loops": lowered.compile().as_text().count(" while("),
            "programs": engine.compiled_functions}


if __name__ == "__main__":
    print(json.dumps(run()))
