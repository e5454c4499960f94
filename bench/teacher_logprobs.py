"""A teacher's log-probs of the student's samples, two ways, in one invocation: openppo's forward (what each
`TeacherWorker` rank runs: `Actor` in micro-batches, the LM head on the response tokens only) against a vLLM engine
asked for prompt log-probs (`SamplingParams(prompt_logprobs=0, max_tokens=1)`, each sample sent as a prompt: vLLM
scores every position and returns each as a Python dict).

The batch is the CPU demo's: 8 arithmetic prompts in SmolLM2-135M's chat template x 8 responses of 32 tokens (drawn
from the vocabulary at random: a teacher's cost does not depend on what the tokens say). One thread each; best of 3
after a warm-up. Prints both times, their ratio (vLLM / forward) and the largest log-prob difference between them on
the response tokens; the last line is the JSON record with the device.

    .venv/bin/python bench/teacher_logprobs.py [--dtype auto]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import add_dtype_option, emit, model_path, resolve_dtype  # noqa: E402

RESPONSE = 32
MICRO = 16


def batch(path: str) -> tuple[list[list[int]], int]:
    """64 token sequences (8 prompts x 8 responses) and the response length."""
    import torch

    from openppo.models.hf import load_tokenizer
    from openppo.tasks.arithmetic import make_rows

    tok = load_tokenizer(path)
    generator = torch.Generator().manual_seed(0)
    seqs = []
    for row in make_rows(8, seed=0):
        text = tok.apply_chat_template(
            [{"role": "user", "content": row["input"]}], add_generation_prompt=True, tokenize=False
        )
        prompt = tok.encode(text, add_special_tokens=False)
        for _ in range(8):
            seqs.append(prompt + torch.randint(0, len(tok) - 200, (RESPONSE,), generator=generator).tolist())
    return seqs, RESPONSE


def best_of(fn, runs: int = 3) -> tuple[float, object]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(runs):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return min(times), out


def forward_log_probs(path: str, dtype: str, seqs: list[list[int]], response: int):
    import torch

    from openppo.models.actor import Actor

    model = Actor.from_pretrained(path, dtype=torch.float32 if dtype == "fp32" else torch.bfloat16).eval()
    width = max(map(len, seqs))

    @torch.no_grad()
    def run():
        out = []
        for i in range(0, len(seqs), MICRO):
            chunk = seqs[i : i + MICRO]
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            score = torch.zeros(len(chunk), width - 1, dtype=torch.long)
            for r, s in enumerate(chunk):
                ids[r, : len(s)] = torch.tensor(s)
                mask[r, : len(s)] = 1
                score[r, len(s) - response - 1 : len(s) - 1] = 1
            lp = model(ids, mask, temperature=1.0, score_mask=score).log_probs
            out += [lp[r][score[r].bool()].float() for r in range(len(chunk))]
        return out

    return best_of(run)


def vllm_log_probs(path: str, dtype: str, seqs: list[list[int]], response: int):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from openppo.rollout.engine import VLLMEngine

    engine = VLLMEngine(
        path,
        dtype="float32" if dtype == "fp32" else "bfloat16",
        max_model_len=max(map(len, seqs)) + 1,
        kv_cache_bytes=512 * 2**20,
    )
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    prompts = [TokensPrompt(prompt_token_ids=s) for s in seqs]

    def run():
        outs = engine.llm.generate(prompts, params, use_tqdm=False)
        return [
            torch.tensor([o.prompt_logprobs[t][s[t]].logprob for t in range(len(s) - response, len(s))])
            for o, s in zip(outs, seqs)
        ]

    try:
        return best_of(run)
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_dtype_option(parser, "the teacher's precision")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # one thread each (the engine reads it at start-up)
    import torch

    torch.set_num_threads(1)
    dtype = resolve_dtype(args.dtype)
    path = model_path("smollm2")
    seqs, response = batch(path)
    forward_s, forward = forward_log_probs(path, dtype, seqs, response)
    print(f"forward (TeacherWorker's): {forward_s:.3f} s", flush=True)
    vllm_s, engine = vllm_log_probs(path, dtype, seqs, response)
    print(f"vLLM prompt log-probs:     {vllm_s:.3f} s ({vllm_s / forward_s:.2f}x)", flush=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(forward, engine))
    emit(
        {
            "bench": "teacher_logprobs",
            "dtype": dtype,
            "sequences": len(seqs),
            "tokens_per_sequence": max(map(len, seqs)),
            "response_tokens": response,
            "forward_s": forward_s,
            "vllm_prompt_logprobs_s": vllm_s,
            "vllm_over_forward": vllm_s / forward_s,
            "max_logprob_diff": diff,
        }
    )


if __name__ == "__main__":
    main()
