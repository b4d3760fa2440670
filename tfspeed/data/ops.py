"""Preprocessing ops: small factories ``make_x(...) -> op``, looked up by name in ``OPS``.

An element is a dict ``{"inputs": tensor, "label": tensor}``. Ops come in four kinds,
because where they may run in the pipeline differs:

  group ``make_group_parser``: a group of serialized records -> parsed (and, for fixed-shape
    features, decoded and standardised) tensors in one vectorised call per group.
  deterministic ``op(element) -> element``: decode, resize. They run once per record,
    before the cache, so their work is paid once.
  random ``op(element, seed) -> element``: flip, crop, random_resized_crop. They run after
    the cache and the shuffle, with a stateless per-element ``seed`` (shape [2]), so a seeded
    run gives the same augmentation whatever the map's parallelism. random_resized_crop
    decodes only its crop, so it runs on the *encoded* image (the cache, if any, then holds
    encoded images).
  batch ``op(batch) -> batch``: normalize. Element-wise maths on whole batches is cheaper.

Every op works eagerly and inside ``tf.data`` (tests check both).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tensorflow as tf

from tfspeed.data.schema import Feature

Element = dict[str, tf.Tensor]
Op = Callable[..., Element]

_TF_DTYPES = {"uint8": tf.uint8, "float32": tf.float32, "int64": tf.int64}
RATIOS = (8, 4, 2)  # the DCT-domain downscales tf.io.decode_jpeg offers


def make_group_parser(schema, standardize: bool = True):
    """``(parse_group, parse_one)`` for ``schema``'s records -> ``{"inputs", "label"}``.

    ``parse_group`` parses ``[n]`` serialized records with one ``parse_example``; fixed-shape
    inputs come out decoded (``raw`` bytes -> uint8 arrays) and, with ``standardize``, float
    features standardised with the train split's statistics, all vectorised. Encoded images
    stay encoded (bytes): they are decoded per record later. ``parse_one`` does the same for
    one record (the fallback that drops a bad payload alone). Several named inputs come as a
    dict ``{name: value}``. Class labels become int32, regression targets float32.
    """
    spec = schema.parse_spec()
    finish = {name: _make_finish(schema.features[name],
                                 schema.stats.get(name) if standardize else None)
              for name in schema.input_names}
    label_dtype = tf.float32 if schema.task == "regression" else tf.int32

    def select(parsed):
        inputs = {name: fn(parsed[name]) for name, fn in finish.items()}
        element = {"inputs": inputs if schema.named_inputs else inputs[schema.input_names[0]]}
        if schema.label:  # a language model's records are their tokens alone
            element["label"] = tf.cast(parsed[schema.label], label_dtype)
        return element

    def parse_group(records):
        return select(tf.io.parse_example(records, spec))

    def parse_one(record):
        return select(tf.io.parse_single_example(record, spec))

    return parse_group, parse_one


def _make_finish(feature: Feature, stats: dict | None):
    """What runs on a parsed (possibly batched) input value before it leaves the group."""
    if feature.encoding == "raw":
        return make_decode(feature, key=None)
    if feature.encoding == "float" and stats:
        shape = list(feature.shape) or [1]
        mean = tf.reshape(tf.constant(stats["mean"], tf.float32), shape)
        std = tf.reshape(tf.constant(stats["std"], tf.float32), shape)
        return lambda x: (x - mean) / std
    if feature.encoding in ("float", "int"):
        return lambda x: tf.cast(x, tf.float32)  # what a model takes
    return lambda x: x  # jpeg / png: decoded per record


def make_label_check(num_classes: int, message: str):
    """A group -> assertion ops that its labels lie in ``[0, num_classes)``.

    A label the classifier has no output for would fail deep inside the loss; checked once
    per group where the labels are parsed anyway, not on every batch.
    """

    def check(group):
        labels = group["label"]
        return [tf.debugging.assert_less(labels, num_classes, message=message),
                tf.debugging.assert_non_negative(labels, message=message)]

    return check


def ratio_for(min_side: int, size: int) -> int:
    """The largest ``decode_jpeg`` ratio whose output still has at least ``size`` pixels on
    the shorter side of the smallest image (1 when none fits)."""
    if not size or not min_side:
        return 1
    return next((r for r in RATIOS if min_side // r >= size), 1)


def make_decode(feature: Feature, key: str | None = "inputs", ratio: int = 1,
                fit: int = 0) -> Op:
    """Decodes ``feature`` as stored by the converter into a dense tensor.

    JPEG uses ``decode_jpeg`` (libjpeg-turbo, much faster than PIL), at ``ratio`` (a
    downscale in the DCT domain: less work for images much larger than the training size).
    With ``fit=N`` each JPEG is decoded at the largest ratio (at least ``ratio``) that still
    leaves N pixels on its shorter side, read from its header: in a split of mixed sizes the
    large images are decoded small even though the smallest ones allow no ratio. Raw bytes
    use ``decode_raw`` (also on a batch of records); ``float``/``int`` features are dense
    already. With ``key=None`` the op maps a value, not an element.
    """
    dtype = _TF_DTYPES[feature.dtype]
    shape = list(feature.shape)
    channels = shape[-1] if shape and shape[-1] is not None else 0

    def decode_value(value):
        if feature.encoding == "jpeg":
            value = _decode_jpeg(value, channels, ratio, fit)
        elif feature.encoding == "png":
            value = tf.io.decode_png(value, channels=channels)
        elif feature.encoding == "raw":
            flat = tf.io.decode_raw(value, dtype)
            value = tf.reshape(flat, tf.concat([tf.shape(flat)[:-1], shape], 0))
        else:
            value = tf.cast(value, dtype)
        if feature.is_image:
            value = tf.ensure_shape(value, [None, None, channels] if ratio > 1 or fit
                                    else shape)
        return value

    if key is None:
        return decode_value
    return lambda element: {**element, key: decode_value(element[key])}


def _decode_jpeg(value: tf.Tensor, channels: int, ratio: int, fit: int) -> tf.Tensor:
    """``decode_jpeg`` at ``ratio``, or with ``fit`` at each image's own largest ratio."""
    larger = [r for r in RATIOS if r > ratio]
    if not fit or not larger:
        return tf.io.decode_jpeg(value, channels=channels, ratio=ratio)
    short_side = tf.reduce_min(tf.io.extract_jpeg_shape(value)[:2])

    def at(r):
        return lambda: tf.io.decode_jpeg(value, channels=channels, ratio=r)

    # The first true condition wins: RATIOS run from the largest down.
    return tf.case([(short_side // r >= fit, at(r)) for r in larger], default=at(ratio),
                   exclusive=False)


def resize_bilinear(image: tf.Tensor, size: int) -> tf.Tensor:
    """``tf.image.resize(image, [size, size])``, the same float32 pixels for less work.

    TF's bilinear kernel reads uint8 input more slowly than float32: on 256-512 px photos
    resized to 224, the cast plus the float32 resize cost less CPU than the uint8 resize
    (``benchmarks/decode_ops.py``). The results are bit-identical (the kernel interpolates
    in float32 either way).
    """
    return tf.image.resize(tf.cast(image, tf.float32), [size, size], method="bilinear")


def make_resize(size: int, key: str = "inputs", keep_uint8: bool = True) -> Op:
    """Resizes an image to ``size``×``size`` (bilinear, as ``tf.image.resize``).

    With ``keep_uint8`` the result is rounded back to uint8: a cache after this op is then
    4× smaller than float32. Without it the float32 result (0..255) goes on as it is: no
    round trip between dtypes when nothing is cached.
    """

    def resize(element: Element) -> Element:
        image = element[key]
        resized = resize_bilinear(image, size)
        if keep_uint8:
            resized = tf.cast(tf.clip_by_value(tf.round(resized), 0, 255), tf.uint8)
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


def make_random_resized_crop(feature: Feature, size: int, key: str = "inputs",
                             area: tuple[float, float] = (0.08, 1.0),
                             aspect: tuple[float, float] = (3 / 4, 4 / 3)) -> Op:
    """Inception-style random-resized crop of an *encoded* image, resized to ``size``².

    A window covering ``area`` of the image with an aspect ratio in ``aspect`` is drawn from
    the seed; for JPEG only that window is decoded (``decode_and_crop_jpeg``), for other
    encodings the image is decoded whole and cropped. The result is float32 in 0..255.
    """
    # raw images arrive decoded already (the group parse decodes them).
    decode = make_decode(feature, key=None) if feature.is_image else (lambda image: image)
    channels = feature.shape[-1]

    def crop(element: Element, seed: tf.Tensor) -> Element:
        encoded = element[key]
        if feature.encoding == "jpeg":
            shape = tf.io.extract_jpeg_shape(encoded)
        else:
            image = decode(encoded)
            shape = tf.shape(image)
        begin, window, _ = tf.image.stateless_sample_distorted_bounding_box(
            shape, bounding_boxes=tf.zeros([1, 0, 4]), seed=seed, min_object_covered=0.0,
            aspect_ratio_range=aspect, area_range=area, max_attempts=10,
            use_image_if_no_bounding_boxes=True)
        if feature.encoding == "jpeg":
            y, x = tf.unstack(begin[:2])
            height, width = tf.unstack(window[:2])
            image = tf.io.decode_and_crop_jpeg(encoded, tf.stack([y, x, height, width]),
                                               channels=channels)
        else:
            image = tf.slice(image, begin, window)
        image = resize_bilinear(image, size)
        return {**element, key: tf.ensure_shape(image, [size, size, channels])}

    return crop


def make_normalize(scale: float = 1 / 255, key: str = "inputs") -> Op:
    """Casts to float32 and scales (uint8 images to [0, 1])."""

    def normalize(batch: Element) -> Element:
        return {**batch, key: tf.cast(batch[key], tf.float32) * scale}

    return normalize


# name -> (kind, factory). Augmentations named in --augment must be "random" ops.
OPS: dict[str, tuple[str, Callable[..., Op]]] = {
    "decode": ("deterministic", make_decode),
    "resize": ("deterministic", make_resize),
    "flip": ("random", make_flip),
    "crop": ("random", make_crop),
    "random_resized_crop": ("random", make_random_resized_crop),
    "normalize": ("batch", make_normalize),
}
AUGMENTATIONS = tuple(name for name, (kind, _) in OPS.items() if kind == "random")
# Augmentations that work on the encoded image, so they run where it is decoded.
DECODING_AUGMENTATIONS = ("random_resized_crop",)


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
