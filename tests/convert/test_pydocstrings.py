"""``pydocstrings``: the built-in corpus of short texts (the standard library's docstrings),
converted by the real converter."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.conftest import token_records
from tfspeed.convert import convert
from tfspeed.convert.sources import pydocstrings, pystdlib
from tfspeed.errors import UsageError


def test_texts_are_the_docstrings_in_path_order():
    texts, identity = pydocstrings.corpus(("json", "http"))
    assert {label for _, _, label in texts} == {"json", "http"}
    paths = [name.split(":")[0] for name, _, _ in texts]
    assert paths == sorted(paths, key=lambda p: (not p.startswith("json"), p))  # by class, path
    assert all(text.strip() for _, text, _ in texts)
    # Each is the docstring of the function, class or method on that line.
    root = pystdlib.stdlib_dir()
    for name, text, _ in texts[:: max(1, len(texts) // 40)]:
        path, line, definition = name.split(":")
        tree = ast.parse(Path(root, path).read_text(encoding="utf-8"))
        node = next(n for n in ast.walk(tree) if getattr(n, "lineno", None) == int(line)
                    and getattr(n, "name", None) == definition)
        assert ast.get_docstring(node) == text
    assert identity == pydocstrings.corpus(("json", "http"))[1]
    assert identity != pydocstrings.corpus(("json",))[1]
    with pytest.raises(UsageError, match="--source=pydocstrings:nope: 'nope' is not a package"):
        pydocstrings.corpus(("nope",))


def test_default_corpus_converts_deterministically_into_short_texts(tmp_path):
    shards = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        result = convert("pydocstrings", str(out), workers=workers)
        schema = json.loads((out / "schema.json").read_text())
        shards.append({s["file"]: s["sha256"] for split in schema["splits"].values()
                       for s in split["shards"]})
    assert shards[0] == shards[1] and len(shards[0]) > 2
    assert result.schema.class_names == pystdlib.CLASSES and result.schema.task == "classification"
    stats = schema["splits"]["train"]["text"]
    assert stats["median"] < 40 and stats["max"] <= 1024  # short texts, the default cap
    assert schema["text"]["tokenizer"]["spec"] == "bpe:8000"
    labels = {int(r["label"]) for r in token_records(str(tmp_path / "w1"), "validation")}
    assert labels == set(range(len(pystdlib.CLASSES)))
