"""Trainer-side weight iteration: checkpoint names, wrapper stripping, LoRA merging (tiny model, no Ray/vLLM)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from openppo.models.actor import Actor
from openppo.models.hf import apply_lora
from openppo.rollout.sender import iter_full_weights, tensors_checksum, unwrap_model
from tests.model_cache import REPO, tiny_model_dir


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)


def test_names_match_the_checkpoint_and_wrappers_are_stripped(hf_model):
    with safe_open(str(tiny_model_dir() / "model.safetensors"), "pt") as f:
        checkpoint_names = set(f.keys())
    actor = Actor(hf_model)
    assert unwrap_model(actor) is hf_model
    named = list(iter_full_weights(actor, rank=0))
    assert {n for n, _ in named} == checkpoint_names
    params = dict(hf_model.named_parameters())
    assert all(torch.equal(t, params[n]) for n, t in named)


def test_experts_come_in_the_checkpoint_layout():
    """transformers 5 holds a mixture of experts' weights fused (`experts.gate_up_proj` [E, 2I, H]) and saves them one
    tensor per expert and projection: the sync sends what the checkpoint holds, tensor for tensor, which is what
    vLLM loads."""
    from transformers import AutoModelForCausalLM

    folder = tiny_model_dir(arch="qwen3_moe")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in model.named_parameters())
    named = dict(iter_full_weights(Actor(model), rank=0))
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        assert set(named) == set(f.keys())
        assert all(torch.equal(named[n], f.get_tensor(n)) for n in f.keys())


def test_other_ranks_get_nothing(hf_model):
    assert list(iter_full_weights(hf_model, rank=1)) == []


def test_lora_adapters_are_merged_under_base_names(hf_model):
    peft_model = apply_lora(
        copy.deepcopy(hf_model), rank=4, alpha=8, dropout=0.0, target_modules=None, task_type="CAUSAL_LM"
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # lora_B starts at zero: make the adapters matter
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    named = dict(iter_full_weights(Actor(peft_model), rank=0))
    expected = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    assert set(named) == set(expected) == set(dict(hf_model.named_parameters()))
    for name, tensor in named.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6)
    changed = [n for n in named if not torch.equal(named[n], dict(hf_model.named_parameters())[n])]
    assert changed and all(n.endswith("proj.weight") for n in changed)
    assert tensors_checksum(named.items()) == pytest.approx(tensors_checksum(expected.items()), rel=1e-9)


@pytest.mark.slow
def test_zero3_parameters_are_gathered_per_layer():
    """DeepSpeed ZeRO-3 engine around our Actor (world size 1, CPU), in a subprocess."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.rollout.zero3_weights"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"partitioned": True, "names_match": True, "values_match": True, "released_after": True}


def _exchange_rank(rank: int, init_file: str, out: str) -> None:
    """One of two gloo ranks: an exchange of rank 0 and 1 gathers, is destroyed, and a new one takes its place."""
    import torch.distributed as dist

    from openppo.rollout.sender import HandleExchange

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        first = HandleExchange([0, 1], timeout_s=60)
        gathered = first.gather(f"handle of {rank}")
        group = first._group
        first.destroy()
        try:
            dist.get_process_group_ranks(group)
            left = False
        except KeyError:  # no longer one of this process's groups
            left = True
        second = HandleExchange([0, 1], timeout_s=60)
        again = second.gather(rank * 10)
        second.destroy()
        lonely = HandleExchange([0], timeout_s=60)  # rank 1 is no member of this one, and leaves it all the same
        lonely.destroy()
        Path(out.format(rank)).write_text(json.dumps({"gathered": gathered, "left": left, "again": again}))
    finally:
        dist.destroy_process_group()


def test_a_destroyed_handle_exchange_leaves_its_group_and_a_new_one_works(tmp_path):
    """TrainerTransfer.shutdown (connecting anew after an engine was replaced) destroys the exchange on every
    rank; before, each reconnect left a gloo group behind."""
    import torch.multiprocessing as mp

    mp.spawn(_exchange_rank, args=(str(tmp_path / "init"), str(tmp_path / "rank{}.json")), nprocs=2)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["gathered"] == {"0": "handle of 0", "1": "handle of 1"}
        assert result["left"], f"rank {rank} still holds the destroyed exchange's group"
        assert result["again"] == {"0": 0, "1": 10}
