"""Text as real files hold it: a CSV cell longer than Python's csv field limit (131,072
characters: one long mail)."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import paragraphs
from tests.conftest import token_records as records
from tfspeed.convert import run

TEXTS = [t for t in paragraphs() if t.isascii()][:60]


def _tokenizer(out) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(out, "tokenizer.json"))


def _schema(out) -> dict:
    with open(os.path.join(out, "schema.json")) as f:
        return json.load(f)


def _cli(capsys, *args) -> tuple[int, str, list[str]]:
    """The converter's command line in this process: (status, stdout, stderr lines)."""
    with pytest.raises(SystemExit) as exit_info:
        run(["to_tfrecord.py", *args])
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err.splitlines()


def _error(capsys, *args) -> str:
    status, _, err = _cli(capsys, *args)
    errors = [line for line in err if not line.startswith("W")]
    assert status == 2 and len(errors) == 1 and errors[0].startswith("error: "), err
    return errors[0]


# ---------------------------------------------------------------- csv: a cell over 131,072 chars


def long_text(n: int = 150_000) -> str:
    """Real human-written text (the language reference's topics, in order) of over n chars."""
    from pydoc_data.topics import topics

    parts, size = [], 0
    for name in sorted(topics):
        parts.append(topics[name].strip())
        size += len(parts[-1]) + 2
        if size > n:
            return "\n\n".join(parts)
    raise AssertionError("pydoc_data.topics is shorter than expected")


def test_a_csv_cell_longer_than_the_csv_field_limit_converts_and_is_kept(tmp_path, capsys):
    """Once: "field larger than field limit (131072); pass a UTF-8 CSV file with a header
    row", for a UTF-8 file with a header."""
    text = long_text()
    assert len(text) > 131_072
    path = tmp_path / "mail.csv"
    texts = [*TEXTS[:40], text]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        w.writerows([("spam" if i % 2 else "ham"), t] for i, t in enumerate(texts))
    out = tmp_path / "out"
    status, stdout, err = _cli(
        capsys,
        f"--source=csv:{path}",
        f"--output={out}",
        "--text_column=text",
        "--label_column=label",
        "--tokenizer=bpe:400",
    )
    assert status == 0, err
    schema, tok = _schema(out), _tokenizer(out)
    # The default long-text policy: a text over 1024 tokens is split into pieces of 1024.
    assert (schema["text"]["long"], schema["text"]["max_length"]) == ("split", 1024)
    n_long = len(tok.encode(text).ids)
    expected = 40 + -(-n_long // 1024)
    assert n_long > 1024 and sum(s["num_records"] for s in schema["splits"].values()) == expected
    stats = [s["text"] for s in schema["splits"].values()]
    assert sum(s["split_into"] for s in stats) == 1 and sum(s["truncated"] for s in stats) == 0
    assert sum(s["tokens"] for s in stats) == sum(len(tok.encode(t).ids) for t in texts)
    # The long text's pieces, in record order, are the whole text.
    ids = np.concatenate([r["tokens"] for s in schema["splits"] for r in records(str(out), s)])
    assert text in tok.decode(ids.tolist())
    assert f"{expected} records" in stdout and "1 split" in stdout
    assert csv.field_size_limit() == 131_072  # put back: the limit is process-wide


def test_a_broken_csv_names_the_row_where_it_breaks(tmp_path, capsys):
    path = tmp_path / "broken.csv"
    lines = [" ".join(t.replace('"', "").replace(",", "").split()) for t in TEXTS[:8]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["label", "text"], *(["ham", t] for t in lines[:3])])
        f.write(f'spam,"{lines[3]}\n')  # a quote opened on line 5, never closed
        csv.writer(f).writerows(["ham", t] for t in lines[4:])
    error = _error(
        capsys, f"--source=csv:{path}", f"--output={tmp_path / 'o'}", "--text_column=text"
    )
    assert f"CSV {path} line 5 is not CSV (unexpected end of data" in error
    # Text after a closing quote, on line 2.
    path.write_text(f'label,text\nham,"{TEXTS[0]}" and more\n', encoding="utf-8")
    error = _error(
        capsys, f"--source=csv:{path}", f"--output={tmp_path / 'o'}", "--text_column=text"
    )
    assert f"CSV {path} line 2 is not CSV (" in error and "quote a cell" in error
