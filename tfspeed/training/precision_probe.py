"""The precision probe: where bfloat16 is native on a CPU (or ``--precision=measure``), a
few steps of the job's own model in float32 and in the mixed policy decide which it trains
in (``tfspeed.plan.measured_precision``). The driver (``training.job``) and
``tfspeed.fit`` both probe through here; the driver records the choice for a rerun
(``training.decisions``)."""

from __future__ import annotations

import dataclasses

from absl import logging

from tfspeed.config import Config


def precision_to_measure(config: Config, rt) -> bool:
    """``--precision=measure``, or ``auto`` chose bfloat16 for a CPU: measure whether it
    pays for this model."""
    from tfspeed import plan

    return plan.precision_to_measure(config.runtime.precision,
                                     rt.plan.reasons.get("precision", ""))


def measure_precision(config: Config, rt, engine_for, source, run_steps: int,
                      compiles: dict | None = None):
    """Times a few steps of the job's model (its loss and metrics too) in float32 and in the
    mixed policy on one real batch; returns the runtime with the faster policy set
    (``plan.measured_precision``). Logs each stage: tracing a large model takes a while.
    The driver and ``tfspeed.fit`` both probe through here.

    Args:
      engine_for: ``policy -> engine``: a fresh model of the job under that policy.
      source: an in-graph input or an iterator of distributed batches (one held batch).
      run_steps: the run's micro-steps (the probe takes a bounded share of them).
      compiles: if given, learns the step programs the probe compiled (``["precision"]``).
    """
    import keras

    from tfspeed import plan
    from tfspeed.probes import autotune

    candidate = rt.plan.precision
    engines = {}
    for policy in ("float32", candidate):
        logging.info("precision probe: building and tracing the model in %s", policy)
        keras.mixed_precision.set_global_policy(policy)
        engines[policy] = engine_for(policy)
    timed = autotune.time_steps(engines, source, agree=rt.mean_over_workers,
                                run_steps=run_steps, progress=logging.info)
    seconds = {policy: rt.mean_over_workers(t) for policy, t in timed.items()}
    if compiles is not None:
        compiles["precision"] = sum(e.compiled_functions for e in engines.values())
    decided = plan.measured_precision(candidate, seconds, config.runtime.precision)
    choice, why = decided.value, decided.reason
    keras.mixed_precision.set_global_policy(choice)
    logging.info("--precision=%s", why)
    return dataclasses.replace(rt, plan=dataclasses.replace(
        rt.plan, precision=choice, loss_scale=choice == "mixed_float16",
        reasons={**rt.plan.reasons, "precision": why}))


def measure_job_precision(config: Config, rt, schema, inputs, input_shape, steps_per_epoch: int,
                       batching=None, compiles: dict | None = None, *, engine_at):
    """``measure_precision`` for the driver's job: the job's model on a held real batch
    (``engine_at``: ``training.job.engine_at``, passed in: the job imports this module)."""
    import tensorflow as tf

    from tfspeed.data import ingraph, pipeline

    data = config.data
    if ingraph.is_in_step(inputs.train):
        source = inputs.train
    else:
        plain = dataclasses.replace(inputs.configs[data.train_split], shuffle=False,
                                    augment=(), cache="none")
        held = next(iter(pipeline.build_from_config(plain, data.train_split, training=True,
                                                    schema=schema, batching=batching)))
        source = iter(rt.distribute(
            tf.data.Dataset.from_tensors(held).repeat()))

    def engine_for(policy):
        return engine_at(config, rt, schema, input_shape, inputs.preprocess, policy,
                         batching=batching)[0]

    run_steps = config.train.train_steps * config.train.grad_accum_steps or (
        config.train.epochs * steps_per_epoch)
    return measure_precision(config, rt, engine_for, source, run_steps, compiles)
