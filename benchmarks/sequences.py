"""Variable-length text: the TF guide's ways of batching it against tfspeed's bucket and pack.

    python benchmarks/sequences.py [--items=0] [--rounds=3] [--epochs=3] [--base=CHECKOUT]
        [--datasets=pystdlib,pydoc_lm,pydocs]

Real text only, each set converted once by the real converter (``scripts/to_tfrecord.py
--tokenizer=bpe:8000 --max_length=512 --long=split``):

  pystdlib  the converter's built-in corpus: top-level functions and classes of Python's
            standard library, classified by their package (10 classes). Code: long texts
            (median ~195 tokens, a tenth at the 512 cap).
  pydoc_lm  the paragraphs of ``pydoc_data.topics`` (the language reference that ships with
            Python: ~2,600 human-written English paragraphs, with their code examples), as a
            jsonl file, for causal language modelling (``--task=lm``). Chosen because it is
            prose rather than code, short (median ~30 tokens: padding costs most there) and
            present in every CPython, with nothing to download.
  pydocs    the converter's built-in ``pydocstrings`` corpus: every docstring of the same ten
            packages, classified by package (10 classes, ~2,800 texts). Short human-written
            prose (median ~19 tokens, a few hundreds long): the short texts a user brings,
            where packing into long rows pays attention over positions no segment uses.

Contenders, each in a process of its own, all training the same transformer
(``tfspeed.training.transformer.build_transformer``; width 64, depth 2, heads 4) for
--epochs passes over the same train split, in float32 (the comparison is of batching, not
precision), with Adam at the same constant learning rate, evaluated on the validation split
after every pass:

  guide_padded_batch         TFRecordDataset -> parse -> shuffle -> padded_batch(B) (each
                             batch to its longest) -> stock ``compile``/``fit``;
  fixed_max_length           the same, padded to --max_length, compiled with
                             ``jit_compile=True``: what XLA users do (one static shape);
  bucket_by_sequence_length  ``Dataset.bucket_by_sequence_length``, boundaries
                             16/32/64/128/256/512 as in the API's example, B per bucket;
  tfspeed_bucket             ``python -m tfspeed.train --batching=bucket --batch_size=B``;
  tfspeed_pack               ``python -m tfspeed.train --batching=pack --batch_size=B``;
  tfspeed_auto               ``python -m tfspeed.train --batching=auto --batch_size=B``:
                             what auto chose, against the faster of bucket and pack.
  base_tfspeed_<mode>        with --base=CHECKOUT: the same driver command run from an older
                             checkout (its working directory and PYTHONPATH), on the same
                             converted data: did a change lose speed? (``--contenders=
                             tfspeed_auto,base_tfspeed_auto``; the ratio is this one / base).

Peers take B sequences per update. tfspeed runs with its defaults for --batch_size=B: a
classifier's buckets hold B texts each, as the peer's; packed batches and a language
model's buckets hold a token budget of B times the split's mean length (about as many real
tokens, so about as many updates a pass). --tokens_per_batch=T gives tfspeed that budget
everywhere instead. The peers' inputs
are the batch contract built in a map (segment_ids = 1 where the token is not <pad>,
positions = range); their lm loss is the TF transformer tutorial's (mean over the non-<pad>
labels of a batch). Their evaluation is exact: summed over the whole validation split, then
divided (per sequence for accuracy, per real token for lm loss and perplexity).

--rounds interleaved rounds, the contenders' order rotated each round. Per contender and
round: real tokens/s of training after its first step (and with the first step, which
traces/compiles), evaluations left out, the padding fraction, the eval metric after each
pass, the process's wall seconds, compiled functions. The record keeps every round and the
median with min-max.

Tokens/s alone would count fewer, larger updates as speed (a token budget puts many short
texts in one batch). So the record also gives time-to-target: the training seconds each
contender needs until an evaluation reaches what the best stock peer reaches after one pass
(accuracy; lm: loss per real token), and the best peer's time over tfspeed's.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import textwrap
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from absl import app, flags  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from tfspeed import bench  # noqa: E402
from tfspeed.training.transformer import build_transformer  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "/tmp/tfspeed-bench-sequences",
                               "Converted datasets and run directories.")
_ITEMS = flags.DEFINE_integer("items", 0, "Texts to convert per dataset (the converter's "
                              "--max_items, a seeded sample); 0 = all.")
_DATASETS = flags.DEFINE_list("datasets", ["pystdlib", "pydoc_lm", "pydocs"],
                              "Datasets to run.")
_CONTENDERS = flags.DEFINE_list("contenders", None, "Contenders to run (default: all).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds over all contenders.")
_EPOCHS = flags.DEFINE_integer("epochs", 3, "Passes over the train split, every contender's "
                               "(evaluated after each: time-to-target).")
_BATCH = flags.DEFINE_integer("batch_size", 32, "Sequences per update of the peers.")
_TOKENS = flags.DEFINE_integer("tokens_per_batch", 0, "tfspeed's token budget, every mode; 0: "
                               "tfspeed's defaults for --batch_size.")
_MAX_LENGTH = flags.DEFINE_integer("max_length", 512, "Longest sequence (conversion and batches).")
_WIDTH = flags.DEFINE_integer("width", 64, "Transformer width.")
_DEPTH = flags.DEFINE_integer("depth", 2, "Transformer blocks.")
_HEADS = flags.DEFINE_integer("heads", 4, "Attention heads.")
_LR = flags.DEFINE_float("learning_rate", 1e-3, "Adam's (constant) learning rate, everyone's.")
_SEED = flags.DEFINE_integer("seed", 0, "Seed (initialisation and shuffle) of round 0; round r "
                             "runs every contender with seed + r.")
_TAG = flags.DEFINE_string("tag", "", "Suffix of the record's file name.")
_RESULTS = flags.DEFINE_string("results_dir", os.path.join(REPO, "benchmarks", "results"),
                               "Where the record is written ('' = print only).")
_CONTENDER = flags.DEFINE_string("contender", "", "Internal: run this peer alone.")
_DATA_DIR = flags.DEFINE_string("data_dir", "", "Internal: the peer's dataset.")
_BASE = flags.DEFINE_string("base", "", "An older checkout of tfspeed: adds base_tfspeed_<mode> "
                            "contenders, the same driver commands run from that checkout "
                            "(did a change lose speed?).")

PEERS = ("guide_padded_batch", "fixed_max_length", "bucket_by_sequence_length")
TFSPEED = {"tfspeed_bucket": "bucket", "tfspeed_pack": "pack", "tfspeed_auto": "auto"}
CONTENDERS = (*PEERS, *TFSPEED)
BASE = "base_"  # base_tfspeed_<mode>: the driver of the --base checkout
GUIDE_BOUNDARIES = (16, 32, 64, 128, 256, 512)
PAD = 0  # the converter's <pad> id (schema.json text.tokenizer.special_ids)


# ------------------------------------------------------------------ data
def pydoc_paragraphs(path: str) -> str:
    """Writes the paragraphs of ``pydoc_data.topics`` as jsonl (``{"text": ...}``)."""
    import pydoc_data.topics


    if not os.path.exists(path):
        paragraphs = [textwrap.dedent(p).strip() for name in sorted(pydoc_data.topics.topics)
                      for p in pydoc_data.topics.topics[name].split("\n\n")]
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs if p)
        os.replace(path + ".tmp", path)
    return path


def dataset_sources(root: str) -> dict[str, tuple[str, list[str]]]:
    return {"pystdlib": ("pystdlib", []),
            "pydoc_lm": (f"jsonl:{pydoc_paragraphs(os.path.join(root, 'pydoc.jsonl'))}",
                         ["--task=lm"]),
            "pydocs": ("pydocstrings", [])}


def prepare(name: str) -> tuple[str, dict]:
    """Converts dataset ``name`` once (real converter, default workers) into the workdir.

    Returns:
      ``(data_dir, facts)``: facts are the conversion's options and train/validation sizes.
    """
    root = _WORKDIR.value
    source, extra = dataset_sources(root)[name]
    out = os.path.join(root, f"{name}-items{_ITEMS.value}-len{_MAX_LENGTH.value}")
    options = [f"--source={source}", f"--output={out}", "--tokenizer=bpe:8000",
               f"--max_length={_MAX_LENGTH.value}", "--long=split", f"--max_items={_ITEMS.value}",
               "--noprogress", *extra]
    if not os.path.exists(os.path.join(out, "schema.json")):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "to_tfrecord.py"),
                               *options], capture_output=True, text=True, check=False)
        if proc.returncode:
            raise SystemExit(f"converting {name} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "schema.json")) as f:
        schema = json.load(f)
    text = schema["text"]
    facts = {"converter": " ".join(options[:1] + options[2:]), "task": text["task"],
             "vocab_size": text["tokenizer"]["vocab_size"],
             "num_classes": schema.get("num_classes")}
    for split in ("train", "validation"):
        lengths = schema["splits"][split]["text"]
        facts.update({f"{split}_{k}": lengths[k]
                      for k in ("records", "tokens", "median", "mean", "max")})
    return out, facts


def token_budget(facts: dict, mode: str = "pack") -> int:
    """About tfspeed's tokens per batch: the peers' real tokens per update (--batch_size
    sequences of the mean length, what tfspeed's defaults give), rounded up to whole rows of
    --max_length for pack (a packed batch is whole rows): the updates a pass to expect."""
    if _TOKENS.value:
        return _TOKENS.value
    tokens = int(round(_BATCH.value * facts["train_mean"]))
    if mode != "pack":
        return max(tokens, _MAX_LENGTH.value)  # at least one row (the longest bucket)
    length = _MAX_LENGTH.value
    return max(1, -(-tokens // length)) * length


# ------------------------------------------------------------------ the peers (stock Keras)
def read(data_dir: str, split: str, lm: bool):
    """TFRecords -> ``(tokens int32 [L], label)`` as the TF guide parses them."""
    files = sorted(tf.io.gfile.glob(os.path.join(data_dir, f"{split}-*.tfrecord")))
    spec = {"tokens": tf.io.VarLenFeature(tf.int64)}
    if not lm:
        spec["label"] = tf.io.FixedLenFeature([], tf.int64)

    def parse(record):
        example = tf.io.parse_single_example(record, spec)
        tokens = tf.cast(tf.sparse.to_dense(example["tokens"]), tf.int32)
        if lm:  # next-token prediction: inputs t[:-1], labels t[1:]
            return tokens[:-1], tokens[1:]
        return tokens, tf.cast(example["label"], tf.int32)[None]

    return tf.data.TFRecordDataset(files).map(parse, num_parallel_calls=tf.data.AUTOTUNE)


def to_contract(tokens, label):
    """A padded batch -> the transformer's inputs (segment_ids 1 where not <pad>)."""
    real = tf.cast(tf.not_equal(tokens, PAD), tf.int32)
    positions = tf.range(tf.shape(tokens)[1], dtype=tf.int32)[None, :] * real
    return {"tokens": tokens, "segment_ids": real, "positions": positions}, label


def batched(ds, contender: str, lm: bool):
    """The contender's batching of ``(tokens, label)`` elements."""
    b, length = _BATCH.value, _MAX_LENGTH.value
    label_shape = [None] if lm else [1]
    if contender == "guide_padded_batch":
        ds = ds.padded_batch(b)
    elif contender == "fixed_max_length":
        ds = ds.padded_batch(b, padded_shapes=([length], [length] if lm else [1]))
    elif contender == "bucket_by_sequence_length":
        ds = ds.bucket_by_sequence_length(
            lambda tokens, label: tf.shape(tokens)[0], list(GUIDE_BOUNDARIES),
            [b] * (len(GUIDE_BOUNDARIES) + 1), padded_shapes=([None], label_shape))
    else:
        raise ValueError(f"unknown peer {contender!r}")
    return ds.map(to_contract, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)


TRACES = [0]  # the loss's Python body runs once per trace of the train step


def masked_loss(label, logits):
    """The TF transformer tutorial's loss: mean cross-entropy over the non-<pad> labels."""
    TRACES[0] += 1
    loss = keras.losses.sparse_categorical_crossentropy(label, logits, from_logits=True)
    mask = keras.ops.cast(keras.ops.not_equal(label, PAD), loss.dtype)
    return keras.ops.sum(loss * mask) / keras.ops.sum(mask)


def masked_accuracy(label, logits):
    ops = keras.ops
    match = ops.cast(ops.equal(ops.cast(label, "int32"), ops.argmax(logits, -1)), "float32")
    mask = ops.cast(ops.not_equal(label, PAD), "float32")
    return ops.sum(match * mask) / ops.sum(mask)


def class_loss(label, logits):
    TRACES[0] += 1
    return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(label, logits,
                                                                       from_logits=True))


class StepClock(keras.callbacks.Callback):
    """When each training step ends (``fit`` syncs on its logs each step), how many times
    the train step was traced meanwhile, and after each pass ``evaluate(model)``: its
    metrics and the training seconds before it (evaluations left out) in ``history``, its
    own seconds in ``eval_seconds``."""

    def __init__(self, evaluate=None):
        super().__init__()
        self.evaluate = evaluate

    def on_train_begin(self, logs=None):
        self.begin, self.ends, self.traces_before = time.perf_counter(), [], TRACES[0]
        self.history, self.eval_seconds = [], []

    def on_train_batch_end(self, batch, logs=None):
        self.ends.append(time.perf_counter())

    def on_epoch_end(self, epoch, logs=None):
        if self.evaluate is None:
            return
        start = time.perf_counter()
        metrics = self.evaluate(self.model)
        self.history.append({"epoch": epoch + 1, **metrics, "train_seconds": (
            start - self.begin - sum(self.eval_seconds))})
        self.eval_seconds.append(time.perf_counter() - start)

    def on_train_end(self, logs=None):
        self.traces = TRACES[0] - self.traces_before


def batch_tokens(ds) -> tuple[list[int], list[int], set]:
    """Real and computed tokens of each batch of a pass, and the distinct input shapes: one
    untimed pass over an identical pipeline (the shuffle is seeded, the maps ordered)."""
    real, computed, shapes = [], [], set()
    for inputs, _ in ds.as_numpy_iterator():
        segments = inputs["segment_ids"]
        real.append(int(np.count_nonzero(segments)))
        computed.append(int(segments.size))
        shapes.add(segments.shape)
    return real, computed, shapes


def peer_model(facts: dict, lm: bool, jit_compile: bool | str = "auto"):
    """The same transformer as tfspeed's, compiled the stock way (float32, Adam; Keras'
    ``jit_compile="auto"`` is off on a CPU-only machine)."""
    keras.utils.set_random_seed(_SEED.value)
    model = build_transformer(facts["vocab_size"], facts["vocab_size"] if lm else facts[
        "num_classes"], "lm" if lm else "classification", width=_WIDTH.value,
        depth=_DEPTH.value, heads=_HEADS.value, max_length=_MAX_LENGTH.value,
        max_segments=1)  # unpacked rows: one sequence each, logits [B, 1, C] for labels [B, 1]
    metric = masked_accuracy if lm else keras.metrics.SparseCategoricalAccuracy(name="accuracy")
    model.compile(optimizer=keras.optimizers.Adam(_LR.value),
                  loss=masked_loss if lm else class_loss, metrics=[metric],
                  jit_compile=jit_compile)
    return model


def exact_eval(model, data_dir: str, lm: bool) -> dict:
    """Loss and accuracy over the whole validation split, summed then divided: per real
    token for lm (and its perplexity), per sequence for classification. Padding cannot
    change these (attention and pooling are masked), so every peer is evaluated on the
    guide's padded batches."""
    @tf.function(reduce_retracing=True)
    def sums(inputs, label):
        logits = model(inputs, training=False)
        ce = tf.nn.sparse_softmax_cross_entropy_with_logits(label, logits)
        weight = tf.cast(tf.not_equal(label, PAD), tf.float32) if lm else tf.ones_like(ce)
        correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), label),
                          tf.float32)
        return tf.stack([tf.reduce_sum(ce * weight), tf.reduce_sum(correct * weight),
                         tf.reduce_sum(weight)])

    if keras.backend.backend() == "tensorflow":
        total = tf.zeros([3])
        for inputs, label in batched(read(data_dir, "validation", lm), "guide_padded_batch", lm):
            total += sums(inputs, label)
        loss, correct, weight = (float(x) for x in total.numpy())
    else:  # a tf.function cannot call a model of another backend: NumPy sums of its logits
        loss, correct, weight = _numpy_sums(model, data_dir, lm)
    metrics = {"loss": loss / weight, "accuracy": correct / weight}
    if lm:
        metrics["perplexity"] = math.exp(metrics["loss"])
    return metrics


def _numpy_sums(model, data_dir: str, lm: bool) -> tuple[float, float, float]:
    """``exact_eval``'s sums on any backend: batches padded to --max_length (one compiled
    shape, not one per batch; padding changes nothing), logits from ``predict_on_batch``."""
    loss = correct = weight = 0.0
    ds = batched(read(data_dir, "validation", lm), "fixed_max_length", lm)
    for inputs, label in ds.as_numpy_iterator():
        logits = np.asarray(model.predict_on_batch(inputs), np.float64)
        logits -= logits.max(-1, keepdims=True)
        log_p = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        w = (label != PAD).astype(np.float64) if lm else np.ones(label.shape)
        ce = -np.take_along_axis(log_p, label[..., None].astype(np.int64), -1)[..., 0]
        loss += float((ce * w).sum())
        correct += float(((log_p.argmax(-1) == label) * w).sum())
        weight += float(w.sum())
    return loss, correct, weight


def run_peer(contender: str, data_dir: str, facts: dict) -> dict:
    """One peer's pass, timed by step; then its exact evaluation."""
    lm = facts["task"] == "lm"

    def train_ds():
        ds = read(data_dir, "train", lm).shuffle(10_000, seed=_SEED.value)
        return batched(ds, contender, lm)

    real, computed, shapes = batch_tokens(train_ds())
    model = peer_model(facts, lm, jit_compile=contender == "fixed_max_length" or "auto")
    clock = StepClock(lambda trained: exact_eval(trained, data_dir, lm))
    epochs = _EPOCHS.value
    model.fit(train_ds(), epochs=epochs, verbose=0, callbacks=[clock])
    # Each pass holds every sequence once (no peer drops a remainder), whatever its order.
    if abs(len(clock.ends) - epochs * len(real)) > epochs * len(GUIDE_BOUNDARIES):
        raise SystemExit(f"{contender}: {len(clock.ends)} steps, {len(real)} batches a pass")
    evaluating = sum(clock.eval_seconds[:-1])  # the last pass's comes after its last step
    steady = clock.ends[-1] - clock.ends[0] - evaluating
    trained = epochs * sum(real)
    return {"real_tokens_per_sec": (trained - real[0]) / steady if steady > 0 else None,
            "real_tokens_per_sec_with_first_step": trained / (
                clock.ends[-1] - clock.begin - evaluating),
            "train_seconds": steady, "first_step_seconds": clock.ends[0] - clock.begin,
            "padding_fraction": 1 - sum(real) / sum(computed), "steps": len(clock.ends),
            "real_tokens": trained, "computed_tokens": epochs * sum(computed),
            "compiled_programs": clock.traces,  # traces of Keras' train step: a program each
            "distinct_input_shapes": len(shapes),
            "eval_metrics": {k: v for k, v in clock.history[-1].items()
                             if k not in ("epoch", "train_seconds")},
            "eval_history": clock.history, "pid": os.getpid(),
            "xla": contender == "fixed_max_length",
            "tf_version": tf.__version__}


# ------------------------------------------------------------------ tfspeed (the driver)
def tfspeed_command(mode: str, data_dir: str, model_dir: str, facts: dict,
                    seed: int = 0) -> list[str]:
    """``python -m tfspeed.train`` as a user runs it: one pass, float32, the peers' model,
    optimizer and learning rate; everything else left to tfspeed's defaults (``--xla=auto``:
    on for pack, off for bucket on a CPU)."""
    return [sys.executable, "-m", "tfspeed.train", f"--data_dir={data_dir}",
            f"--model_dir={model_dir}", "--model=transformer", f"--batching={mode}",
            *([f"--tokens_per_batch={_TOKENS.value}"] if _TOKENS.value else []),
            f"--max_length={_MAX_LENGTH.value}",
            f"--batch_size={_BATCH.value}",  # the peers' sequences per batch (pad mode's B)
            f"--width={_WIDTH.value}", f"--depth={_DEPTH.value}", f"--heads={_HEADS.value}",
            f"--epochs={_EPOCHS.value}", "--eval_every_epochs=1",  # as the peers: each pass
            "--precision=float32", "--optimizer=adam",
            f"--learning_rate={_LR.value}", "--lr_schedule=constant", "--warmup_steps=0",
            f"--seed={seed}"]


def run_tfspeed(contender: str, data_dir: str, facts: dict, seed: int = 0) -> dict:
    """Runs the driver into a fresh model dir and reads its report.json."""
    model_dir = os.path.join(_WORKDIR.value, "runs", f"{os.path.basename(data_dir)}-{contender}")
    shutil.rmtree(model_dir, ignore_errors=True)
    tree = os.path.abspath(_BASE.value) if contender.startswith(BASE) else REPO
    contender = contender.removeprefix(BASE)
    command = tfspeed_command(TFSPEED[contender], data_dir, model_dir, facts, seed)
    proc = subprocess.Popen(command, cwd=tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": tree})
    _, err = proc.communicate()
    report_path = os.path.join(model_dir, "report.json")
    if proc.returncode or not os.path.exists(report_path):
        return {"failed": " ".join(command[1:]), "error": err.strip()[-1500:], "pid": proc.pid}
    with open(report_path) as f:
        report = json.load(f)
    keys = ("padding_fraction", "compiled_programs", "eval_metrics", "optimizer_updates",
            "too_few_steps", "steps_measured", "steps_excluded", "seconds_measured",
            "real_tokens_measured", "sequences_per_sec", "seconds", "steps_per_execution",
            "eval_history", "seconds_excluded", "real_tokens")
    result = {k: _find(report, k) for k in keys}
    # As the peers': the real tokens of the steps after the first call (one step, which
    # traced) over their time. The driver's own figure is a median over its log windows.
    result["driver_real_tokens_per_sec"] = _find(report, "real_tokens_per_sec")
    if result["seconds_measured"] and result["real_tokens_measured"]:
        result["real_tokens_per_sec"] = result["real_tokens_measured"] / result["seconds_measured"]
    # As the peers' first step: the driver's warm-up call (it traces; pack's also compiles),
    # and every step with it over the training loop's time, evaluations left out.
    result["first_step_seconds"] = result["seconds_excluded"]
    if result["real_tokens"] and (result["seconds"] or {}).get("fit"):
        result["real_tokens_per_sec_with_first_step"] = (result["real_tokens"]
                                                         / result["seconds"]["fit"])
    # About one pass's worth of updates (T holds ~B sequences' tokens), else not comparable:
    # the driver counts a pass as train records // --batch_size updates.
    expected = _EPOCHS.value * facts["train_tokens"] / token_budget(facts, TFSPEED[contender])
    if not 0.75 <= (result["optimizer_updates"] or 0) / expected <= 1.33:
        result["warning"] = (f"{result['optimizer_updates']} updates, about {expected:.0f} "
                             "expected for one pass")
    return {**result, "batching": _find(report, "batching"), "pid": proc.pid,
            "xla": (report.get("runtime") or {}).get("xla")}


def _find(report: dict, key: str):
    """``key`` at the report's top level or one level down (its layout is still moving)."""
    if key in report:
        return report[key]
    for value in report.values():
        if isinstance(value, dict) and key in value:
            return value[key]
    return None


# ------------------------------------------------------------------ rounds and the record
def in_process_of_its_own(contender: str, data_dir: str, facts: dict, seed: int) -> dict:
    """One contender's run in a fresh process, with ``seed`` (initialisation and shuffle);
    adds the process's wall seconds and the seed."""
    start = time.perf_counter()
    if contender.removeprefix(BASE) in TFSPEED:
        result = run_tfspeed(contender, data_dir, facts, seed)
    else:
        result = bench.run_contender([sys.executable, os.path.abspath(__file__),
                                      f"--contender={contender}", f"--data_dir={data_dir}",
                                      *_shared_flags(), f"--seed={seed}"], contender,
                                     check=False)
    return {**result, "wall_seconds": time.perf_counter() - start, "seed": seed}


def _shared_flags() -> list[str]:
    return [f"--{f.name}={f.value}" for f in (_WORKDIR, _ITEMS, _BATCH, _MAX_LENGTH, _WIDTH,
                                              _DEPTH, _HEADS, _LR, _EPOCHS)]


def summary(values: list) -> dict | None:
    values = [v for v in values if isinstance(v, int | float)]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def eval_metric(result: dict, name: str):
    """``name`` from the run's eval metrics; perplexity is exp(loss per real token) where
    only the (exact, per-token) loss is reported."""
    metrics = result.get("eval_metrics") or {}
    value = metrics.get(name, metrics.get(f"eval_{name}"))
    if value is None and name == "perplexity" and metrics.get("loss") is not None:
        value = math.exp(metrics["loss"])
    return value


FIGURES = ("real_tokens_per_sec", "real_tokens_per_sec_with_first_step", "first_step_seconds",
           "padding_fraction", "wall_seconds", "compiled_programs")


def usable(rounds: list[dict]) -> list[dict]:
    """The comparable rounds: not failed, and the passes asked for trained."""
    return [r for r in rounds if "failed" not in r and "warning" not in r]


def summarise(rounds: list[dict], lm: bool, target: dict | None = None) -> dict:
    """Every round, and the median with min-max of each figure over the comparable rounds;
    the metric after each pass; with a ``target``, time-to-target (rounds that never reach
    it count as infinitely slow: a median that is inf reads None, ``reached`` says how many
    did)."""
    kept = usable(rounds)
    out = {"rounds": rounds, "failed_rounds": sum("failed" in r for r in rounds),
           "rounds_left_out": len(rounds) - len(kept)}
    for figure in FIGURES:
        out[figure] = summary([r.get(figure) for r in kept])
    for metric in ("loss", "perplexity") if lm else ("accuracy", "loss"):
        out[f"eval_{metric}"] = summary([eval_metric(r, metric) for r in kept])
    metric = "loss" if lm else "accuracy"
    passes = max((len(r.get("eval_history") or []) for r in kept), default=0)
    out[f"eval_{metric}_by_pass"] = [summary([r["eval_history"][i][metric] for r in kept
                                              if len(r.get("eval_history") or []) > i])
                                     for i in range(passes)]
    if target and kept:
        out["seconds_to_target"] = bench.seconds_to_target(
            target, [r.get("eval_history") for r in kept])
    return out


def ratios_of(figures: dict) -> dict:
    """Medians of real tokens/s: each tfspeed mode / the guide, best tfspeed / best peer;
    after the first step, and over the whole pass with it (where tfspeed ran too few steps
    to leave its warm-up out, only the latter)."""
    ratios = {}
    for figure, suffix in (("real_tokens_per_sec", ""),
                           ("real_tokens_per_sec_with_first_step", ", with first step")):
        median = {c: (f[figure] or {}).get("median") for c, f in figures.items()}
        guide = median.get("guide_padded_batch")
        for name in TFSPEED:
            if median.get(name) and guide:
                ratios[f"{name}/guide_padded_batch{suffix}"] = median[name] / guide
        peers = [median[c] for c in PEERS if median.get(c)]
        ours = [median[c] for c in ("tfspeed_bucket", "tfspeed_pack") if median.get(c)]
        if peers and ours:
            ratios[f"best_tfspeed/best_peer{suffix}"] = max(ours) / max(peers)
        for name in TFSPEED:  # this checkout against --base's, mode by mode
            if median.get(name) and median.get(BASE + name):
                ratios[f"{name}/{BASE}{name}{suffix}"] = median[name] / median[BASE + name]
        if ours and median.get("tfspeed_auto"):  # auto against the faster of its choices
            ratios[f"tfspeed_auto/faster_of_bucket_and_pack{suffix}"] = (
                median["tfspeed_auto"] / max(ours))
    # Time-to-target: the best peer's seconds over the best tfspeed mode's (> 1: tfspeed
    # reaches the peer's one-pass figure sooner), None where a median never reached it.
    seconds = {c: (f.get("seconds_to_target") or {}).get("median") for c, f in figures.items()}
    peers = [seconds[c] for c in PEERS if c in seconds]
    ours = [seconds[c] for c in ("tfspeed_bucket", "tfspeed_pack") if c in seconds]
    if peers and ours:
        best = min((t for t in peers if t), default=None)
        mine = min((t for t in ours if t), default=None)
        ratios["time_to_target: best_peer/best_tfspeed"] = (best / mine if best and mine
                                                            else None)
        if "tfspeed_auto" in seconds:
            auto = seconds["tfspeed_auto"]
            ratios["time_to_target: best_peer/tfspeed_auto"] = (best / auto if best and auto
                                                                else None)
    return ratios


def run_rounds(datasets: dict, contenders: list[str], save) -> dict:
    """``--rounds`` rounds; in round r the contenders' order is rotated by r and every
    contender runs with seed ``--seed + r``: accuracy after a pass swings with the seed (one
    pass of tfspeed's bucket on pydocs: 0.655-0.715 over three seeds), so one seed for all rounds
    would give the peers' target no spread. ``save(results, complete)`` is called after
    every contender's run, so that a run cut short keeps its rounds."""
    results = {d: {c: [] for c in contenders} for d in datasets}
    for r in range(_ROUNDS.value):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for name, (data_dir, facts) in datasets.items():
            for contender in order:
                result = in_process_of_its_own(contender, data_dir, facts, _SEED.value + r)
                results[name][contender].append({"round": r, **result})
                print(f"round {r} {name} {contender}: "
                      f"{result.get('real_tokens_per_sec') or result.get('error', '')[-300:]}",
                      file=sys.stderr, flush=True)
                save(results, complete=False)
    save(results, complete=True)
    return results


def main(argv):
    del argv
    if _CONTENDER.value:  # one peer, in a process of its own
        _, facts = prepare(os.path.basename(_DATA_DIR.value).split("-items")[0])
        print(bench.RESULT + json.dumps(run_peer(_CONTENDER.value, _DATA_DIR.value, facts)))
        return
    contenders = _CONTENDERS.value or list(CONTENDERS)
    if _BASE.value and not os.path.isdir(os.path.join(_BASE.value, "tfspeed")):
        raise app.UsageError("--base must be a checkout of tfspeed (a folder holding tfspeed/)")
    unknown = [c for c in contenders if c not in CONTENDERS and not (
        _BASE.value and c.removeprefix(BASE) in TFSPEED)]
    if unknown:
        raise app.UsageError(f"--contenders: unknown {unknown}; known: {list(CONTENDERS)}"
                             + (f" and {BASE}<tfspeed contender>" if _BASE.value else ""))
    datasets = {name: prepare(name) for name in _DATASETS.value}
    name = f"sequences-{datetime.date.today().isoformat()}{'-' + _TAG.value if _TAG.value else ''}"
    path = os.path.join(_RESULTS.value, name + ".json") if _RESULTS.value else None

    def save(results: dict, complete: bool) -> None:
        text = json.dumps(make_record(datasets, contenders, results, complete), indent=2)
        if complete:
            print(text)
        if path:
            os.makedirs(_RESULTS.value, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                f.write(text + "\n")
            os.replace(path + ".tmp", path)

    run_rounds(datasets, contenders, save)


def make_record(datasets: dict, contenders: list[str], results: dict, complete: bool) -> dict:
    """The record of the rounds run so far (``complete`` once every round has run)."""
    lm = {name: facts["task"] == "lm" for name, (_, facts) in datasets.items()}
    targets = {name: bench.accuracy_target({c: usable(per.get(c, [])) for c in PEERS},
                                           "loss" if lm[name] else "accuracy")
               for name, per in results.items()}
    figures = {name: {c: summarise(rounds, lm[name], targets[name])
                      for c, rounds in per.items()} for name, per in results.items()}
    ratios = {name: ratios_of(per) for name, per in figures.items()}
    config = {
        "complete": complete,
        "datasets": {name: {**facts, "tokens_per_batch": {m: token_budget(facts, m) for m in (
            "bucket", "pack")}}
                     for name, (_, facts) in datasets.items()},
        "why_pydoc_lm": "pydoc_data.topics ships with every CPython: human-written English "
                        "prose (the language reference), short paragraphs, nothing to download; "
                        "it complements pystdlib (code, long texts) and exercises the lm task",
        "why_pydocs": "short human-written texts (docstrings, median under 40 tokens) that a "
                      "user's own corpus resembles: the case where packing into rows as long "
                      "as the longest text costs attention that padding figures do not show",
        "contenders": contenders, "rounds": _ROUNDS.value, "batch_size": _BATCH.value,
        **({"base": {"path": _BASE.value, "commit": bench.commit(_BASE.value),
                     "head": bench.commit(REPO)}} if _BASE.value else {}),
        "max_length": _MAX_LENGTH.value, "model": {"width": _WIDTH.value, "depth": _DEPTH.value,
                                                   "heads": _HEADS.value},
        "precision": "float32 for every contender (the comparison is of batching)",
        "optimizer": f"adam, constant learning rate {_LR.value}", "passes": _EPOCHS.value,
        "guide_boundaries": list(GUIDE_BOUNDARIES),
        "targets": targets,
        "time_to_target": "training seconds (evaluations left out; the first step's trace and "
                          "compile in) until the first evaluation after a pass reaches the "
                          "target: what the best stock peer reaches after one pass (accuracy, "
                          "or lm loss per real token). tfspeed's token batches make fewer, "
                          "larger updates per pass than B sequences do; this counts what that "
                          "costs in accuracy, which tokens/s alone does not",
        "timing": "real_tokens_per_sec: real (non-padding) tokens trained on after the first "
                  "step / the time after it (tfspeed: its driver's first call is that one "
                  "step; the rest is in its report's measured windows); *_with_first_step: "
                  "every pass with the first step's trace (tfspeed: its warm-up call, "
                  "pack's XLA compile included; the loop's time), evaluations left out; "
                  "wall_seconds: the whole process (start-up, evaluations included)",
        "tfspeed_command": " ".join(tfspeed_command("MODE", "DATA", "RUN", next(iter(
            datasets.values()))[1])[1:]),
    }
    return bench.record("sequences", config, figures, ratios)


if __name__ == "__main__":
    app.run(main)
