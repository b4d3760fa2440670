"""How sources store images (`ImageStorage`): deterministic JPEG/PNG or raw uint8, or a `Skip`.

Three ways to size them:
  * as they are: a file already in the stored format is kept byte for byte;
  * ``max_side``: the long side shrunk to at most this, aspect kept (LANCZOS), for training
    with random-resized crops;
  * ``size``: N x N, the pixels TF's guide computes with
    ``tf.image.resize(tf.io.decode_jpeg(data, channels=3), [N, N])``: decoded as TF decodes
    (libjpeg-turbo's fast integer DCT, TF's default), resized as TF resizes, rounded to uint8.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import re
import struct

import numpy as np
import simplejpeg
from PIL import Image, UnidentifiedImageError

from tfspeed.convert.sources.base import Skip, StoredImage
from tfspeed.convert.sources.resize import resize_to_uint8

JPEG_QUALITY = 95  # fixed, so re-encoded images are byte-identical run to run
FORMATS = ("jpeg", "png", "raw")
_PIL_FORMATS = {"jpeg": "JPEG", "png": "PNG"}

# What PIL and simplejpeg raise for a file that is no (complete) image.
_IMAGE_ERRORS = (
    OSError,
    ValueError,
    SyntaxError,
    EOFError,
    struct.error,
    Image.DecompressionBombError,
)


@dataclasses.dataclass(frozen=True)
class ImageStorage:
    """How a conversion stores images.

    Attributes:
      image_format: ``jpeg`` (quality `JPEG_QUALITY`), ``png`` or ``raw`` (the uint8 array).
      size: stores ``size`` x ``size`` images as TF's bilinear resize makes them; 0 = off.
      max_side: shrinks images so the long side is at most this (aspect kept); 0 = keep.
      channels: 3 (RGB) or 1 (grayscale).
    """

    image_format: str
    size: int = 0
    max_side: int = 0
    channels: int = 3

    def from_bytes(self, data: bytes) -> StoredImage:
        """Stores an encoded image; raises one of ``_IMAGE_ERRORS`` if it is no image.

        EXIF orientation is ignored, as TF's decoders ignore it.
        """
        image = Image.open(io.BytesIO(data))  # reads the header only
        if not self.size and self._keeps(image, data):
            # Decoded only to reject a broken file: a truncated one must fail here, not in the
            # training input. A JPEG is decoded at 1/8 scale (DCT scaling): every entropy-coded
            # byte is still read, so truncation is still caught, in less than a full decode's time.
            height, width = image.height, image.width  # before draft() scales them down
            image.draft(image.mode, (1, 1))
            image.load()
            return StoredImage(data, height, width)
        if self.size:
            return self.from_array(self._decode_as_tf(image, data))
        image.load()
        return self._finish(image.convert(self._mode))

    def from_array(self, array: np.ndarray) -> StoredImage:
        """Stores a uint8 ``(H, W, C)`` array (C = `channels`)."""
        if self.size and array.shape[:2] != (self.size, self.size):
            array = resize_to_uint8(array, self.size)
        height, width = array.shape[:2]
        shrink = self.max_side and max(height, width) > self.max_side
        if self.image_format == "raw" and not shrink:
            return StoredImage(np.ascontiguousarray(array), height, width)
        return self._finish(Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array))

    @property
    def _mode(self) -> str:
        return "RGB" if self.channels == 3 else "L"

    def _keeps(self, image: Image.Image, data: bytes) -> bool:
        """Whether ``data`` can be stored byte for byte: the format, mode and size it needs."""
        fits = self.max_side == 0 or max(image.size) <= self.max_side
        # PNG's IHDR bit depth is byte 24; PIL shows 16-bit RGB as 8-bit "RGB". A
        # transparency chunk would give the file an alpha channel for decoders that honour it.
        plain = self.image_format != "png" or (
            data[24:25] == b"\x08" and "transparency" not in image.info
        )
        wanted = _PIL_FORMATS.get(self.image_format)
        return fits and plain and image.mode == self._mode and image.format == wanted

    def _decode_as_tf(self, image: Image.Image, data: bytes) -> np.ndarray:
        """The uint8 ``(H, W, C)`` pixels ``tf.io.decode_image(data, channels)`` gives."""
        if image.format == "JPEG":
            try:
                # TF decodes with libjpeg-turbo's fast integer DCT and fancy upsampling;
                # simplejpeg can do the same (PIL cannot pick the DCT: pixels up to 8 apart).
                colorspace = "RGB" if self.channels == 3 else "GRAY"
                pixels = simplejpeg.decode_jpeg(data, colorspace=colorspace, fastdct=True)
                return pixels.reshape(*pixels.shape[:2], self.channels)
            except ValueError:
                pass  # e.g. CMYK, or recoverable damage simplejpeg refuses: PIL decides
        image.load()
        return np.asarray(image.convert(self._mode)).reshape(image.height, image.width, -1)

    def _finish(self, image: Image.Image) -> StoredImage:
        """Shrinks ``image`` to ``max_side`` if needed, then stores it."""
        if self.max_side and max(image.size) > self.max_side:
            scale = self.max_side / max(image.size)
            size = tuple(max(1, round(side * scale)) for side in image.size)
            image = image.resize(size, Image.Resampling.LANCZOS)
        if self.image_format == "raw":
            return self.from_array(np.asarray(image).reshape(image.height, image.width, -1))
        return StoredImage(_save(image, self.image_format), image.height, image.width)


def image_or_skip(
    item: str, data: bytes | pathlib.Path, storage: ImageStorage
) -> StoredImage | Skip:
    """``storage.from_bytes(data)``, or a `Skip` of ``item`` if it is no readable image.

    Args:
      item: names the image in the `Skip` (a path, or a TFDS split and index).
      data: the encoded image, or the file holding it.
      storage: how to store it.

    Returns:
      The stored image, or the `Skip` saying why there is none.
    """
    try:
        if isinstance(data, pathlib.Path):
            data = data.read_bytes()  # an unreadable file is skipped like an undecodable one
        return storage.from_bytes(data)
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
