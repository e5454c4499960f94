"""Print docs/flags.md: every flag of every CLI with its default and meaning."""

from __future__ import annotations

import sys


def clis() -> dict[str, type]:
    from openppo.cli.lora_combiner import LoraCombinerConfig
    from openppo.cli.make_task import MakeTaskConfig
    from openppo.cli.serve_rm import ServeRMConfig
    from openppo.ppo.config import PPOConfig
    from openppo.trainers.configs import DPOConfig, RMConfig, SFTConfig

    return {
        "train_ppo_ray": PPOConfig,
        "train_sft": SFTConfig,
        "train_rm": RMConfig,
        "train_dpo": DPOConfig,
        "lora_combiner": LoraCombinerConfig,
        "make_task": MakeTaskConfig,
        "serve_rm": ServeRMConfig,
    }


def main() -> int:
    from openppo.config.docs import render

    sys.stdout.write(render(clis()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
