"""Preprocessing ops: small factories ``make_x(...) -> op``, looked up by name in ``OPS``.

An element is a dict ``{"inputs": tensor, "label": tensor}``. Ops come in three kinds,
because where they may run in the pipeline differs:

  deterministic ``op(element) -> element``: decode, resize. They run once per record,
    before the cache, so their work is paid once.
  random ``op(element, seed) -> element``: flip, crop. They run after the cache and the
    shuffle, with a stateless per-element ``seed`` (shape [2]), so a seeded run gives the
    same augmentation whatever the map's parallelism.
  batch ``op(batch) -> batch``: normalize, standardize. Element-wise maths runs on whole
    batches, which is cheaper than per element.

Every op works eagerly and inside ``tf.data`` (tests check both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfspeed.data.schema import Feature

Element = dict[str, tf.Tensor]
Op = Callable[..., Element]

_TF_DTYPES = {"uint8": tf.uint8, "float32": tf.float32, "int64": tf.int64}


def make_decode(feature: Feature, key: str = "inputs") -> Op:
    """Decodes ``feature`` as stored by the converter into a dense tensor.

    JPEG uses ``decode_jpeg`` (libjpeg-turbo, much faster than PIL); raw bytes use
    ``decode_raw``; ``float``/``int`` features are already dense after parsing.
    """
    dtype = _TF_DTYPES[feature.dtype]
    shape = list(feature.shape)
    channels = shape[-1] if shape and shape[-1] is not None else 0

    def decode(element: Element) -> Element:
        value = element[key]
        if feature.encoding == "jpeg":
            value = tf.io.decode_jpeg(value, channels=channels)
        elif feature.encoding == "png":
            value = tf.io.decode_png(value, channels=channels)
        elif feature.encoding == "raw":
            # Works on one record or a batch of them (vectorised parse): keep leading dims.
            flat = tf.io.decode_raw(value, dtype)
            value = tf.reshape(flat, tf.concat([tf.shape(flat)[:-1], shape], 0))
        else:
            value = tf.cast(value, dtype)
        if feature.is_image:
            value = tf.ensure_shape(value, shape)
        return {**element, key: value}

    return decode


def make_resize(size: int, key: str = "inputs") -> Op:
    """Resizes an image to ``size``×``size`` (bilinear), keeping uint8.

    Staying uint8 keeps a cache after this op 4× smaller than float32 would.
    """

    def resize(element: Element) -> Element:
        image = element[key]
        resized = tf.image.resize(image, [size, size], method="bilinear")
        resized = tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), image.dtype)
        return {**element, key: resized}

    return resize


def make_flip(key: str = "inputs") -> Op:
    """Random horizontal flip."""

    def flip(element: Element, seed: tf.Tensor) -> Element:
        return {**element, key: tf.image.stateless_random_flip_left_right(element[key], seed)}

    return flip


def make_crop(padding_fraction: float = 0.125, key: str = "inputs") -> Op:
    """Random crop back to the input size after reflect-padding by a fraction of the side.

    The classic CIFAR-style shift augmentation; output size equals input size.
    """

    def crop(element: Element, seed: tf.Tensor) -> Element:
        image = element[key]
        shape = tf.shape(image)
        pad = tf.cast(tf.cast(shape[0], tf.float32) * padding_fraction, tf.int32)
        padded = tf.pad(image, [[pad, pad], [pad, pad], [0, 0]], mode="REFLECT")
        cropped = tf.image.stateless_random_crop(padded, shape, seed)
        return {**element, key: tf.ensure_shape(cropped, image.shape)}

    return crop


def make_normalize(scale: float = 1 / 255, key: str = "inputs") -> Op:
    """Casts to float32 and scales (uint8 images to [0, 1])."""

    def normalize(batch: Element) -> Element:
        return {**batch, key: tf.cast(batch[key], tf.float32) * scale}

    return normalize


def make_standardize(mean: Sequence[float], std: Sequence[float], key: str = "inputs") -> Op:
    """(x - mean) / std per feature, with the train split's statistics from the schema."""
    mean_t = tf.constant(mean, tf.float32)
    std_t = tf.constant(std, tf.float32)

    def standardize(batch: Element) -> Element:
        x = tf.cast(batch[key], tf.float32)
        shape = tf.shape(x)
        flat = tf.reshape(x, [shape[0], -1])
        return {**batch, key: tf.reshape((flat - mean_t) / std_t, shape)}

    return standardize


# name -> (kind, factory). Augmentations named in --augment must be "random" ops.
OPS: dict[str, tuple[str, Callable[..., Op]]] = {
    "decode": ("deterministic", make_decode),
    "resize": ("deterministic", make_resize),
    "flip": ("random", make_flip),
    "crop": ("random", make_crop),
    "normalize": ("batch", make_normalize),
    "standardize": ("batch", make_standardize),
}
AUGMENTATIONS = tuple(name for name, (kind, _) in OPS.items() if kind == "random")


def compose_random(ops: Sequence[Op]) -> Callable[[Element, tf.Tensor], Element]:
    """Chains random ops, giving each its own seed split from the element's seed."""

    def apply(element: Element, seed: tf.Tensor) -> Element:
        if not ops:
            return element
        seeds = tf.random.experimental.stateless_split(seed, num=len(ops))
        for i, op in enumerate(ops):
            element = op(element, seeds[i])
        return element

    return apply


def compose(ops: Sequence[Op]) -> Op:
    """Chains deterministic or batch ops left to right."""

    def apply(element: Element) -> Element:
        for op in ops:
            element = op(element)
        return element

    return apply
