"""The actor: a causal LM that scores given tokens (per-token log-probs at a temperature, optional entropy).

Used for the policy in RL, for SFT and for DPO (policy and reference). Padded batches pass an attention mask;
packed batches (several sequences in one row) pass `position_ids` restarting at 0 and no attention mask.
`use_cache=False` always: with transformers 5 a packed row is silently mis-attended when the cache is on.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from openppo.algorithms import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from openppo.models.loading import finish_model, resolve_model_path
from openppo.models.packing import next_token_values, prepare_inputs, unpack_rows
from openppo.models.varlen_attention import enable_varlen_attention


class ActorOutput(NamedTuple):
    """A NamedTuple, not a dataclass: ZeRO-3 hooks only see tensors inside tuples, lists and dicts."""

    log_probs: torch.Tensor  # [B, T-1]: log p(token t+1 | tokens <= t)
    entropy: torch.Tensor | None  # [B, T-1] or None
    logits: torch.Tensor | None  # [B, T, V] only when asked for


class Actor(nn.Module):
    """Wraps an HF causal LM (optionally with LoRA adapters)."""

    sequence_parallel = None  # a SequenceParallel when packed rows are sharded over a ring (--ring_attn_size)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: torch.dtype, flag: str = "--pretrain",
                        attn_implementation: str = "sdpa", lora_rank: int = 0, lora_alpha: int = 16,
                        lora_dropout: float = 0.0, target_modules: list[str] | None = None,
                        gradient_checkpointing: bool = False) -> "Actor":
        from transformers import AutoModelForCausalLM

        path = resolve_model_path(path, flag)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation,
                                                     trust_remote_code=True)
        model.config.use_cache = False
        enable_varlen_attention(model)  # packed rows without an N x N mask (plain sdpa for padded batches)
        return cls(finish_model(model, task_type="CAUSAL_LM", lora_rank=lora_rank, lora_alpha=lora_alpha,
                                lora_dropout=lora_dropout, target_modules=target_modules,
                                gradient_checkpointing=gradient_checkpointing))

    @property
    def config(self):
        return self.model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, *, temperature: float = 1.0,
                return_entropy: bool | str = False, return_logits: bool = False, pack: bool = False) -> ActorOutput:
        """`return_entropy`: True for an entropy with gradient (an entropy loss term), "log" for a detached one
        (logging only: no graph is kept through the full-vocabulary softmax).

        `pack=True` runs a right-padded batch as one packed row (`--packing_samples`) and returns the same padded
        [B, T-1] outputs: the padding is never computed, the numbers are those of the padded forward.
        """
        input_ids, attention_mask, position_ids, packed = prepare_inputs(input_ids, attention_mask, position_ids, pack)
        ring = self.sequence_parallel if packed is not None else None
        if ring is not None:
            assert not return_logits, "ring attention returns per-token values, not logits"
            num_tokens = input_ids.size(1)
            input_ids, position_ids, labels = ring.shard(input_ids, position_ids)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=False)
        # Position t scores token t + 1. Every position is scored, the last one against a wrapped-around label, and
        # its value dropped afterwards: slicing the [B, T, V] logits instead would make autograd build a zero-filled
        # full-vocabulary gradient for the slice. With a ring, this rank's chunk scores its own tokens' successors
        # (labels cross into the next chunk). The temperature is applied chunk by chunk, without a divided copy.
        logits = out.logits
        if ring is None:
            labels = input_ids.roll(-1, dims=1)
        entropy = None
        if return_entropy == "log":  # for logging: from the same pass as the log-probs, no gradient
            log_probs, entropy = log_probs_and_entropy(logits, labels, temperature)
        else:
            log_probs = log_probs_from_logits(logits, labels, temperature)
            if return_entropy:
                entropy = entropy_from_logits(logits, temperature)
        if ring is not None:  # whole-row values again
            log_probs = ring.gather(log_probs, num_tokens)
            entropy = None if entropy is None else ring.gather(entropy, num_tokens)
        log_probs = log_probs[:, :-1]
        entropy = None if entropy is None else entropy[:, :-1]
        full_logits = out.logits if return_logits else None
        if packed is not None:
            log_probs = next_token_values(log_probs, packed.token_mask)
            entropy = None if entropy is None else next_token_values(entropy, packed.token_mask)
            full_logits = None if full_logits is None else unpack_rows(full_logits, packed.token_mask)
        return ActorOutput(log_probs=log_probs, entropy=entropy, logits=full_logits)
