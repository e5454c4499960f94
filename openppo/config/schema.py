"""Typed configuration: dataclasses are the single source of the command line.

Each component owns a dataclass whose fields carry a one-line help text (`opt(...)`). A CLI composes them into
one top-level dataclass; `build_parser` turns every leaf field into a flat `--field_name` flag (the OpenRLHF
names users copy from recipes), one argparse group per component, and `parse_config` builds the nested
dataclass back from the parsed namespace. Field names must therefore be unique across the components of a CLI.
Each flag also answers to its other OpenRLHF spellings (`openppo.config.openrlhf_names`: the dotted names of
OpenRLHF >= 0.10); one setting given under two spellings is an error naming both.

Argparse's own errors are reduced to one line (`error: argument --zero_stage: invalid choice: 4 ...`) so that
every bad input, whether caught by argparse or by validation, reads the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import types
import typing
from typing import Any, TypeVar

from openppo.config import openrlhf_names

T = TypeVar("T")
logger = logging.getLogger(__name__)


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
    """An ArgumentParser whose usage errors are a single line on stderr and exit code 2.

    Abbreviations are refused: argparse's default takes `--pretrai` for `--pretrain`, so a recipe's typo (or a flag
    that a later version adds with a longer name) silently sets another option. An unknown flag names the closest
    known one instead."""

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:  # noqa: D401 - argparse API
        if message.startswith("unrecognized arguments:"):
            message += self._closest(message.split(":", 1)[1].split())
        sys.stderr.write(f"error: {message} (see {self.prog} --help)\n")
        sys.exit(2)

    def _closest(self, tokens: list[str]) -> str:
        """`; did you mean --pretrain?` for the first unknown flag that is close to a known one."""
        import difflib

        known = [s for action in self._actions for s in action.option_strings if action.help != argparse.SUPPRESS]
        for token in tokens:
            if token.startswith("--"):
                match = difflib.get_close_matches(token.partition("=")[0], known, n=1, cutoff=0.75)
                if match:
                    return f"; did you mean {match[0]}?"
        return ""


class _HelpFormatter(argparse.HelpFormatter):
    """Every spelling of a flag, then its value once: `--max_norm, --actor.max_norm MAX_NORM`."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if not action.option_strings or action.nargs == 0:
            return super()._format_action_invocation(action)
        return (
            ", ".join(action.option_strings)
            + " "
            + self._format_args(action, self._get_default_metavar_for_optional(action))
        )


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    """`X | None` -> (X, True); anything else -> (tp, False)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


def _add_field(group: argparse._ArgumentGroup, f: dataclasses.Field, tp: Any, aliases: list[str]) -> None:
    meta = f.metadata
    help_text = meta.get("help", "")
    default = (
        f.default
        if f.default is not dataclasses.MISSING
        else (f.default_factory() if f.default_factory is not dataclasses.MISSING else None)
    )
    flags = [f"--{f.name}", *(f"--{a}" for a in aliases)]
    inner, optional = _unwrap_optional(tp)
    kwargs: dict[str, Any] = {"dest": f.name, "help": f"{help_text} (default: {default!r})".strip()}
    if meta.get("metavar"):
        kwargs["metavar"] = meta["metavar"]
    if inner is bool and not optional:
        # Every boolean is an opt-in switch, like OpenRLHF's store_true flags.
        assert default is False, f"boolean field {f.name} must default to False"
        group.add_argument(*flags, dest=f.name, action="store_true", default=False, help=kwargs["help"])
        return
    if inner is bool:
        # `bool | None`: a backend's own default unless given, --x on, --no-x off (also --no-dotted.name, Molt's)
        assert default is None, f"optional boolean field {f.name} must default to None"
        group.add_argument(
            *flags, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=kwargs["help"]
        )
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
    group.add_argument(*flags, **kwargs)


def build_parser(config_cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    """An argparse parser with one flat flag per leaf field of `config_cls` (nested dataclasses = groups)."""
    parser = OneLineParser(prog=prog, description=description, formatter_class=_HelpFormatter)
    # Launchers (deepspeed, torch.distributed.launch) may append --local_rank; accept and ignore it.
    parser.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    names = spellings(config_cls)
    aliases = names.aliases()
    for name, (takes_value, _) in openrlhf_names.NO_EFFECT.items():
        if name not in names.fields:
            flags = [f"--{name}", *(f"--{d}" for d, target in names.dotted.items() if target == name)]
            kind = {"nargs": "?", "const": True} if takes_value else {"action": "store_true"}
            parser.add_argument(*flags, dest=f"_no_effect_{name}", default=None, help=argparse.SUPPRESS, **kind)
    _add_molt_options(parser, getattr(config_cls, "openrlhf_cli", None), names.fields)
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
                _add_field(group, f, sub_hints[f.name], aliases.get(f.name, []))
        else:
            assert top.name not in seen, f"duplicate flag --{top.name}"
            seen.add(top.name)
            _add_field(parser, top, tp, aliases.get(top.name, []))  # type: ignore[arg-type]
    return parser


def _add_molt_options(parser: argparse.ArgumentParser, cli: str | None, fields: set[str]) -> None:
    """Molt's flags whose values differ from openppo's (docs/flags.md, "Molt's values"): its checkpoint modes and
    offload levels on openppo's switches, and its FSDP2-only parallelism, checked after parsing
    (`_check_fsdp_only`)."""
    if cli not in openrlhf_names.MOLT_CHECKPOINT_MODES:
        return
    rl = cli == "train_ppo_ray"
    for name, (no_op, _) in {**openrlhf_names.MOLT_FSDP_ONLY, **(openrlhf_names.MOLT_RL_ONLY if rl else {})}.items():
        kind = {"action": "store_true"} if no_op is None else {"metavar": "N"}
        parser.add_argument(f"--{name}", dest=f"_fsdp_only_{name}", default=None, help=argparse.SUPPRESS, **kind)
    for name, (takes_value, _) in (openrlhf_names.MOLT_RL_NO_EFFECT if rl else {}).items():
        kind = {"metavar": "VALUE"} if takes_value else {"action": "store_true"}
        parser.add_argument(f"--{name}", dest=f"_no_effect_{name}", default=None, help=argparse.SUPPRESS, **kind)
    if rl and "enable_prefix_caching" in fields:  # Molt's switch is on/off (BooleanOptionalAction), off by default
        off = {"dest": "enable_prefix_caching", "action": "store_false", "default": argparse.SUPPRESS}
        parser.add_argument("--no-vllm.enable_prefix_caching", help=argparse.SUPPRESS, **off)
    if "gradient_checkpointing" in fields:
        parser.add_argument(
            f"--{openrlhf_names.MOLT_CHECKPOINT_MODES[cli]}",
            dest="gradient_checkpointing",
            nargs="?",
            const=True,
            type=checkpoint_mode,
            default=argparse.SUPPRESS,  # the field's own flag sets the default
            metavar="{full,selective,none}",
            help="Molt's spelling of --gradient_checkpointing: full (or no value), selective (full here) or none",
        )
    if rl and "teacher_pretrain" in fields:
        parser.add_argument(f"--{openrlhf_names.MOLT_REF}", dest="_molt_ref", default=None, help=argparse.SUPPRESS)
    if "vllm_is_correction_type" in fields:
        for name, dest, choices in (
            (openrlhf_names.MOLT_IS_LEVEL, "_molt_is_level", ("off", "token", "seq", "geo")),
            (openrlhf_names.MOLT_IS_MODE, "_molt_is_mode", ("mask", "clip", "trunc")),
        ):
            parser.add_argument(
                f"--{name}",
                dest=dest,
                choices=choices,
                default=None,
                help=f"Molt's IS correction {name.rsplit('_', 1)[1]} (with the other of the pair, one "
                '--vllm_is_correction_type: docs/flags.md, "Molt\'s values")',
            )
    if "adam_offload" in fields:
        parser.add_argument(
            "--fsdp.offload",
            dest="adam_offload",
            type=offload_level,
            default=argparse.SUPPRESS,
            metavar="{none,optimizer}",
            help="Molt's offload levels: optimizer is --adam_offload, none leaves it off (full is refused)",
        )


def _check_fsdp_only(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Molt's FSDP2-only parallelism and engine settings openppo lacks: a size of 1 (a count of 0) asks for nothing (one
    log line); anything else stops the run."""
    for name, (no_op, why) in {**openrlhf_names.MOLT_FSDP_ONLY, **openrlhf_names.MOLT_RL_ONLY}.items():
        value = getattr(ns, f"_fsdp_only_{name}", None)
        if value in (None, False):
            continue
        if no_op is not None and value == no_op:
            logger.info("--%s %s has no effect: it asks for no %s", name, value, name.split(".", 1)[1])
        else:
            parser.error(f"--{name}{'' if no_op is None else ' ' + value}: {why}")


def _molt_is_correction(ns: argparse.Namespace, argv: list[str], names, parser: argparse.ArgumentParser) -> None:
    """Molt's IS level and mode on openppo's one --vllm_is_correction_type (which turns the correction on)."""
    level, mode = getattr(ns, "_molt_is_level", None), getattr(ns, "_molt_is_mode", None)
    if level in (None, "off"):
        if mode is not None:
            logger.info("--%s %s has no effect: Molt's correction level is off", openrlhf_names.MOLT_IS_MODE, mode)
        return
    mode = mode or "mask"  # Molt's default
    flag = f"--{openrlhf_names.MOLT_IS_LEVEL} {level}"
    if (level, mode) not in openrlhf_names.MOLT_IS_CORRECTION:
        parser.error(f"{flag}: the seq and geo levels drop whole responses (mode mask), they do not reweight ({mode})")
    given = [n for n, _ in _options(argv) if names.field_of(n) == "vllm_is_correction_type"]
    if given:
        parser.error(f"{flag} and --{given[0]} set the same option (--vllm_is_correction_type); give it once")
    ns.vllm_is_correction_type = openrlhf_names.MOLT_IS_CORRECTION[(level, mode)]
    ns.enable_vllm_is_correction = True
    logger.info("%s with mode %s: --vllm_is_correction_type %s", flag, mode, ns.vllm_is_correction_type)


def _molt_distill(ns: argparse.Namespace, argv: list[str], names, parser: argparse.ArgumentParser) -> None:
    """Molt's `--algo.advantage.estimator on_policy_distill` distils from `--ref.model_name_or_path` with the
    teacher's log-ratio as the whole advantage: openppo's `--teacher_pretrain` run without a task reward
    (`--distill_task_coef 0`) and without a KL-to-start reference. Outside distillation Molt's reference path may
    only name the actor's own starting weights, which are openppo's reference."""
    ref, flag = getattr(ns, "_molt_ref", None), f"--{openrlhf_names.MOLT_REF}"
    given = {names.field_of(n) or n: (n, v) for n, v in _options(argv)}
    estimator = given.get("advantage_estimator", ("", []))[1]
    if openrlhf_names.MOLT_DISTILL not in estimator:
        if ref is not None and os.path.realpath(ref) != os.path.realpath(ns.pretrain or ""):
            parser.error(
                f"{flag} {ref}: openppo's reference model is the actor's starting weights (--pretrain); to learn "
                "from another model distil from it (--teacher_pretrain, or Molt's on_policy_distill)"
            )
        return
    if ref is None:
        parser.error(f"--{given['advantage_estimator'][0]} on_policy_distill: the teacher is {flag}; pass it")
    if "teacher_pretrain" in given:
        parser.error(f"{flag} and --{given['teacher_pretrain'][0]} both name the teacher; give it once")
    if "init_kl_coef" in given and ns.init_kl_coef != 1:
        parser.error(
            f"--{given['init_kl_coef'][0]} {ns.init_kl_coef} with on_policy_distill: openppo weighs the teacher's "
            "log-ratio by 1; mix in a task reward with --distill_task_coef instead"
        )
    ns.teacher_pretrain, ns.init_kl_coef = [ref], 0.0
    logger.info("on_policy_distill from %s: --teacher_pretrain %s --init_kl_coef 0", ref, ref)


def _molt_cispo_ceiling(ns: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser) -> None:
    """Molt's `--actor.loss_mode cispo` reads the high value of the clip pair as the ratio's ceiling (1.2), where
    openppo's cispo, like its PPO clip and the CISPO paper, reads an offset from 1 (0.2): the Molt-only spelling
    tells a Molt recipe, whose value is rewritten once with one log line."""
    molt = [v for n, v in _options(argv) if n == "actor.loss_mode"]
    if getattr(ns, "policy_loss_type", None) != "cispo" or not molt or ns.eps_clip_low_high is None:
        return
    low, ceiling = ns.eps_clip_low_high
    if ceiling <= 1:
        parser.error(
            f"--actor.eps_clip_low_high {low} {ceiling}: with Molt's --actor.loss_mode cispo the high value is the "
            "ratio's ceiling, above 1 (e.g. 0.2 1.2)"
        )
    ns.eps_clip_low_high = (low, ceiling - 1)
    logger.info(
        "--actor.loss_mode cispo: Molt's ratio ceiling %s is openppo's clip-high offset %.6g", ceiling, ceiling - 1
    )


def _molt_recipe(argv: list[str], model: str = "actor.model_name_or_path") -> str | None:
    """A Molt recipe is told by its names: all dotted, the model given as `model` (--actor.model_name_or_path in RL,
    --model.model_name_or_path in SFT: a whole run, as every Molt script is), and one of Molt's own
    (`openrlhf_names.molt_only`); returns the first such name. None for a recipe that mixes in flat names (openppo's
    or OpenRLHF 0.9's) or uses OpenRLHF 0.10's dotted names only."""
    names = [name for name, _ in _options(argv)]
    molt = sorted(n for n in names if openrlhf_names.molt_only(n))
    whole = model in names and all("." in n for n in names)
    return molt[0] if molt and whole else None


def _molt_sft(config_cls: type, ns: argparse.Namespace, argv: list[str]) -> None:
    """Molt's train_sft renders every row as a chat with the model's template (it has no --apply_chat_template; its
    recipes' rows are chat messages): a Molt SFT recipe (`_molt_recipe`) runs with --apply_chat_template, said in
    one log line."""
    if getattr(config_cls, "openrlhf_cli", None) != "train_sft" or getattr(ns, "apply_chat_template", True):
        return
    if (first := _molt_recipe(argv, "model.model_name_or_path")) is not None:
        ns.apply_chat_template = True
        logger.info(
            "a Molt recipe (--%s): each row is rendered with the chat template, as Molt's train_sft renders it "
            "(--apply_chat_template)",
            first,
        )


def _molt_rollout(ns: argparse.Namespace, argv: list[str]) -> None:
    """Two rollout settings mean otherwise in a Molt recipe (`_molt_recipe`), each rewritten with one log line.

    - Molt's trainer always generates ahead of training (up to --train.async_queue_size batches, one weight sync
      stale at 1) unless --train.force_sync_mode; openppo, like OpenRLHF, generates in sync unless --async_train
      (OpenRLHF 0.10: --train.async_enable). A Molt recipe runs with --async_train.
    - Molt's --rollout.vllm_generate_batch_size caps the prompts in flight, below --rollout.batch_size too (a
      scheduling knob: vLLM schedules a round's prompts itself in openppo, so such a value has no effect); above
      it, both generate the surplus ahead for later batches."""
    if not hasattr(ns, "async_train") or (first := _molt_recipe(argv)) is None:
        return
    if not ns.async_train and not ns.force_sync_mode:
        ns.async_train = True
        logger.info(
            "a Molt recipe (--%s): batches are generated ahead of training as in Molt (--async_train, up to "
            "--train.async_queue_size %d ahead); --train.force_sync_mode generates each with the weights that train "
            "on it",
            first,
            ns.async_queue_size,
        )
    if ns.vllm_generate_batch_size is not None and ns.vllm_generate_batch_size < ns.rollout_batch_size:
        logger.info(
            "--rollout.vllm_generate_batch_size %d has no effect: Molt's cap on the prompts in flight, below "
            "--rollout.batch_size %d (openppo's engines schedule a round's prompts themselves)",
            ns.vllm_generate_batch_size,
            ns.rollout_batch_size,
        )
        ns.vllm_generate_batch_size = None


def checkpoint_mode(value: str) -> bool:
    """Molt's `--actor.gradient_checkpoint` modes on openppo's `--gradient_checkpointing`: full, or selective (per-op
    checkpointing, which openppo does not have: full instead, with one log line), or none/off/empty."""
    mode = value.strip().lower()
    if mode in ("none", "off", ""):
        return False
    if mode == "selective":
        logger.info("gradient checkpoint mode selective: openppo checkpoints whole layers (full) instead")
    elif mode != "full":
        raise argparse.ArgumentTypeError(f"{value!r}: choose full, selective or none")
    return True


def offload_level(value: str) -> bool:
    """Molt's `--fsdp.offload` levels on openppo's `--adam_offload`; `full` (the weights streamed from CPU too) has no
    counterpart for the trained model."""
    level = value.strip().lower()
    if level == "full":
        raise argparse.ArgumentTypeError(
            "full (the trained model's weights on CPU) is not in openppo: --fsdp.offload optimizer keeps the "
            "optimizer states there (--adam_offload), and ZeRO-3 shards the weights over the ranks (--zero_stage 3)"
        )
    if level not in ("none", "optimizer"):
        raise argparse.ArgumentTypeError(f"{value!r}: choose none or optimizer (full is not in openppo)")
    return level == "optimizer"


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
    argv = list(sys.argv[1:] if argv is None else argv)
    names = spellings(config_cls)
    _check_spellings(argv, names, parser)
    ns = parser.parse_args(_molt_values(argv, names))
    for name, (_, why) in {**openrlhf_names.NO_EFFECT, **openrlhf_names.MOLT_RL_NO_EFFECT}.items():
        if getattr(ns, f"_no_effect_{name}", None) not in (None, False):
            logger.warning("--%s has no effect: %s", name, why)
    _check_fsdp_only(ns, parser)
    _molt_is_correction(ns, argv, names, parser)
    _molt_distill(ns, argv, names, parser)
    _molt_cispo_ceiling(ns, argv, parser)
    _molt_rollout(ns, argv)
    _molt_sft(config_cls, ns, argv)
    _muon_clipping(ns, argv, names, parser)
    return _from_namespace(config_cls, ns)


def _muon_clipping(ns: argparse.Namespace, argv: list[str], names, parser: argparse.ArgumentParser) -> None:
    """Under ZeRO-1/2/3 DeepSpeed orthogonalises Muon's momentum into the gradient partitions and clips afterwards,
    so a clip norm meant for gradients shrinks Muon's step (measured: 22x on a 2-layer test model's q_proj at
    --max_norm 1). With --optim muon clipping is therefore off unless --max_norm is given, and a given norm above 0
    stops the run under ZeRO >= 1. ZeRO-0 clips the raw gradient before the optimizer, so it keeps a given norm."""
    if getattr(ns, "optim", None) != "muon" or not hasattr(ns, "max_norm"):
        return
    given = [n for n, _ in _options(argv) if (names.field_of(n) or n) == "max_norm"]
    if not given:
        if ns.max_norm > 0:
            logger.info("--optim muon: gradient clipping off (--max_norm 0; Newton-Schulz bounds each update)")
        ns.max_norm = 0.0
    elif ns.max_norm > 0 and getattr(ns, "zero_stage", 0) >= 1:
        parser.error(
            f"--{given[0]} {ns.max_norm} with --optim muon: DeepSpeed's ZeRO-{ns.zero_stage} clips after Muon's "
            f"orthogonalisation, which shrinks its update; pass --{given[0]} 0 (Newton-Schulz bounds each update)"
        )


def _molt_values(argv: list[str], names: openrlhf_names.Spellings) -> list[str]:
    """`argv` with Molt's names for values openppo spells otherwise (`--algo.advantage.estimator grpo`) rewritten to
    openppo's, each with one log line."""
    out = list(argv)
    for i, token in enumerate(out):
        if not token.startswith("--"):
            continue
        name, eq, value = token[2:].partition("=")
        if not eq and i + 1 < len(out):
            value = out[i + 1]
        ours = openrlhf_names.MOLT_VALUES.get(names.field_of(name) or "", {}).get(value)
        if ours is None:
            continue
        if eq:
            out[i] = f"--{name}={ours}"
        else:
            out[i + 1] = ours
        if value != openrlhf_names.MOLT_DISTILL:  # (`_molt_distill` says what that one becomes)
            logger.info("--%s %s: Molt's name for openppo's %s", name, value, ours)
    return out


def _options(argv: typing.Sequence[str]) -> list[tuple[str, list[str]]]:
    """(option name without dashes, its value tokens) for every `--option` in `argv`."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, eq, value = token[2:].partition("=")
            out.append((name, [value] if eq else []))
        elif out:
            out[-1][1].append(token)
    return out


def spellings(config_cls: type) -> openrlhf_names.Spellings:
    """The other OpenRLHF spellings of `config_cls`'s flags (`openrlhf_cli` names the OpenRLHF CLI it stands for)."""
    return openrlhf_names.Spellings(set(field_names(config_cls)), getattr(config_cls, "openrlhf_cli", None))


def _check_spellings(
    argv: typing.Sequence[str], names: openrlhf_names.Spellings, parser: argparse.ArgumentParser
) -> None:
    """Stop at a flag this CLI refuses (with the reason), and at one setting given under two spellings."""
    # field -> spelling -> (the flag as given, its values); a switch's --no-x is x's spelling with the value "off",
    # so `--x --no-x` is one spelling given twice (the last wins, as for any flag) and `--x --no-dotted.x` two
    given: dict[str, dict[str, tuple[str, list[str]]]] = {}
    for name, values in _options(argv):
        why = names.refusal(name)
        if why is not None:
            parser.error(f"--{name}: {why}")
        spelling, field = name, names.field_of(name)
        if field is None and name.startswith("no-"):
            spelling, values = name[3:], ["<off>"]
            field = names.field_of(spelling)
        if field is not None:
            given.setdefault(field, {})[spelling] = (name, values)
    for field, spellings in given.items():
        if len(spellings) < 2:
            continue
        names = " and ".join(f"--{given_as}" for given_as, _ in spellings.values())
        split = all(n != field and n.split(".")[0] in ("actor", "critic", "ref", "reward") for n in spellings)
        if not split:
            parser.error(f"{names} set the same option (--{field}); give it once")
        if len({tuple(v) for _, v in spellings.values()}) > 1:
            parser.error(f"{names} set one option for both models in openppo (--{field}); give them the same value")


def field_names(config_cls: type) -> list[str]:
    """Every leaf field name of `config_cls` (its flat flags without the dashes)."""
    return [name[2:] for name in flag_names(config_cls)]


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
