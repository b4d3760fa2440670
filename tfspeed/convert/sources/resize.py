"""TensorFlow's bilinear resize in numpy: the pixels ``tf.image.resize(image, [n, n])`` gives.

The converter resizes images for ``--image_size=N`` in its workers, which import no
TensorFlow. Training then reads the pixels the TF guide's pipeline would have computed
(``tf.image.resize`` defaults: bilinear, half-pixel centres, no antialiasing, aspect squashed).
No library computes exactly that (OpenCV's uint8 path uses fixed-point weights, PIL's
bilinear antialiases when shrinking), so it is written out as TF's kernel
(``resize_bilinear_op.cc``) computes it, in float32 and in the same order: along x, then y.
The result equals TF's float output exactly (tests compare them).
"""

from __future__ import annotations

import numpy as np


def _weights(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index: the lower and upper source index, and the upper one's weight."""
    scale = np.float32(in_size) / np.float32(out_size)
    centre = (np.arange(out_size, dtype=np.float32) + np.float32(0.5)) * scale - np.float32(0.5)
    floor = np.floor(centre)
    lower = np.maximum(floor, 0).astype(np.intp)
    upper = np.minimum(np.ceil(centre), in_size - 1).astype(np.intp)
    return lower, upper, centre - floor


def resize_bilinear(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """``image`` resized as ``tf.image.resize(image, [height, width])`` resizes it.

    Args:
      image: a ``(H, W, C)`` array (uint8 from a decoder).
      height: the output height.
      width: the output width.

    Returns:
      The float32 ``(height, width, C)`` array TF returns.
    """
    in_height, in_width, channels = image.shape
    y0, y1, wy = _weights(in_height, height)
    x0, x1, wx = _weights(in_width, width)
    # Pixels as rows of W * C values: gathers and weights then run along long rows (numpy is
    # slow over an inner axis of 3), and only the source rows in use are converted.
    rows, where = np.unique(np.concatenate([y0, y1]), return_inverse=True)
    flat = image[rows].reshape(len(rows), in_width * channels)
    step = np.arange(channels)
    left = flat[:, (x0[:, None] * channels + step).ravel()].astype(np.float32)
    right = flat[:, (x1[:, None] * channels + step).ravel()].astype(np.float32)
    right -= left
    right *= np.repeat(wx, channels)
    right += left  # along x: left + (right - left) * wx, for every source row in use
    top, bottom = right[where[:height]], right[where[height:]]
    bottom -= top
    bottom *= wy[:, None]
    bottom += top  # along y: top + (bottom - top) * wy
    return bottom.reshape(height, width, channels)


def resize_to_uint8(image: np.ndarray, size: int) -> np.ndarray:
    """``image`` resized to ``size`` x ``size`` as TF's bilinear resize does, rounded to uint8.

    Rounds half to even, as ``tf.round`` does.
    """
    resized = resize_bilinear(image, size, size)
    return np.clip(np.round(resized), 0, 255).astype(np.uint8)
