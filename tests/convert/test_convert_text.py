"""Text sources and tokenisation at conversion time: real files, the real converter."""

from __future__ import annotations

import csv
import glob
import io
import json
import os

import numpy as np
import pytest

from tests.conftest import converter_cli as cli
from tests.conftest import paragraphs
from tests.conftest import token_records as records
from tfspeed.convert import convert
from tfspeed.convert.sources import TextOptions
from tfspeed.data import schema as schema_lib
from tfspeed.errors import UsageError

TEXTS = paragraphs()[:240]


def shard_bytes(out: str) -> dict[str, bytes]:
    names = sorted(
        glob.glob(os.path.join(out, "*.tfrecord")) + [os.path.join(out, "tokenizer.json")]
    )
    found = {}
    for name in names:
        with open(name, "rb") as f:
            found[os.path.basename(name)] = f.read()
    return found


def write_textfolder(root, with_bad: bool = True) -> None:
    for i, text in enumerate(TEXTS[:120]):
        cls = "short" if len(text) < 200 else "long"
        path = root / cls / f"{i:03d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    if with_bad:
        (root / "short" / "latin1.txt").write_bytes("café crème".encode("latin-1"))
        (root / "short" / "blank.txt").write_text("  \n\n")
        (root / "long" / "image.bin").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")


def convert_text(source: str, out, task: str = "classification", **options):
    """The converter on a text source into 2 shards, with ``TextOptions(**options)``."""
    return convert(source, str(out), shards=2, task=task, text=TextOptions(**options))


@pytest.fixture(scope="module")
def folder_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("texts")
    write_textfolder(root)
    out = str(tmp_path_factory.mktemp("out") / "tf")
    result = convert(
        f"textfolder:{root}", out, workers=2, shards=4, text=TextOptions(tokenizer="bpe:400")
    )
    return root, out, result


def test_textfolder_roundtrip_and_bad_files(folder_dataset):
    root, out, result = folder_dataset
    schema = schema_lib.read(out)
    assert schema.class_names == ("long", "short")
    assert schema.features["tokens"].encoding == "tokens" and schema.inputs == "tokens"
    skipped = {s["item"]: s["kind"] for split in schema.splits.values() for s in split.skipped}
    # A latin-1 file is decoded (charsets.decode), no longer skipped as "not UTF-8".
    assert skipped == {
        os.path.join("short", "blank.txt"): "empty",
        os.path.join("long", "image.bin"): "binary",
    }
    assert result.summary["skipped"] == 2 and schema.num_classes == 2
    assert sum(s.num_records for s in schema.splits.values()) == 121  # nothing else lost
    assert result.summary["text"]["charsets"] == {"utf-8": 121, "cp1252": 1}  # blank.txt too
    # Byte-level BPE: decode(ids) gives each text back exactly.
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
    assert [tok.token_to_id(t) for t in ("<pad>", "<unk>", "<bos>", "<eos>")] == [0, 1, 2, 3]
    decoded = {
        tok.decode(r["tokens"].tolist(), skip_special_tokens=False): int(r["label"])
        for split in schema.splits
        for r in records(out, split)
    }
    assert decoded == {t: (1 if len(t) < 200 else 0) for t in [*TEXTS[:120], "café crème"]}


def test_schema_text_section_and_histograms(folder_dataset):
    _, out, _ = folder_dataset
    with open(os.path.join(out, "schema.json")) as f:
        d = json.load(f)
    text = d["text"]
    assert text["tokenizer"]["file"] == "tokenizer.json" and text["tokenizer"]["vocab_size"] == 400
    assert text["tokenizer"]["special_ids"] == {"pad": 0, "unk": 1, "bos": 2, "eos": 3}
    # The defaults: the driver's cap and policy (config.MAX_LENGTH_CAP, LONG_DEFAULT).
    assert (text["task"], text["max_length"], text["long"]) == ("classification", 1024, "split")
    for split in d["splits"].values():
        stats = split["text"]
        lengths = [
            len(r["tokens"])
            for name in d["splits"]
            for r in records(out, name)
            if split is d["splits"][name]
        ]
        assert stats["records"] == split["num_records"] == len(lengths)
        assert (stats["min"], stats["max"], stats["tokens"]) == (
            min(lengths),
            max(lengths),
            sum(lengths),
        )
        assert stats["median"] == int(np.sort(lengths)[(len(lengths) - 1) // 2])
        assert sum(stats["histogram"]["counts"]) == len(lengths)
        assert sum(c for _, c in stats["lengths"]) == len(lengths)
    assert (
        d["splits"]["train"]["text"]["skipped_by_kind"]
        or d["splits"]["validation"]["text"]["skipped_by_kind"]
    )


def test_split_folders_and_resume(tmp_path):
    root = tmp_path / "texts"
    for split, texts in (("train", TEXTS[:80]), ("test", TEXTS[80:100])):
        for i, text in enumerate(texts):
            path = root / split / ("a" if i % 2 else "b") / f"{i}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    out = str(tmp_path / "out")
    options = TextOptions(tokenizer="bpe:300", max_length=16, long="truncate")
    first = convert(f"textfolder:{root}", out, shards=4, text=options)
    assert list(first.schema.splits) == ["train", "test"]
    assert first.summary["text"]["truncated"] > 0
    before = shard_bytes(out)
    os.remove(os.path.join(out, first.schema.splits["train"].shards[1].file))
    again = convert(f"textfolder:{root}", out, shards=4, workers=2, text=options)
    assert again.summary["resumed_shards"] == len(before) - 2  # all shards but the deleted one
    assert shard_bytes(out) == before
    assert again.schema.splits["train"].text == first.schema.splits["train"].text


def test_pystdlib_cli_deterministic_across_workers(tmp_path):
    outs = []
    for workers in (1, 2):
        out = str(tmp_path / f"w{workers}")
        proc = cli(
            "--source=pystdlib:http,json",
            f"--output={out}",
            "--tokenizer=bpe:500",
            f"--workers={workers}",
            "--max_length=64",
            "--long=split",
        )
        assert proc.returncode == 0, proc.stderr
        assert "split" in proc.stdout and "tokens" in proc.stdout
        outs.append(out)
    assert shard_bytes(outs[0]) == shard_bytes(outs[1])
    schema = schema_lib.read(outs[0])
    assert schema.class_names == ("http", "json")
    train = schema.splits["train"].text
    assert train["split_into"] > 0 and train["max"] == 64
    labels = {int(r["label"]) for r in records(outs[0])}
    assert labels == {0, 1}


def test_pystdlib_texts_are_definitions():
    from tfspeed.convert.sources import pystdlib

    texts, identity = pystdlib.corpus(("json",))
    names = [name for name, _, _ in texts]
    assert names == sorted(names, key=lambda n: n.split(":")[0]) and len(texts) > 10
    assert all(t.startswith(("def ", "class ", "async def ")) for _, t, _ in texts)
    assert identity == pystdlib.corpus(("json",))[1]
    with pytest.raises(UsageError, match="not a package"):
        pystdlib.corpus(("no_such_package",))


def test_jsonl_classification_and_lm(tmp_path):
    path = tmp_path / "docs.jsonl"
    lines = [
        json.dumps({"body": t, "topic": "even" if i % 2 == 0 else "odd"})
        for i, t in enumerate(TEXTS[:100])
    ]
    path.write_text("\n".join(lines) + "\n\n")
    out = str(tmp_path / "cls")
    result = convert_text(f"jsonl:{path}", out, tokenizer="bpe:300", text_field="body",
                          label_field="topic")
    assert result.schema.class_names == ("even", "odd") and result.schema.task == "classification"
    assert sum(s.num_records for s in result.schema.splits.values()) == 100

    lm = str(tmp_path / "lm")
    result = convert_text(f"jsonl:{path}", lm, "lm", tokenizer="bpe:300", text_field="body",
                          max_length=32, long="skip")
    schema = result.schema
    assert schema.task == "lm" and schema.label == "" and list(schema.features) == ["tokens"]
    assert schema.num_outputs == 300
    rows = records(lm)
    assert rows and all(r["tokens"][0] == 2 and r["tokens"][-1] == 3 for r in rows)
    assert all(len(r["tokens"]) <= 32 for r in rows)
    skipped_long = sum(s.text["skipped_long"] for s in schema.splits.values())
    assert skipped_long > 0 and result.summary["text"]["skipped_long"] == skipped_long
    assert skipped_long + sum(s.num_records for s in schema.splits.values()) == 100


def test_csv_text_column(tmp_path):
    path = tmp_path / "table.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["label", "text"])
        for i, t in enumerate(TEXTS[:60]):
            w.writerow(["b" if i % 3 else "a", t])
    out = str(tmp_path / "out")
    result = convert_text(f"csv:{path}", out, tokenizer="bpe:300", text_column="text")
    schema = result.schema
    assert schema.input_names == ("tokens",) and list(schema.features) == ["tokens", "label"]
    assert schema.class_names == ("a", "b") and not schema.stats
    rows = [r for split in schema.splits for r in records(out, split)]
    assert len(rows) == 60 and {int(r["label"]) for r in rows} == {0, 1}
    assert all(set(r) == {"tokens", "label"} and len(r["tokens"]) > 5 for r in rows)


def test_user_tokenizer_json_and_sentencepiece(tmp_path, caplog):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:50]))
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(
        paragraphs(),
        trainers.WordPieceTrainer(
            vocab_size=500, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
        ),
    )
    tok.save(str(tmp_path / "wp.json"))
    out = str(tmp_path / "hf")
    result = convert_text(f"jsonl:{corpus}", out, "lm", tokenizer=str(tmp_path / "wp.json"))
    assert result.schema.text["tokenizer"]["special_ids"] == {
        "pad": 0,
        "unk": 1,
        "bos": 2,
        "eos": 3,
    }
    with open(os.path.join(out, "tokenizer.json"), "rb") as f:
        assert f.read() == (tmp_path / "wp.json").read_bytes()
    expected = {tuple([2, *tok.encode(t).ids, 3]) for t in TEXTS[:50]}
    got = {tuple(r["tokens"]) for s in result.schema.splits for r in records(out, s)}
    assert got == expected

    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(paragraphs()),
        model_writer=model,
        vocab_size=600,
        byte_fallback=True,
        minloglevel=2,
    )
    (tmp_path / "sp.model").write_bytes(model.getvalue())
    sp = spm.SentencePieceProcessor(model_proto=model.getvalue())
    out = str(tmp_path / "sp")
    caplog.clear()
    result = convert(
        f"jsonl:{corpus}", out, shards=2, text=TextOptions(tokenizer=str(tmp_path / "sp.model"))
    )
    # No pad: one warning, as the converter's other warnings (absl logging).
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"--tokenizer={tmp_path / 'sp.model'} has no pad token: padded batch positions hold id "
        "0, which is the token '<unk>' here, so a model that masks id 0 (keras.layers.Embedding("
        "mask_zero=True)) masks that token too (tfspeed's models read segment_ids instead)"]
    assert result.schema.text["tokenizer"]["kind"] == "sentencepiece"
    assert os.path.exists(os.path.join(out, "tokenizer.model"))
    got = {tuple(r["tokens"]) for s in result.schema.splits for r in records(out, s)}
    # No labels: language modelling, between SentencePiece's own bos and eos (it has no pad).
    assert result.schema.task == "lm"
    assert result.schema.text["tokenizer"]["special_ids"] == {
        "pad": None,
        "unk": 0,
        "bos": 1,
        "eos": 2,
    }
    assert got == {(1, *sp.encode(t), 2) for t in TEXTS[:50]}
    assert {sp.decode([int(i) for i in ids[1:-1]]) for ids in got} == {
        " ".join(t.split()) for t in TEXTS[:50]
    }


def test_bad_options_are_one_line_errors(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:20]))
    garbage = tmp_path / "tokenizer.json"
    garbage.write_text('{"not": "a tokenizer"}')
    cases = [
        (["--max_length=1"], "--max_length=1: must be >= 2"),
        ([f"--tokenizer={garbage}"], "cannot load it"),
        (["--tokenizer=bpe:10"], "vocabulary size"),
        (["--text_field=body"], "no string field 'body'"),
    ]
    for args, message in cases:
        proc = cli(f"--source=jsonl:{corpus}", f"--output={tmp_path / 'o'}", *args)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], lines
    with pytest.raises(UsageError, match="text sources"):
        convert("digits", str(tmp_path / "d"), text=TextOptions(max_length=64))


def test_max_items_samples_the_corpus(tmp_path):
    out = str(tmp_path / "few")
    # No length limit: each item is one record.
    result = convert_text("pystdlib:json", out, "lm", tokenizer="bpe:300", max_items=12,
                          max_length=0)
    assert sum(s.num_records for s in result.schema.splits.values()) == 12
    assert result.schema.options["max_items"] == 12 and result.schema.class_names == ()
