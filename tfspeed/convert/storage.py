"""How a conversion stores its images: ``--image_format=auto|jpeg|png|raw``, and why.

``raw`` stores the uint8 pixels: the reader skips decoding, but every image takes H*W*C bytes.
It needs images of one shape (``--image_size=N``, or a source of fixed-size images). ``auto``
picks raw where that is measured to be faster to read than JPEG is to decode, and the
dataset's raw size fits ``--raw_budget_mb`` (default: `RAW_BUDGET_FRACTION` of this machine's
RAM, so that it stays in the page cache from the second epoch on); JPEG at quality
`JPEG_QUALITY` otherwise.

The measurement takes `PROBE_IMAGES` images of the train split as they would
be stored, then times
  * decoding their JPEGs with libjpeg-turbo's fast integer DCT, the decoder and method
    ``tf.io.decode_jpeg`` uses by default (best of 3 passes), against
  * reading their raw bytes back from a file in the output directory, repeated to at least
    `PROBE_BYTES`, after dropping that file from the page cache
    (``posix_fadvise(POSIX_FADV_DONTNEED)``): a first epoch's reads, from the disk itself.
The choice and its figures go into ``schema.json``'s ``storage`` entry and the plan, and a
rerun of the same conversion adopts them, so that resuming never depends on a new timing.
"""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Callable, Sequence

import numpy as np
import simplejpeg
from PIL import Image

from tfspeed.convert.plan import PROBE_FILE
from tfspeed.convert.sources import JPEG_QUALITY

RAW_BUDGET_FRACTION = 0.25  # of physical RAM: the rest is the trainer's and the system's
PROBE_IMAGES = 32
PROBE_BYTES = 8 << 20  # read-back size: enough that disk throughput, not latency, counts
_READ_BLOCK = 256 << 10  # TFRecordDataset's default read buffer


def default_raw_budget_mb() -> float:
    """`RAW_BUDGET_FRACTION` of this machine's physical memory, in MB (2**20 bytes)."""
    try:
        ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # no sysconf (Windows): 16 GiB assumed
        ram = 16 << 30
    return RAW_BUDGET_FRACTION * ram / 2**20


def choose(
    requested: str,
    shape: tuple[int | None, ...],
    *,
    raw_mb: float,
    budget_mb: float,
    sample: Callable[[], Sequence[np.ndarray]],
    probe_dir: str,
) -> dict:
    """Decides how images are stored; returns the ``storage`` entry of ``schema.json``.

    Args:
      requested: ``--image_format``: ``auto``, ``jpeg``, ``png`` or ``raw``.
      shape: the stored images' shape, ``None`` where sides vary.
      raw_mb: the dataset's size stored raw, in MB.
      budget_mb: ``--raw_budget_mb``.
      sample: returns a few images of the train split as uint8 arrays (called for auto only).
      probe_dir: where the read-back file may be written (the output directory).

    Returns:
      ``image_format`` (jpeg, png or raw), ``requested``, a ``reason`` in words and, when
      measured, ``read_ms`` and ``decode_ms`` per image, ``raw_mb`` and ``raw_budget_mb``.
    """
    if requested != "auto":
        return _entry(requested, requested, f"--image_format={requested}")
    if None in shape:
        return _entry("jpeg", requested, "image sides vary; raw needs one shape (--image_size=N)")
    sizes = {"raw_mb": round(raw_mb, 1), "raw_budget_mb": round(budget_mb, 1)}
    if raw_mb > budget_mb:
        return _entry(
            "jpeg", requested, f"raw would take {raw_mb:.0f} MB, over --raw_budget_mb", **sizes
        )
    images = sample()
    if not images:
        return _entry("jpeg", requested, "no image of the train split could be read to measure")
    read_ms, decode_ms = measure(images, probe_dir)
    raw = read_ms < decode_ms
    reason = (
        f"reading an image's {images[0].nbytes} raw bytes from disk takes {read_ms:.3g} ms, "
        f"decoding its JPEG {decode_ms:.3g} ms"
        + (f"; raw ({raw_mb:.3g} MB) fits --raw_budget_mb" if raw else "")
    )
    figures = {"read_ms": float(f"{read_ms:.4g}"), "decode_ms": float(f"{decode_ms:.4g}")}
    return _entry("raw" if raw else "jpeg", requested, reason, **figures, **sizes)


def measure(images: Sequence[np.ndarray], probe_dir: str) -> tuple[float, float]:
    """Milliseconds per image: (reading it raw from disk, decoding it from JPEG).

    Args:
      images: uint8 ``(H, W, C)`` arrays, as they would be stored.
      probe_dir: a directory on the disk the dataset goes to.

    Returns:
      ``(read_ms, decode_ms)``.
    """
    jpegs = [_jpeg(image) for image in images]
    colorspace = "RGB" if images[0].shape[-1] == 3 else "GRAY"
    decode_s = math.inf
    for _ in range(3):
        start = time.perf_counter()
        for data in jpegs:
            simplejpeg.decode_jpeg(data, colorspace=colorspace, fastdct=True)
        decode_s = min(decode_s, time.perf_counter() - start)
    raw = b"".join(image.tobytes() for image in images)
    copies = max(1, math.ceil(PROBE_BYTES / len(raw)))
    read_s = _read_back(raw * copies, probe_dir)
    return 1e3 * read_s / (copies * len(images)), 1e3 * decode_s / len(images)


def _read_back(data: bytes, probe_dir: str) -> float:
    """Seconds to read ``data`` back from a file, the page cache dropped (best of 2)."""
    path = os.path.join(probe_dir, f"{PROBE_FILE}.tmp-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)  # only clean pages can be dropped
        best = math.inf
        for _ in range(2):
            if hasattr(os, "posix_fadvise"):  # not on macOS/Windows: a warm read, then
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start = time.perf_counter()
            offset = 0
            while block := os.pread(fd, _READ_BLOCK, offset):
                offset += len(block)
            best = min(best, time.perf_counter() - start)
        return best
    finally:
        os.close(fd)
        os.remove(path)


def _jpeg(image: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(
        buffer, "JPEG", quality=JPEG_QUALITY
    )
    return buffer.getvalue()


def _entry(image_format: str, requested: str, reason: str, **figures) -> dict:
    entry = {"image_format": image_format, "requested": requested, "reason": reason, **figures}
    if image_format == "jpeg":
        entry["jpeg_quality"] = JPEG_QUALITY
    return entry
