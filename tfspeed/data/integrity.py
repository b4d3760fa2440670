"""A pure-Python TFRecord framing walker that survives damage.

A TFRecord file is a sequence of frames::

    uint64 length (little-endian) | uint32 masked crc32c(length bytes)
    length data bytes             | uint32 masked crc32c(data)

TF's reader stops at the first bad frame (and ``ignore_errors`` drops the rest of the
file), so it cannot say what is still intact. ``walk`` checks every frame and, after a
bad one, resynchronises by scanning forward byte by byte for the next offset that holds a
whole valid frame (header CRC and data CRC both right), so intact records after the damage
are found. A chance false frame would need two 32-bit CRCs to match at once.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator

import google_crc32c

HEADER_BYTES = 12  # uint64 length + uint32 masked crc
FOOTER_BYTES = 4  # uint32 masked crc of the data
_MASK_DELTA = 0xA282EAD8


def masked_crc(data: bytes) -> int:
    """TFRecord's masked crc32c of ``data``."""
    crc = google_crc32c.value(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def frame(data: bytes) -> bytes:
    """``data`` framed as one TFRecord record."""
    length = struct.pack("<Q", len(data))
    return (
        length + struct.pack("<I", masked_crc(length)) + data + struct.pack("<I", masked_crc(data))
    )


@dataclasses.dataclass(frozen=True)
class Record:
    """An intact record: its frame starts at ``offset`` and spans ``size`` bytes."""

    offset: int
    size: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class BadSpan:
    """Bytes ``[offset, offset + length)`` hold no intact record; ``reason`` says why."""

    offset: int
    length: int
    reason: str


def _check_frame(buf: bytes, pos: int) -> tuple[int, str]:
    """(frame size, "") if a valid frame starts at ``pos``, else (0, why not)."""
    remaining = len(buf) - pos
    if remaining < HEADER_BYTES:
        return 0, "truncated header"
    (length,) = struct.unpack_from("<Q", buf, pos)
    (header_crc,) = struct.unpack_from("<I", buf, pos + 8)
    if masked_crc(buf[pos : pos + 8]) != header_crc:
        return 0, "bad header crc"
    size = HEADER_BYTES + length + FOOTER_BYTES
    if size > remaining:
        return 0, "truncated record"
    start = pos + HEADER_BYTES
    (data_crc,) = struct.unpack_from("<I", buf, start + length)
    if masked_crc(buf[start : start + length]) != data_crc:
        return 0, "bad data crc"
    return size, ""


def _resync(buf: bytes, pos: int) -> int:
    """The first offset after ``pos`` where a valid frame starts, or ``len(buf)``."""
    for candidate in range(pos + 1, len(buf) - HEADER_BYTES - FOOTER_BYTES + 1):
        if _check_frame(buf, candidate)[0]:
            return candidate
    return len(buf)


def walk(buf: bytes) -> Iterator[Record | BadSpan]:
    """Yields the intact records and bad spans of a TFRecord file's bytes, in file order.

    Args:
      buf: the whole file's content.

    Returns:
      An iterator of ``Record`` and ``BadSpan``; together they cover ``buf`` exactly.
      A truncated tail is a ``BadSpan``.
    """
    pos = 0
    while pos < len(buf):
        size, reason = _check_frame(buf, pos)
        if size:
            start = pos + HEADER_BYTES
            yield Record(pos, size, bytes(buf[start : start + size - HEADER_BYTES - FOOTER_BYTES]))
            pos += size
            continue
        nxt = _resync(buf, pos)
        yield BadSpan(pos, nxt - pos, reason)
        pos = nxt


def record_offsets(buf: bytes) -> list[tuple[int, int]]:
    """(offset, size) of every record of an undamaged file; ValueError at the first bad frame."""
    spans = []
    for item in walk(buf):
        if isinstance(item, BadSpan):
            raise ValueError(f"{item.reason} at byte {item.offset}")
        spans.append((item.offset, item.size))
    return spans
