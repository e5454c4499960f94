"""Write a built-in task's data set as JSONL: `python -m openppo.cli.make_task --task arithmetic --out data.jsonl`.

arithmetic: 'What is a + b?' prompts (columns input, output, label). shapes: a picture of 1..max_shapes shapes and
"How many shapes are in the picture?" for vision-language models (columns prompt, images, label; the images are
PNG data URIs inside the file).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from openppo.cli.runner import run_cli
from openppo.config.schema import opt
from openppo.errors import require
from openppo.tasks import arithmetic, shapes
from openppo.utils.paths import check_output_file


@dataclass
class MakeTaskConfig:
    task: str = opt("arithmetic", "which built-in task", choices=("arithmetic", "shapes"))
    out: str = opt(None, "output .jsonl path", metavar="PATH")
    num_samples: int = opt(512, "rows to generate")
    seed: int = opt(0, "generator seed")
    max_operand: int = opt(9, "operands are drawn from 0..max_operand")
    ops: str = opt("+", "operators to draw from, e.g. '+-*'")
    max_shapes: int = opt(4, "shapes: each picture holds 1..max_shapes shapes (at most 9)")
    image_size: int = opt(56, "shapes: picture side in pixels")


def make(cfg: MakeTaskConfig) -> None:
    require(bool(cfg.out), "--out is required: the .jsonl file to write")
    check_output_file(cfg.out, "--out")
    require(cfg.num_samples > 0, f"--num_samples must be positive, got {cfg.num_samples}")
    require(
        cfg.max_operand >= 0,
        f"--max_operand must be >= 0 (operands are drawn from 0..max_operand), got {cfg.max_operand}",
    )
    require(set(cfg.ops) <= set("+-*") and cfg.ops != "", f"--ops: use characters from '+-*', got {cfg.ops!r}")
    if cfg.task == "shapes":
        rows = shapes.make_rows(cfg.num_samples, seed=cfg.seed, max_shapes=cfg.max_shapes, image_size=cfg.image_size)
    else:
        rows = arithmetic.make_rows(cfg.num_samples, seed=cfg.seed, max_operand=cfg.max_operand, ops=cfg.ops)
    print(arithmetic.write_jsonl(rows, cfg.out))


def main(argv=None) -> int:
    return run_cli(make, MakeTaskConfig, "openppo.cli.make_task", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
