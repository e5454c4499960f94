"""Peak host memory of one actor rank's training, for the planner test: `python -m tests.ppo.memory_probe MODEL
STAGE DTYPE` prints one JSON line with the peak RSS growth (GiB) from just before the model loads.

One rank (gloo), DeepSpeed ZeRO STAGE with AdamW, micro-batches of MICRO rows x (PROMPT + RESPONSE) tokens, padded
(not packed), STEPS optimizer steps of ROWS rows each: what `openppo.cli.plan` sees with the same flags. The first step
allocates Adam's states after the micro-batches' activations are freed; from the second on, the states, the gradients
and a micro-batch's activations live at once, which is the peak of any real run and what the plan adds up. The peak
is the kernel's high-water mark of the RSS (ru_maxrss: no short peak is missed, and no sampling thread competes with
the step); a fresh process, so nothing else this test session did is counted.
"""

from __future__ import annotations

import json
import os
import resource
import sys

ROWS, MICRO, PROMPT, RESPONSE, STEPS = 8, 4, 32, 64, 2


def main(model: str, stage: int, dtype: str) -> dict:
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from openppo.strategy.distributed import free_port

    os.environ["MASTER_PORT"] = str(free_port())
    import psutil
    import torch

    from openppo.models.actor import Actor
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, fit_experience
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from tests.model_cache import smollm2_dir, tiny_model_dir
    from tests.ppo.rank_helpers import train_engine

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=stage, param_dtype=dtype, dist_timeout=120),
        train_batch_size=ROWS,
        micro_batch_size=MICRO,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    base = psutil.Process().memory_info().rss
    path = str(tiny_model_dir() if model == "tiny" else smollm2_dir())
    engine = train_engine(strategy, Actor.from_pretrained(path, dtype=strategy.torch_dtype), lr=1e-6, steps=2 * STEPS)
    width = PROMPT + RESPONSE
    rows = ROWS * STEPS
    seqs = torch.randint(100, 1000, (rows, width), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(rows, width - 1)
    mask[:, PROMPT - 1 :] = 1
    data = {
        "sequences": seqs,
        "attention_mask": torch.ones_like(seqs),
        "action_mask": mask,
        "advantages": torch.randn(rows, width - 1) * mask,
    }
    loss_fn = actor_loss(
        engine,
        AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0),
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=RESPONSE,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )
    fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(rows=MICRO),
        rows_per_step=ROWS,
        epochs=1,
        world_size=1,
        seed=0,
        device=strategy.device,
    )
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_growth_gib": (peak - base) / 2**30}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
