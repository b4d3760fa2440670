"""How text sources turn bytes into text: strict UTF-8 first, then ``--encoding`` (a codec
name) or, by default (``auto``), the charset that charset-normalizer detects.

Real text comes in many charsets: a folder of mail holds latin-1, cp1252 and UTF-16 files
beside UTF-8 ones, and skipping them loses texts unevenly between classes. So a file that is
not UTF-8 is decoded with the charset given or detected, and the converter counts the texts
each charset decoded (``schema.json``, the summary line). Only bytes that are no text in any
charset (a binary file, or NUL characters once decoded) are skipped. A file that is mostly
UTF-8 with a few stray bytes (a latin-1 signature) keeps its UTF-8 and reads those bytes as
cp1252 (counted as ``utf-8+cp1252``). Detection runs only for a file that fails UTF-8, and is
deterministic: the same bytes give the same text.

Imports nothing heavy: the writer's worker processes import it (charset-normalizer lazily).
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import re
from collections.abc import Callable
from typing import TextIO, TypeVar

from tfspeed.errors import UsageError

AUTO = "auto"  # --encoding's default: detect the charset of a file that is not UTF-8
UTF8 = "utf-8"
MIXED = "utf-8+cp1252"  # UTF-8 with a few stray bytes of a single-byte charset (`_mostly_utf8`)
# The charset preferred among those that decode a file equally well (see `_detect`).
_PREFERRED = "cp1252"

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A text and the charset that decoded it (Python's codec name, e.g. ``cp1252``)."""

    text: str
    charset: str


@dataclasses.dataclass(frozen=True)
class Undecoded:
    """Bytes that are no text: why, and the kind of skip (``binary`` or ``undecodable``)."""

    why: str
    kind: str


def check(encoding: str) -> None:
    """Raises a one-line UsageError unless ``encoding`` is ``auto`` or a text codec."""
    if encoding == AUTO:
        return
    try:
        info = codecs.lookup(encoding)
    except LookupError:
        info = None
    # base64, rot13 and the like are codecs too, but of bytes to bytes (or str to str).
    if info is None or not getattr(info, "_is_text_encoding", True):
        raise UsageError(
            f"--encoding={encoding}: not a text encoding Python knows; use auto (UTF-8, else "
            "detect each file's charset) or a codec name such as latin-1, cp1252, utf-16"
        )


def decode(data: bytes, encoding: str = AUTO) -> Decoded | Undecoded:
    """The text of ``data``: strict UTF-8 (a BOM dropped), else ``encoding``, else detected.

    Args:
      data: the bytes of one text (a file).
      encoding: a codec name, or `AUTO` to detect the charset with charset-normalizer.

    Returns:
      The text and its charset, or why the bytes are no text.
    """
    # UTF-8 text holds no NUL; ASCII in UTF-16 without a BOM is valid UTF-8 that does.
    if b"\0" not in data:
        try:
            return Decoded(data.decode("utf-8-sig"), UTF8)
        except UnicodeDecodeError:
            pass
    if encoding != AUTO:
        charset = codecs.lookup(encoding).name
        try:
            decoded = Decoded(data.decode(charset), charset)
        except UnicodeDecodeError as e:
            return Undecoded(
                f"not {charset} text (byte {e.start}: {e.reason}); pass the file's own "
                "--encoding, or --encoding=auto to detect it",
                "undecodable",
            )
    else:
        decoded = _mostly_utf8(data) or _detect(data)
        if decoded is None:
            return Undecoded(
                "not text in any charset charset-normalizer knows (a binary file?)", "binary"
            )
    if "\0" in decoded.text:
        return Undecoded(
            f"NUL characters once decoded as {decoded.charset}: a binary file, not text", "binary"
        )
    return decoded


def read_text_file(
    path: str, encoding: str, parse: Callable[[TextIO], T], newline: str | None = None
) -> tuple[T, str]:
    """``parse`` of a whole file's text, and the charset that decoded it.

    The file is streamed as UTF-8 first; only if that fails is it read whole and decoded
    with ``encoding`` or the charset detected (`decode`). ``newline`` is ``open``'s.

    Raises:
      UsageError: the file is no text in any charset (or not in ``encoding``).
      OSError: it cannot be read.
    """
    try:
        with open(path, encoding="utf-8-sig", newline=newline) as f:
            return parse(f), UTF8
    except UnicodeDecodeError:
        pass
    with open(path, "rb") as f:
        decoded = decode(f.read(), encoding)
    if isinstance(decoded, Undecoded):
        raise UsageError(f"cannot read {path}: {decoded.why}")
    return parse(io.StringIO(decoded.text, newline=newline)), decoded.charset


def _mostly_utf8(data: bytes) -> Decoded | None:
    """``data`` as UTF-8 with its few stray bytes read as cp1252, or None if it is not
    mostly UTF-8 (fewer stray bytes than bytes of valid multi-byte UTF-8 characters).

    A mail's body in UTF-8 with a signature or a quoted line from a latin-1 program fails
    UTF-8 on a few bytes. Detection then picks one single-byte charset for the whole file,
    and every UTF-8 character of the rest becomes two or three wrong ones ('é' read as
    'Ã©'); decoding each part as what it is keeps both.
    """
    # surrogateescape turns each stray byte into one lone surrogate, U+DC80..U+DCFF.
    text = data.decode("utf-8-sig", errors="surrogateescape")
    stray = len(_STRAY.findall(text))
    multibyte = len(data) - len(data.translate(None, _HIGH_BYTES)) - stray
    if not 0 < stray < multibyte:
        return None
    return Decoded(_STRAY.sub(lambda m: _cp1252_or_latin1(ord(m.group()) - 0xDC00), text), MIXED)


def _cp1252_or_latin1(byte: int) -> str:
    # cp1252 leaves 5 bytes undefined; latin-1 reads them (as C1 controls).
    try:
        return bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:
        return chr(byte)


_STRAY = re.compile("[\udc80-\udcff]")
_HIGH_BYTES = bytes(range(0x80, 0x100))


def _detect(data: bytes) -> Decoded | None:
    """``data`` decoded with the charset charset-normalizer finds best, or None."""
    from charset_normalizer import from_bytes

    matches = list(from_bytes(data))
    if not matches:
        return None
    best = matches[0]
    # Mostly-ASCII text with a few accents decodes without a flaw in a dozen single-byte
    # charsets, and charset-normalizer breaks the tie by name or by weak letter statistics
    # (latin-1 French came back as cp1250, which reads 'naïve' as 'naďve'). Among the
    # matches as clean as the best, the most widespread one wins: cp1252, which is latin-1
    # plus typographic quotes, dashes and the euro sign (the WHATWG default for latin-1).
    for match in matches:
        if match.chaos <= best.chaos and _PREFERRED in match.could_be_from_charset:
            return Decoded(data.decode(_PREFERRED), _PREFERRED)
    return Decoded(str(best), codecs.lookup(best.encoding).name)
