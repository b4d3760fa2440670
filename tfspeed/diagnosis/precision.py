"""The precision figures ``tfspeed.diagnose`` advises from: measured, never a rule of thumb.

Where the driver's own precision probe ran (``--precision=auto`` on a CPU with native
bfloat16, or ``--precision=measure``: ``training.job.measure_precision``), its figures are
the ones read, so diagnose and the run it diagnoses agree on one measurement. Elsewhere,
where another policy could pay (float32 on hardware with a mixed policy, or a mixed policy
given), diagnose times both the way the probe does: fresh models of the job under each
policy (``job.engine_at``) on one held real batch, in ``autotune.time_steps``' interleaved
rounds. The issue behind this: diagnose advised "--precision=mixed_bfloat16, ~1.5-3x" on a
transformer whose probe had just measured float32 773.7 against bfloat16 799.1 ms/step.
"""

from __future__ import annotations

import re

from absl import logging

# ``tfspeed.plan.measured_precision``'s reason, as the probe writes it into the plan.
_PROBED = re.compile(r"measured ([0-9.]+) ms/step in float32, ([0-9.]+) in (\w+)")
PROBE_SOURCE = "the driver's precision probe"
OWN_SOURCE = "diagnose's timing of the step in each policy"
ROUNDS = 3  # interleaved timed calls of each policy (the probe's default is 5)


def probed(reason: str) -> dict | None:
    """The probe's figures from its reason in the plan (``plan.reasons["precision"]``).

    Returns:
      ``{"ms_per_step": {policy: ms}, "source": PROBE_SOURCE}``, or None where the reason
      holds no measurement.
    """
    found = _PROBED.search(reason or "")
    if not found:
        return None
    return {"ms_per_step": {"float32": float(found[1]), found[3]: float(found[2])},
            "source": PROBE_SOURCE}


def alternative(plan) -> str | None:
    """The policy to time against the plan's: float32 against a mixed policy, and against
    float32 the mixed policy this hardware would choose; None where there is none."""
    from tfspeed.config import RuntimeConfig
    from tfspeed.runtime import detect_hardware, resolve

    if plan.precision != "float32":
        return "float32"
    hardware = resolve(RuntimeConfig(precision="auto", xla="auto"), detect_hardware(),
                       plan.backend).precision
    return None if hardware == "float32" else hardware


def measure(job, held) -> dict | None:
    """The step's milliseconds in the job's policy and in ``alternative``'s: the probe's
    where it ran, else timed here on ``held`` (a real batch). None where nothing is to
    compare.

    Args:
      job: the prepared job (``training.job.Job``).
      held: one batch of the job's training input, as its pipeline batches it.

    Returns:
      ``{"ms_per_step": {policy: ms}, "source": str}``, or None.
    """
    import keras

    from tfspeed.probes import autotune
    from tfspeed.training import job as job_lib

    plan = job.runtime.plan
    found = probed(plan.reasons.get("precision", ""))
    other = alternative(plan)
    if found or other is None:
        return found
    logging.info("diagnose: precision: timing the step in %s and in %s", plan.precision, other)
    engines = {policy: job_lib.engine_at(job.config, job.runtime, job.schema, job.input_shape,
                                         job.preprocess, policy, batching=job.batching)[0]
               for policy in (plan.precision, other)}
    try:
        seconds = autotune.time_steps(engines, _source(job, held), rounds=ROUNDS,
                                      progress=logging.info)
    finally:
        keras.mixed_precision.set_global_policy(plan.precision)  # engine_at set another
    return {"ms_per_step": {p: round(1000 * s, 3) for p, s in seconds.items()},
            "source": OWN_SOURCE}


def _source(job, held):
    """What the probe times on: the job's in-step source, or ``held`` repeated."""
    import tensorflow as tf

    from tfspeed.data import ingraph

    if ingraph.is_in_step(job.train_data):
        return job.train_data
    options = tf.data.Options()
    options.autotune.enabled = False  # nothing to tune in one batch repeated
    return iter(job.runtime.distribute(
        tf.data.Dataset.from_tensors(held).repeat().with_options(options)))


def advice(plan, measured: dict | None, step) -> list[dict]:
    """A policy measured clearly faster than the plan's (``costs.AUTO_MARGIN``, the
    probe's own margin), with the measured ratio; nothing where none is.

    Args:
      plan: the job's runtime plan (its precision, and the probe's reason).
      measured: ``measure``'s figures, or None (then the probe's reason, if any).
      step: ``(advice, score, gain) -> dict``, the advice's entry.
    """
    from tfspeed.probes.costs import AUTO_MARGIN

    measured = measured or probed(plan.reasons.get("precision", ""))
    if not measured or plan.precision not in measured["ms_per_step"]:
        return []
    ms = measured["ms_per_step"]
    now = ms[plan.precision]
    steps = []
    for policy, t in ms.items():
        if policy == plan.precision or t > (1 - AUTO_MARGIN) * now:
            continue  # no faster within the noise the probe allows: nothing to advise
        ratio = now / max(t, 1e-9)
        steps.append(step(
            f"--precision={policy}: the step measured {t:.1f} ms in {policy} against "
            f"{now:.1f} ms in {plan.precision} ({measured['source']})", ratio,
            f"{ratio:.2f}x measured"))
    return steps


def describe(measured: dict | None) -> str:
    """One line of the figures, for the report; "" where none."""
    if not measured:
        return ""
    return ", ".join(f"{p} {ms:.1f} ms/step" for p, ms in measured["ms_per_step"].items()
                     ) + f" ({measured['source']})"

