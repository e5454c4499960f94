"""Benchmark: bytes per weight sync, delta (--vllm_sync_delta) against full, over real training steps.

    .venv/bin/python bench/delta_sync.py                      # SmolLM2-135M, 4 steps of AdamW at lr 1e-6
    .venv/bin/python bench/delta_sync.py --lr 1e-5 --steps 8

Trains the model in fp32 (as the trainer's master weights) with AdamW on next-token loss over batches of the
arithmetic task's prompts, and after every step runs the trainer's side of a sync for a bf16 engine and for an
fp32 engine: `DeltaEncoder` over the full weights (`iter_full_weights`), packed into buckets as a sync packs them
(`iter_buckets`). The bytes counted are the buckets' (what a broadcast, a hand-over or the object store moves; the
engine unpacks exactly these). The first sync of a delta run is full; steps 2.. are the delta syncs. Also timed: the
encoding (the comparison with the last sync's copy) against packing the full weights, both on this process. The last
line printed is one JSON object with the per-step figures, the ratios (`delta_over_full_bytes` per engine dtype,
mean over the delta syncs) and the device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import MODELS, emit, model_path  # noqa: E402 (after the path set-up)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--steps", type=int, default=4, help="training steps, one sync after each")
    parser.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (train_ppo_ray's default)")
    parser.add_argument("--batch", type=int, default=8, help="prompts per step")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openppo.rollout.buckets import DEFAULT_BUCKET_BYTES, iter_buckets
    from openppo.rollout.delta import DeltaEncoder
    from openppo.rollout.sender import iter_full_weights
    from openppo.tasks.arithmetic import make_rows

    torch.manual_seed(0)
    path = model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rows = make_rows(args.steps * args.batch, seed=0)
    encoders = {"bf16": DeltaEncoder(torch.bfloat16), "fp32": DeltaEncoder(torch.float32)}

    def wire_bytes(named, dtype) -> int:
        return sum(b.meta.nbytes for b in iter_buckets(named, DEFAULT_BUCKET_BYTES, dtype=dtype))

    steps = []
    for step in range(args.steps):
        texts = [f"{r['input']} {r['label']}" for r in rows[step * args.batch : (step + 1) * args.batch]]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        record = {"step": step + 1, "loss": round(loss.item(), 4)}
        for name, encoder in encoders.items():
            start = time.perf_counter()
            full = wire_bytes(iter_full_weights(model, rank=0), encoder.dtype)
            full_s = time.perf_counter() - start
            start = time.perf_counter()
            sent = wire_bytes(encoder.encode(iter_full_weights(model, rank=0)), encoder.dtype)
            delta_s = time.perf_counter() - start
            record[name] = {
                "full_mib": round(full / 2**20, 2),
                "delta_mib": round(sent / 2**20, 3),
                "changed": round(encoder.stats.sent / encoder.stats.elements, 5),
                "full_pack_s": round(full_s, 3),
                "delta_encode_pack_s": round(delta_s, 3),
            }
        steps.append(record)
        print(record, flush=True)

    later = steps[1:] or steps
    ratios = {
        f"{name}_delta_over_full_bytes": round(
            statistics.mean(s[name]["delta_mib"] / s[name]["full_mib"] for s in later), 4
        )
        for name in encoders
    }
    emit(
        {
            "bench": "delta_sync",
            "model": args.model,
            "lr": args.lr,
            "steps": steps,
            **ratios,
            "threads": torch.get_num_threads(),
        }
    )


if __name__ == "__main__":
    main()
