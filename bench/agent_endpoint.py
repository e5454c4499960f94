"""What the agent endpoint costs: the same 32 two-turn chat sessions generated through it (32 `openai` clients on
threads, as --agent_program runs them) and by direct engine calls (each turn's 32 contexts in one generate call dealt
over the engines, as --agent_func_path episodes run), in one invocation, on the same two vLLM engine actors.

Both paths render the conversations with the same chat template and generate with the same code
(`SingleTurn.generate`, the run's); the endpoint adds HTTP and JSON, its batching (a batch closes when every running
session has a request in it), and the turns of different sessions no longer start together. Responses differ in
length from run to run (temperature 1), so the comparison is generated tokens per second: the endpoint's slowdown is
direct tok/s / endpoint tok/s, of the best round of each and of their means. Alternating rounds (direct, endpoint)
x --rounds after a warm-up round of each. The last line is the JSON record with the device.

    .venv/bin/python bench/agent_endpoint.py [--sessions 32] [--max_tokens 64]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import emit, model_path  # noqa: E402

FOLLOW_UP = "Check your answer and give the final number."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import ray
    from openai import OpenAI

    from openppo.agents.program import PythonAgent
    from openppo.models.hf import load_tokenizer
    from openppo.ppo.collector import SingleTurn
    from openppo.ppo.config import PPOConfig
    from openppo.ppo.served_agents import ServedAgents
    from openppo.rollout import VLLMEngine
    from openppo.rollout.pool import EnginePool
    from openppo.tasks.arithmetic import make_rows

    path = model_path("smollm2")
    tok = load_tokenizer(path)
    cfg = PPOConfig()
    cfg.model.pretrain = path
    cfg.data.prompt_max_len, cfg.data.generate_max_len = 448, args.max_tokens
    tasks = [row["input"] for row in make_rows(args.sessions, seed=0)]

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    engines = [
        ray.remote(num_cpus=1)(VLLMEngine).remote(
            path, dtype="float32", seed=i, max_model_len=512, kv_cache_bytes=256 << 20, enable_prefix_caching=True
        )
        for i in range(2)
    ]
    ray.get([e.ready.remote() for e in engines], timeout=600)
    turns = SingleTurn(EnginePool(engines, timeout_s=600), cfg)

    def render(messages) -> list[int]:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    def direct() -> int:
        conversations = [[{"role": "user", "content": t}] for t in tasks]
        generated = 0
        for _ in range(2):
            items = [{"prompt_ids": render(c), "index": i} for i, c in enumerate(conversations)]
            samples = turns.generate(
                items, n=1, temperature=1.0, seed=None, version=0, max_new_tokens=[args.max_tokens] * len(items)
            )
            for c, s in zip(conversations, samples):
                c += [
                    {"role": "assistant", "content": tok.decode(s.response_ids, skip_special_tokens=True)},
                    {"role": "user", "content": FOLLOW_UP},
                ]
                generated += len(s.response_ids)
        return generated

    counted = threading.Lock()
    total = [0]

    def agent(base_url: str, task: dict) -> float:
        client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=600)
        messages = [{"role": "user", "content": task["prompt"]}]
        for _ in range(2):
            reply = client.chat.completions.create(model=path, messages=messages, max_tokens=args.max_tokens)
            with counted:
                total[0] += reply.usage.completion_tokens
            messages += [{"role": "assistant", "content": reply.choices[0].message.content}]
            messages += [{"role": "user", "content": FOLLOW_UP}]
        return 0.0

    served = ServedAgents(turns, PythonAgent(agent, "bench"), tok, None)
    items = [{"prompt": t, "prompt_ids": [], "index": i} for i, t in enumerate(tasks)]

    def endpoint() -> int:
        total[0] = 0
        samples = served.generate(items, n=1, temperature=1.0, seed=None, version=0)
        assert not any(s.dropped for s in samples), [s.dropped for s in samples if s.dropped]
        return total[0]

    def rate(fn) -> float:
        start = time.perf_counter()
        tokens = fn()
        return tokens / (time.perf_counter() - start)

    rate(direct), rate(endpoint)  # warm-up: prefix caches, HTTP connections, the server's start
    direct_rates, endpoint_rates = [], []
    for r in range(args.rounds):
        direct_rates.append(rate(direct))
        endpoint_rates.append(rate(endpoint))
        print(f"round {r + 1}: direct {direct_rates[-1]:.1f}, endpoint {endpoint_rates[-1]:.1f} tok/s", flush=True)
    served.close()
    best_direct, best_endpoint = max(direct_rates), max(endpoint_rates)
    mean_ratio = sum(direct_rates) / sum(endpoint_rates)
    print(
        f"endpoint slowdown: {best_direct / best_endpoint:.3f}x best of {args.rounds}, {mean_ratio:.3f}x of the means",
        flush=True,
    )
    emit(
        {
            "bench": "agent_endpoint",
            "sessions": args.sessions,
            "turns": 2,
            "max_tokens": args.max_tokens,
            "engines": 2,
            "direct_tok_s": direct_rates,
            "endpoint_tok_s": endpoint_rates,
            "endpoint_slowdown": best_direct / best_endpoint,
            "endpoint_slowdown_of_means": mean_ratio,
        }
    )
    ray.shutdown()


if __name__ == "__main__":
    main()
