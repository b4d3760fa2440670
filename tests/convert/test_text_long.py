"""Long texts at conversion: the one long-text policy (`tfspeed.data.long_texts`) and the
defaults the converter shares with the driver (split at 1024 tokens, all CPUs)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.conftest import converter_cli, paragraphs
from tfspeed.config import LONG_DEFAULT, MAX_LENGTH_CAP, DataConfig
from tfspeed.convert import convert
from tfspeed.convert import tokenizer as tokenizer_lib
from tfspeed.convert.sources.base import TextOptions
from tfspeed.convert.sources.lengths import SKIPPED_LONG, TextSkip, TokenIds
from tfspeed.convert.sources.text import Encoding
from tfspeed.util import system

TEXTS = paragraphs()[:200]


def sliced_as_before(ids: np.ndarray, task: str, m: int, long: str) -> list:
    """The records the converter made of a text's ids before it took `long_texts.pieces`:
    ``[(ids, truncated, part, parts)]``, or None for a skip (the expected records)."""
    if len(ids) <= m:
        return [(list(ids), False, 0, 1)]
    if long == "skip":
        return None
    if long == "truncate":
        return [(list(ids[:m]), True, 0, 1)]
    stride = m - 1 if task == "lm" else m
    starts = range(0, len(ids) - (task == "lm"), stride)
    return [(list(ids[s : s + m]), False, i, len(starts)) for i, s in enumerate(starts)]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    tok = tokenizer_lib.make("bpe:300", TEXTS)
    folder = tmp_path_factory.mktemp("tok")
    (folder / tok.file).write_bytes(tok.data)
    return tok.ref(str(folder))


@pytest.mark.parametrize("task", ["classification", "lm"])
@pytest.mark.parametrize("long", ["split", "truncate", "skip"])
@pytest.mark.parametrize("max_length", [2, 3, 16, 64])
def test_records_are_those_of_the_earlier_slicing(bpe, task, long, max_length):
    ref = bpe
    encoding = Encoding(ref, task, max_length, long, bos=2, eos=3)
    made_over = 0
    for i, text in enumerate(TEXTS):
        ids = ref.load().encode(text)
        if task == "lm":
            ids = np.concatenate([[2], ids, [3]]).astype(np.int64)
        made = list(encoding.records(f"t{i}", text, {}))
        expected = sliced_as_before(ids, task, max_length, long)
        made_over += len(ids) > max_length
        if expected is None:
            assert len(made) == 1 and isinstance(made[0], TextSkip)
            assert made[0].kind == SKIPPED_LONG and f"{len(ids)} tokens" in made[0].reason
            continue
        assert all(isinstance(r["tokens"], TokenIds) for r in made)
        got = [(list(r["tokens"].ids), r["tokens"].truncated, r["tokens"].part,
                r["tokens"].parts) for r in made]
        assert got == expected
    assert made_over > 20  # the policy had work to do on most of these texts


def test_a_long_one_line_text_is_split_by_default(tmp_path):
    """A 2 MB text on one line, converted with the defaults: once a single record of ~350k
    tokens (its batches exhausted memory), now pieces of at most 1024 tokens, counted."""
    text = " ".join(paragraphs()).replace("\n", " ")
    text = (text + " ") * (2_000_000 // len(text) + 1)
    (tmp_path / "src" / "books").mkdir(parents=True)
    (tmp_path / "src" / "books" / "all.txt").write_text(text[:2_000_000])
    out = tmp_path / "out"
    proc = converter_cli(f"--source=textfolder:{tmp_path / 'src'}", f"--output={out}")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads((out / "schema.json").read_text())
    assert (schema["text"]["max_length"], schema["text"]["long"]) == (1024, "split")
    stats = schema["splits"]["train"]["text"]
    assert stats["split_into"] == 1 and stats["max"] == 1024
    assert stats["records"] == -(-stats["tokens"] // 1024) > 100  # whole pieces, the last short
    assert ", 1 split," in proc.stdout and f"{stats['records']} records" in proc.stdout


def test_the_converter_shares_the_drivers_defaults(tmp_path):
    assert (TextOptions().long, TextOptions().max_length) == (LONG_DEFAULT, MAX_LENGTH_CAP)
    assert DataConfig().long == TextOptions().long
    # The library writes with every CPU available, as the command line does: the driver's
    # --prepare_source calls convert() with its defaults.
    result = convert("digits", str(tmp_path / "d"), shards=2)
    assert result.summary["workers"] == system.cpus_available()
