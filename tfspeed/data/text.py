"""Token records (text) -> batches: how a split is batched, chosen once from ``schema.json``.

The text branch of ``tfspeed.data.pipeline``: records are parsed, turned into per-sequence
examples (``sequences.to_examples``: the one cast to int32), cached, shuffled, repeated and
then batched by one of ``sequences``' modes, all to the batch contract documented there.
``resolve`` works out the row length (``--max_length``), the token budget
(``--tokens_per_batch``) and the buckets from the split's length histogram alone, predicts
each mode's cost (``tfspeed.probes.costs``) and takes the mode ``tfspeed.plan.batching``
decides from them (``--batching``), so the job, the model (its position table and segment count) and the report agree with the
pipeline without building it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tfspeed import plan as plan_lib
from tfspeed.config import MAX_LENGTH_CAP
from tfspeed.data import buckets, long_texts, sequences
from tfspeed.errors import UsageError
from tfspeed.probes import costs as costs_lib

INPUT_NAMES = ("tokens", "segment_ids", "positions")
MAX_BUCKETS = 16
BUCKET_PADDING_TARGET = 0.10  # the fewest buckets that keep expected padding below this
# Where no bucket's shape is compiled (TensorFlow without XLA traces the step once for every
# width), more buckets cost nothing but a partial batch each in the grouping buffer: up to
# this many, on multiples of FREE_MULTIPLE, whatever brings the padding lowest. Short texts
# gain most: at multiples of 8, a 9-token text is padded to 16.
FREE_BUCKETS = 32
FREE_MULTIPLE = 4
# Every bucket holds at least this many of its batches a pass. group_by_window emits full
# batches only, so a bucket that fills less often holds its texts back for passes while the
# others' batches (the long texts', in these corpora) take their place in the epoch: with
# 32 buckets on pystdlib's code, 62% of the texts trained in the first pass and 90% in
# three (simulated on the split's lengths); with two batches a bucket 94% and all of them,
# at 4.5% padding instead of 1.6%. A bucket_by_sequence_length of 6 buckets of 32: 97%.
MIN_BUCKET_BATCHES = 2
PACK_WINDOW = 1024  # sequences first-fit together (sequences.pack)


@dataclasses.dataclass(frozen=True)
class Batching:
    """How token records become batches, and why (global figures: all replicas).

    Attributes:
      mode: ``pad``, ``bucket`` or ``pack``.
      reason: one sentence, citing the predicted (or measured: ``measured``) figures of
        the alternatives.
      max_length: T: a packed row's tokens, the last bucket's boundary, the longest a padded
        batch gets. From the data (every split's longest sequence, rounded up to a multiple
        of 8) unless ``--max_length`` is lower; longer sequences follow ``long``.
      tokens_per_batch: the token budget of a bucket's or a packed batch (a classifier's
        buckets: what ``bucket_size`` sequences of the mean length hold).
      batch_size: sequences per padded batch (``pad``).
      rows_per_batch: rows per packed batch (``pack``), a multiple of the replicas.
      boundaries: the buckets' lengths (``bucket``).
      bucket_batch_sizes: sequences per batch of each bucket, multiples of the replicas.
      bucket_size: sequences per batch (``bucket``, classification, no
        ``--tokens_per_batch``: ``--batch_size`` texts, so that every text has the same
        share of the updates, as in padded batches; fewer only in buckets too wide for
        ``buckets.WIDE_BATCH`` token budgets); 0: each bucket's batch holds the token
        budget (language models: their loss is a mean over tokens).
      max_segments: S, sequences per row (1 unless packed).
      long: what happens to a sequence longer than ``max_length``.
      expected_padding: the fraction of computed tokens that would be padding, per mode,
        from the train split's lengths (``pad``: each random batch padded to its longest;
        ``pack``: first-fit on samples of the lengths).
      costs: predicted compute per real token of each mode, in units of the per-token work
        (1.0: no padding and no attention): padding and attention pairs both counted.
      attention_length: K, the row length at which a token's attention pairs cost as much
        as its per-token work (from the model); None: a model whose attention is not known,
        whose costs count padding only.
      long_counts: per split, what the long policy does to one pass
        (``tfspeed.data.long_texts.events``).
      mean_length: the train split's mean sequence (piece) length.
      replicas: every global batch's sequences or rows are a multiple of this.
      measured: what ``--batching=auto`` timed, when it did (``training.job``'s batching
        probe): real tokens/s of bucket and pack, and the batches each pass held.
      source: where ``mode`` came from (``tfspeed.plan``: given, predicted, measured, reused).
      free_shapes: no batch shape is compiled (TensorFlow without XLA): up to
        ``FREE_BUCKETS`` buckets, and evaluation's last batch of a bucket is filled only to a
        multiple of the replicas, not to the bucket's full batch.
    """

    mode: str
    reason: str
    max_length: int
    tokens_per_batch: int
    batch_size: int
    rows_per_batch: int
    boundaries: tuple[int, ...]
    bucket_batch_sizes: tuple[int, ...]
    max_segments: int
    long: str
    expected_padding: dict
    costs: dict = dataclasses.field(default_factory=dict)
    attention_length: float | None = None
    long_counts: dict = dataclasses.field(default_factory=dict)
    mean_length: float = 0.0
    replicas: int = 1
    free_shapes: bool = False
    bucket_size: int = 0
    measured: dict = dataclasses.field(default_factory=dict)
    source: str = plan_lib.GIVEN

    def decision(self) -> plan_lib.Decision:
        """The mode as the plan's decision (report.json's ``plan.batching``)."""
        return plan_lib.Decision(self.mode, self.reason, self.source)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    def expected_weight(self, task: str) -> float:
        """What one global batch holds on average: real tokens (lm), or sequences."""
        if self.mode == "pad":
            sequences = float(self.batch_size)
        elif self.mode == "bucket" and self.bucket_size:
            sequences = float(self.bucket_size)
        else:
            real = self.tokens_per_batch * (1 - self.expected_padding.get(self.mode, 0.0))
            sequences = real / max(self.mean_length, 1.0)
        return sequences * self.mean_length if task == "lm" else sequences


def is_text(schema) -> bool:
    """Whether ``schema`` holds token records (``encoding: tokens``)."""
    return not schema.named_inputs and schema.input_feature.encoding == "tokens"


def input_spec() -> dict[str, tuple]:
    """The model input of a token schema: three int32 [batch, T] tensors (T varies)."""
    return {name: (None,) for name in INPUT_NAMES}


def length_counts(schema, split: str) -> np.ndarray:
    """``counts[n]``: the sequences of length n that ``sequences.to_examples`` makes of the
    split (an lm's example is one token shorter than its record: inputs ``t[:-1]``), from the
    per-length counts the converter records: the one length-histogram format."""
    stats = schema.split(split).text or {}
    if not stats.get("lengths"):
        raise UsageError(f"schema.json has no per-length token counts for split {split!r}; "
                         "reconvert the text with this version of scripts/to_tfrecord.py "
                         "--overwrite")
    shift = 1 if schema.task == "lm" else 0
    pairs = np.asarray(stats["lengths"], np.int64).reshape(-1, 2)
    counts = np.zeros(int(pairs[:, 0].max()) + 1)
    np.add.at(counts, np.maximum(pairs[:, 0] - shift, 0), pairs[:, 1])
    return counts


def longest(counts: np.ndarray) -> int:
    """The longest length with a sequence in ``counts`` (0 for none)."""
    return int(np.flatnonzero(counts)[-1]) if counts.any() else 0


def resolve_max_length(longest_sequence: int, requested: int = 0) -> int:
    """T: the longest sequence rounded up to a multiple of 8, at most ``requested`` (0: at
    most ``MAX_LENGTH_CAP``, the cap the converter applies by default too)."""
    cap = requested or MAX_LENGTH_CAP
    return max(2, min(cap, -(-max(longest_sequence, 1) // 8) * 8))


def expected_padding(counts: np.ndarray, batch_size: int, shape_cost: float = 0.0,
                     free_shapes: bool = False, tokens_per_batch: float = 0.0,
                     bucket_size: int = 0) -> dict:
    """Expected padding fractions of ``counts`` (lengths after the long policy).

    Args:
      shape_cost: where every bucket's shape is compiled, what one compile costs as a share
        of the run (``costs.COMPILE_BATCHES`` over its batches); 0: not known.
      free_shapes: no bucket's shape is compiled: up to ``FREE_BUCKETS`` buckets on
        multiples of ``FREE_MULTIPLE``, the least padding.
      tokens_per_batch: a bucketed batch's token budget: every bucket then holds at least
        ``MIN_BUCKET_BATCHES`` batches of ``counts`` (one pass); 0: no such bound.
      bucket_size: a bucketed batch's sequences (``buckets.bucket_batch_sizes``), instead
        of the budget's.

    Returns:
      ``{"pad", "fixed", "bucket", "boundaries", "pad_width"}``: ``pad`` pads a batch of
      ``batch_size`` random sequences to its longest (``pad_width``, E[max] from the length
      distribution), ``fixed`` every sequence to the longest allowed, ``bucket`` each to its
      bucket's boundary, with the fewest buckets (up to ``MAX_BUCKETS``) that bring it under
      ``BUCKET_PADDING_TARGET`` (with ``shape_cost``: the number of buckets that costs least,
      ``(1 + buckets * shape_cost) / (1 - padding)``; with ``free_shapes``: the least padding).
    """
    max_length = len(counts) - 1
    total = counts.sum()
    if not total:
        return {"pad": 0.0, "fixed": 0.0, "bucket": 0.0, "boundaries": [max_length],
                "pad_width": float(max_length)}
    lengths = np.arange(max_length + 1)
    mean = float(np.dot(lengths, counts)) / total
    cdf = np.cumsum(counts) / total
    below = np.concatenate([[0.0], cdf[:-1]])
    widest = float(np.dot(lengths, cdf ** batch_size - below ** batch_size))
    filled = {"tokens_per_batch": int(tokens_per_batch), "min_batches": MIN_BUCKET_BATCHES,
              "batch_size": bucket_size}
    if shape_cost:
        choices = [buckets.choose_boundaries(counts, max_length, k, **filled)
                   for k in range(1, MAX_BUCKETS + 1)]
        boundaries, bucket = min(choices, key=lambda c: (1 + len(c[0]) * shape_cost)
                                 / max(1 - c[1], 1e-3))
    elif free_shapes:
        boundaries, bucket = buckets.choose_boundaries(counts, max_length, FREE_BUCKETS,
                                                       multiple=FREE_MULTIPLE, **filled)
    else:
        for n in range(1, MAX_BUCKETS + 1):
            boundaries, bucket = buckets.choose_boundaries(counts, max_length, n, **filled)
            if bucket <= BUCKET_PADDING_TARGET:
                break
    return {"pad": round(float(1 - mean / widest), 4) if widest else 0.0,
            "fixed": round(float(1 - mean / max_length), 4), "bucket": round(float(bucket), 4),
            "boundaries": [int(b) for b in boundaries], "pad_width": round(widest, 2)}


def pack_padding(counts: np.ndarray, max_length: int, max_segments: int,
                 windows: int = 4) -> float:
    """The padding of packed rows of ``max_length``: ``sequences.pack``'s first-fit run on
    ``windows`` windows of lengths drawn (seeded) from ``counts``."""
    lengths = np.repeat(np.arange(len(counts)), np.round(counts).astype(np.int64))
    lengths = lengths[lengths > 0]
    if not lengths.size:
        return 0.0
    sample = np.random.default_rng(0).permutation(lengths)[: windows * PACK_WINDOW]
    packer = sequences.Packer(max_length, max_segments, "truncate", False, None)
    rows = sum(packer.rows(sample[i:i + PACK_WINDOW])
               for i in range(0, sample.size, PACK_WINDOW))
    return round(1.0 - float(sample.sum()) / (rows * max_length), 4)


def resolve(config, schema, takes_segments: bool = False, replicas: int = 1,
            attention_length: float | None = None, compiled=None, run_steps: int = 0,
            run_epochs: float = 0.0, recall=None, probe=None) -> Batching:
    """The ``Batching`` of a DataConfig (``batching``, ``max_length``, ``tokens_per_batch``,
    ``long``, ``batch_size``) on a token schema: the one resolver (the job resolves once and
    hands the result to its pipelines, the model, tune and diagnose).

    Every split is batched alike (one set of shapes); the figures come from the train
    split's lengths, and T and the last bucket cover every split's longest sequence.

    Args:
      config: the data settings.
      schema: a token schema.
      takes_segments: the model takes segment ids (``auto`` may then pack).
      replicas: every global batch is a multiple of this many sequences or rows.
      attention_length: the model's K (see ``Batching``); None: padding alone is counted.
      compiled: the modes whose every batch shape is compiled on this runtime (XLA); None:
        not known (a dataset for a user's own step, which may compile each shape).
      run_steps, run_epochs: the run's length in batches, or in passes over the train split
        (0: unknown): what share of the run a compile takes.
      recall, probe: ``tfspeed.plan.batching``'s: the first run's decision, and a probe that
        times bucket against pack (the job's); None: the mode is predicted.

    Raises:
      UsageError: a token budget too small for one row (or the longest bucket) per
        replica; a padded batch that does not split over the replicas.
    """
    split = config.train_split if config.train_split in schema.splits else next(
        iter(schema.splits))
    every = {name: length_counts(schema, name) for name in schema.splits
             if schema.split(name).text}
    t = resolve_max_length(max(map(longest, every.values())), config.max_length)
    counts = long_texts.piece_counts(every[split], t, config.long)
    mean = float(np.dot(np.arange(len(counts)), counts)) / max(counts.sum(), 1.0)
    tokens = _tokens_per_batch(config, mean, t, replicas)
    per_bucket = bucket_size(config, schema, replicas)
    run_batches = run_steps or run_epochs * mean * counts.sum() / tokens
    shape_cost = costs_lib.COMPILE_BATCHES / run_batches if run_batches and compiled else 0.0
    free = compiled is not None and "bucket" not in compiled
    compiled = compiled or ()
    padding = expected_padding(counts, config.batch_size,
                               shape_cost if "bucket" in compiled else 0.0, free, tokens,
                               per_bucket)
    segments = max(1, t // 8)
    padding["pack"] = pack_padding(counts, t, segments)
    boundaries = _cover(padding["boundaries"], every, t, config.long)
    costs = costs_lib.predicted_costs(counts, padding, t, attention_length, compiled,
                                      shape_cost, tokens / replicas, schema.task)
    decision, measured = plan_lib.batching(config.batching, costs, takes_segments,
                                           recall=recall, probe=probe)
    mode, reason = decision.value, decision.reason
    if (mode == "pad" or mode == "bucket" and per_bucket) and config.batch_size % replicas:
        raise UsageError(f"--batch_size={config.batch_size} does not split evenly over "
                         f"{replicas} replicas; use a multiple of {replicas}")
    rows = max(replicas, round(tokens / t / replicas) * replicas)
    return Batching(
        mode=mode, reason=reason, max_length=t, tokens_per_batch=tokens,
        batch_size=config.batch_size, rows_per_batch=rows,
        boundaries=tuple(boundaries) if mode == "bucket" else (),
        bucket_batch_sizes=(tuple(buckets.bucket_batch_sizes(boundaries, tokens, replicas,
                                                             per_bucket))
                            if mode == "bucket" else ()),
        max_segments=segments if mode == "pack" else 1, long=config.long,
        expected_padding=padding, costs=costs, attention_length=attention_length,
        long_counts={name: long_texts.events(np.arange(len(c)), t, config.long, weights=c)
                     for name, c in every.items()},
        mean_length=round(mean, 2), replicas=replicas, free_shapes=free,
        bucket_size=per_bucket if mode == "bucket" else 0, measured=measured,
        source=decision.source)


def bucket_size(config, schema, replicas: int = 1) -> int:
    """Sequences in every bucketed batch: a classifier's ``--batch_size`` texts (its loss is
    a mean over texts, and every text then has the same share of the updates, as in padded
    batches), a multiple of the replicas; 0 for a language model (a mean over tokens) or a
    given ``--tokens_per_batch``: each bucket's batch then holds that many tokens."""
    if schema.task == "lm" or config.tokens_per_batch:
        return 0
    return max(replicas, config.batch_size // replicas * replicas)


def _cover(boundaries: list[int], every: dict, max_length: int, long: str) -> list[int]:
    """``boundaries`` with the last one covering every split's longest piece: a validation
    sequence longer than any in train is the long policy's, never cut by bucketing."""
    widest = max(longest(long_texts.piece_counts(c, max_length, long)) for c in every.values())
    need = min(max_length, -(-widest // 8) * 8)
    if need <= boundaries[-1]:
        return list(boundaries)
    return [*boundaries[: max(MAX_BUCKETS, len(boundaries)) - 1], need]


def _tokens_per_batch(config, mean: float, max_length: int, replicas: int) -> int:
    """``--tokens_per_batch``, or by default ``--batch_size`` sequences of the mean length
    (about as many sequences per update as a padded batch), at least one row (which holds
    the longest bucket) per replica."""
    least = max_length * replicas if config.batching != "pad" else 0
    if config.tokens_per_batch:
        if config.tokens_per_batch < least:
            raise UsageError(
                f"--tokens_per_batch={config.tokens_per_batch} holds less than one row of "
                f"{max_length} tokens (--max_length, or the longest sequence) per replica "
                f"({replicas}); raise it to at least {least}, or lower --max_length")
        return config.tokens_per_batch
    return max(int(round(config.batch_size * mean)), max_length * replicas)


def batches_per_epoch(batching: Batching, schema, split: str) -> int:
    """Training batches (drop-remainder) in one pass over ``split``, from its lengths: what an
    epoch is for token data, where a batch holds a token budget rather than a fixed number of
    records. Batches span epoch ends (the input repeats before batching), so a bucket's
    remainder counts as the fraction of a batch it is."""
    counts = long_texts.piece_counts(length_counts(schema, split), batching.max_length,
                                     batching.long)
    if batching.mode == "pad":
        return int(counts.sum()) // batching.batch_size
    if batching.mode == "bucket":
        lower, total = 0, 0.0
        for boundary, size in zip(batching.boundaries, batching.bucket_batch_sizes,
                                  strict=True):
            total += counts[lower + 1: boundary + 1].sum() / size
            lower = boundary
        return int(total)
    tokens = float(np.dot(np.arange(len(counts)), counts))
    fill = 1 - batching.expected_padding.get("pack", 0.0)
    return int(tokens / (batching.max_length * fill)) // batching.rows_per_batch


def make_to_example(task: str):
    """A parsed record ``{"inputs": tokens, "label"?}`` -> ``sequences``' per-sequence
    element (tokens int32; an lm's inputs and next-token labels)."""
    import tensorflow as tf

    to_example = sequences.make_to_example(task)

    def convert(record):
        tokens = record["inputs"]
        if isinstance(tokens, tf.RaggedTensor):  # a record of a ragged group: its values
            tokens = tokens.flat_values
        return to_example({"tokens": tokens, "label": record.get("label", 0)})

    return convert


def batch(ds, batching: Batching, *, training: bool, longest: int, num_pipelines: int = 1,
          local_replicas: int = 1, deterministic: bool = True):
    """Per-sequence elements -> the batch contract, as ``batching`` says.

    Training batches are full (drop_remainder) and each pipeline's share of the global
    batch is one batch cut into ``local_replicas`` equal consecutive parts, which
    ``distribute_datasets_from_function`` hands to its replicas in turn: every replica of a
    step gets the same static [B, T]. Evaluation drops nothing: a short last batch (per
    bucket) is filled with empty rows (weight 0), to the full batch where each shape
    compiles, else to a multiple of the replicas.

    Args:
      ds: ``make_to_example``'s elements (shuffled and repeated for training).
      batching: from ``resolve``.
      training: full batches only.
      longest: the longest example in the split (the long policy runs only if it is above
        ``max_length``).
      num_pipelines: input pipelines sharing the global batch (workers).
      local_replicas: replicas this pipeline feeds.
    """
    import tensorflow as tf

    t, drop = batching.max_length, training
    if longest > t:  # per sequence, before windows are padded to their longest
        ds = sequences.apply_long(ds, t, batching.long, deterministic)
    if batching.mode == "pack":
        rows = batching.rows_per_batch // num_pipelines
        ds = sequences.pack(ds, t, rows, window=PACK_WINDOW, max_segments=batching.max_segments,
                            long=batching.long, drop_remainder=drop, deterministic=deterministic)
        ds = ds if drop else ds.map(lambda x, y: _fill((x, y), rows))
    elif batching.mode == "bucket":
        tokens = batching.tokens_per_batch // num_pipelines
        # Multiples of the replicas this pipeline feeds, whether it cuts the batch for them
        # (tf.distribute) or hands it on whole (the JAX engine shards it).
        multiple = max(local_replicas, batching.replicas // num_pipelines)
        size = batching.bucket_size // num_pipelines
        ds = sequences.bucket(ds, batching.boundaries, tokens, multiple, drop_remainder=drop,
                              deterministic=deterministic, batch_size=size)
        if not drop:
            edges = tf.constant(batching.boundaries, tf.int32)
            sizes = tf.constant(buckets.bucket_batch_sizes(batching.boundaries, tokens,
                                                           multiple, size), tf.int32)

            def fill(x, y):
                if batching.free_shapes:  # no compile per shape: whole replica shares only
                    return _fill((x, y), -(-tf.shape(x["tokens"])[0] // multiple) * multiple)
                index = tf.argmax(tf.cast(edges == tf.shape(x["tokens"])[1], tf.int32))
                return _fill((x, y), sizes[index])

            ds = ds.map(fill)
    else:
        size = batching.batch_size // num_pipelines
        ds = sequences.pad(ds, size, drop_remainder=drop, deterministic=deterministic)
        ds = ds if drop else ds.map(lambda x, y: _fill((x, y), size))
    return _per_replica(ds, local_replicas) if local_replicas > 1 else ds


def _fill(batch, rows):
    """A batch with empty rows (zeros: padding, weight 0) added up to ``rows``."""
    import tensorflow as tf

    def fill(x):
        padding = [[0, rows - tf.shape(x)[0]]] + [[0, 0]] * (x.shape.rank - 1)
        x = tf.pad(x, padding)
        return tf.ensure_shape(x, [rows, *x.shape[1:]]) if isinstance(rows, int) else x

    return tf.nest.map_structure(fill, batch)


def _per_replica(ds, replicas: int):
    """Each batch -> ``replicas`` consecutive batches of an equal part of its rows."""
    import tensorflow as tf

    def split(*batch):
        def cut(x):
            rows = x.shape[0] // replicas if x.shape[0] is not None else -1
            return tf.reshape(x, tf.concat([[replicas, rows], tf.shape(x)[1:]], 0))

        out = tf.nest.map_structure(cut, batch)
        return tf.nest.map_structure(
            lambda a, b: tf.ensure_shape(a, [replicas, b.shape[0] // replicas
                                             if b.shape[0] is not None else None,
                                             *b.shape[1:]]), out, batch)

    return ds.map(split).unbatch()
