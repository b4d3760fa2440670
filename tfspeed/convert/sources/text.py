"""Text sources: ``textfolder:PATH``, ``pystdlib[:CLASSES]`` (Python's own standard library
source, `pystdlib`) and ``pydocstrings[:CLASSES]`` (its docstrings, `pydocstrings`) here,
``jsonl:PATH`` and ``csv:PATH`` with ``--text_column`` in `text_tables`; and what they share:
`text_source`, the chunks, the options' checks.

Each item is tokenised in the chunks, so in the writer workers, with a tokeniser trained or
loaded here, in the parent (`tfspeed.convert.tokenizer`). A record holds ``tokens`` (int64
ids, variable length) and, for classification, ``label``; for ``--task=lm`` only ``tokens``,
between the tokeniser's bos and eos. Texts over ``--max_length`` tokens are truncated, split
into several records or skipped (``--long``, as `tfspeed.data.long_texts` says). A file
that is not UTF-8 is decoded with ``--encoding`` or the charset detected (`charsets`), and
the texts each charset decoded are counted; items that are no text (binary, empty) are
skipped and counted, like undecodable images.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import numpy as np
from absl import logging

from tfspeed.convert import tokenizer as tokenizer_lib
from tfspeed.convert.sources import charsets, images, pydocstrings, pystdlib
from tfspeed.convert.sources.base import (
    LABEL,
    Chunk,
    Skip,
    Source,
    SourceOptions,
    TextOptions,
    content_hash,
    ordered_splits,
    train_validation,
)
from tfspeed.convert.sources.lengths import SKIPPED_LONG, TextSkip, TokenIds
from tfspeed.data import long_texts
from tfspeed.data.schema import Feature
from tfspeed.errors import UsageError

TOKENS = Feature("tokens", "int64", (None,), "tokens")
KINDS = ("textfolder", "jsonl", "pystdlib", "pydocstrings")


@dataclasses.dataclass(frozen=True)
class Labels:
    """A text source's classes and where they come from, as the summary's task line says.

    Attributes:
      names: label ``i`` is ``names[i]``; empty where the source has none.
      found: where the classes come from (``by folder``, ``on field 'label'``); "" if
        the source has none to offer.
      missing: why it has none (``no label field``), where ``found`` is "".
      to_classify: what to pass to classify instead (``--label_field=NAME to classify``).
    """

    names: tuple[str, ...]
    found: str
    missing: str = ""
    to_classify: str = ""

    def task_note(self, task: str, requested: str) -> str:
        """The task chosen, from what, and how to choose the other (``requested``: --task)."""
        if task == "classification":
            return (f"classification {self.found} ({len(self.names)} classes); --task=lm for "
                    "a language model")
        if requested != "lm":
            return f"lm ({self.missing}); {self.to_classify}"
        if self.found:
            return f"lm (--task=lm); drop --task=lm to classify {self.found}"
        return f"lm (--task=lm); {self.to_classify} without --task=lm"


@dataclasses.dataclass(frozen=True)
class Encoding:
    """How a chunk turns a text into records (picklable: it travels to the workers)."""

    tokenizer: tokenizer_lib.TokenizerRef
    task: str
    max_length: int
    long: str
    bos: int | None
    eos: int | None

    def records(
        self, name: str, text: str, extra: dict, charset: str = ""
    ) -> Iterator[dict | Skip]:
        """The records of one text (one, or several with ``--long=split``), or a skip; each
        holds ``extra`` (the label) beside the tokens. ``charset`` (what decoded the text)
        travels with the first record or the skip, to be counted once."""
        ids = self.tokenizer.load().encode(text)
        if self.task == "lm":
            ids = np.concatenate([[self.bos], ids, [self.eos]]).astype(np.int64)
        m = self.max_length
        if not m or len(ids) <= m:
            yield {"tokens": TokenIds(ids, charset=charset), **extra}
            return
        # A language-model record's pieces overlap by one token: every next-token pair stays
        # inside a piece.
        made = long_texts.pieces([len(ids)], m, self.long, overlap=int(self.task == "lm"))
        if not made.length.size:
            yield TextSkip(name, f"{len(ids)} tokens, over --max_length={m} (--long=skip)",
                           SKIPPED_LONG, charset)
        truncated, parts = self.long == "truncate", made.length.size
        for part, (start, n) in enumerate(zip(made.offset, made.length, strict=True)):
            tokens = TokenIds(ids[start : start + n], truncated, part, parts, charset)
            yield {"tokens": tokens, **extra}


@dataclasses.dataclass(frozen=True)
class TextChunk:
    """Texts (or text files under ``root``) with their labels, tokenised by ``encoding``.

    ``items`` are ``(name, text, label)``; ``text`` None means the file ``root/name``, read
    as `charsets.decode` does with ``file_encoding`` (``--encoding``). ``decoded_as`` is the
    charset the given texts were decoded from ("" for texts that were never bytes).
    """

    items: tuple[tuple[str, str | None, int], ...]
    encoding: Encoding
    root: str = ""
    file_encoding: str = charsets.AUTO
    decoded_as: str = ""

    def records(self) -> Iterator[dict | Skip]:
        for name, text, label in self.items:
            if text is None:
                found = read_text(os.path.join(self.root, name), name, self.file_encoding)
            else:
                found = charsets.Decoded(text, self.decoded_as)
            found = checked(name, found)
            if isinstance(found, Skip):
                yield found
                continue
            extra = {} if self.encoding.task == "lm" else {"label": label}
            yield from self.encoding.records(name, found.text, extra, found.charset)


def read_text(
    path: str, name: str, encoding: str = charsets.AUTO
) -> charsets.Decoded | TextSkip:
    """The text of the file at ``path`` and its charset (`charsets.decode` with
    ``encoding``), or why it is no text."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        return TextSkip(name, f"cannot read it: {e.strerror}", "unreadable")
    decoded = charsets.decode(data, encoding)
    if isinstance(decoded, charsets.Undecoded):
        return TextSkip(name, decoded.why, decoded.kind)
    return decoded


def checked(name: str, found: charsets.Decoded | TextSkip) -> charsets.Decoded | TextSkip:
    """``found``, or a skip if its text is empty (or whitespace only)."""
    if isinstance(found, charsets.Decoded) and not found.text.strip():
        return TextSkip(name, "an empty text", "empty", found.charset)
    return found


# ---------------------------------------------------------------- the sources


def open_textfolder(root: str, opts: SourceOptions) -> Source:
    """Lists ``root/[<split>/]<class>/<text files>`` as imagefolder does its images."""
    if not os.path.isdir(root):
        raise UsageError(f"{root} is not a folder; textfolder:PATH needs PATH/<class>/<files>")
    listing = {
        s: images._list_class_files(os.path.join(root, d), root)
        for s, d in images._split_dirs(root).items()
    }
    class_names = tuple(sorted({c for classes in listing.values() for c in classes}))
    if not class_names:
        raise UsageError(
            f"{root} has no class folders; put texts in {root}/<class>/ (one "
            "file per text, one folder per class)"
        )
    ids = {name: i for i, name in enumerate(class_names)}
    files = {
        s: sorted((rel, None, ids[c], st.st_size) for c, fs in classes.items() for rel, st in fs)
        for s, classes in listing.items()
    }
    if not any(files.values()):
        raise UsageError(f"the class folders in {root} hold no files; put texts in {root}/<class>/")
    stats = sorted(
        [rel, size, os.stat(os.path.join(root, rel)).st_mtime_ns]
        for fs in files.values()
        for rel, _, _, size in fs
    )
    if "" in files:
        items = split_items(files[""], opts)
    else:
        items = {
            s: [fs[i] for i in images._shuffled(len(fs), opts.seed, s)] for s, fs in files.items()
        }
    labels = Labels(class_names, "by folder")
    options = {"encoding": text_options(opts).encoding}
    return text_source(items, labels, content_hash(stats), options, opts, root=root)


def open_pystdlib(arg: str, opts: SourceOptions) -> Source:
    """Python's standard library: one text per top-level function or class, its package the
    class; ``pystdlib:asyncio,json`` takes only those packages (see `pystdlib.CLASSES`)."""
    return _package_corpus(arg, opts, pystdlib.corpus)


def open_pydocstrings(arg: str, opts: SourceOptions) -> Source:
    """The standard library's docstrings: one text per documented function, class or method,
    its package the class; ``pydocstrings:asyncio,json`` takes only those packages."""
    return _package_corpus(arg, opts, pydocstrings.corpus)


def _package_corpus(arg: str, opts: SourceOptions, corpus) -> Source:
    """A corpus of the standard library packages ``arg`` names (all of `pystdlib.CLASSES` if
    none), labelled by package; ``corpus(classes)`` gives its texts and identity."""
    classes = tuple(c for c in arg.split(",") if c) or pystdlib.CLASSES
    texts, identity = corpus(classes)
    ids = {name: i for i, name in enumerate(classes)}
    items = [(name, text, ids[label]) for name, text, label in texts]
    labels = Labels(classes, "by package")
    return text_source(split_items(items, opts), labels, identity, {"classes": list(classes)}, opts)


# ---------------------------------------------------------------- shared


def text_source(
    items: dict[str, list],
    labels: Labels,
    identity: str,
    options: dict,
    opts: SourceOptions,
    *,
    root: str = "",
    decoded_as: str = "",
) -> Source:
    """The `Source` over text ``items``, its tokeniser made (trained on the train split).

    Args:
      items: split -> ``[(name, text or None, label, size)]``, each split in record order;
        ``text`` None reads the file ``root/name`` (in the workers); ``size`` is the text's
        size.
      labels: the classes (none: a language model) and where they come from.
      identity: the content identity of what the items were read from.
      options: the kind's own record-shaping options.
      opts: the converter options (``opts.text`` the text ones).
      root: the folder of file items.
      decoded_as: the charset the given texts were decoded from ("" for texts that were
        never bytes), counted with each.

    Returns:
      The `Source`: ``tokens`` (and ``label``) per record. Its ``text``
      section's ``task_note`` says which task was chosen, from what, and how to choose
      the other (the converter's summary line shows it).
    """
    t = text_options(opts)
    task = "lm" if opts.task == "lm" or not labels.names else "classification"
    if t.max_length == 1:  # checked here, where the task is known (a jsonl: may be either)
        why = ("a language-model record needs bos and a token" if task == "lm" else
               "a record of 1 token holds too little of a text to classify; e.g. "
               "--max_length=512")
        raise UsageError(f"--max_length=1: must be >= 2 (or 0 = no limit): {why}")
    items = {s: items[s] for s in ordered_splits(items) if items[s]}
    if "train" not in items:
        raise UsageError(
            f"the source has no train split (splits: {', '.join(items)}); a text "
            "source needs one to train the tokeniser and the model on"
        )
    train = items["train"]
    if tokenizer_lib.needs_training(t.tokenizer):
        texts = (_train_text(root, item, t.encoding) for item in train)
        tok = tokenizer_lib.make(t.tokenizer, (x for x in texts if x is not None))
    else:
        tok = tokenizer_lib.make(t.tokenizer)
    if task == "lm" and (tok.special_ids["bos"] is None or tok.special_ids["eos"] is None):
        raise UsageError(
            f"--tokenizer={t.tokenizer} has no bos/eos token (looked for "
            "<bos>/<s>, <eos>/</s>), which --task=lm adds to each text; use bpe:N"
        )
    if warning := tokenizer_lib.missing_specials(tok):
        logging.warning("%s", warning)
    encoding = Encoding(
        tok.ref(t.data_dir),
        task,
        t.max_length,
        t.long,
        tok.special_ids["bos"],
        tok.special_ids["eos"],
    )
    def make_chunk(split: str, start: int, stop: int, storage=None) -> Chunk:
        chosen = tuple(tuple(it[:3]) for it in items[split][start:stop])
        return TextChunk(chosen, encoding, root, t.encoding, decoded_as)

    features = [TOKENS] if task == "lm" else [TOKENS, LABEL]
    section = {"task": task, "tokenizer": tok.to_json(), "max_length": t.max_length, "long": t.long}
    return Source(
        features=tuple(features),
        inputs="tokens",
        class_names=tuple(labels.names) if task != "lm" else (),
        splits={s: len(v) for s, v in items.items()},
        split_bytes={s: sum(_size(it) for it in v) for s, v in items.items()},
        identity=identity,
        options={
            **options,
            **section,
            "tokenizer": tok.spec,
            "tokenizer_sha256": tok.sha256,
            "max_items": t.max_items,
            "validation_fraction": opts.validation_fraction,
            "seed": opts.seed,
        },
        make_chunk=make_chunk,
        text={**section, "task_note": labels.task_note(task, opts.task)},
        files={tok.file: tok.data},
    )


def check_options(kind: str, spec: str, opts: SourceOptions) -> None:
    """Raises a one-line UsageError for text options that are wrong or that ``kind`` ignores."""
    t = text_options(opts)
    is_text = kind in KINDS or (kind == "csv" and t.text_column)
    if not is_text:
        given = [
            f"--{f.name}={getattr(t, f.name)}"
            for f in dataclasses.fields(t)
            if f.name != "data_dir" and getattr(t, f.name) != f.default
        ]
        if given or opts.task == "lm":
            raise UsageError(
                f"{(given or ['--task=lm'])[0]} is for text sources (textfolder:, "
                f"jsonl:, pystdlib, pydocstrings, csv: with --text_column), not --source={spec}"
            )
        return
    problems = [
        (t.max_length < 0, f"--max_length={t.max_length}: must be >= 2, or 0 = no limit"),
        (t.long not in long_texts.POLICIES, f"--long={t.long}: use one of "
         f"{', '.join(long_texts.POLICIES)}"),
        (t.max_items < 0, f"--max_items={t.max_items}: must be >= 0 (0 = all)"),
        (not t.text_field, "--text_field is empty: name the JSON field holding the text"),
        (opts.task == "regression", f"--task=regression: text sources hold classes or "
         f"language-model text; use --task=classification or --task=lm, not with {spec}"),
    ]  # fmt: skip
    for bad, message in problems:
        if bad:
            raise UsageError(message)
    charsets.check(t.encoding)
    if t.encoding != charsets.AUTO and kind in ("pystdlib", "pydocstrings"):
        raise UsageError(f"--encoding={t.encoding} is for texts read from files (textfolder:, "
                         f"jsonl:, csv:); --source={spec} is Python's own text: drop it")


def text_options(opts: SourceOptions) -> TextOptions:
    return opts.text or TextOptions()


def split_items(items: list, opts: SourceOptions) -> dict[str, list]:
    """Splits split-less items by a seeded permutation (after ``--max_items`` sampling)."""
    # (name, text, label) gets its size; file items come with it.
    items = [it if len(it) == 4 else (*it, len(it[1])) for it in items]
    n = text_options(opts).max_items
    if n and n < len(items):  # a seeded sample, kept in source order
        keep = np.sort(np.random.default_rng(opts.seed).permutation(len(items))[:n])
        items = [items[i] for i in keep]
    if not items:
        raise UsageError("the source holds no texts; check its path and fields")
    order = train_validation(len(items), opts.validation_fraction, opts.seed)
    return {s: [items[i] for i in idx] for s, idx in order.items()}


def _train_text(root: str, item: tuple, encoding: str) -> str | None:
    name, text = item[0], item[1]
    if text is not None:
        return text if text.strip() else None
    found = checked(name, read_text(os.path.join(root, name), name, encoding))
    return None if isinstance(found, Skip) else found.text


def _size(item: tuple) -> int:
    # A token takes ~3.5 bytes of text and 2 of a record.
    return item[3] * 2 // 3 + 32
