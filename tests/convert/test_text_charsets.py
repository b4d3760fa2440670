"""Text as real files hold it: a CSV cell longer than Python's csv field limit (131,072
characters: one long mail), and texts in charsets other than UTF-8 (a folder of mail holds
latin-1, cp1252 and UTF-16 files), decoded and counted per charset, binary files skipped."""

from __future__ import annotations

import csv
import glob
import gzip
import json
import os
import pathlib

import numpy as np
import pytest
from tokenizers import Tokenizer

from tests.conftest import paragraphs
from tests.conftest import token_records as records
from tfspeed.convert import convert, run
from tfspeed.convert.cli import summary_line
from tfspeed.convert.sources import TextOptions

TEXTS = [t for t in paragraphs() if t.isascii()][:60]  # each fits any charset below
# Real sentences with the letters a single-byte charset stores differently from UTF-8.
ACCENTED = [
    "Le café de M. Müller ferme le lundi ; une idée naïve, mais la crème brûlée est bonne.",
    "Grüße aus Köln: die Straße ist schön, und das Frühstück war gemütlich.",
    "El niño comió piña en Málaga y habló español con la señora García.",
    "Señor Ibáñez pidió un café con leche; el camarero sonrió.",
]
# cp1252's own characters, which latin-1 lacks: quotes, a dash, the euro sign.
CP1252 = [
    "“Smart quotes” — and a price of 12 € for the café’s menu.",
    "She said “bonjour” to Zoë — the cost: 3 €, naïvely paid.",
]
SIGNATURE = "-- \nJürgen Müller, Köln\n"
UTF16 = ["Ünïcödé in UTF-16: the naïve café of Müller.", "Ελληνικά και русский текст в UTF-16."]


def _tokenizer(out) -> Tokenizer:
    return Tokenizer.from_file(os.path.join(out, "tokenizer.json"))


def _decoded(out) -> dict[str, int]:
    """Each record's text (byte-level BPE decodes a text back exactly) and its label."""
    tok = _tokenizer(out)
    return {
        tok.decode(r["tokens"].tolist()): int(r["label"])
        for split in ("train", "validation")
        for r in records(out, split)
    }


def _schema(out) -> dict:
    with open(os.path.join(out, "schema.json")) as f:
        return json.load(f)


def _charsets(schema: dict) -> dict[str, int]:
    found: dict[str, int] = {}
    for split in schema["splits"].values():
        for name, n in split["text"]["charsets"].items():
            found[name] = found.get(name, 0) + n
    return found


def _skipped(schema: dict) -> dict[str, str]:
    return {s["item"]: s["kind"] for split in schema["splits"].values() for s in split["skipped"]}


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
    assert f"{expected} records" in stdout and "1 split" in stdout and "decoded: utf-8 41" in stdout
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


# ---------------------------------------------------------------- charsets


def write_mail_folder(root) -> dict[str, tuple[str, str, str]]:
    """A folder of texts as mail comes: UTF-8, latin-1, cp1252 and UTF-16 files, a UTF-8 one
    signed in latin-1, and a binary one. Returns file -> (class, text, charset written)."""
    files = {}
    for i, text in enumerate(TEXTS[:30]):
        files[f"{i:02d}.txt"] = ("ham" if i % 2 else "spam", text, "utf-8")
    for i, text in enumerate(ACCENTED):
        files[f"latin1_{i}.txt"] = (
            "ham" if i % 2 else "spam",
            f"{text}\n\n{TEXTS[30 + i]}",
            "latin-1",
        )
    for i, text in enumerate(CP1252):
        files[f"cp1252_{i}.txt"] = ("spam", text, "cp1252")
    for i, text in enumerate(UTF16):
        files[f"utf16_{i}.txt"] = ("ham", text, "utf-16")
    for name, (cls, text, charset) in files.items():
        (root / cls).mkdir(parents=True, exist_ok=True)
        (root / cls / name).write_bytes(text.encode(charset))
    files["signed.txt"] = ("ham", f"{ACCENTED[0]}\n{SIGNATURE}", "utf-8 and latin-1")
    (root / "ham" / "signed.txt").write_bytes(
        f"{ACCENTED[0]}\n".encode() + SIGNATURE.encode("latin-1")
    )
    # A real binary file: a text, gzipped.
    (root / "spam" / "attachment.gz").write_bytes(gzip.compress(TEXTS[40].encode(), mtime=0))
    return files


@pytest.fixture(scope="module")
def mail(tmp_path_factory):
    root = tmp_path_factory.mktemp("mail")
    files = write_mail_folder(root)
    out = str(tmp_path_factory.mktemp("out") / "tf")
    result = convert(
        f"textfolder:{root}", out, workers=2, shards=3, text=TextOptions(tokenizer="bpe:400")
    )
    return root, files, out, result


def test_texts_in_other_charsets_are_decoded_and_counted(mail):
    """Once: every file that was not UTF-8 skipped as "not UTF-8"."""
    root, files, out, result = mail
    schema = _schema(out)
    assert _skipped(schema) == {os.path.join("spam", "attachment.gz"): "binary"}
    reason = (
        schema["splits"]["train"]["skipped"]
        + schema["splits"].get("validation", {"skipped": []})["skipped"]
    )
    assert "not text in any charset" in reason[0]["reason"]
    classes = {"ham": 0, "spam": 1}
    assert _decoded(out) == {text: classes[cls] for cls, text, _ in files.values()}
    # latin-1 text without cp1252's own characters decodes the same in cp1252, which wins
    # such ties (see charsets._detect); UTF-16 is found by its BOM; the UTF-8 mail signed
    # in latin-1 keeps both (charsets._mostly_utf8).
    counts = {"utf-8": 30, "cp1252": 6, "utf-16": 2, "utf-8+cp1252": 1}
    assert _charsets(schema) == result.summary["text"]["charsets"] == counts
    assert "decoded: utf-8 30, cp1252 6, utf-16 2, utf-8+cp1252 1" in summary_line(result)
    assert schema["options"]["encoding"] == "auto"


def test_encoding_forces_the_charset_of_files_that_are_not_utf8(mail, tmp_path):
    root, files, out, _ = mail
    forced = str(tmp_path / "latin1")
    convert(
        f"textfolder:{root}",
        forced,
        workers=2,
        shards=3,
        text=TextOptions(tokenizer="bpe:400", encoding="latin-1"),
    )
    schema = _schema(forced)
    # UTF-8 files stay UTF-8; the others are read as latin-1: UTF-16 then holds NULs.
    assert _charsets(schema) == {"utf-8": 30, "iso8859-1": 7}
    assert _skipped(schema) == {
        os.path.join("spam", "attachment.gz"): "binary",
        os.path.join("ham", "utf16_0.txt"): "binary",
        os.path.join("ham", "utf16_1.txt"): "binary",
    }
    decoded = _decoded(forced)
    assert all(text in decoded for _, text, charset in files.values() if charset == "latin-1")
    # cp1252's quotes read as latin-1 are C1 control characters: forced, not detected.
    assert CP1252[0].encode("cp1252").decode("latin-1") in decoded
    assert schema["options"]["encoding"] == "latin-1"
    assert schema["fingerprint"] != _schema(out)["fingerprint"]


def test_charset_detection_is_deterministic_across_workers(mail, tmp_path):
    root, _, out, _ = mail
    one = str(tmp_path / "one")
    convert(f"textfolder:{root}", one, workers=1, shards=3, text=TextOptions(tokenizer="bpe:400"))
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(out, "*.tfrecord")))
    assert len(shards) == 4  # 3 of train, 1 of validation
    for shard in shards:
        assert pathlib.Path(one, shard).read_bytes() == pathlib.Path(out, shard).read_bytes()
    assert _schema(one)["splits"] == _schema(out)["splits"]


def test_csv_and_jsonl_files_in_other_charsets(tmp_path):
    texts = ACCENTED + CP1252 + TEXTS[:10]
    path = tmp_path / "mail.csv"
    with open(path, "w", newline="", encoding="cp1252") as f:
        csv.writer(f).writerows(
            [["label", "text"], *(["ab"[i % 2], t] for i, t in enumerate(texts))]
        )
    out = str(tmp_path / "csv")
    result = convert(
        f"csv:{path}", out, shards=2, text=TextOptions(tokenizer="bpe:300", text_column="text")
    )
    assert set(_decoded(out)) == set(texts)
    assert result.summary["text"]["charsets"] == {"cp1252": len(texts)}

    lines = tmp_path / "mail.jsonl"
    body = "".join(
        json.dumps({"text": t, "label": "ab"[i % 2]}, ensure_ascii=False) + "\n"
        for i, t in enumerate(texts)
    )
    lines.write_bytes(body.encode("utf-16"))
    out = str(tmp_path / "jsonl")
    result = convert(f"jsonl:{lines}", out, shards=2, text=TextOptions(tokenizer="bpe:300"))
    assert set(_decoded(out)) == set(texts)
    assert result.summary["text"]["charsets"] == {"utf-16": len(texts)}


def test_bad_encodings_are_one_line_errors(mail, tmp_path, capsys):
    root = mail[0]
    out = f"--output={tmp_path / 'o'}"
    for name in ("nonsense", "base64"):
        error = _error(capsys, f"--source=textfolder:{root}", out, f"--encoding={name}")
        assert f"--encoding={name}: not a text encoding Python knows" in error
    error = _error(capsys, "--source=digits", out, "--encoding=latin-1")
    assert "--encoding=latin-1 is for text sources" in error
    error = _error(capsys, "--source=pystdlib:json", out, "--encoding=latin-1")
    assert "--encoding=latin-1 is for texts read from files" in error
    # A whole file that is no text in any charset.
    binary = tmp_path / "x.jsonl"
    binary.write_bytes(gzip.compress(b'{"text": "hello"}\n', mtime=0))
    error = _error(capsys, f"--source=jsonl:{binary}", out)
    assert f"cannot read {binary}: not text in any charset" in error
