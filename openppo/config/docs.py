"""Markdown reference of every CLI flag, generated from the typed configs (docs/flags.md is its output)."""

from __future__ import annotations

import dataclasses
import typing

from openppo.config import openrlhf_names
from openppo.config.schema import spellings


def _rows(config_cls: type, aliases: dict[str, list[str]]) -> list[tuple[str, str, str, str]]:
    rows = []
    hints = typing.get_type_hints(config_cls)
    for f in dataclasses.fields(config_cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp, aliases))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        choices = f.metadata.get("choices")
        help_text = f.metadata.get("help", "") + (f" (one of: {', '.join(map(str, choices))})" if choices else "")
        names = " ".join(f"`--{n}`" for n in (f.name, *aliases.get(f.name, [])))
        rows.append((names, f"`{default!r}`", help_text.replace("|", "\\|"), config_cls.__name__))
    return rows


def render(clis: dict[str, type]) -> str:
    out = [
        "# Command-line flags",
        "",
        "Generated from the typed configs by `python -m openppo.cli.flags_doc > docs/flags.md`; "
        "a test keeps it current. Each flag is listed by its flat name (OpenRLHF <= 0.9 and seed 004), then its "
        "other spellings: the dotted names of OpenRLHF >= 0.10. Either may be used, and the generations may be mixed "
        "across flags; see docs/openrlhf-migration.md for what openppo does differently.",
        "",
    ]
    for cli, config_cls in clis.items():
        aliases = spellings(config_cls).aliases()
        out += [f"## `python -m openppo.cli.{cli}`", "", "| flag | default | meaning |", "|---|---|---|"]
        out += [f"| {flag} | {default} | {text} |" for flag, default, text, _ in _rows(config_cls, aliases)]
        out.append("")
    out += [
        "## OpenRLHF flags openppo refuses",
        "",
        "A CLI that has none of the flags below as its own stops at it before anything starts, with this reason. "
        "Both spellings are refused (`--load_in_4bit`, `--ds.load_in_4bit`).",
        "",
        "| flag | why, and what to do instead |",
        "|---|---|",
    ]
    out += [f"| `--{name}` | {why} |" for name, why in sorted(openrlhf_names.REFUSED.items())]
    out += ["", "## OpenRLHF flags with no effect", "", "Accepted, with one warning line.", ""]
    out += ["| flag | why |", "|---|---|"]
    out += [f"| `--{name}` | {why} |" for name, (_, why) in sorted(openrlhf_names.NO_EFFECT.items())]
    out += ["", "## Molt's values", "", "Molt (OpenRLHF's successor) spells these settings with values of its own.", ""]
    out += ["| flag and value | openppo's setting |", "|---|---|"]
    modes = " ".join(f"`--{flag}`" for flag in openrlhf_names.MOLT_CHECKPOINT_MODES.values())
    out.append(
        f"| {modes} `full` (or no value), `selective`, `none` | `--gradient_checkpointing` on (selective: whole "
        "layers, with one log line), on, off |"
    )
    out.append(
        "| `--fsdp.offload` `none`, `optimizer`, `full` | `--adam_offload` off, on; `full` (the weights on CPU too) "
        "refused: use `optimizer` and ZeRO-3 |"
    )
    pairs = ", ".join(f"{level} {mode}: `{kind}`" for (level, mode), kind in openrlhf_names.MOLT_IS_CORRECTION.items())
    out.append(
        f"| `--{openrlhf_names.MOLT_IS_LEVEL}` with `--{openrlhf_names.MOLT_IS_MODE}` (default mask) | "
        f"`--enable_vllm_is_correction --vllm_is_correction_type` of the same formula: {pairs}; off: neither; "
        "seq or geo with clip or trunc refused (they drop whole responses) |"
    )
    out.append(
        "| `--actor.loss_mode cispo` with `--actor.eps_clip_low_high LOW CEILING` | `--policy_loss_type cispo "
        "--eps_clip_low_high LOW CEILING-1`: Molt's high value is the ratio's ceiling, openppo's the offset from 1 "
        "(a ceiling of 1 or less is refused) |"
    )
    for field, values in sorted(openrlhf_names.MOLT_VALUES.items()):
        out += [
            f"| `--{field}` `{theirs}` | `--{field} {ours}` |"
            for theirs, ours in sorted(values.items())
            if theirs != openrlhf_names.MOLT_DISTILL
        ]
    out.append(
        f"| `--advantage_estimator {openrlhf_names.MOLT_DISTILL}` with `--{openrlhf_names.MOLT_REF} T` | "
        "`--teacher_pretrain T --advantage_estimator group_norm --init_kl_coef 0` (distillation alone; Molt's "
        "`--algo.kl.init_coef` may only be 1); without on_policy_distill the reference path may only be `--pretrain`'s "
        "folder |"
    )
    for name, (no_op, why) in {**openrlhf_names.MOLT_FSDP_ONLY, **openrlhf_names.MOLT_RL_ONLY}.items():
        given = f"`--{name}`" + ("" if no_op is None else f" `{no_op}`: nothing, with one log line; another value")
        out.append(f"| {given} | refused: {why} |")
    for name, (_, why) in openrlhf_names.MOLT_RL_NO_EFFECT.items():
        out.append(f"| `--{name}` (train_ppo_ray) | nothing, with one log line: {why} |")
    out.append("")
    return "\n".join(out)
