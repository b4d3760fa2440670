"""Text sources read from one file of rows: ``jsonl:PATH`` (``--text_field``,
``--label_field``) and ``csv:PATH`` with ``--text_column``. Each becomes a `text.text_source`.
A file that is not UTF-8 is decoded whole with ``--encoding`` or the charset detected
(`charsets.read_text_file`); each of its texts is counted under that charset.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator

from tfspeed.convert.sources import charsets, tables
from tfspeed.convert.sources.base import Source, SourceOptions, file_identity
from tfspeed.convert.sources.text import Labels, split_items, text_options, text_source
from tfspeed.errors import UsageError

LABEL_FIELD = "label"  # the JSON field a jsonl: source's classes are taken from unless named


def open_jsonl(path: str, opts: SourceOptions) -> Source:
    """One JSON object per line: the text in ``--text_field``; the label in ``--label_field``,
    else in ``label`` where every line has one (else no labels: ``--task=lm``)."""
    t = text_options(opts)
    lines, charset = _json_lines(path, t.encoding)
    texts = []
    for line_no, obj in lines:
        text = obj.get(t.text_field) if isinstance(obj, dict) else None
        if not isinstance(text, str):
            raise UsageError(
                f"{path} line {line_no} has no string field {t.text_field!r}; "
                "every line needs one (or pass --text_field=NAME)"
            )
        texts.append(text)
    field, labels = _jsonl_label_field(path, lines, t.label_field)
    y, names = tables._encode_labels([str(obj[field]) for _, obj in lines]) if field else ([], ())
    base = os.path.basename(path)
    items = [(f"{base}:{i}", text, int(y[i - 1]) if field else -1)
             for i, text in enumerate(texts, start=1)]
    options = {"text_field": t.text_field, "label_field": field, "encoding": t.encoding}
    labels = dataclasses.replace(labels, names=tuple(names))
    return text_source(split_items(items, opts), labels, file_identity(path), options, opts,
                       decoded_as=charset)


def _jsonl_label_field(path: str, lines: list[tuple[int, dict]], given: str) -> tuple[str, Labels]:
    """The field holding a jsonl source's labels ("" for none), and where they come from."""
    for line_no, obj in lines if given else ():
        if obj.get(given) in (None, ""):
            raise UsageError(
                f"{path} line {line_no} has no label {given!r}; every "
                "line needs one, or drop --label_field (for --task=lm)"
            )
    field = given or LABEL_FIELD
    labelled = sum(obj.get(field) not in (None, "") for _, obj in lines)
    if labelled == len(lines):
        return field, Labels((), f"on field {field!r}")
    if labelled:  # a language model, as without any label, but never silently
        return "", Labels((), "", f"field {field!r} on {labelled} of {len(lines)} lines only",
                          f"--label_field={field} to classify (every line needs one)")
    return "", Labels((), "", "no label field", "--label_field=NAME to classify")


def open_csv_text(path: str, opts: SourceOptions) -> Source:
    """A CSV with a text column, tokenised, and the label column holding the classes (none:
    ``--task=lm``). Other columns are refused: tfspeed's text models take tokens only."""
    t = text_options(opts)
    rows, charset = tables._read_csv(path, t.encoding)
    if len(rows) < 2:
        raise UsageError(f"CSV {path} is empty; it needs a header row and at least one data row")
    header = [c.strip() for c in rows[0][1]]
    if t.text_column not in header:
        raise UsageError(
            f"CSV {path} has no text column {t.text_column!r} (columns: "
            f"{', '.join(header)}); pass --text_column=NAME"
        )
    others = [c for c in header if c not in (t.text_column, opts.label_column)]
    if others:
        raise UsageError(
            f"CSV {path} has columns besides the text and label ({', '.join(others)}): text "
            "records hold tokens and a label only; drop them from the file, or name the label "
            "column with --label_column=NAME"
        )
    labelled = opts.label_column in header and opts.task != "lm"
    items = []
    for line, cells in rows[1:]:
        if len(cells) != len(header):
            raise UsageError(
                f"CSV {path} line {line} has {len(cells)} cells, the header has "
                f"{len(header)}; fix that row (quote texts that hold commas)"
            )
        cell = dict(zip(header, cells, strict=True))
        label = cell[opts.label_column].strip() if labelled else ""
        if labelled and not label:
            raise UsageError(
                f"CSV {path} line {line} has an empty {opts.label_column!r}; "
                "every row needs a label (or pass --task=lm)"
            )
        items.append((f"line {line}", cell[t.text_column], label))
    y, class_names = tables._encode_labels([lab for _, _, lab in items]) if labelled else ([], ())
    items = [(name, text, int(y[i]) if labelled else -1) for i, (name, text, _) in enumerate(items)]
    options = {"text_column": t.text_column, "label_column": opts.label_column,
               "encoding": t.encoding}
    column = opts.label_column
    labels = Labels(class_names, f"on column {column!r}" if column in header else "",
                    f"no column {column!r}", "--label_column=NAME to classify")
    return text_source(split_items(items, opts), labels, file_identity(path), options, opts,
                       decoded_as=charset)


def _json_lines(path: str, encoding: str) -> tuple[list[tuple[int, object]], str]:
    """``(line number, object)`` of each non-blank line, and the charset that decoded the
    file (UTF-8, else ``encoding`` or the one detected); a UsageError names a bad line."""
    try:
        lines, charset = charsets.read_text_file(path, encoding, list)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}; pass a file of JSON lines") from None
    return list(_parsed(path, lines)), charset


def _parsed(path: str, lines: list[str]) -> Iterator[tuple[int, object]]:
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise UsageError(
                    f"{path} line {line_no} is not JSON ({e.msg}, column {e.colno}); "
                    "each line must be one JSON object"
                ) from None
