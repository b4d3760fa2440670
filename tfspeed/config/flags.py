"""The command line's flags, defined from the config dataclasses, and their conversion into a
validated ``Config``.

Each field of ``DataConfig``, ``ModelConfig``, ``RuntimeConfig`` and ``TrainConfig`` (and
``Config.model_dir``) is one flag, with the field's default, help text and allowed values:
the dataclasses are the only place a default is written. Library code never reads flags:
``to_config()`` is the only bridge.
"""

from __future__ import annotations

import dataclasses
import os
import sys

from absl import flags

from tfspeed.config import AUTO, SECTIONS, Config, flag_name
from tfspeed.errors import UsageError


def _define(field: dataclasses.Field) -> flags.FlagHolder:
    """One absl flag for one config field, chosen by the field's type."""
    name, default = flag_name(field), field.default
    help_text, choices = field.metadata["help"], field.metadata.get("choices")
    kind = str(field.type)
    if kind == "bool":
        return flags.DEFINE_boolean(name, default, help_text)
    if kind == "int":
        return flags.DEFINE_integer(name, default, help_text)
    if kind == "float":
        return flags.DEFINE_float(name, default, help_text)
    if kind.startswith("tuple["):
        return flags.DEFINE_list(name, [str(v) for v in default], help_text)
    if kind == "str" and choices:
        return flags.DEFINE_enum(name, default, list(choices), help_text)
    return flags.DEFINE_string(name, str(default), help_text)  # str, and int | Auto


_FLAGS = {section: {field.name: _define(field) for field in dataclasses.fields(cls)}
          for section, cls in SECTIONS.items()}
_MODEL_DIR = _define(next(f for f in dataclasses.fields(Config) if f.name == "model_dir"))


def help_groups() -> dict[str, list[flags.FlagHolder]]:
    """The experiment's flags by concern, as ``--help`` lists them (``tfspeed.util.cli``)."""
    groups = {section: list(holders.values()) for section, holders in _FLAGS.items()}
    groups["train"].append(_MODEL_DIR)
    return groups


def parse(argv: list[str]) -> list[str]:
    """Parses ``argv`` into the flags; a flag error becomes one line and exit status 2."""
    try:
        _check_flagfile_loops(argv)
        return flags.FLAGS(argv)
    except flags.Error as e:
        message = " ".join(str(e).split())
        print(f"error: {message} (see --helpfull)", file=sys.stderr)
        sys.exit(2)


def _check_flagfile_loops(argv: list[str], chain: tuple[str, ...] = ()) -> None:
    """absl only warns about a flagfile that includes itself (and goes on without it)."""
    for arg in argv:
        if not arg.startswith("--flagfile="):
            continue
        path = os.path.abspath(arg.split("=", 1)[1])
        if path in chain:
            loop = " -> ".join(os.path.relpath(p) for p in (*chain, path))
            raise flags.Error(f"flagfile loop {loop}: remove one of these --flagfile lines")
        try:
            with open(path) as f:
                nested = [line.strip() for line in f]
        except OSError:
            continue  # absl reports the unreadable file itself
        _check_flagfile_loops(nested, (*chain, path))


def to_config() -> Config:
    """Builds and validates the experiment config from the parsed flags."""
    if not _FLAGS["data"]["data_dir"].value:
        raise UsageError("--data_dir is required: a directory made by scripts/to_tfrecord.py")
    if not _MODEL_DIR.value:
        raise UsageError("--model_dir is required: where logs, checkpoints and report.json go")
    sections = {
        section: cls(**{field.name: _value(field, _FLAGS[section][field.name].value)
                        for field in dataclasses.fields(cls)})
        for section, cls in SECTIONS.items()}
    return Config(**sections, model_dir=_MODEL_DIR.value).validate()


def _value(field: dataclasses.Field, value):
    """A flag's value as the field holds it: tuples for lists, ``AUTO`` or an int for the
    settings that may be ``auto``."""
    kind = str(field.type)
    if kind == "tuple[int, ...]":
        try:
            return tuple(int(v) for v in value)
        except ValueError:
            raise UsageError(f"--{flag_name(field)}={','.join(value)} must be integers, "
                             "e.g. 10,20") from None
    if kind.startswith("tuple["):
        return tuple(value)
    if "Auto" in kind:
        if value == AUTO:
            return AUTO
        try:
            return int(value)
        except ValueError:
            raise UsageError(f"--{flag_name(field)}={value!r} must be a number or 'auto'"
                             ) from None
    return value
