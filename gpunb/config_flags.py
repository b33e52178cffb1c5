"""TrainConfig's fields as command-line flags: the options of `%%gputrain` and of an exported script.

Every field that a command line can hold is a flag, made from the field itself: its name
(`max_steps` -> `--max-steps`), the kind of value from its annotation, its help and section
from `config.setting(...)`. Nothing else lists them: a new field is a new flag. RENAMED holds
the few flags spelt otherwise (the field's own spelling works too). Fields of functions or
objects (`transforms`, `batch_size_fn`) are set in Python, not on a command line; `slurm`, a
mapping, comes from the magic's own --partition, --time, ... and --slurm KEY=VALUE.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from gpunb.config import TrainConfig, make_config

# Flags shorter than their field's name, kept from the magic's first options.
RENAMED = {
    "clip_grad_norm": "--clip",
    "loggers": "--log",
    "activation_checkpointing": "--checkpointing",
}
_YES, _NO = ("true", "on", "yes"), ("false", "off", "no")


@dataclasses.dataclass(frozen=True)
class Flag:
    field: str  # the TrainConfig field it sets
    spellings: tuple  # the option strings, the one shown first
    kind: str  # "switch", "int", "float", "text", "int-or-text" or "switch-or-text"
    help: str
    section: str


def config_flags(config_class: type = TrainConfig) -> list[Flag]:
    """One Flag per field a command line can hold, in the fields' order."""
    hints = typing.get_type_hints(config_class)
    flags, section = [], "options"
    for field in dataclasses.fields(config_class):
        section = field.metadata.get("section") or section
        kind = _kind(hints[field.name])
        if kind is None:
            continue  # functions, objects: set in Python
        spellings = tuple(dict.fromkeys((flag_of(field.name), "--" + field.name.replace("_", "-"))))
        flags.append(Flag(field.name, spellings, kind, _help(field, kind), section))
    return flags


def add_config_flags(parser, config_class: type = TrainConfig) -> None:
    """Add every field's flag to `parser` (an argparse parser), one group per section.

    Each flag's default is None: a flag not given leaves the field at its default."""
    groups = {}
    for flag in config_flags(config_class):
        if flag.section not in groups:
            groups[flag.section] = parser.add_argument_group(f"{flag.section} (TrainConfig)")
        groups[flag.section].add_argument(*flag.spellings, dest=flag.field, default=None, help=flag.help,
                                          **_argparse_kind(flag.kind))


def config_values(args, config_class: type = TrainConfig) -> dict:
    """The fields the parsed `args` set, as TrainConfig takes them ("8" -> 8, "off" -> False)."""
    values = {}
    for flag in config_flags(config_class):
        value = getattr(args, flag.field, None)
        if value is not None:
            values[flag.field] = _convert(value, flag.kind)
    return values


def parse_config(argv, config: TrainConfig | None = None, prog: str | None = None) -> TrainConfig:
    """`config` (default: TrainConfig()) with the flags in `argv` applied: what an exported script
    does with its command line (`torchrun ... train.py --epochs 5`). `--help` lists the flags."""
    base = config or TrainConfig()
    parser = argparse.ArgumentParser(prog=prog, allow_abbrev=False,
                                     description="Train with the exported settings; each option overrides one.")
    add_config_flags(parser, type(base))
    return make_config(base, **config_values(parser.parse_args(argv), type(base)))


def flag_of(field: str) -> str:
    """The flag a field is given with on a command line."""
    return RENAMED.get(field, "--" + field.replace("_", "-"))


def as_flag_hints(message: str, config_class: type = TrainConfig) -> str:
    """A config error speaks of `field=value`; on a command line the fix is `--flag value` (a switch:
    `--flag` or `--no-flag`). A field with no flag, or a hint naming several settings in one
    code span, is left as it is."""
    flags = {flag.field: flag for flag in config_flags(config_class)}

    def flag(match):
        name, value = match.group(1), match.group(2).strip("'\"")
        if name not in flags:
            return match.group(0)
        spelling = flags[name].spellings[0]
        if flags[name].kind == "switch" and value in ("True", "False"):
            return f"`{spelling if value == 'True' else '--no-' + spelling[2:]}`"
        return f"`{spelling} {value}`"

    # one value a span: quoted (it may hold commas), or up to a space or comma
    return re.sub(r"`(\w+)=('[^'`]*'|\"[^\"`]*\"|[^`,\s]+)`", flag, message)


def _kind(hint) -> str | None:
    """What a field's annotation lets a command line give: None for functions and objects."""
    options = set(typing.get_args(hint)) or {hint}
    options.discard(type(None))
    if options == {bool}:
        return "switch"
    if options <= {int, float}:
        return "float" if float in options else "int"
    if str not in options:
        return None
    if bool in options:
        return "switch-or-text"  # compile, gpu_resident, resume: `--compile` alone means on
    if int in options:
        return "int-or-text"  # batch_size, devices, log_every, num_workers: 64 or "auto"
    return "text"  # loggers too: "csv,tensorboard"


def _argparse_kind(kind: str) -> dict:
    if kind == "switch":
        return {"action": argparse.BooleanOptionalAction}
    if kind == "switch-or-text":
        return {"nargs": "?", "const": "on"}
    if kind in ("int", "float"):
        return {"type": int if kind == "int" else float}
    return {}


def _convert(value, kind: str):
    if kind == "int-or-text" and value.strip().lstrip("-").isdigit():
        return int(value)
    if kind == "switch-or-text" and value.strip().lower() in _YES + _NO:
        return value.strip().lower() in _YES
    return value


def _help(field, kind: str) -> str:
    text = field.metadata.get("help", "")
    default = field.default
    if kind == "switch":
        text += f" (default: {'on' if default else 'off'})"
    elif default not in (None, dataclasses.MISSING, ()):
        text += f" (default: {default})"
    return text.replace("%", "%%")  # argparse formats help with %
