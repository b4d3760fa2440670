"""``tfspeed.diagnose(dataset, model)``: where a user's own training time goes.

Three timings of the user's compiled Keras model and dataset, each bounded in seconds:
(a) the input alone, (b) the step alone on one batch held in memory, (c) both together, as the
script's ``fit`` runs them. Then a verdict: input-bound, compute-bound or shared CPU, with the
fixes ranked by their predicted gain. The model's weights and optimizer state are put back
after the timings: diagnosing does not train the user's model.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import statistics
import time

from tfspeed.probes.profiling import INPUT_BOUND_HIGH_PCT, INPUT_BOUND_MODERATE_PCT

SECONDS = 4.0  # each timing's budget, after its warm-up
WARMUP_STEPS = 3
SAME_RATIO = 1.1  # together within this of the step alone: the input hides behind the step
STEPS_PER_EXECUTION = 8  # steps per call timed where the model runs one per call
REPLAY_SAMPLE_MB = 64  # the stored part held to time what optimize replays after it
COMPUTE_BOUND = "compute-bound: the input is not your limit"


def diagnose(dataset, model, *, seconds: float = SECONDS, out_dir: str | None = None,
             xla: bool = True, given: str = "dataset") -> dict:
    """Times ``dataset`` and ``model``'s step alone and together, and says what limits them.

    Args:
      dataset: a ``tf.data.Dataset`` of batches, as given to ``fit``.
      model: a compiled ``keras.Model``.
      seconds: each timing's budget after its warm-up.
      out_dir: where ``diagnose.json`` and ``diagnose.png`` go (None: nowhere).
      xla: on a compute-bound step, also time it compiled by XLA (``jit_compile=True``).
      given: what the script gave ``fit`` (``given_kind``): "dataset", "arrays",
        "pydataset" (":N threads" or ":N processes" added where it has workers) or
        "generator"; the fixes for its input depend on it.

    Returns:
      ``{"verdict", "why", "ms_per_batch", "batches_per_sec", "next_steps", "pipeline"}``.
    """
    from tfspeed.attach import graph
    from tfspeed.errors import UsageError

    if not getattr(model, "compiled", False) and getattr(model, "optimizer", None) is None:
        raise UsageError("tfspeed.diagnose needs the model compiled (model.compile(...)) as "
                         "the script compiles it before fit")
    first = next(iter(dataset))
    saved = _state(model, first)
    try:
        ms = {"input_alone": _time_input(dataset, seconds)}
        held = _held_batch(first)
        ms["step_alone"] = _time_fit(model, held, seconds)
        ms["together"] = _time_fit(model, dataset, seconds)
        if ms["input_alone"] < ms["step_alone"]:  # the step is the limit: what helps it
            ms.update(_step_options(model, held, seconds))  # without XLA, as step_alone
        if xla and not model.jit_compile:  # one step per call as given, as step_alone
            ms["step_alone_xla"] = _time_fit(model, held, seconds, jit_compile=True,
                                             steps_per_execution=saved[2])
    finally:
        _restore(model, saved)
    plan = graph.plan(dataset)
    if plan.stored is not None:
        ms["input_optimized"] = _time_replayed(plan, seconds)
    result = decide(ms, plan, dataset.element_spec, given=given,
                    scales=_scales_first(model))
    if out_dir:
        _write(result, out_dir)
    return result


def decide(ms: dict, plan, element_spec, cores: int | None = None, given: str = "dataset",
           scales: bool = False) -> dict:
    """The verdict and ranked fixes from the three timings (pure but for ``cores``, the
    CPU's cores: None reads them); ``given`` is what ``fit`` got, ``scales`` whether the
    model's first layer already rescales images."""
    input_ms, step_ms, both = ms["input_alone"], ms["step_alone"], ms["together"]
    wait = max(0.0, 100.0 * (both - step_ms) / both)
    line = (f"input {input_ms:.1f} ms per batch, the step {step_ms:.1f} ms alone and "
            f"{both:.1f} ms with its input")
    # An input that, on every core, takes under SAME_RATIO's share of a step cannot slow
    # the step by more: "together" slower than that is other load on a shared machine (its
    # timings are taken one after the other), not the input.
    cores = cores or os.cpu_count() or 1
    negligible = input_ms * cores < step_ms * (SAME_RATIO - 1)
    steps = []
    if input_ms < step_ms and (both <= step_ms * SAME_RATIO or negligible):
        verdict, why = COMPUTE_BOUND, f"{line}: the step alone sets the pace"
        if both > step_ms * SAME_RATIO:
            why += (f" (the input's {input_ms:.1f} ms on all {cores} cores is under "
                    f"{100 * (SAME_RATIO - 1):.0f}% of a step: the rest is other load)")
        steps += _step_fixes(ms)
    elif input_ms >= step_ms * 0.9 or wait >= INPUT_BOUND_HIGH_PCT:
        severity = "highly" if wait >= INPUT_BOUND_HIGH_PCT else "moderately"
        verdict = f"input-bound ({severity})"
        why = f"{wait:.0f}% of each step waits for input; {line}"
        steps += _input_fixes(ms, plan, element_spec, given, scales) + _gaining(ms)
    else:
        verdict = "input-bound (by sharing the CPU)"
        why = (f"{line}: together is {both / max(input_ms, step_ms):.1f}x the slower alone; the "
               "pipeline takes CPU time from the step")
        steps += _input_fixes(ms, plan, element_spec, given, scales) + _gaining(ms)
    if wait < INPUT_BOUND_MODERATE_PCT and not steps:
        steps.append({"advice": "nothing to gain on the input side", "expected_gain": "-"})
    steps.sort(key=lambda s: -s.pop("score", 0.0))
    return {"verdict": verdict, "why": why, "ms_per_batch": ms,
            "batches_per_sec": {k: 1000.0 / v for k, v in ms.items() if v > 0},
            "input_wait_pct": wait, "next_steps": steps,
            "pipeline": {"storable": plan.stored is not None, "reason": plan.reason}}


def given_kind(x) -> str:
    """What a script gave ``fit`` as ``x``, in ``diagnose``'s words."""
    import inspect

    import keras
    import tensorflow as tf

    if isinstance(x, tf.data.Dataset):
        return "dataset"
    if isinstance(x, keras.utils.PyDataset):
        workers = int(getattr(x, "workers", 1) or 1)
        if workers <= 1:
            return "pydataset"
        kind = "processes" if getattr(x, "use_multiprocessing", False) else "threads"
        return f"pydataset:{workers} {kind}"
    if inspect.isgenerator(x) or hasattr(x, "__next__"):
        return "generator"
    return "arrays"


def _input_fixes(ms: dict, plan, element_spec, given: str = "dataset",
                 scales: bool = False) -> list[dict]:
    both, step = ms["together"], ms["step_alone"]
    fixes = []
    gain = both / step
    if plan.stored is not None:
        # What is replayed after the store (augmentation) runs every epoch: the input
        # optimised is as fast as that, however fast the step.
        replayed = ms.get("input_optimized", 0.0)
        pace = ("the step alone's pace" if replayed <= step else
                f"the replayed random part's pace, {replayed:.1f} ms")
        gain = both / max(step, replayed)
        fixes.append({"advice": "train = tfspeed.optimize(train): the pipeline's deterministic "
                      f"part ({plan.maps_stored} map(s)) is computed once and replayed",
                      "expected_gain": f"up to {gain:.1f}x ({pace})", "score": gain})
    else:
        fixes.append({"advice": _unstored_advice(plan, given),
                      "expected_gain": f"up to {gain:.1f}x", "score": gain * 0.5})
    if _float_images(element_spec):
        fixes.append({"advice": "images leave the pipeline as float32 (4x the bytes of "
                      "uint8): " + ("your model's first layer already rescales them: end "
                                    "the pipeline with tf.cast(images, tf.uint8) where their "
                                    "values are whole (resize with interpolation='nearest')"
                                    if scales else
                                    "send uint8 and put keras.layers.Rescaling first in the "
                                    "model"),
                      "expected_gain": "less host-to-device traffic (largest on GPUs)",
                      "score": 1.05})
    return fixes


def _unstored_advice(plan, given: str) -> str:
    """What to do where no part of the input can be stored, by what fit was given."""
    if given.startswith("pydataset:"):  # workers already set: what is left
        has = given.split(":", 1)[1]
        more = ("" if has.endswith("processes") else
                "use_multiprocessing=True where the loading is Python-heavy (threads share "
                "the GIL), or ")
        return (f"your PyDataset already loads in {has} and fit still waits for it: {more}"
                "load with tf.data ops (tf.io.decode_image, Dataset.map) so tfspeed.optimize "
                "can store them, or convert the data once with scripts/to_tfrecord.py")
    if given == "pydataset":
        return ("your PyDataset loads each batch in the training process, one at a time: give "
                "it workers in its constructor (super().__init__(workers=4, "
                "use_multiprocessing=True) for Python-heavy loading), or load with tf.data "
                "ops (tf.io.decode_image, Dataset.map) so tfspeed.optimize can store them")
    if given == "generator":
        return ("a Python generator feeds fit one batch at a time under the GIL: wrap it in "
                "tf.data.Dataset.from_generator and let tfspeed.optimize run it in worker "
                "processes, or load with tf.data ops, or convert the data once with "
                "scripts/to_tfrecord.py")
    if "Python" in plan.reason:
        return (f"the pipeline cannot be stored ({plan.reason}); python -m tfspeed.run (or "
                "tfspeed.optimize) runs its Python in worker processes where that measures "
                "faster")
    return (f"the pipeline cannot be stored as it is ({plan.reason}); move the random ops "
            "after the deterministic maps, or convert the data once with "
            "scripts/to_tfrecord.py")


def _scales_first(model) -> bool:
    """Whether the model's first layer (past its inputs) is ``keras.layers.Rescaling``."""
    layers = [layer for layer in getattr(model, "layers", [])
              if type(layer).__name__ != "InputLayer"]
    return bool(layers) and type(layers[0]).__name__ == "Rescaling"


def _gaining(ms: dict) -> list[dict]:
    """The step-side fixes that measured a gain: what helps the step once the input is
    fixed (a "no gain" line is for a compute-bound step, where it is the question)."""
    return [fix for fix in _step_fixes(ms)
            if "(measured)" in fix["expected_gain"] and fix["score"] > SAME_RATIO]


def _step_fixes(ms: dict) -> list[dict]:
    fixes = []
    step, xla = ms["step_alone"], ms.get("step_alone_xla")
    if xla:
        gain = step / xla
        if gain > SAME_RATIO:
            fixes.append({"advice": "model.compile(..., jit_compile=True): the step measured "
                          f"{xla:.1f} ms under XLA against {step:.1f}",
                          "expected_gain": f"{gain:.2f}x (measured)", "score": gain})
        else:
            fixes.append({"advice": f"XLA measured {xla:.1f} ms against {step:.1f}: no gain, "
                          "keep jit_compile off", "expected_gain": f"{gain:.2f}x (measured)",
                          "score": 0.0})
    doubled, per_call = ms.get("step_alone_2x_batch"), ms.get("step_alone_per_call")
    if doubled:
        gain = 2 * step / doubled
        measured = f"{doubled:.1f} ms for twice the examples against {step:.1f}"
        fixes.append(
            {"advice": (f"a batch twice as large (the learning rate scaled with it): the step "
                        f"measured {measured}" if gain > SAME_RATIO else
                        f"a batch twice as large measured {measured}: no gain per example"),
             "expected_gain": f"{gain:.2f}x examples/s (measured)",
             "score": gain if gain > SAME_RATIO else 0.0})
    if per_call:
        gain = step / per_call
        measured = f"{per_call:.2f} ms a step against {step:.2f} at one per call"
        fixes.append(
            {"advice": (f"model.compile(..., steps_per_execution={STEPS_PER_EXECUTION}): the "
                        f"step measured {measured}" if gain > SAME_RATIO else
                        f"steps_per_execution={STEPS_PER_EXECUTION} measured {measured}: no "
                        "gain, keep one per call"),
             "expected_gain": f"{gain:.2f}x (measured)",
             "score": gain if gain > SAME_RATIO else 0.0})
    if not doubled and not per_call:
        fixes.append({"advice": "a larger batch, or model.compile(steps_per_execution=N) "
                      "where a step is short: fewer Python round trips per example",
                      "expected_gain": "unmeasured", "score": 0.5})
    fixes.append({"advice": "mixed precision: keras.mixed_precision.set_global_policy("
                  "'mixed_float16') before the model is built on a GPU ('mixed_bfloat16' on a "
                  "TPU or a CPU with AMX); python -m tfspeed.run keeps the model's own",
                  "expected_gain": "unmeasured (none on most CPUs)", "score": 0.4})
    return fixes


def _float_images(element_spec) -> bool:
    import tensorflow as tf

    x = tf.nest.flatten(element_spec)[0]
    return getattr(x, "shape", None) is not None and x.shape.rank == 4 and x.dtype.is_floating


def _state(model, first):
    """The model's and its optimizer's variables with their values, and its step options:
    built first as ``fit`` builds them on its first batch (a Sequential without an
    ``Input``, as the tutorials write it, has no weights until then)."""
    build = getattr(model, "_symbolic_build", None)  # Keras 3's own, which fit calls
    if build is not None and not model.built:
        build(data_batch=first)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and not optimizer.built:  # as fit would: its slots exist now
        optimizer.build(model.trainable_variables)
    held = [*model.variables, *getattr(optimizer, "variables", [])]
    return ([(v, v.numpy()) for v in held], model.jit_compile,
            getattr(model, "steps_per_execution", 1))


def _restore(model, saved) -> None:
    """The variables back as they were; any the timings created (a metric's) stay."""
    values, jit, per_call = saved
    for v, value in values:
        v.assign(value)
    if model.jit_compile != jit or getattr(model, "steps_per_execution", 1) != per_call:
        model.jit_compile = jit
        model.steps_per_execution = per_call
        model.make_train_function(force=True)


def _time_input(dataset, seconds: float) -> float:
    """Median ms per batch of the pipeline alone."""
    it = iter(dataset)
    times, last, start = [], None, time.perf_counter()
    for i, _ in enumerate(it):
        now = time.perf_counter()
        if i >= 1 and last is not None:
            times.append(now - last)
        last = now
        if now - start > seconds and len(times) >= 3:
            break
    if not times:
        raise ValueError("the dataset yields fewer than two batches: nothing to time")
    return 1000.0 * statistics.median(times)


def _time_replayed(plan, seconds: float) -> float:
    """Median ms per batch of the input as ``tfspeed.optimize`` runs it on a later run: a
    sample of the stored part computed once and held (up to ``REPLAY_SAMPLE_MB``), the rest
    of the pipeline (shuffles, random maps, batching) replayed on it."""
    from tfspeed.attach.optimize import element_bytes

    first = next(iter(plan.stored))
    count = max(8, min(1024, int(REPLAY_SAMPLE_MB * 2**20 / max(element_bytes(first), 1))))
    sample = plan.stored.take(count).cache()
    for _ in sample:  # computed once, as the store is
        pass
    return _time_input(plan.replay(sample.repeat()), seconds)


def _held_batch(first):
    import tensorflow as tf

    return tf.data.Dataset.from_tensors(first).repeat()


def _step_options(model, held, seconds: float) -> dict:
    """The step alone on a batch twice as large (ms per batch of twice the examples) and,
    where the model runs one step per call, with ``STEPS_PER_EXECUTION`` (ms per step); a
    timing that fails (the doubled batch out of memory, or a model built for one batch
    size) is left out."""
    import tensorflow as tf

    out = {}
    first = next(iter(held))
    doubled = tf.data.Dataset.from_tensors(
        tf.nest.map_structure(lambda t: tf.concat([t, t], 0), first)).repeat()
    with contextlib.suppress(Exception):  # Keras' own errors differ by backend
        out["step_alone_2x_batch"] = _time_fit(model, doubled, seconds)
    if getattr(model, "steps_per_execution", 1) == 1:
        out["step_alone_per_call"] = _time_fit(model, held, seconds,
                                               steps_per_execution=STEPS_PER_EXECUTION)
    return out


def _time_fit(model, dataset, seconds: float, jit_compile: bool | None = None,
              steps_per_execution: int | None = None) -> float:
    """Median ms per step of ``model.fit`` on ``dataset`` (batch-end to batch-end, over the
    steps between two of Keras' calls)."""
    import keras

    if jit_compile is not None or steps_per_execution is not None:
        if jit_compile is not None:
            model.jit_compile = jit_compile
        if steps_per_execution is not None:
            model.steps_per_execution = steps_per_execution
        model.make_train_function(force=True)
    stamps = []

    class Stamp(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            stamps.append((batch, time.perf_counter()))
            if len(stamps) > WARMUP_STEPS + 3 and \
                    stamps[-1][1] - stamps[WARMUP_STEPS][1] > seconds:
                self.model.stop_training = True

    steps = 10_000
    source = dataset.repeat() if int(dataset.cardinality()) >= 0 else dataset
    model.fit(source, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=[Stamp()],
              shuffle=False)
    gaps = [(t - s) / (b - a) for (a, s), (b, t) in itertools.pairwise(stamps[WARMUP_STEPS:])
            if b > a]
    return 1000.0 * statistics.median(gaps)


def _write(result: dict, out_dir: str) -> None:
    from tfspeed.util import charts, files

    os.makedirs(out_dir, exist_ok=True)
    ms = result["ms_per_batch"]
    result["chart"] = charts.bar_chart(os.path.join(out_dir, "diagnose.png"), [
        charts.Panel(list(ms), {"": list(ms.values())}, "ms per batch",
                     f"verdict: {result['verdict']}", horizontal=False),
    ], size=(7, 4))
    files.write_json_atomic(os.path.join(out_dir, "diagnose.json"), result)


def lines(result: dict) -> list[str]:
    """The verdict as a person reads it."""
    ms = result["ms_per_batch"]
    out = [f"tfspeed diagnose: {result['verdict'].upper()}: {result['why']}"]
    for name, value in ms.items():
        out.append(f"  {name.replace('_', ' '):16s}: {value:8.1f} ms per batch")
    out.append("next steps, by expected gain:")
    out += [f"  {i}. {s['advice']}  [{s['expected_gain']}]"
            for i, s in enumerate(result["next_steps"], 1)]
    return out
