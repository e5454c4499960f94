"""Markdown reference of every CLI flag, generated from the typed configs (docs/flags.md is its output)."""

from __future__ import annotations

import dataclasses
import typing


def _rows(config_cls: type) -> list[tuple[str, str, str, str]]:
    rows = []
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        choices = f.metadata.get("choices")
        help_text = f.metadata.get("help", "") + (f" (one of: {', '.join(map(str, choices))})" if choices else "")
        rows.append((f"`--{f.name}`", f"`{default!r}`", help_text.replace("|", "\\|"), config_cls.__name__))
    return rows


def render(clis: dict[str, type]) -> str:
    out = [
        "# Command-line flags",
        "",
        "Generated from the typed configs by `python -m openppo.cli.flags_doc > docs/flags.md`; "
        "a test keeps it current. Flag names follow OpenRLHF's flat names.",
        "",
    ]
    for cli, config_cls in clis.items():
        out += [f"## `python -m openppo.cli.{cli}`", "", "| flag | default | meaning |", "|---|---|---|"]
        out += [f"| {flag} | {default} | {text} |" for flag, default, text, _ in _rows(config_cls)]
        out.append("")
    return "\n".join(out)
