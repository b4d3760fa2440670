"""What the pipeline does to a record, and where: decode before or after the cache, in which
dtype, which cache, how big a shuffle buffer. Decided once per split from the config and
the schema, so ``pipeline.py`` stays a straight line and the choices can be tested (and
reported) without building a dataset.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable

from tfspeed import plan
from tfspeed.config import DataConfig
from tfspeed.data import ops

DEFAULT_RAM_FRACTION = 0.5  # of the memory available when the run starts
# Cap on a shuffle buffer that holds copies (not cached references). On 224 px raw photos
# (150 KB records, cold) larger buffers ran slower, the old 256 MB cap by far; encoded JPEGs
# (31 KB) ran the same either way (measured once on 2 cores, not benchmarked). Records still
# come from all shards at once, their order shuffled.
SHUFFLE_BUFFER_MB = 64
_ELEMENT_OVERHEAD = 256  # bytes per cached element besides its data (tensor headers, label)


@dataclasses.dataclass(frozen=True)
class CachePlan:
    """Where decoded records are cached, and why.

    Attributes:
      mode: ``none``, ``memory`` or ``disk``.
      estimate_mb: the split's size as cached (records × bytes per record at the target size
        and dtype), from ``schema.json``.
      budget_mb: the RAM the data may take (``--ram_budget_mb``, or a share of what is free).
      reason: one sentence.
    """

    mode: str
    estimate_mb: float
    budget_mb: float
    reason: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Steps:
    """The per-record work of one split's pipeline.

    Attributes:
      decode: element -> decoded element (images), or None when the group parse already
        decoded everything (raw arrays, numbers).
      decode_before_cache: run ``decode`` before the cache (its work is paid once).
      decode_uint8 / augment_uint8: the same ops keeping uint8 (what tf.data service
        workers send: 4× fewer bytes than float32).
      augment: (element, seed) -> element for training, or None.
      cache: where the cache is, and why.
      shuffle_buffer: records in the shuffle buffer.
      normalize: scale uint8 images to float32 in [0, 1] per batch.
      scale_in_map: scale images to [0, 1] at the end of the per-record map after the cache
        instead (one exists: decoding or augmenting). On photos, scaling each image while it
        is in the CPU cache beats a pass over a 38 MB float batch (measured once, not
        benchmarked).
      mapped_after_cache: a per-record map runs after the cache (decoding or augmenting).
    """

    decode: Callable | None
    decode_before_cache: bool
    decode_uint8: Callable | None
    augment: Callable | None
    augment_uint8: Callable | None
    cache: CachePlan
    shuffle_buffer: int
    normalize: bool
    scale_in_map: bool = False
    mapped_after_cache: bool = False


def plan_steps(config: DataConfig, schema, split: str, training: bool,
               passes: int | None = None) -> Steps:
    """The ``Steps`` for ``split`` (see the module docstring)."""
    feature = schema.input_feature
    image = feature.dtype == "uint8"  # images, encoded or raw: scaled to [0, 1]
    augment_names = config.augment if training else ()
    decoding_augment = any(name in ops.DECODING_AUGMENTATIONS for name in augment_names)
    cache = plan_cache(config, schema, split, training, passes, encoded=decoding_augment)
    uint8_out = config.image_dtype == "uint8"
    # Kept float32 (0..255) from the resize on when nothing cached in between needs uint8.
    float_ok = not uint8_out and (cache.mode == "none" or decoding_augment)
    decode = _decode(feature, config, schema, split, keep_uint8=not float_ok)
    decode_uint8 = _decode(feature, config, schema, split, keep_uint8=True)
    augment = _augment(feature, config, augment_names, keep_uint8=uint8_out)
    decode = None if decoding_augment and training else decode
    before_cache = decode is not None and cache.mode != "none"
    mapped_after_cache = (decode is not None and not before_cache) or augment is not None
    scale_in_map = image and not uint8_out and mapped_after_cache
    return Steps(
        decode=decode,
        decode_before_cache=before_cache,
        decode_uint8=None if decoding_augment and training else decode_uint8,
        augment=augment,
        augment_uint8=_augment(feature, config, augment_names, keep_uint8=True),
        cache=cache,
        shuffle_buffer=_shuffle_buffer(config, schema, split, cache, encoded=decoding_augment),
        normalize=image and not uint8_out and not scale_in_map,
        scale_in_map=scale_in_map,
        mapped_after_cache=mapped_after_cache,
    )


def _decode(feature, config, schema, split, keep_uint8: bool):
    """Decode (at a reduced JPEG ratio where the images allow it) and resize, or None."""
    ratio, fit = 1, 0
    if feature.encoding == "jpeg" and config.image_size:
        shortest, longest = _sides(schema, split)
        ratio = ops.ratio_for(shortest, config.image_size)
        # Some images may allow more than the smallest one does: each is then decoded at
        # its own ratio (its header read first). Sides unknown (an older schema): the same.
        if not longest or ops.ratio_for(longest, config.image_size) > ratio:
            fit = config.image_size
    resize = bool(config.image_size) and (
        ratio > 1 or fit or tuple(feature.shape[:2]) != (config.image_size,) * 2)
    if not feature.is_image and not resize:
        return None
    steps = [ops.make_decode(feature, ratio=ratio, fit=fit)] if feature.is_image else []
    if resize:
        steps.append(ops.make_resize(config.image_size, keep_uint8=keep_uint8))
    return ops.compose(steps)


def _sides(schema, split) -> tuple[int, int]:
    """The split's shortest short side and longest long side of a stored image ((0, 0) if
    the converter did not record them)."""
    sides = schema.split(split).image_sides
    return (int(sides[0]), int(sides[1])) if sides else (0, 0)


def _augment(feature, config, names, keep_uint8: bool):
    if not names:
        return None
    # The decoding ones first: the others work on decoded pixels.
    names = sorted(names, key=lambda name: name not in ops.DECODING_AUGMENTATIONS)
    random_ops = []
    for name in names:
        if name == "random_resized_crop":
            random_ops.append(ops.make_random_resized_crop(feature, config.image_size))
        else:
            random_ops.append(ops.OPS[name][1]())
    if keep_uint8 and any(name in ops.DECODING_AUGMENTATIONS for name in names):
        random_ops.append(lambda element, seed: _to_uint8(element))
    return ops.compose_random(random_ops)


def _to_uint8(element):
    import tensorflow as tf

    image = element["inputs"]
    return {**element, "inputs": tf.cast(tf.clip_by_value(tf.round(image), 0, 255), tf.uint8)}


def record_bytes(config: DataConfig, schema, split: str, encoded: bool = False) -> float:
    """Bytes one record takes once decoded at the target size and dtype (or, ``encoded``,
    as stored), from ``schema.json`` alone."""
    if schema.named_inputs:
        return sum(math.prod(schema.features[n].shape) * 4 for n in schema.input_names)
    feature = schema.input_feature
    if feature.encoding == "tokens" and not encoded:
        # Cached as int32 examples: an lm's holds its inputs and its labels.
        mean = float((schema.split(split).text or {}).get("mean", 0))
        return mean * 4 * (2 if schema.task == "lm" else 1) + 4
    if encoded or feature.encoding == "tokens" or (feature.is_image and None in feature.shape[:2] and not config.image_size):
        shards = schema.split(split).shards
        return sum(s.num_bytes for s in shards) / max(sum(s.num_records for s in shards), 1)
    shape = list(feature.shape)
    if config.image_size and len(shape) == 3:
        shape[:2] = [config.image_size] * 2
    itemsize = 1 if feature.dtype == "uint8" else 4
    return math.prod(shape) * itemsize


def available_memory_mb() -> float:
    """MemAvailable from /proc/meminfo (all physical memory where that is not readable)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20


def ram_budget_mb(config: DataConfig) -> tuple[float, str]:
    """The RAM the input data may take, and where that figure comes from."""
    if config.ram_budget_mb:
        return float(config.ram_budget_mb), f"--ram_budget_mb={config.ram_budget_mb}"
    available = available_memory_mb()
    return (DEFAULT_RAM_FRACTION * available,
            f"{DEFAULT_RAM_FRACTION:.0%} of the {available / 1024:.1f} GB available")


def plan_cache(config: DataConfig, schema, split: str, training: bool,
               passes: int | None = None, encoded: bool = False) -> CachePlan:
    """Resolves ``config.cache`` for ``split``; checks an explicit ``memory`` against RAM.

    Args:
      config: the data settings (``cache``, ``ram_budget_mb``, ``image_size``).
      schema: the dataset's schema (records and stored shapes).
      split: the split.
      training: a training split (read many times) or not.
      passes: how often the split will be read, if known (1: caching cannot pay).
      encoded: the cache holds encoded records (a decoding augmentation follows it).

    Raises:
      UsageError: ``--cache=memory`` for a split that does not fit the budget.
    """
    records = schema.split(split).num_records
    estimate = records * (record_bytes(config, schema, split, encoded) + _ELEMENT_OVERHEAD)
    estimate_mb = estimate / 2**20
    budget_mb, source = ram_budget_mb(config)
    read_once = passes == 1 or (passes is None and not training)
    decided = plan.cache(config.cache, split, estimate_mb, budget_mb, source, read_once)
    return CachePlan(decided.value, estimate_mb, budget_mb, decided.reason)


def _shuffle_buffer(config, schema, split, cache: CachePlan, encoded: bool) -> int:
    """``--shuffle_buffer``, capped at the split, and at ``SHUFFLE_BUFFER_MB`` where the
    buffer holds copies of records rather than references to cached ones."""
    buffer = min(config.shuffle_buffer, schema.split(split).num_records)
    if cache.mode == "memory":
        return buffer
    per_record = record_bytes(config, schema, split, encoded=encoded or cache.mode == "none")
    return max(1, min(buffer, int(SHUFFLE_BUFFER_MB * 2**20 // max(per_record, 1))))
