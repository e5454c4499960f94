"""Typed configuration: dataclasses are the single source of the command line.

Each component owns a dataclass whose fields carry a one-line help text (`opt(...)`). A CLI composes them into
one top-level dataclass; `build_parser` turns every leaf field into a flat `--field_name` flag (the OpenRLHF
names users copy from recipes), one argparse group per component, and `parse_config` builds the nested
dataclass back from the parsed namespace. Field names must therefore be unique across the components of a CLI.

Argparse's own errors are reduced to one line (`error: argument --zero_stage: invalid choice: 4 ...`) so that
every bad input, whether caught by argparse or by validation, reads the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def opt(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    choices: typing.Sequence | None = None,
    factory: Any = None,
    metavar: str | None = None,
    const: Any = None,
) -> Any:
    """A config field with its help line. `const` makes the flag usable bare (`--use_wandb` means `const`)."""
    meta = {"help": help, "choices": choices, "metavar": metavar, "const": const}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are a single line on stderr and exit code 2."""

    def error(self, message: str) -> typing.NoReturn:  # noqa: D401 - argparse API
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        sys.exit(2)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, tp: Any) -> None:
    meta = f.metadata
    help_text = meta.get("help", "")
    default = (
        f.default
        if f.default is not dataclasses.MISSING
        else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    )
    flag = f"--{f.name}"
    inner, optional = _unwrap_optional(tp)
    kwargs: dict[str, Any] = {"dest": f.name, "help": f"{help_text} (default: {default!r})".strip()}
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    if inner is bool and not optional:
        # Every boolean is an opt-in switch, like OpenRLHF's store_true flags.
        assert default is False, f"boolean field {f.name} must default to False"
        group.add_argument(flag, action="store_true", default=False, help=kwargs["help"])
        return
    origin = typing.get_origin(inner)
    if origin in (tuple, list):
        elem_types = typing.get_args(inner)
        elem = elem_types[0] if elem_types else str
        kwargs["type"] = elem
        kwargs["nargs"] = len(elem_types) if origin is tuple and Ellipsis not in elem_types else "+"
    else:
        kwargs["type"] = inner
    if meta.get("choices") is not None:
        kwargs["choices"] = list(meta["choices"])
    if meta.get("const") is not None:
        kwargs["nargs"] = "?"
        kwargs["const"] = meta["const"]
    kwargs["default"] = default
    group.add_argument(flag, **kwargs)


def build_parser(config_cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flat flag per leaf field of `config_cls` (nested dataclasses = groups)."""
    parser = OneLineParser(prog=prog, description=description)
    # Launchers (deepspeed, torch.distributed.launch) may append --local_rank; accept and ignore it.
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    seen: set[str] = set()
    hints = typing.get_type_hints(config_cls)
    for top in dataclasses.fields(config_cls):
        tp = hints[top.name]
        if dataclasses.is_dataclass(tp):
            group = parser.add_argument_group(top.name, (tp.__doc__ or "").strip().splitlines()[0])
            sub_hints = typing.get_type_hints(tp)
            for f in dataclasses.fields(tp):
                assert f.name not in seen, f"duplicate flag --{f.name} in {config_cls.__name__}"
                seen.add(f.name)
                _add_field(group, f, sub_hints[f.name])
        else:
            assert top.name not in seen, f"duplicate flag --{top.name}"
            seen.add(top.name)
            _add_field(parser, top, tp)  # type: ignore[arg-type]
    return parser


def _from_namespace(config_cls: type[T], ns: argparse.Namespace) -> T:
    hints = typing.get_type_hints(config_cls)
    values = {}
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            values[f.name] = _from_namespace(tp, ns)
        else:
            value = getattr(ns, f.name)
            inner, _ = _unwrap_optional(tp)
            if typing.get_origin(inner) is tuple and isinstance(value, list):
                value = tuple(value)
            values[f.name] = value
    return config_cls(**values)


def parse_config(config_cls: type[T], argv: typing.Sequence[str] | None, prog: str, description: str = "") -> T:
    """Parse `argv` (None = sys.argv[1:]) into an instance of `config_cls`."""
    parser = build_parser(config_cls, prog, description)
    ns = parser.parse_args(argv)
    return _from_namespace(config_cls, ns)


def flag_names(config_cls: type) -> list[str]:
    """Every flat flag name `config_cls` defines (for docs and tests)."""
    names = []
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        names.extend(flag_names(tp) if dataclasses.is_dataclass(tp) else [f"--{f.name}"])
    return names


def to_dict(config: Any) -> dict:
    """A JSON-ready nested dict of a config instance."""
    return dataclasses.asdict(config)
