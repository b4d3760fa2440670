"""How sources store images: deterministic JPEG/PNG encoding, or a `Skip` for a bad file."""

from __future__ import annotations

import io
import pathlib
import re
import struct

import numpy as np
from PIL import Image, UnidentifiedImageError

from tfspeed.convert.sources.base import Skip

JPEG_QUALITY = 95  # fixed, so re-encoded images are byte-identical run to run
_PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG"}

# What PIL raises for a file that is no (complete) image.
_IMAGE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    struct.error,
    Image.DecompressionBombError,
)


def encode_image(data: bytes, image_format: str, max_side: int = 0, channels: int = 3) -> bytes:
    """Returns ``data`` as a ``channels``-channel image in ``image_format``, long side <= max_side.

    A file already in that format and mode, 8-bit and small enough is returned byte for byte
    (fast, lossless). EXIF orientation is ignored on both paths, as TF's decoders ignore it.

    Args:
      data: the encoded image.
      image_format: ``jpeg`` or ``png``.
      max_side: the longest side allowed; 0 keeps the size.
      channels: 3 (RGB) or 1 (grayscale).

    Returns:
      The encoded image. Raises one of ``_IMAGE_ERRORS`` if ``data`` is no decodable image.
    """
    image = Image.open(io.BytesIO(data))  # reads the header only
    mode = "RGB" if channels == 3 else "L"
    fits = max_side == 0 or max(image.size) <= max_side
    # PNG's IHDR bit depth is byte 24; PIL shows 16-bit RGB as 8-bit "RGB". A transparency
    # chunk would give the file an alpha channel for decoders that honour it.
    plain = image_format != "png" or (data[24:25] == b"\x08" and "transparency" not in image.info)
    if fits and plain and image.mode == mode and image.format == _PIL_FORMATS[image_format]:
        # Decoded only to reject a broken file: a truncated one must fail here, not in the
        # training input. A JPEG is decoded at 1/8 scale (DCT scaling): every entropy-coded
        # byte is still read, so truncation is still caught, in ~60% of a full decode's time.
        image.draft(image.mode, (1, 1))
        image.load()
        return data
    image.load()
    image = image.convert(mode)
    if not fits:
        scale = max_side / max(image.size)
        size = tuple(max(1, round(side * scale)) for side in image.size)
        image = image.resize(size, Image.Resampling.LANCZOS)
    return _save(image, image_format)


def encode_array(array: np.ndarray, image_format: str) -> bytes:
    """Encodes a uint8 ``(H, W, C)`` array (C = 1 or 3) as ``image_format`` bytes."""
    image = Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array)
    return _save(image, image_format)


def image_or_skip(
    item: str, data: bytes | pathlib.Path, image_format: str, max_side: int, channels: int = 3
) -> bytes | Skip:
    """`encode_image` of ``data``, or a `Skip` of ``item`` if it is no readable image.

    Args:
      item: names the image in the `Skip` (a path, or a TFDS split and index).
      data: the encoded image, or the file holding it.
      image_format: ``jpeg`` or ``png``.
      max_side: the longest side allowed; 0 keeps the size.
      channels: 3 (RGB) or 1 (grayscale).

    Returns:
      The encoded image, or the `Skip` saying why there is none.
    """
    try:
        if isinstance(data, pathlib.Path):
            data = data.read_bytes()  # an unreadable file is skipped like an undecodable one
        return encode_image(data, image_format, max_side, channels)
    except _IMAGE_ERRORS as e:
        return Skip(item, _skip_reason(e))


def _save(image: Image.Image, image_format: str) -> bytes:
    buffer = io.BytesIO()
    if image_format == "jpeg":
        image.save(buffer, "JPEG", quality=JPEG_QUALITY)
    else:
        image.save(buffer, "PNG")
    return buffer.getvalue()


def _skip_reason(error: Exception) -> str:
    if isinstance(error, UnidentifiedImageError):
        return "not a decodable image (unknown format)"
    # PIL names in-memory buffers by address; drop it so schema.json stays deterministic.
    message = re.sub(r" at 0x[0-9a-fA-F]+", "", " ".join(str(error).split()))
    return f"undecodable image: {type(error).__name__}: {message}"
