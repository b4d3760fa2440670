"""The converter's command line: converts a dataset into TFRecord shards plus ``schema.json``.

  python scripts/to_tfrecord.py --source=digits --output=data/digits
  python scripts/to_tfrecord.py --source=imagefolder:/data/photos --output=/data/tfr --image_size=224
  python scripts/to_tfrecord.py --source=imagefolder:/data/photos --output=/data/tfr --runner=beam \
      --beam_options="--direct_num_workers=8 --direct_running_mode=multi_processing"
  python scripts/to_tfrecord.py --source=pystdlib --output=data/pystdlib --tokenizer=bpe:8000 \
      --max_length=512 --long=split
  python scripts/to_tfrecord.py --source=textfolder:/data/reviews --output=/data/tfr \
      --tokenizer=/models/tokenizer.json
  python scripts/to_tfrecord.py --source=jsonl:/data/docs.jsonl --output=/data/lm --task=lm

Sources: imagefolder:PATH, csv:PATH, npz:PATH, tfds:NAME (prepared in --tfds_data_dir), digits.
Text sources: textfolder:PATH (PATH/[<split>/]<class>/<one text per file>), jsonl:PATH
(--text_field, --label_field), csv:PATH with --text_column, pystdlib[:PACKAGES] (Python's
standard library source, one text per top-level function or class, its package the class: a
real corpus that needs no download) and pydocstrings[:PACKAGES] (the same packages' docstrings,
one short text per documented function, class or method). Texts are tokenised once, here, by the worker processes;
records hold `tokens` (int64 ids, any length) and `label`, or only `tokens` with --task=lm
(between bos and eos). A file that is not UTF-8 is decoded with --encoding, or by default with
the charset detected; schema.json and the summary count the texts each charset decoded. Binary
files and empty texts are skipped and counted; so are texts over --max_length with --long=skip.
Rerunning an interrupted command resumes it; rerunning a finished one returns at once.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from absl import flags, logging

from tfspeed.config import LONG_POLICIES
from tfspeed.convert import runners, sources
from tfspeed.convert.converter import ConvertResult, convert
from tfspeed.errors import UsageError, exit_on_usage_error

_FLAGS = flags.FlagValues()  # our own: importing convert() must not add flags to a trainer's
_SOURCE = flags.DEFINE_string(
    "source", None, f"What to convert: {', '.join(sources.KINDS)}.", flag_values=_FLAGS
)
_OUTPUT = flags.DEFINE_string(
    "output", None, "Output directory for the shards and schema.json.", flag_values=_FLAGS
)
_SHARDS = flags.DEFINE_integer(
    "shards",
    0,
    "Shards of the train split (others proportionally); 0 = automatic: 16, or about "
    "--target_shard_mb each, whichever gives more.",
    flag_values=_FLAGS,
)
_TARGET_SHARD_MB = flags.DEFINE_float(
    "target_shard_mb", 128.0, "Shard size aimed at when --shards=0.", flag_values=_FLAGS
)
_VALIDATION_FRACTION = flags.DEFINE_float(
    "validation_fraction",
    0.1,
    "Share held out as validation when the source has no splits; 0 = train only.",
    flag_values=_FLAGS,
)
_SEED = flags.DEFINE_integer("seed", 0, "Seeds the split and the record order.", flag_values=_FLAGS)
_WORKERS = flags.DEFINE_integer(
    "workers",
    None,
    "Processes writing shards with --runner=local (default: the CPUs available).",
    flag_values=_FLAGS,
)
_RUNNER = flags.DEFINE_enum(
    "runner",
    "local",
    list(runners.RUNNERS),
    "Who writes the shards: local (this machine) or beam (an Apache Beam pipeline; "
    f"{runners.BEAM_INSTALL}). Same output bytes.",
    flag_values=_FLAGS,
)
_BEAM_OPTIONS = flags.DEFINE_string(
    "beam_options",
    "",
    "Beam pipeline options for --runner=beam, one quoted string, e.g. "
    '"--direct_num_workers=2 --direct_running_mode=multi_processing" or '
    '"--runner=FlinkRunner --flink_master=host:8081".',
    flag_values=_FLAGS,
)
_IMAGE_SIZE = flags.DEFINE_integer(
    "image_size",
    0,
    "Store images ready for N x N training: the pixels tf.image.resize(decode_jpeg(...), "
    "[N, N]) gives (bilinear, aspect squashed); 0 = keep the sizes.",
    flag_values=_FLAGS,
)
_IMAGE_MAX_SIDE = flags.DEFINE_integer(
    "image_max_side",
    0,
    "Shrink images so the long side is at most this, aspect kept (for random-resized "
    "crops); 0 = keep. Not with --image_size.",
    flag_values=_FLAGS,
)
_IMAGE_FORMAT = flags.DEFINE_enum(
    "image_format",
    "auto",
    ["auto", *sources.FORMATS],
    "How images are stored: raw (uint8 pixels; needs one image size), jpeg (quality "
    f"{sources.JPEG_QUALITY}), png, or auto: raw where reading it is measured faster than "
    "decoding JPEG and it fits --raw_budget_mb, else jpeg.",
    flag_values=_FLAGS,
)
_RAW_BUDGET_MB = flags.DEFINE_float(
    "raw_budget_mb",
    None,
    "Largest dataset (MB, stored raw) that --image_format=auto stores raw "
    "(default: a quarter of this machine's RAM, so it stays in the page cache).",
    flag_values=_FLAGS,
)
_TASK = flags.DEFINE_enum(
    "task", "classification", ["classification", "regression", "lm"],
    "csv/npz: the labels are classes, or numbers to predict (regression; stored as float). "
    "Text: classification (when there are labels) or lm (causal language modelling: records "
    "hold only tokens, bos and eos added).",
    flag_values=_FLAGS)
_TEXT = sources.TextOptions()  # the text flags' defaults
_TOKENIZER = flags.DEFINE_string(
    "tokenizer", _TEXT.tokenizer, "Text: bpe:N trains a byte-level BPE of N ids (<pad>=0, <unk>, "
    "<bos>, <eos>) on the train split; or the path of a tokenizer.json (HF tokenizers) or a "
    "SentencePiece .model. Saved beside schema.json.", flag_values=_FLAGS)
_MAX_LENGTH = flags.DEFINE_integer(
    "max_length", _TEXT.max_length, "Text: the most tokens per record (bos/eos included), >= 2; "
    "0 = no limit.", flag_values=_FLAGS)
_LONG = flags.DEFINE_enum(
    "long", _TEXT.long, list(LONG_POLICIES), "Text: a text over --max_length is cut "
    "(truncate), made into several records (split) or skipped; each counted.", flag_values=_FLAGS)
_TEXT_FIELD = flags.DEFINE_string(
    "text_field", _TEXT.text_field, "jsonl: the field holding the text.", flag_values=_FLAGS)
_LABEL_FIELD = flags.DEFINE_string(
    "label_field", _TEXT.label_field, "jsonl: the field holding the label; default: 'label' "
    "where every line has one, else none (a language model; the summary says which).",
    flag_values=_FLAGS)
_TEXT_COLUMN = flags.DEFINE_string(
    "text_column", _TEXT.text_column, "csv: the column holding a text to tokenise (the label "
    "column as --label_column; no other columns: text records hold tokens and a label).",
    flag_values=_FLAGS)
_MAX_ITEMS = flags.DEFINE_integer(
    "max_items", _TEXT.max_items, "Text: convert only this many items (a seeded sample, e.g. "
    "for a quick run); 0 = all.", flag_values=_FLAGS)
_ENCODING = flags.DEFINE_string(
    "encoding", _TEXT.encoding, "Text files (textfolder, jsonl, csv) that are not UTF-8: their "
    "charset (a Python codec name: latin-1, cp1252, utf-16...), or auto: detect each file's "
    "(charset-normalizer). UTF-8 files are read as UTF-8 either way.", flag_values=_FLAGS)
_NAMED_COLUMNS = flags.DEFINE_bool(
    "named_columns", False, "csv: each feature column is a named model input of shape (1,), "
    "instead of one vector 'features'.", flag_values=_FLAGS)
_LABEL_COLUMN = flags.DEFINE_string(
    "label_column", "label", "CSV column holding the labels.", flag_values=_FLAGS
)
_TFDS_DATA_DIR = flags.DEFINE_string(
    "tfds_data_dir", None, "Where the tfds: dataset is prepared.", flag_values=_FLAGS
)
_OVERWRITE = flags.DEFINE_bool(
    "overwrite", False, "Replace another dataset's shards in --output.", flag_values=_FLAGS
)
_PROGRESS = flags.DEFINE_bool(
    "progress", True, "Show a progress bar on a terminal.", flag_values=_FLAGS
)


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: returns the exit status (2 and one ``error:`` line for a usage error)."""
    return exit_on_usage_error(lambda: _main(list(sys.argv if argv is None else argv)))


def run(argv: Sequence[str] | None = None) -> None:
    """CLI entry point (``tfspeed.util.cli.convert_main`` wraps it with a quiet TF import)."""
    sys.exit(main(argv))


def _main(argv: list[str]) -> int:
    if any(arg in ("-h", "-help", "--help", "--helpfull") for arg in argv[1:]):
        print(f"{__doc__}\nflags:\n{_FLAGS.get_help()}")
        return 0
    _parse(argv)
    _log_to_stderr()
    result = convert(
        _SOURCE.value,
        _OUTPUT.value,
        shards=_SHARDS.value,
        target_shard_mb=_TARGET_SHARD_MB.value,
        validation_fraction=_VALIDATION_FRACTION.value,
        seed=_SEED.value,
        workers=_WORKERS.value,
        runner=_RUNNER.value,
        beam_options=_BEAM_OPTIONS.value,
        image_size=_IMAGE_SIZE.value,
        image_max_side=_IMAGE_MAX_SIDE.value,
        image_format=_IMAGE_FORMAT.value,
        raw_budget_mb=_RAW_BUDGET_MB.value,
        label_column=_LABEL_COLUMN.value,
        task=_TASK.value,
        named_columns=_NAMED_COLUMNS.value,
        text=sources.TextOptions(
            tokenizer=_TOKENIZER.value,
            max_length=_MAX_LENGTH.value,
            long=_LONG.value,
            text_field=_TEXT_FIELD.value,
            label_field=_LABEL_FIELD.value,
            text_column=_TEXT_COLUMN.value,
            max_items=_MAX_ITEMS.value,
            encoding=_ENCODING.value,
        ),
        tfds_data_dir=_TFDS_DATA_DIR.value,
        overwrite=_OVERWRITE.value,
        progress=_PROGRESS.value,
    )
    print(summary_line(result))
    return 0


def _parse(argv: list[str]) -> None:
    """Parses the flags; every problem is a UsageError (one line, exit status 2)."""
    _FLAGS.unparse_flags()  # run() may be called more than once in a process (tests)
    try:
        rest = _FLAGS(argv)
    except flags.Error as e:
        raise UsageError(f"{e}; see --help") from None
    if len(rest) > 1:
        raise UsageError(f"unexpected argument {rest[1]!r}; options are --flags, see --help")
    if _SOURCE.value is None:
        raise UsageError(f"--source is required: one of {', '.join(sources.KINDS)}")
    if _OUTPUT.value is None:
        raise UsageError("--output is required: the directory to write the shards into")
    if _RUNNER.value == "beam" and _WORKERS.present:
        raise UsageError(
            "--workers is for --runner=local; with --runner=beam set Beam's parallelism in "
            '--beam_options, e.g. "--direct_num_workers=4 --direct_running_mode=multi_processing"'
        )


def _log_to_stderr() -> None:
    """absl's log format on the current sys.stderr, as absl.app.run would set up.

    app.run itself can run only once per process, and run() is called many times in tests.
    """
    if not flags.FLAGS.is_parsed():  # else whoever parsed the global flags owns logging
        flags.FLAGS.mark_as_parsed()
        flags.FLAGS.logtostderr = True  # follow sys.stderr even when it is replaced
    logging.use_absl_handler()
    logging.set_verbosity(logging.WARNING)  # TFDS' INFO chatter is not for this tool's users


def summary_line(result: ConvertResult) -> str:
    """One line for humans: records, speed, bytes, shards per split, skipped items; for text
    the tokens, the long-text events and the task (with how to choose the other)."""
    s, schema = result.summary, result.schema
    if result.already_converted:
        return (
            f"already converted: {result.output} holds {schema.source} ({s['records']} records, "
            f"fingerprint {schema.fingerprint[:12]}); nothing to do"
        )
    splits = ", ".join(
        f"{name} {split.num_records} in {len(split.shards)} shard"
        f"{'s' if len(split.shards) != 1 else ''}"
        for name, split in schema.splits.items()
    )
    resumed = (
        f"; kept {s['resumed_shards']} shards of an earlier run" if s["resumed_shards"] else ""
    )
    return (
        f"converted {schema.source} into {result.output}: {s['records']} records ({splits}), "
        f"{s['bytes'] / 1e6:.1f} MB, {s['skipped']} skipped, {s['seconds']:.1f} s "
        f"({s['records_per_sec']:.0f} records/s){_text_counts(s)}{resumed}{_task(schema)}"
    )


def _text_counts(summary: dict) -> str:
    """The token count, long-text events and the texts each charset decoded (where texts
    were read from bytes) of a text conversion, for the summary line."""
    t = summary.get("text")
    if not t:
        return ""
    decoded = ", ".join(f"{name} {n}" for name, n in t.get("charsets", {}).items())
    return (f"; {t['tokens']} tokens, {t['truncated']} truncated, {t['split_into']} split, "
            f"{t['skipped_long']} skipped as too long{f'; decoded: {decoded}' if decoded else ''}")


def _task(schema) -> str:
    """A text conversion's task, from what it was chosen and how to choose the other."""
    note = (schema.text or {}).get("task_note")
    return f"; task: {note}" if note else ""


def convert_main() -> None:
    """``tfspeed-convert`` / ``scripts/to_tfrecord.py``: the converter's CLI.

    It starts without TensorFlow (seconds and memory saved): shards are written without it,
    and only a ``tfds:`` source imports it, quietly, when opened.
    """
    # The converter does no TF math: a TFDS worker that imports TF then starts without the
    # oneDNN banner on stderr. The caller's settings win.
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from tfspeed.runtime import hostmem

    hostmem.apply()  # again: oneDNN off means malloc unless the pool is asked for
    run()
