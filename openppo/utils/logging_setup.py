"""Process-wide logging format; quiets the chattiest libraries."""

from __future__ import annotations

import logging
import os
import sys
import warnings


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at emit time (it may be swapped, e.g. by test capture)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


def setup_logging(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"[rank{rank}] "
    handler = _StdoutHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls collectives torch 2.13 marks deprecated, once per call: pure noise in every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
