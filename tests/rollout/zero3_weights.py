"""Run as `python -m tests.rollout.zero3_weights`: ZeRO-3 (world size 1, CPU) -> iter_full_weights == checkpoint.

Prints one JSON line. A separate process because DeepSpeed initialises torch.distributed and patches modules.
"""

from __future__ import annotations

import json
import os
import sys


def main() -> None:
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "DS_ACCELERATOR": "cpu"})
    import deepspeed
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from openppo.models.actor import Actor
    from openppo.rollout.sender import iter_full_weights, unwrap_model
    from openppo.strategy.distributed import init_distributed
    from tests.model_cache import tiny_model_dir

    init_distributed(timeout_s=60)  # gloo on an in-process store, no JIT build of DeepSpeed's shm op
    reference = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).named_parameters())
    config = {
        "zero_optimization": {"stage": 3},
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "zero_allow_untested_optimizer": True,
    }
    holder = HfDeepSpeedConfig(config)  # noqa: F841 -- makes from_pretrained partition under ZeRO-3
    actor = Actor(AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32))
    engine, *_ = deepspeed.initialize(model=actor, optimizer=torch.optim.SGD(actor.parameters(), lr=0.0), config=config)
    first = next(unwrap_model(engine).parameters())
    named = list(iter_full_weights(engine))
    result = {
        "partitioned": hasattr(first, "ds_id") and first.numel() == 0,
        "names_match": [n for n, _ in named] == list(reference),
        "values_match": all(torch.equal(t, reference[n]) for n, t in named),
        "released_after": next(unwrap_model(engine).parameters()).numel() == 0,
    }
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
