"""Checks of a converted dataset's input against the flags that read it, and the shape the
pipeline hands the model."""

from __future__ import annotations

import os
import threading

from absl import logging

from tfspeed.config import DataConfig
from tfspeed.data import schema as schema_lib
from tfspeed.data import text
from tfspeed.errors import UsageError


def input_shape(schema: schema_lib.Schema, config: DataConfig):
    """The shape of one model input (no batch dimension) that the pipeline produces; a dict
    name -> shape for several named inputs."""
    if schema.named_inputs:
        return {name: tuple(schema.features[name].shape) for name in schema.input_names}
    if text.is_text(schema):
        return text.input_spec()
    feature = schema.input_feature
    if is_image(feature) and config.image_size:
        return (config.image_size, config.image_size, feature.shape[-1])
    return tuple(feature.shape)


def is_image(feature) -> bool:
    """Encoded (JPEG/PNG) or raw (uint8, height × width × channels) images."""
    return feature.is_image or (feature.dtype == "uint8" and len(feature.shape) == 3)


def check_input_fits(schema: schema_lib.Schema, config: DataConfig) -> None:
    feature = schema.input_feature
    if "random_resized_crop" in config.augment:
        if feature.dtype != "uint8" or len(feature.shape) != 3:
            raise UsageError("--augment=random_resized_crop needs image inputs; drop it")
        if not config.image_size:
            raise UsageError("--augment=random_resized_crop resizes its crop to --image_size: "
                             "pass --image_size=N")
    if feature.is_image and None in feature.shape[:2] and not config.image_size:
        raise UsageError(
            f"images in {config.data_dir} have varying sizes; pass --image_size=N to resize them "
            "(or reconvert with --image_size or --image_max_side)"
        )


_upscale_warned: set = set()
_upscale_lock = threading.Lock()


def warn_if_upscaled(schema: schema_lib.Schema, config: DataConfig, split: str) -> None:
    """One warning per split when ``--image_size`` exceeds every stored image's longest
    side: each image is then upscaled (more pixels to decode, move and train on, and no
    more detail), which is easy to miss in a flagfile written for another conversion."""
    feature = schema.input_feature
    if schema.named_inputs or not config.image_size or not is_image(feature):
        return
    sides = schema.split(split).image_sides
    if sides:
        shortest, longest = int(sides[0]), int(sides[1])
    elif None not in feature.shape[:2]:
        shortest, longest = min(feature.shape[:2]), max(feature.shape[:2])
    else:
        return  # sizes not recorded (an older schema): nothing to compare
    requested = config.image_size
    if requested <= longest:
        return
    key = (os.path.abspath(config.data_dir), split, requested)
    with _upscale_lock:
        if key in _upscale_warned:
            return
        _upscale_warned.add(key)
    stored = f"{longest} px" if shortest == longest else f"{shortest}-{longest} px"
    factor = (requested / longest) ** 2
    logging.warning(
        "--image_size=%d upscales every image of split %r of %s, stored at %s a side "
        "(%s× the pixels of the largest, no new detail): convert with --image_size=%d, "
        "or lower --image_size to %d", requested, split, config.data_dir, stored,
        f"{factor:.1f}" if factor < 10 else f"{factor:.0f}", requested, longest)
