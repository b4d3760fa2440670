"""Array files: ``csv:PATH`` (numeric columns plus a label column) and ``npz:PATH`` (x, y)."""

from __future__ import annotations

import csv
import zipfile
from collections.abc import Sequence
from typing import TextIO

import numpy as np

from tfspeed.convert.sources import charsets
from tfspeed.convert.sources.arrays import array_source
from tfspeed.convert.sources.base import LABEL, Source, SourceOptions, file_identity, target
from tfspeed.data.schema import Feature
from tfspeed.errors import UsageError

# ---------------------------------------------------------------- csv

# Python's csv refuses a cell over 131,072 characters by default: one mail or book is more.
# The largest limit a C long holds on every platform (Windows' is 32 bits).
_FIELD_LIMIT = 2**31 - 1


def open_csv(path: str, opts: SourceOptions) -> Source:
    """Reads a CSV file: every column but ``opts.label_column`` is a float feature.

    The features are one vector input ``features``, or with ``opts.named_columns`` one named
    input per column (shape ``(1,)``, standardised each). The label column holds classes
    (any values, mapped to ids) or, for ``opts.task="regression"``, numbers.
    """
    rows, _ = _read_csv(path)
    header = _csv_header(path, rows, opts.label_column)
    x, labels = _csv_table(path, header, rows[1:], opts.label_column)
    columns = [c for c in header if c != opts.label_column]
    if opts.task == "regression":
        y, class_names, label = _targets(path, labels, opts.label_column), (), target()
    else:
        (y, class_names), label = _encode_labels(labels), LABEL
    if opts.named_columns:
        _check_names(path, columns)
        arrays = {name: x[:, i:i + 1] for i, name in enumerate(columns)}
        features = tuple(Feature(name, "float32", (1,), "float") for name in columns)
        inputs = tuple(columns)
    else:
        arrays = {"features": x}
        features, inputs = (Feature("features", "float32", (x.shape[1],), "float"),), None
    return array_source(
        {**arrays, "label": y},
        features=features,
        class_names=class_names,
        identity=file_identity(path),
        options={"label_column": opts.label_column, "task": opts.task,
                 "named_columns": opts.named_columns},
        opts=opts,
        label=label,
        inputs=inputs,
    )


def _targets(path: str, values: Sequence[str], column: str) -> np.ndarray:
    """Regression targets: the label column as float32."""
    return np.asarray([_number(v, column, f"row {i}", path, what="the label column of a "
                               "regression") for i, v in enumerate(values, start=1)], np.float32)


def _check_names(path: str, columns: Sequence[str]) -> None:
    """Named inputs become Keras input names: letters, digits and _ . - only."""
    import re

    for name in columns:
        if name == "label" or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", name):
            raise UsageError(f"CSV {path}: column {name!r} cannot name a model input; rename "
                             "it (letters, digits, _ . -, not 'label') or drop --named_columns")


def _read_csv(
    path: str, encoding: str = charsets.AUTO
) -> tuple[list[tuple[int, list[str]]], str]:
    """``[(line number, cells)]`` of the non-blank rows of a CSV file (the line a row starts
    on), and the charset that decoded it (UTF-8, else ``encoding`` or the one detected)."""
    try:
        return charsets.read_text_file(path, encoding, lambda f: _csv_rows(path, f), newline="")
    except OSError as e:
        raise UsageError(f"cannot read CSV {path}: {e.strerror}") from None


def _csv_rows(path: str, f: TextIO) -> list[tuple[int, list[str]]]:
    # Strict: a quote that opens a cell and never closes, or text after a closing quote, is
    # an error at its row. Without it, and with no field limit, the rest of the file would
    # pass as one cell (the limit only caught that where it ran past 131,072 characters).
    reader, start, rows = csv.reader(f, strict=True), 1, []
    previous = csv.field_size_limit(_FIELD_LIMIT)  # process-wide: put back after
    try:
        for row in reader:
            if any(c.strip() for c in row):
                rows.append((start, row))
            start = reader.line_num + 1
    except csv.Error as e:
        raise UsageError(
            f"CSV {path} line {start} is not CSV ({e}, at line {reader.line_num}): quote a "
            'cell that holds commas, quotes or line breaks ("..."), doubling the quotes in it'
        ) from None
    finally:
        csv.field_size_limit(previous)
    return rows


def _csv_header(path: str, rows: list[tuple[int, list[str]]], column: str) -> list[str]:
    """The column names; raises a UsageError unless there is data and a label ``column``."""
    if len(rows) < 2:
        raise UsageError(f"CSV {path} is empty; it needs a header row and at least one data row")
    header = [c.strip() for c in rows[0][1]]
    if column not in header:
        raise UsageError(
            f"CSV {path} has no label column {column!r} (columns: {', '.join(header)}); "
            "pass --label_column=NAME"
        )
    if len(header) < 2:
        raise UsageError(f"CSV {path} has only the label column; it needs numeric feature columns")
    return header


def _csv_table(
    path: str, header: list[str], rows: list[tuple[int, list[str]]], column: str
) -> tuple[np.ndarray, list[str]]:
    """The float32 feature matrix and the label strings of the data ``rows``."""
    label_at = header.index(column)
    features, labels = [], []
    for row, (line, cells) in enumerate(rows, start=1):
        if len(cells) != len(header):
            raise UsageError(
                f"CSV {path} line {line} has {len(cells)} cells, the header has {len(header)}; fix that row"
            )
        labels.append(cells[label_at].strip())
        if not labels[-1]:
            raise UsageError(
                f"CSV {path} line {line} has an empty {column!r}; every row needs a label"
            )
        features.append(
            [
                _number(c, header[i], f"row {row} (line {line})", path)
                for i, c in enumerate(cells)
                if i != label_at
            ]
        )
    return np.asarray(features, np.float32), labels


def _number(cell: str, column: str, where: str, path: str,
            what: str = "every column except the label column") -> float:
    try:
        value = float(cell)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value):
        raise UsageError(
            f"CSV {path}: column {column!r}, {where} holds {cell!r}, not a finite "
            f"number; {what} must be numeric"
        )
    return value


def _encode_labels(values: Sequence[str]) -> tuple[np.ndarray, tuple[str, ...]]:
    """Label strings -> ids: ints 0..n-1 stay as they are, anything else maps sorted values."""
    try:
        ints = [int(v) for v in values]
    except ValueError:
        ints = None
    if ints is not None and set(ints) == set(range(len(set(ints)))):
        return np.asarray(ints, np.int64), tuple(str(i) for i in range(len(set(ints))))
    names = sorted(set(values), key=(lambda v: (int(v), v)) if ints is not None else None)
    ids = {name: i for i, name in enumerate(names)}
    return np.asarray([ids[v] for v in values], np.int64), tuple(names)


# ---------------------------------------------------------------- npz


def open_npz(path: str, opts: SourceOptions) -> Source:
    """Reads ``x`` (inputs), ``y`` (class ids, or regression targets with
    ``opts.task="regression"``) and optional ``class_names`` from a .npz file."""
    arrays = _load_npz(path)
    feature, x = _npz_feature(path, arrays["x"])
    if opts.task == "regression":
        y = _npz_targets(path, arrays["x"], arrays["y"])
        names, label = (), target(y.shape[1:])
    else:
        y = _npz_labels(path, arrays["x"], arrays["y"])
        names, label = _npz_class_names(path, arrays, int(y.max()) + 1), LABEL
    return array_source(
        {"x": x, "label": y},
        features=(feature,),
        class_names=names,
        identity=file_identity(path),
        options={"task": opts.task},
        opts=opts,
        label=label,
    )


def _npz_targets(path: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``y`` as float32 regression targets, one row per example of ``x``."""
    if x.ndim < 1 or len(x) != len(y) or not len(y) or y.ndim > 2:
        raise UsageError(f"{path}: x has shape {x.shape} and y {y.shape}; they need the same, "
                         "non-zero number of examples (y one target or a vector per example)")
    if not np.issubdtype(y.dtype, np.number) or not np.isfinite(y).all():
        raise UsageError(f"{path}: y must hold finite numbers for --task=regression")
    return y.astype(np.float32)


def _load_npz(path: str) -> dict[str, np.ndarray]:
    """The arrays ``x``, ``y`` and (if present) ``class_names``; UsageError if x or y is missing."""
    try:
        with np.load(path, allow_pickle=False) as data:
            keys = list(data.files)
            arrays = {k: data[k] for k in keys if k in ("x", "y", "class_names")}
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        raise UsageError(
            f"cannot read {path} as .npz ({e}); save it with np.savez(path, x=..., y=...)"
        ) from None
    for key in ("x", "y"):
        if key not in arrays:
            raise UsageError(
                f"{path} has no array {key!r} (it has: {', '.join(keys) or 'none'}); "
                "save it with np.savez(path, x=inputs, y=labels)"
            )
    return arrays


def _npz_labels(path: str, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``y`` as int64 class ids, one per example of ``x``; a ``(n, 1)`` column is flattened."""
    y = y.reshape(-1) if y.ndim == 2 and y.shape[1:] == (1,) else y
    if x.ndim < 1 or y.ndim != 1 or len(x) != len(y) or not len(y):
        raise UsageError(
            f"{path}: x has shape {x.shape} and y {y.shape}; they need the same, "
            "non-zero number of examples (y one label per example)"
        )
    if not np.issubdtype(y.dtype, np.number) or not np.array_equal(y, np.round(y)) or y.min() < 0:
        raise UsageError(f"{path}: y must hold integer class ids >= 0")
    return y.astype(np.int64)


def _npz_class_names(path: str, arrays: dict[str, np.ndarray], n_classes: int) -> list[str]:
    """The stored ``class_names``, or ``"0"``, ``"1"``, ... if the file has none."""
    names = [
        n.decode() if isinstance(n, bytes) else str(n)
        for n in arrays.get("class_names", np.arange(n_classes))
    ]
    if len(names) < n_classes:
        raise UsageError(
            f"{path}: class_names has {len(names)} names but y goes up to {n_classes - 1}"
        )
    return names


def _npz_feature(path: str, x: np.ndarray) -> tuple[Feature, np.ndarray]:
    """uint8 ``x`` is stored raw; any other numeric ``x`` as float32."""
    if x.dtype == np.uint8:
        return Feature("x", "uint8", x.shape[1:], "raw"), x
    if np.issubdtype(x.dtype, np.number) or x.dtype == bool:
        return Feature("x", "float32", x.shape[1:], "float"), x.astype(np.float32)
    raise UsageError(f"{path}: x has dtype {x.dtype}; use a float or uint8 array")
