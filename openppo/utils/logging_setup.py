"""Process-wide logging format; quiets the chattiest libraries."""

from __future__ import annotations

import logging
import os
import sys
import warnings


def setup_logging(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"[rank{rank}] "
    logging.basicConfig(level=level, stream=sys.stdout, force=True,
                        format=f"%(asctime)s {prefix}%(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls collectives torch 2.13 marks deprecated, once per call: pure noise in every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
