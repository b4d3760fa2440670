"""From measurements to a verdict and ranked next steps. Pure functions: no measuring here.

Figures come from ``tfspeed.diagnosis.measure``: the input pipeline alone (a), the model
alone on held batches (b) and both together (c), each in milliseconds per batch (per step)
and in examples/s, the share of step time spent waiting for input (the engine's own timing
and xprof's), milliseconds per batch added by each pipeline stage, the host's cores and peak
memory. The verdict compares milliseconds per batch: token batches hold different numbers of
sequences, so sequences/s of one set of batches and of another are not comparable.
"""

from __future__ import annotations

import math

from tfspeed.data import images as images_lib
from tfspeed.diagnosis import precision
from tfspeed.probes.profiling import INPUT_BOUND_HIGH_PCT, INPUT_BOUND_MODERATE_PCT

INPUT_BOUND_RATIO = 0.9  # a pipeline slower than this share of (b) cannot feed the model
MEMORY_BOUND_SHARE = 0.85  # peak memory above this share of the machine's is the limit
CONTENTION_RATIO = 0.75  # together below this share of the slower alone: shared CPU
SHARDS_FOR_INTERLEAVE = 16


def decide(config, schema, plan, figures: dict) -> dict:
    """Returns ``{"verdict", "severity", "why", "next_steps": [{"advice", "expected_gain"}]}``."""
    ms = figures["ms_per_batch"]
    wait = max(figures["input_wait_pct"], figures.get("profile", {}).get("input_wait_pct", 0.0))
    memory_share = _memory_share(figures["memory"])
    slow_input = ms["input_alone"] * INPUT_BOUND_RATIO > ms["compute_alone"]
    figures_line = (f"input {ms['input_alone']:.1f} ms per batch, the step "
                    f"{ms['compute_alone']:.1f} ms alone and {ms['together']:.1f} ms with its "
                    "input")
    if memory_share > MEMORY_BOUND_SHARE:
        verdict, severity = "memory-bound", ""
        why = f"peak memory is {memory_share:.0%} of what the machine has"
        steps = _memory_steps(config, plan)
    elif wait >= INPUT_BOUND_HIGH_PCT or (slow_input and wait >= INPUT_BOUND_MODERATE_PCT):
        verdict = "input-bound"
        severity = "highly" if wait >= INPUT_BOUND_HIGH_PCT else "moderately"
        why = f"{wait:.0f}% of step time waits for input; {figures_line}"
        steps = _input_steps(config, schema, figures)
    elif _cpu_shared(figures):
        verdict, severity = "input-bound", "by sharing the CPU"
        slower = max(ms["input_alone"], ms["compute_alone"])
        why = (f"{figures_line}: {ms['together'] / slower:.1f}x the slower alone, though the "
               "step seldom waits; the input pipeline takes CPU time from the step")
        steps = _input_steps(config, schema, figures)
    else:
        verdict, severity = "compute-bound", ""
        why = f"only {wait:.0f}% of step time waits for input; {figures_line}"
        steps = _compute_steps(config, plan, figures, wait, memory_share)
    if verdict != "memory-bound":
        # Measured figures only (the driver's probe, or diagnose's own timing): a rule of
        # thumb once advised bfloat16 for a model the probe had just measured slower in it.
        # Cited whatever the verdict, ranked by its measured ratio.
        steps += precision.advice(plan, figures.get("precision"), _step)
    steps += batching_steps(config, figures) + image_steps(figures, slow_input)
    steps.sort(key=lambda s: -s.pop("score"))
    return {"verdict": verdict, "severity": severity, "why": why, "next_steps": steps}


def _cpu_shared(figures: dict) -> bool:
    """Whether the input takes CPU time from the step: together far slower than the slower of
    the two alone, by no more than the input's work can take.

    On a host without accelerators the pipeline and the step share the cores: prefetch keeps
    up (little waiting), yet together runs far below either alone. Input alone keeps at most
    every core busy for its time per batch, so that is all it can take from a step: a 2.6 ms
    pipeline cannot make a 500 ms step take 530 ms (more load on the host, or tracing and
    compiling new shapes in the timed steps, can).
    """
    ms = figures["ms_per_batch"]
    slower = max(ms["input_alone"], ms["compute_alone"])
    taken = ms["together"] - slower
    return (slower < CONTENTION_RATIO * ms["together"]
            and taken <= figures["host_cpus"] * ms["input_alone"])


def _memory_share(memory: dict) -> float:
    share = memory["peak_host_rss_mb"] / memory["host_total_mb"]
    gpu_peaks = [v for k, v in memory.items() if k.startswith("gpu") and k.endswith("_peak_mb")]
    gpu_totals = [v for k, v in memory.items() if k.startswith("gpu") and k.endswith("_total_mb")]
    if gpu_peaks and gpu_totals:
        share = max(share, max(p / t for p, t in zip(gpu_peaks, gpu_totals, strict=False)))
    return share


def _step(advice: str, score: float, gain: str) -> dict:
    return {"advice": advice, "expected_gain": gain, "score": score}


def _speedup(share: float, ceiling: float) -> tuple[float, str]:
    """Removing ``share`` of input time speeds input up by 1/(1-share), capped by compute.

    Returns the uncapped figure as the ranking score (two fixes that both reach the cap are
    ordered by how much input work they remove) and the capped one as the text.
    """
    gain = 1 / max(1 - share, 1e-3)
    return gain, f"up to {min(gain, ceiling):.1f}x"


def _input_steps(config, schema, figures: dict) -> list[dict]:
    data = config.data
    eps, ms = figures["examples_per_sec"], figures["ms_per_batch"]
    # Fixing the input entirely brings a step down to the model alone's time.
    ceiling = max(ms["together"] / max(ms["compute_alone"], 1e-9), 1.0)
    stages = figures["stages_ms_per_batch"]
    total = sum(stages.values()) or 1.0
    share = {name: ms / total for name, ms in stages.items()}
    feature = schema.input_feature
    shards = len(schema.split(data.train_split).shards)
    steps = []
    decoded_gb = _decoded_gb(schema, data)
    if figures["memory"].get("host_allocator") == "malloc":
        # Decoding tf.data pipelines run faster with the pool (benchmarks/host_allocator.py).
        score, gain = _speedup(0.3, ceiling)
        steps.append(_step(
            "TensorFlow allocates host memory with malloc here (oneDNN off), ~150 page faults "
            "per decoded photo: set TF_CPU_ALLOCATOR_USE_BFC=1 (import tfspeed does, unless "
            "it is set to 0 or a tensor exists before the import)", score, gain))
    if share.get("decode", 0) >= 0.25:
        fixed_side = max(feature.shape[:2]) if None not in feature.shape[:2] else 0
        stored_side = schema.options.get("image_max_side") or fixed_side
        target = data.image_size or fixed_side
        score, gain = _speedup(share["decode"] * 0.7, ceiling)
        if feature.is_image and target and (not stored_side or stored_side > 2 * target):
            steps.append(_step(
                f"parse+decode takes {share['decode']:.0%} of input time: reconvert with "
                f"--image_max_side={_round_side(target)} so JPEGs are decoded near "
                f"--image_size={target}", score, gain))
        else:
            steps.append(_step(
                f"parse+decode takes {share['decode']:.0%} of input time: more CPU cores for "
                "its parallel map, or move the input pipeline onto tf.data service workers",
                score * 0.8, gain))
    if data.cache == "none" and decoded_gb is not None:
        fits = decoded_gb < 0.5 * _ram_gb(figures)
        score, gain = _speedup(share.get("read", 0) + share.get("decode", 0), ceiling)
        steps.append(_step(
            f"cache after decode {'fits' if fits else 'does not fit'} the RAM budget "
            f"(est. {_size(decoded_gb)}): --cache={'memory' if fits else 'disk'}", score,
            gain + " from the second epoch"))
    if share.get("read", 0) >= 0.1 or shards < SHARDS_FOR_INTERLEAVE // 4:
        score, gain = _speedup(share.get("read", 0) * 0.8, ceiling)
        if shards < SHARDS_FOR_INTERLEAVE:
            steps.append(_step(
                f"reading takes {share.get('read', 0):.0%} of input time and interleave has only "
                f"{shards} shard(s) to read at once: write >= {SHARDS_FOR_INTERLEAVE} shards "
                f"(reconvert with --shards={SHARDS_FOR_INTERLEAVE})", score, gain))
    if share.get("augment", 0) >= 0.25:
        score, gain = _speedup(share["augment"] * 0.5, ceiling)
        steps.append(_step(
            f"shuffle+augment take {share['augment']:.0%} of input time: drop costly --augment "
            "ops or lower --shuffle_buffer", score, gain))
    if data.data_service:
        host = data.data_service.split("://")[-1]
        steps.append(_step(
            f"the tf.data service at {data.data_service} delivers {eps['input_alone']:.0f} "
            "examples/s: start more workers (python -m tfspeed.data_service worker "
            f"--dispatcher={host}) on hosts with idle CPUs", 1.2,
            f"up to {ceiling:.1f}x (the compute ceiling), if workers, not the network, limit"))
    else:
        steps.append(_step(
            "still short of the model's rate: move read/decode/augment onto tf.data service "
            "workers on other hosts (--data_service=grpc://HOST:PORT), or use larger/faster "
            "CPUs for the input pipeline", 1.0, f"up to {ceiling:.1f}x (the compute ceiling)"))
    return steps


def image_steps(figures: dict, slow_input: bool) -> list[dict]:
    """Images sent as float32 (``--image_dtype=float32``): 4x the bytes of uint8 through
    the pipeline's last stages and, on an accelerator, the copy to the device, which
    limits small models there more than decoding does (issue 37: MobileNetV2 on an H100
    ran at 0.47x its uint8 rate). Ranked first where the device takes the copy or the
    input is the slower side."""
    if figures.get("settings", {}).get("image_dtype") != "float32":
        return []
    accelerator = any(name.startswith("gpu") for name in figures["memory"])
    score = 2.0 if accelerator or slow_input else 1.05
    return [_step(images_lib.float_images_advice(
        "drop --image_dtype=float32: the default sends uint8 and scales them inside the "
        "compiled step"), score, "up to 2x on an accelerator; less host work per batch")]


def batching_steps(config, figures: dict) -> list[dict]:
    """A batching predicted to compute less per real token than the job's, ranked by that
    gain (``text.Batching.costs``: padding, and the attention each token pays over its whole
    row, masked positions included). Padding shows in a padding fraction; the attention of
    long packed rows does not ("0% padding" hides it), so each piece of advice names the
    waste it removes. Empty for batches without token figures."""
    from tfspeed import plan as plan_lib
    from tfspeed.probes import costs as costs_lib
    from tfspeed.training import models

    batching = figures.get("batching") or {}
    costs, mode = batching.get("costs"), batching.get("mode")
    if not costs or mode not in costs:
        return []
    steps = []
    for other in plan_lib.batching_modes(models.takes_segments(config.model.name)):
        gain = costs[mode] / max(costs[other], 1e-9)
        if other == mode or gain < costs_lib.ADVICE_GAIN:
            continue
        steps.append(_step(f"{_waste(batching, figures)}: --batching={other} "
                           f"({_instead(other, batching)})", gain,
                           f"~{gain:.1f}x real tokens/s (predicted)"))
    return steps


def _waste(batching: dict, figures: dict) -> str:
    """What the job's batching computes besides real tokens."""
    padding = figures.get("padding_fraction", 0.0)
    k, width = batching.get("attention_length"), batching["max_length"]
    if batching["mode"] == "pack" and k:
        return (f"packed rows of {width} tokens: each token attends over all {width} "
                f"positions, other sequences' too (masked, still computed): "
                f"{width / k:.1f}x its other work, though only {padding:.0%} is padding")
    return f"{padding:.0%} of the tokens computed are padding (--batching={batching['mode']})"


def _instead(mode: str, batching: dict) -> str:
    expected = batching["expected_padding"]
    if mode == "pack":
        return (f"rows of {batching['max_length']} tokens, expected padding "
                f"{expected['pack']:.0%}; the model keeps packed sequences apart")
    if mode == "bucket":
        return (f"buckets {expected['boundaries']}, expected padding {expected['bucket']:.0%}; "
                "each batch only as wide as its sequences")
    return f"each batch padded to its longest, expected padding {expected['pad']:.0%}"


def _compute_steps(config, plan, figures: dict, wait: float, memory_share: float) -> list:
    from tfspeed.config import RuntimeConfig
    from tfspeed.runtime import detect_hardware, resolve

    batch = config.data.batch_size
    step_ms = figures["ms_per_batch"]["together"]
    steps = []
    best = resolve(RuntimeConfig(precision="auto", xla="auto"), detect_hardware())
    if step_ms < 10 and config.train.steps_per_execution == 1:
        steps.append(_step(f"a step takes {step_ms:.1f} ms, so Python overhead per step matters: "
                           "--steps_per_execution=auto", 1.8, "up to 4x for tiny steps"))
    if best.xla and not plan.xla:
        steps.append(_step("--xla=on: fuse the step's kernels on the accelerator", 1.3,
                           "~10-30%"))
    tokens = config.data.tokens_per_batch if figures.get("unit") == "sequences" else 0
    if memory_share < 0.5 and tokens and config.data.batching != "pad":
        steps.append(_step(f"memory is at {memory_share:.0%}: try --tokens_per_batch="
                           f"{2 * tokens} for better device utilisation", 1.2,
                           "~10-40% more real tokens/s"))
    elif memory_share < 0.5:
        steps.append(_step(f"memory is at {memory_share:.0%}: try --batch_size={2 * batch} "
                           "with --scale_lr_with_batch for better device utilisation", 1.2,
                           "~10-40% more examples/s"))
    steps.append(_step(f"input is only {wait:.0f}% of step time: the model's step is the limit; "
                       "a smaller model or a faster device is what is left", 1.0, "-"))
    return steps


def _memory_steps(config, plan) -> list[dict]:
    batch, k = config.data.batch_size, config.train.grad_accum_steps
    steps = [_step(f"--batch_size={max(batch // 2, 1)} --grad_accum_steps={2 * k}: the same "
                   "update in half the activation memory", 3.0, "~half the activation memory")]
    if not config.model.remat:
        steps.append(_step("--remat: recompute activations in the backward pass", 2.5,
                           "less activation memory for ~30% more compute"))
    if plan.precision == "float32":
        steps.append(_step("--precision=auto: 16-bit activations take half the memory", 2.0,
                           "~half the activation memory"))
    if config.data.cache == "memory":
        steps.append(_step("--cache=disk: keep decoded records out of RAM", 1.5,
                           "frees the cache's RAM"))
    return steps


def _decoded_gb(schema, data) -> float | None:
    feature = schema.input_feature
    shape = list(feature.shape)
    if feature.is_image and data.image_size:
        shape = [data.image_size, data.image_size, shape[-1]]
    if None in shape:
        return None
    bytes_per_value = 1 if feature.dtype == "uint8" else 4
    records = schema.split(data.train_split).num_records
    return records * math.prod(shape) * bytes_per_value / 2**30


def _size(gb: float) -> str:
    if gb >= 1:
        return f"{gb:.1f} GB"
    return f"{gb * 1024:.0f} MB" if gb * 1024 >= 1 else f"{gb * 2**20:.0f} KB"


def _ram_gb(figures: dict) -> float:
    return figures["memory"]["host_total_mb"] / 1024


def _round_side(target: int) -> int:
    """A stored side a little above the training size, leaving room for crops."""
    return int(math.ceil(target * 1.15 / 16) * 16)
