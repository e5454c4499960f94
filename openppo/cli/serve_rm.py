"""Serve a reward model or a reward function over HTTP: `python -m openppo.cli.serve_rm --reward_pretrain DIR`.

POST /get_reward takes {"query": [...], "prompts": [...], "labels": [...]} and answers {"rewards": [...],
"scores": [...], "extra_logs": {...}}; GET /health answers {"status": "ok"}. Point the trainer at it with
`--remote_rm_url http://127.0.0.1:5000/get_reward` (several servers: a comma list). A line
`serving rewards on http://HOST:PORT/get_reward` is printed once requests are accepted.
"""

from __future__ import annotations

import ipaddress
import sys
from dataclasses import dataclass
from typing import ClassVar

from openppo.cli.runner import run_cli
from openppo.config.common import value_head_prefix_opt
from openppo.config.schema import opt
from openppo.errors import UserError, require


@dataclass
class ServeRMConfig:
    """What to serve and where."""

    openrlhf_cli: ClassVar[str] = "serve_rm"

    reward_pretrain: str = opt(
        None, "reward model folder to serve (a scalar-head model, e.g. from train_rm)", metavar="DIR"
    )
    reward_func: str = opt(None, "serve reward_func from this .py file instead of a model", metavar="FILE.py")
    reward_func_timeout: float = opt(
        600.0, "--reward_func: seconds one call may take; a late request gets HTTP 500 naming the limit"
    )
    host: str = opt(
        "127.0.0.1",
        "address to listen on; there is no authentication, so keep it on loopback unless the network is trusted",
    )
    port: int = opt(5000, "port to listen on; 0 = any free port (the ready line says which)")
    max_len: int = opt(2048, "model: tokens read per query; a longer query keeps its last max_len tokens")
    batch_size: int = opt(16, "model: queries per forward pass")
    value_head_prefix: str = value_head_prefix_opt()
    normalize_reward: bool = opt(False, "model: return (score - mean) / std with the statistics in its config")
    disable_fast_tokenizer: bool = opt(False, "model: use its slow (Python) tokenizer where it has one")
    append_eos: bool = opt(
        False,
        "model: append the EOS token text to queries that do not end with it (for clients that strip special tokens)",
    )
    bf16: bool = opt(False, "model: load the weights in bf16 instead of fp32")
    param_dtype: str = opt(None, "model: weights dtype (OpenRLHF's name; bf16 = --bf16)", choices=("fp32", "bf16"))
    packing_samples: bool = opt(False, "model: run each batch of queries as one packed row (no padding computed)")
    attn_implementation: str = opt(
        "sdpa", "model: attention kernel passed to transformers", choices=("sdpa", "eager", "flash_attention_2")
    )
    device: str = opt("auto", "model: where to run it; auto = cuda when available", choices=("auto", "cpu", "cuda"))
    max_request_samples: int = opt(4096, "larger requests are refused with HTTP 413")
    max_request_bytes: int = opt(32 * 2**20, "larger request bodies are refused with HTTP 413")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_warning(host: str) -> str | None:
    """The one-line warning for a non-loopback --host, or None."""
    if is_loopback(host):
        return None
    return (
        f"warning: --host {host} is not a loopback address: anyone who can reach it can use this reward "
        f"server (it has no authentication)"
    )


def validate(cfg: ServeRMConfig) -> None:
    require(
        bool(cfg.reward_pretrain) != bool(cfg.reward_func),
        "pass exactly one of --reward_pretrain DIR (a reward model) or --reward_func FILE.py",
    )
    require(0 <= cfg.port <= 65535, f"--port must be in 0..65535, got {cfg.port}")
    require(cfg.max_len > 0, f"--max_len must be positive, got {cfg.max_len}")
    require(cfg.batch_size > 0, f"--batch_size must be positive, got {cfg.batch_size}")
    require(not (cfg.bf16 and cfg.param_dtype == "fp32"), "--bf16 and --param_dtype fp32 disagree; give one of them")
    require(cfg.max_request_samples > 0, f"--max_request_samples must be positive, got {cfg.max_request_samples}")
    require(cfg.max_request_bytes > 0, f"--max_request_bytes must be positive, got {cfg.max_request_bytes}")
    if cfg.reward_func:
        used = [
            f
            for f, on in (
                ("--normalize_reward", cfg.normalize_reward),
                ("--append_eos", cfg.append_eos),
                ("--bf16", cfg.bf16),
                ("--param_dtype", cfg.param_dtype is not None),
                ("--packing_samples", cfg.packing_samples),
            )
            if on
        ]
        require(not used, f"{', '.join(used)} only apply to --reward_pretrain; drop them with --reward_func")
        require(cfg.reward_func.endswith(".py"), f"--reward_func must be a .py file, got {cfg.reward_func}")


def build_source(cfg: ServeRMConfig):
    if cfg.reward_func:
        from openppo.rewards.function import FunctionReward

        return FunctionReward(cfg.reward_func, flag="--reward_func", timeout_s=cfg.reward_func_timeout)
    import torch

    from openppo.rewards.model import ModelReward

    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is visible; pass --device cpu (or auto)")
    return ModelReward(
        cfg.reward_pretrain,
        device=device,
        dtype=torch.bfloat16 if cfg.bf16 or cfg.param_dtype == "bf16" else torch.float32,
        attn_implementation=cfg.attn_implementation,
        packed=cfg.packing_samples,
        max_len=cfg.max_len,
        batch_size=cfg.batch_size,
        normalize=cfg.normalize_reward,
        append_eos=cfg.append_eos,
        use_fast_tokenizer=not cfg.disable_fast_tokenizer,
    )


def serve_rm(cfg: ServeRMConfig) -> None:
    from openppo.rewards.server import bind, create_app, serve

    validate(cfg)
    # Bind before loading anything: a taken port or an unknown host fails at once, and the warning below is
    # only printed for an address that is really served.
    sock = bind(cfg.host, cfg.port)
    warning = host_warning(cfg.host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        source = build_source(cfg)
    except BaseException:
        sock.close()
        raise
    app = create_app(source, max_request_samples=cfg.max_request_samples, max_request_bytes=cfg.max_request_bytes)
    host = f"[{cfg.host}]" if ":" in cfg.host else cfg.host
    try:
        serve(app, sock, lambda port: print(f"serving rewards on http://{host}:{port}/get_reward", flush=True))
    finally:
        source.close()


def main(argv=None) -> int:
    return run_cli(serve_rm, ServeRMConfig, "openppo.cli.serve_rm", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
