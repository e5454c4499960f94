"""openppo: an RLHF trainer (SFT, reward model, DPO, PPO/GRPO family) on Ray, DeepSpeed and vLLM."""

__version__ = "0.1.0"
