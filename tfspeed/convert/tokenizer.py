"""Tokenisers for text sources: trained or loaded in the parent, applied in the writer workers.

``--tokenizer=bpe:N`` trains a byte-level BPE of N ids (HF ``tokenizers``) on the train split;
``--tokenizer=PATH`` takes a ``tokenizer.json`` (``tokenizers``) or a SentencePiece ``.model``.
Either way the file is saved beside ``schema.json`` (`Tokenizer.file`), and every worker loads
it from there (`TokenizerRef.load`, once per process): tokens are made once, at conversion
time, in parallel, never per epoch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from collections.abc import Iterable

import numpy as np

from tfspeed.errors import UsageError

# The BPE we train: <pad> is id 0 (what padded batches fill with), then the other specials.
SPECIALS = {"pad": "<pad>", "unk": "<unk>", "bos": "<bos>", "eos": "<eos>"}
# Other spellings a user's tokenizer.json may use for them.
_ALIASES = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "unk": ("<unk>", "[UNK]", "<|unk|>"),
    "bos": ("<bos>", "<s>", "[CLS]", "<|startoftext|>", "<|begin_of_text|>"),
    "eos": ("<eos>", "</s>", "[SEP]", "<|endoftext|>", "<|end_of_text|>"),
}
HF, SPM = "tokenizers", "sentencepiece"


@dataclasses.dataclass(frozen=True)
class TokenizerRef:
    """Where a worker finds the tokeniser: a picklable handle, loaded once per process."""

    path: str
    kind: str
    sha256: str

    def load(self):
        """The tokeniser: ``encode(text) -> list[int]`` and ``decode(ids) -> str``."""
        return _load(self.path, self.kind, self.sha256)


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """A tokeniser ready to save beside ``schema.json``.

    Attributes:
      spec: the ``--tokenizer`` value.
      kind: ``tokenizers`` or ``sentencepiece``.
      file: its file name in the output directory.
      data: the file's bytes.
      vocab_size: ids are in ``[0, vocab_size)``.
      special_ids: ``pad``, ``unk``, ``bos``, ``eos`` -> id, None where it has none.
    """

    spec: str
    kind: str
    file: str
    data: bytes
    vocab_size: int
    special_ids: dict

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    def ref(self, data_dir: str) -> TokenizerRef:
        return TokenizerRef(os.path.join(data_dir, self.file), self.kind, self.sha256)

    def to_json(self) -> dict:
        """The tokeniser's part of ``schema.json``'s ``text`` section."""
        return {
            "file": self.file,
            "kind": self.kind,
            "spec": self.spec,
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": dict(self.special_ids),
        }


def needs_training(spec: str) -> bool:
    """Whether ``spec`` trains a tokeniser (on the train split's texts)."""
    return spec.startswith("bpe:")


def make(spec: str, train_texts: Iterable[str] | None = None) -> Tokenizer:
    """The tokeniser ``spec`` names: trained on ``train_texts`` (``bpe:N``) or loaded (PATH).

    Raises a one-line UsageError for a bad spec or a file that does not load.
    """
    if needs_training(spec):
        size = spec.partition(":")[2]
        if not size.isdigit() or not 260 <= int(size) <= 1_000_000:
            raise UsageError(
                f"--tokenizer={spec}: the BPE vocabulary size must be a whole "
                "number from 260 (256 bytes + 4 specials) up, e.g. bpe:8000"
            )
        data = train_bpe(train_texts or (), int(size))
        return _describe(spec, HF, data)
    if not os.path.isfile(spec):
        raise UsageError(
            f"--tokenizer={spec}: no such file; pass bpe:N to train one, or a "
            "tokenizer.json (tokenizers) or SentencePiece .model file"
        )
    with open(spec, "rb") as f:
        data = f.read()
    kind = SPM if spec.endswith(".model") else HF
    return _describe(spec, kind, data)


def missing_specials(tok: Tokenizer) -> str:
    """A warning for a tokeniser without some special tokens ("" when it has them all).

    Batches hold id 0 at padded positions (``tfspeed.data.sequences``), so where id 0 is not
    a pad token it is a real one that a model masking id 0 cannot tell from padding.
    """
    missing = [name for name in SPECIALS if tok.special_ids[name] is None]
    if not missing:
        return ""
    found = f"--tokenizer={tok.spec} has no {', '.join(missing)} token"
    if tok.special_ids["pad"] is None:
        first = _parse(tok.kind, tok.data).token(0)
        found += (f": padded batch positions hold id 0, which is the token {first!r} here, so "
                  "a model that masks id 0 (keras.layers.Embedding(mask_zero=True)) masks that "
                  "token too (tfspeed's models read segment_ids instead)")
    if tok.special_ids["bos"] is None or tok.special_ids["eos"] is None:
        found += "; --task=lm needs bos and eos"
    return found


def train_bpe(texts: Iterable[str], vocab_size: int) -> bytes:
    """A byte-level BPE (GPT-2 style: any text encodes, ``decode(encode(t)) == t``) trained on
    ``texts``; the same texts in the same order give the same bytes."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tokenizer = HfTokenizer(models.BPE(unk_token=SPECIALS["unk"]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS.values()),  # ids 0..3, in this order
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer.to_str().encode()


def _describe(spec: str, kind: str, data: bytes) -> Tokenizer:
    """Loads ``data`` as ``kind`` to check it and read its vocabulary and special ids."""
    try:
        model = _parse(kind, data)
    except Exception as e:  # each library raises its own types for a bad file
        reason = " ".join(str(e).split())[:200]
        raise UsageError(
            f"--tokenizer={spec}: cannot load it as a {kind} "
            f"{'.model' if kind == SPM else 'tokenizer.json'} ({reason}); pass a tokenizer.json "
            "saved by tokenizers.Tokenizer.save, a SentencePiece .model, or bpe:N"
        ) from None
    if kind == SPM:
        specials = {name: getattr(model.sp, f"{name}_id")() for name in SPECIALS}
        specials = {k: (v if v >= 0 else None) for k, v in specials.items()}
        size, file = model.sp.get_piece_size(), "tokenizer.model"
    else:
        vocab = model.hf.get_vocab(with_added_tokens=True)
        specials = {
            name: next((vocab[t] for t in _ALIASES[name] if t in vocab), None) for name in SPECIALS
        }
        size, file = model.hf.get_vocab_size(with_added_tokens=True), "tokenizer.json"
    return Tokenizer(spec, kind, file, data, size, specials)


class _Loaded:
    """A loaded tokeniser of either kind, behind one interface."""

    def __init__(self, hf=None, sp=None):
        self.hf, self.sp = hf, sp

    def encode(self, text: str) -> np.ndarray:
        if self.sp is not None:
            return np.asarray(self.sp.encode(text), np.int64)
        return np.asarray(self.hf.encode(text, add_special_tokens=False).ids, np.int64)

    def token(self, i: int) -> str:
        """The token (piece) of id ``i``."""
        if self.sp is not None:
            return self.sp.id_to_piece(i)
        return self.hf.id_to_token(i)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.sp is not None:
            return self.sp.decode(ids)
        return self.hf.decode(ids, skip_special_tokens=False)


def _parse(kind: str, data: bytes) -> _Loaded:
    if kind == SPM:
        import sentencepiece

        return _Loaded(sp=sentencepiece.SentencePieceProcessor(model_proto=data))
    from tokenizers import Tokenizer as HfTokenizer

    return _Loaded(hf=HfTokenizer.from_str(data.decode("utf-8")))


@functools.lru_cache(maxsize=4)
def _load(path: str, kind: str, sha256: str) -> _Loaded:
    """Loads the file at ``path`` (once per process and content)."""
    del sha256  # part of the cache key: the file at ``path`` may be replaced by a new run
    with open(path, "rb") as f:
        return _parse(kind, f.read())
