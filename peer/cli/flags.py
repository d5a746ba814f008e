"""Command-line flags generated from the pydantic models that declare the settings.

A field becomes `--<field name>`: its type, choices (a Literal, or the field's `choices`), list
(nargs), bool (store_true; a field that is on by default also gets its `negative` flag) and help
(the description and the model's default) all come from the model. A flag's argparse default is
SUPPRESS: an absent flag stays absent from the parsed namespace, so the model's default, or a config
file's or an environment variable's value, fills it (peer/config/peer_config.py). `HelpParser`, the
parser of `pathswarm` and of every subcommand, shows the default of a flag written by hand alike.
"""

from __future__ import annotations

import argparse
import copy
import types
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    names: typing.Iterable[str] | None = None,
    *,
    required: bool = False,
) -> None:
    """One flag per field of `model` (or per field in `names`). `required`: a field without a default
    is a required flag (for `peer` it is not: a config file or the environment may give it)."""
    wanted = model.model_fields if names is None else {n: model.model_fields[n] for n in names}
    for name, field in wanted.items():
        _add_flag(parser, name, field, required)


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def _add_flag(parser, name: str, field: FieldInfo, required: bool) -> None:
    if not field.description:
        raise TypeError(f"--{name} has no description: give its field one (Field(description=...))")
    kind = _unwrap_optional(field.annotation)
    common: dict[str, Any] = dict(dest=name, default=argparse.SUPPRESS, help=help_text(field, required))
    if kind is bool:
        parser.add_argument(f"--{name}", action="store_true", **common)
        if field.get_default() is True:
            negative = _extra(field).get("negative", f"no_{name}")
            off_help = _extra(field).get("negative_help", f"turn --{name} off")
            parser.add_argument(
                f"--{negative}",
                action="store_false",
                **{**common, "help": _escape(f"{off_help} (default: --{name}, on)")},
            )
        return
    if required and field.is_required():
        common["required"] = True
    nargs = None
    if typing.get_origin(kind) is list:
        nargs, kind = "*", typing.get_args(kind)[0]
    choices = _extra(field).get("choices")
    if typing.get_origin(kind) is Literal:
        choices = typing.get_args(kind)
        kind = type(choices[0])
    if kind not in (str, int, float, Path):
        raise TypeError(f"--{name}: no flag for a field of type {field.annotation}")
    parser.add_argument(f"--{name}", type=kind, nargs=nargs, choices=choices, **common)


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return annotation


def help_text(field: FieldInfo, required: bool = True) -> str:
    """The field's description and its default, as `--help` shows them. `required`: a field without a
    default must be given as a flag (else the config file or the environment may give it)."""
    if field.is_required():
        where = "" if required else ": here, in --config or in the environment"
        return _escape(f"{field.description} (required{where})")
    default = field.get_default(call_default_factory=True)
    if default is None and "unset:" in (field.description or ""):
        return _escape(field.description or "")  # it says what unset means
    return _escape(f"{field.description} (default: {show_default(default)})")


def show_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value) if value else "none"
    return str(value)


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def given(args: argparse.Namespace, model: type[BaseModel]) -> dict[str, Any]:
    """The values of `model`'s fields that the command line gave."""
    return {name: value for name, value in vars(args).items() if name in model.model_fields}


def flag_or_default(args: argparse.Namespace, model: type[BaseModel], name: str) -> Any:
    """A flag's value, else the model's default for it."""
    if hasattr(args, name):
        return getattr(args, name)
    return model.model_fields[name].get_default(call_default_factory=True)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's default in --help. A flag generated from a model says its own (its argparse
    default is SUPPRESS); a flag written by hand gets "(default: X)", or "(required)", unless its help
    already says what its default is."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.option_strings and action.help is not argparse.SUPPRESS:
            action = copy.copy(action)  # argparse prints no help line, hence no default, for no help
            action.help = self._with_default(action)
        return super()._format_action(action)

    @staticmethod
    def _with_default(action: argparse.Action) -> str:
        text = (action.help or "").strip()
        if action.default is argparse.SUPPRESS or "default" in text:
            return text
        if action.required:
            return f"{text} (required)".strip()
        if action.default is None and "unset" in text:
            return text  # it says what unset means
        return f"{text} (default: {_escape(show_default(action.default))})".strip()


class HelpParser(argparse.ArgumentParser):
    """An ArgumentParser whose --help shows defaults; its subparsers are HelpParsers too (argparse
    makes a subparser of the parser's own class)."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
