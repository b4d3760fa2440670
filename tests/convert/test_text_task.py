"""What a text conversion makes and says it makes: the task chosen (and how to choose the
other), and the refusals and warnings about data a text model cannot use as given."""

from __future__ import annotations

import json
from pydoc_data.topics import topics

import pytest

from tests.conftest import token_records
from tfspeed.convert import run
from tfspeed.data import schema as schema_lib


def labelled_paragraphs(classes: int = 8, names=None) -> list[tuple[str, str]]:
    """Real labelled text: the paragraphs of the language reference's first topics (or those
    ``names``), each labelled by its topic."""
    found = []
    for name in names or sorted(topics)[:classes]:
        found += [(p.strip(), name) for p in topics[name].split("\n\n") if len(p.strip()) > 40]
    return found


def converter(capsys, *args) -> tuple[int, str, list[str]]:
    """The command line in this process: (exit status, stdout, stderr lines). absl logs to
    the captured stderr even where another test of this process parsed the global flags
    first (the command then leaves logging to whoever did, as a library call should)."""
    from absl import flags

    logtostderr = flags.FLAGS["logtostderr"].value
    flags.FLAGS["logtostderr"].value = True
    try:
        with pytest.raises(SystemExit) as exit_info:
            run(["to_tfrecord.py", "--tokenizer=bpe:300", "--workers=1", "--noprogress", *args])
    finally:
        flags.FLAGS["logtostderr"].value = logtostderr
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err.splitlines()


def write_jsonl(path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return f"--source=jsonl:{path}"


# ---------------------------------------------------------------- the task, said


def test_jsonl_with_a_label_on_every_line_classifies(tmp_path, capsys):
    rows = [{"text": text, "label": label} for text, label in labelled_paragraphs()]
    source = write_jsonl(tmp_path / "docs.jsonl", rows)
    status, out, err = converter(capsys, source, f"--output={tmp_path / 'cls'}")
    assert status == 0, err
    schema = schema_lib.read(str(tmp_path / "cls"))
    assert schema.task == "classification" and schema.class_names == tuple(sorted(topics)[:8])
    assert schema.options["label_field"] == "label"
    assert out.strip().endswith(
        "task: classification on field 'label' (8 classes); --task=lm for a language model")

    status, out, err = converter(capsys, source, f"--output={tmp_path / 'lm'}", "--task=lm")
    assert status == 0, err
    assert schema_lib.read(str(tmp_path / "lm")).task == "lm"
    assert out.strip().endswith("task: lm (--task=lm); drop --task=lm to classify on field "
                                "'label'")


def test_jsonl_without_labels_is_lm_and_says_how_to_classify(tmp_path, capsys):
    texts = [text for text, _ in labelled_paragraphs()]
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"text": t} for t in texts])
    status, out, err = converter(capsys, plain, f"--output={tmp_path / 'plain'}")
    assert status == 0, err
    assert schema_lib.read(str(tmp_path / "plain")).task == "lm"
    assert out.strip().endswith("task: lm (no label field); --label_field=NAME to classify")

    some = [{"text": t, **({"label": "x"} if i % 3 == 0 else {})} for i, t in enumerate(texts)]
    partly = write_jsonl(tmp_path / "partly.jsonl", some)
    status, out, err = converter(capsys, partly, f"--output={tmp_path / 'partly'}")
    assert status == 0, err
    labelled = sum("label" in row for row in some)
    assert schema_lib.read(str(tmp_path / "partly")).task == "lm" and 0 < labelled < len(some)
    assert out.strip().endswith(
        f"task: lm (field 'label' on {labelled} of {len(some)} lines only); "
        "--label_field=label to classify (every line needs one)")


def test_every_text_source_states_its_task(tmp_path, capsys):
    for i, (text, label) in enumerate(labelled_paragraphs(3)):
        (tmp_path / "folder" / label).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / label / f"{i}.txt").write_text(text)
    rows = [(t.replace('"', "'"), label) for t, label in labelled_paragraphs(3)]
    table, texts = tmp_path / "table.csv", tmp_path / "texts.csv"
    table.write_text("text,label\n" + "".join(f'"{t}",{label}\n' for t, label in rows))
    texts.write_text("text\n" + "".join(f'"{t}"\n' for t, _ in rows))
    cases = [
        ([f"--source=textfolder:{tmp_path / 'folder'}"],
         "task: classification by folder (3 classes); --task=lm for a language model"),
        ([f"--source=textfolder:{tmp_path / 'folder'}", "--task=lm"],
         "task: lm (--task=lm); drop --task=lm to classify by folder"),
        ([f"--source=csv:{table}", "--text_column=text"],
         "task: classification on column 'label' (3 classes); --task=lm for a language model"),
        ([f"--source=csv:{texts}", "--text_column=text"],
         "task: lm (no column 'label'); --label_column=NAME to classify"),
        (["--source=pystdlib:json,http", "--max_items=40"],
         "task: classification by package (2 classes); --task=lm for a language model"),
    ]
    for n, (args, said) in enumerate(cases):
        status, out, err = converter(capsys, *args, f"--output={tmp_path / str(n)}")
        assert status == 0, err
        assert out.strip().endswith(said), out
        assert schema_lib.read(str(tmp_path / str(n))).task == said.split()[1]


# ---------------------------------------------------------------- refused, warned


def test_csv_text_with_other_columns_is_refused(tmp_path, capsys):
    """Text models take tokens only: numeric columns beside the text converted, then could
    not train; now the conversion says so."""
    rows = [(t.replace('"', "'"), label) for t, label in labelled_paragraphs(3)]
    table = tmp_path / "x.csv"
    table.write_text("a,text,label,b\n" + "".join(
        f'{len(t)},"{t}",{label},{len(t.split())}\n' for t, label in rows))
    status, out, err = converter(capsys, f"--source=csv:{table}", "--text_column=text",
                                 f"--output={tmp_path / 'out'}")
    assert status == 2 and not out
    assert err == [f"error: CSV {table} has columns besides the text and label (a, b): text "
                   "records hold tokens and a label only; drop them from the file, or name the "
                   "label column with --label_column=NAME"]
    assert not (tmp_path / "out" / "schema.json").exists()


def test_max_length_errors_name_the_task_being_converted(tmp_path, capsys):
    for i, (text, label) in enumerate(labelled_paragraphs(2)):
        (tmp_path / "folder" / label).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / label / f"{i}.txt").write_text(text)
    folder = f"--source=textfolder:{tmp_path / 'folder'}"
    unlabelled = write_jsonl(tmp_path / "plain.jsonl",
                             [{"text": t} for t, _ in labelled_paragraphs(2)])
    lm = "a language-model record needs bos and a token"
    cases = [
        ([folder, "--max_length=1"], "error: --max_length=1: must be >= 2 (or 0 = no limit): a "
         "record of 1 token holds too little of a text to classify; e.g. --max_length=512"),
        ([folder, "--max_length=1", "--task=lm"],
         f"error: --max_length=1: must be >= 2 (or 0 = no limit): {lm}"),
        ([unlabelled, "--max_length=1"],  # no labels: a language model, though not asked for
         f"error: --max_length=1: must be >= 2 (or 0 = no limit): {lm}"),
        ([folder, "--max_length=-5"], "error: --max_length=-5: must be >= 2, or 0 = no limit"),
    ]
    for args, message in cases:
        status, _, err = converter(capsys, *args, f"--output={tmp_path / 'o'}")
        assert status == 2 and err == [message]


def test_a_tokenizer_without_special_tokens_is_warned_about(tmp_path, capsys):
    """A user's tokenizer.json with no pad/unk/bos/eos: id 0 is a real token, and padded
    batch positions hold id 0 too; one warning line says what that means."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    # Topics that use "!=": "!" is id 0 of a byte-level BPE without special tokens.
    texts = labelled_paragraphs(names=[n for n in sorted(topics) if "!=" in topics[n]][:2])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([t for t, _ in texts], trainers.BpeTrainer(
        vocab_size=400, special_tokens=[], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "plain.json"))
    first = tok.id_to_token(0)
    for i, (text, label) in enumerate(texts):
        (tmp_path / "folder" / label).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folder" / label / f"{i}.txt").write_text(text)
    args = [f"--source=textfolder:{tmp_path / 'folder'}", f"--tokenizer={tmp_path / 'plain.json'}"]
    status, out, err = converter(capsys, *args, f"--output={tmp_path / 'cls'}")
    assert status == 0 and out.startswith("converted"), err
    assert len(err) == 1 and err[0].startswith("W"), err
    assert err[0].endswith(
        f"--tokenizer={tmp_path / 'plain.json'} has no pad, unk, bos, eos token: padded batch "
        f"positions hold id 0, which is the token {first!r} here, so a model that masks id 0 "
        "(keras.layers.Embedding(mask_zero=True)) masks that token too (tfspeed's models read "
        "segment_ids instead); --task=lm needs bos and eos")
    ids = {i for split in ("train", "validation")
           for r in token_records(str(tmp_path / "cls"), split) for i in r["tokens"]}
    assert 0 in ids  # id 0 is real text here

    # --task=lm cannot do without bos and eos: the one-line error, no warning before it.
    status, out, err = converter(capsys, *args, "--task=lm", f"--output={tmp_path / 'lm'}")
    assert status == 2 and len(err) == 1 and err[0].startswith("error: --tokenizer=")
