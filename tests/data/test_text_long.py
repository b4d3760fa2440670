"""Sequences longer than a batch holds, in every split: the long policy (``--long``) applies
to train and evaluation alike, nothing is cut silently, and report figures count it.

The corpus is real prose: paragraphs of Python's language reference (``pydoc_data``),
written as a text folder whose validation split holds the longest paragraphs, longer than
any in train (as a user's held-out set may).
"""

import re
from pydoc_data.topics import topics

import numpy as np
import pytest
import tensorflow as tf

import tfspeed.data
from tfspeed.config import DataConfig
from tfspeed.convert import convert
from tfspeed.convert.sources.base import TextOptions
from tfspeed.data import schema as schema_lib
from tfspeed.data import text
from tfspeed.errors import UsageError

PARAGRAPHS = sorted({p.strip() for key in sorted(topics)
                     for p in re.split(r"\n\s*\n", topics[key]) if len(p.split()) >= 3},
                    key=lambda p: (len(p), p))


@pytest.fixture(scope="module")
def long_eval_dir(tmp_path_factory) -> str:
    """train: 240 paragraphs of under 40 words; validation: 40 of 100 to 200 words."""
    root = tmp_path_factory.mktemp("long_eval")
    words = {p: len(p.split()) for p in PARAGRAPHS}
    picks = {"train": [p for p in PARAGRAPHS if words[p] < 40][::7][:240],
             "validation": [p for p in PARAGRAPHS if 100 <= words[p] <= 200][:40]}
    for split, paragraphs in picks.items():
        for i, paragraph in enumerate(paragraphs):
            folder = root / "src" / split / ("even" if i % 2 == 0 else "odd")
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"p{i:04d}.txt").write_text(paragraph)
    out = root / "data"
    convert(f"textfolder:{root / 'src'}", str(out), shards=2,
            text=TextOptions(tokenizer="bpe:400", max_length=0))
    return str(out)


def _longest(data_dir, split):
    return text.longest(text.length_counts(schema_lib.read(data_dir), split))


def _tokens(batches):
    """Every real token of ``batches``, as a multiset (id -> count), and the widest row."""
    counts, widest = {}, 0
    for x, _ in batches:
        real = x["segment_ids"].numpy() > 0
        widest = max(widest, x["tokens"].shape[1])
        for token in x["tokens"].numpy()[real].tolist():
            counts[token] = counts.get(token, 0) + 1
    return counts, widest


def _reference(data_dir, split):
    schema = schema_lib.read(data_dir)
    counts = {}
    for path in schema.shard_paths(data_dir, split):
        for record in tf.data.TFRecordDataset(path):
            example = tf.train.Example.FromString(record.numpy())
            for token in example.features.feature["tokens"].int64_list.value:
                counts[token] = counts.get(token, 0) + 1
    return counts


def test_the_corpus_has_validation_texts_longer_than_any_in_train(long_eval_dir):
    assert _longest(long_eval_dir, "validation") > 2 * _longest(long_eval_dir, "train")


@pytest.mark.parametrize("mode", ["bucket", "pad", "pack"])
def test_validation_longer_than_train_is_whole_by_default(long_eval_dir, mode):
    """T covers every split's longest (rounded up to 8): no validation token is cut, and the
    last bucket is as wide as the longest validation text, though train's are all shorter."""
    longest = _longest(long_eval_dir, "validation")
    batching = text.resolve(DataConfig(data_dir=long_eval_dir, batch_size=8, batching=mode),
                            schema_lib.read(long_eval_dir))
    assert batching.max_length == -(-longest // 8) * 8
    assert batching.long_counts["validation"]["over"] == 0
    ds = tfspeed.data.build(long_eval_dir, "validation", 8, batching=mode)
    found, widest = _tokens(ds)
    assert found == _reference(long_eval_dir, "validation")
    assert widest >= longest
    if mode == "bucket":
        assert batching.boundaries[-1] >= longest


@pytest.mark.parametrize("long", ["split", "truncate", "skip"])
@pytest.mark.parametrize("mode", ["bucket", "pack"])
def test_a_cap_below_the_longest_applies_long_to_evaluation_and_counts_it(long_eval_dir, mode,
                                                                          long):
    schema = schema_lib.read(long_eval_dir)
    cap = 8 * (_longest(long_eval_dir, "train") // 8 + 1)  # above every train text
    config = DataConfig(data_dir=long_eval_dir, batch_size=8, batching=mode, max_length=cap,
                        long=long)
    batching = text.resolve(config, schema)
    lengths = np.repeat(*np.unique(np.concatenate([
        np.full(int(c), n) for n, c in enumerate(text.length_counts(schema, "validation"))
        if c]), return_counts=True))
    over = lengths[lengths > cap]
    counted = batching.long_counts["validation"]
    assert counted["over"] == over.size > 0 and batching.long_counts["train"]["over"] == 0
    found, widest = _tokens(tfspeed.data.build(long_eval_dir, "validation", 8, batching=mode,
                                               max_length=cap, long=long))
    assert widest <= cap
    real = sum(found.values())
    total = sum(_reference(long_eval_dir, "validation").values())
    if long == "split":
        assert counted["split"] == over.size and counted["pieces"] == sum(-(-over // cap))
        assert real == total  # every token, in pieces
    elif long == "truncate":
        assert counted["truncated_tokens"] == int((over - cap).sum())
        assert real == total - counted["truncated_tokens"]
    else:
        assert counted["skipped"] == over.size and real == total - int(over.sum())


def test_a_token_budget_below_one_row_is_refused_in_one_line(long_eval_dir):
    schema = schema_lib.read(long_eval_dir)
    config = DataConfig(data_dir=long_eval_dir, batch_size=8, batching="pack",
                        tokens_per_batch=100, max_length=256)
    with pytest.raises(UsageError, match=r"--tokens_per_batch=100 holds less than one row of "
                                         r"256 tokens .* at least 512"):
        text.resolve(config, schema, replicas=2)
    bucket = DataConfig(data_dir=long_eval_dir, batch_size=8, batching="bucket",
                        tokens_per_batch=100)
    with pytest.raises(UsageError, match="--tokens_per_batch=100 holds less than one row"):
        text.resolve(bucket, schema)


def test_padded_batches_must_split_over_the_replicas(long_eval_dir):
    config = DataConfig(data_dir=long_eval_dir, batch_size=7, batching="pad")
    with pytest.raises(UsageError, match="--batch_size=7 does not split evenly over 2"):
        text.resolve(config, schema_lib.read(long_eval_dir), replicas=2)


def test_a_huge_text_converted_without_a_cap_trains_in_bounded_memory(tmp_path):
    """A 2 MB one-line text converted with --max_length=0 (as before the converter capped
    lengths) is one record of ~10^6 tokens; the driver's defaults split it at batching time
    (T at most the 1024 cap) and count it, and memory stays bounded (it once grew to 21.7
    GB and was killed)."""
    import json
    import os
    import subprocess
    import sys

    from tests.conftest import REPO, converter_cli, paragraphs

    book = " ".join(paragraphs()).replace("\n", " ")
    book = ((book + " ") * (2_000_000 // len(book) + 1))[:2_000_000]
    for label, items in (("book", [book]), ("note", PARAGRAPHS[:300:3])):
        (tmp_path / "src" / label).mkdir(parents=True)
        for i, item in enumerate(items):
            (tmp_path / "src" / label / f"{i}.txt").write_text(item)
    data = tmp_path / "data"
    done = converter_cli(f"--source=textfolder:{tmp_path / 'src'}", f"--output={data}",
                         "--max_length=0", "--tokenizer=bpe:400", "--validation_fraction=0")
    assert done.returncode == 0, done.stderr
    assert text.longest(text.length_counts(schema_lib.read(str(data)), "train")) > 10**5
    run = subprocess.run(
        [sys.executable, "-m", "tfspeed.train", f"--data_dir={data}",
         f"--model_dir={tmp_path / 'run'}", "--model=transformer", "--width=16", "--depth=1",
         "--heads=2", "--batch_size=16", "--train_steps=3", "--eval_split="],
        cwd=REPO, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, capture_output=True,
        text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    batching = report["input"]["batching"]
    assert batching["max_length"] == 1024 and batching["long"] == "split"
    counted = batching["long_counts"]["train"]
    assert counted["over"] == 1 and counted["pieces"] > 100
    # Bounded by the batch (16 sequences of about T tokens), not by the text.
    assert report["peak_host_rss_mb"] < 3000


_PIPELINE_PEAK = """
import resource, sys
from tfspeed.config import DataConfig
from tfspeed.data import pipeline
for mode in ("bucket", "pack"):
    config = DataConfig(data_dir=sys.argv[1], batch_size=32, max_length=512,
                        tokens_per_batch=8192, long="split", batching=mode).validate()
    ds = pipeline.build_from_config(config, "train", training=True)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in ds.take(60):
        pass
    print(mode, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def _one_line_corpus(root, size: int, *convert_args: str) -> str:
    """200 short paragraphs and one single-line text of ``size`` bytes, as a jsonl source
    (no labels: a language model, whose examples hold labels as long as their tokens)."""
    import json

    from tests.conftest import converter_cli, paragraphs

    prose = paragraphs()
    book = " ".join(prose).replace("\n", " ")
    rows = [{"text": p} for p in prose[:600:3]]
    rows.insert(100, {"text": ((book + " ") * (size // len(book) + 1))[:size]})
    root.mkdir(parents=True)
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    done = converter_cli(f"--source=jsonl:{root / 'in.jsonl'}", f"--output={root / 'data'}",
                         *convert_args)
    assert done.returncode == 0, done.stderr
    return str(root / "data")


def _pipeline_growth(data_dir) -> dict[str, int]:
    """MB the peak RSS of a fresh process grows while 60 batches of each mode go by, with
    the text job's settings (--max_length=512 --tokens_per_batch=8192)."""
    import os
    import subprocess
    import sys

    from tests.conftest import REPO

    run = subprocess.run(["prlimit", "--as=6000000000", "--", sys.executable, "-c",
                          _PIPELINE_PEAK, data_dir], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return {mode: int(mb) for mode, mb in (line.split() for line in run.stdout.splitlines())}


@pytest.mark.parametrize("cap", ["default", "none"])
def test_batches_of_a_long_one_line_text_take_memory_bounded_by_the_row(tmp_path, cap):
    """Defect 9: a 300 KB single-line text (~64k tokens, ~130 pieces of 512) among 200 short
    ones, converted with the defaults (pieces of 1024) or with no cap (one record): batching
    it grows the peak no more than a 30 KB one does, plus 100 MB (measured: +16 to +103 MB
    for 0.1 to 2 MB with the defaults; a pack window padded to the unsplit text's length
    would take ~0.5 GB here)."""
    args = () if cap == "default" else ("--max_length=0",)
    short = _pipeline_growth(_one_line_corpus(tmp_path / "short", 30_000, *args))
    long = _pipeline_growth(_one_line_corpus(tmp_path / "long", 300_000, *args))
    for mode in short:
        assert long[mode] <= short[mode] + 100, (mode, short, long)
