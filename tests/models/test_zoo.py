"""The offline model zoo: tiny random models and SmolLM2 from its package, through the real CLI."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from openppo.errors import UserError
from openppo.models.zoo import VLLM_CPU_HEAD_DIMS, build_tiny_model
from tests.model_cache import smollm2_dir


def test_tiny_builds_reloads_and_is_cached(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "t", seed=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.hidden_size // model.config.num_attention_heads in VLLM_CPU_HEAD_DIMS
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    mtime = (path / "model.safetensors").stat().st_mtime
    start = time.time()
    assert build_tiny_model(tmp_path / "t", seed=3) == path
    assert time.time() - start < 1.0 and (path / "model.safetensors").stat().st_mtime == mtime


def test_tiny_seed_determines_weights(tmp_path):
    from safetensors.torch import load_file

    a = load_file(build_tiny_model(tmp_path / "a", seed=1) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", seed=1) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", seed=2) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_tiny_llama_and_bad_head_dim(tmp_path):
    from transformers import AutoConfig

    path = build_tiny_model(tmp_path / "llama", arch="llama", hidden_size=128, num_heads=2)
    assert AutoConfig.from_pretrained(path).model_type == "llama"
    with pytest.raises(UserError, match="--hidden"):
        build_tiny_model(tmp_path / "bad", hidden_size=64, num_heads=4)  # head_dim 16


def test_cli_refuses_foreign_folder(tmp_path):
    (tmp_path / "mine.txt").write_text("keep me")
    proc = subprocess.run([sys.executable, "-m", "openppo.cli.models", "tiny", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--out" in proc.stderr and (tmp_path / "mine.txt").exists()


@pytest.mark.slow
def test_smollm2_materializes_generates_and_caches():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and tok.pad_token != tok.eos_token
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is 2+3? Reply with only the number."}],
                                     add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    print("SmolLM2 says:", tok.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True))
    start = time.time()
    proc = subprocess.run([sys.executable, "-m", "openppo.cli.models", "smollm2", "--out", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert time.time() - start < 15  # cached: interpreter start-up only
