"""A transformer with a scalar head: the critic (a value per token) and the reward model (score at the last token).

Built on transformers' `AutoModelForSequenceClassification` with `num_labels=1`, so the saved folder is an
ordinary HF checkpoint (`*ForSequenceClassification`, head named `score`) that any HF tool can load. The head is
applied to every position ourselves rather than through the HF forward, which pools at the last non-pad token by
looking for pad ids and cannot handle packed rows.

Normalisation statistics live in the config as `value_mean` / `value_std` (0 / 1 until a reward-model run
measures them), so they travel with the folder.
"""

from __future__ import annotations

import torch
from torch import nn

from openppo.models.hf import attention_kernel, base_model, finish_model, resolve_model_path, router_aux_loss
from openppo.models.row_layout import RowLayout
from openppo.models.varlen_attention import enable_varlen_attention


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each right-padded row: [B, T] -> [B]."""
    positions = torch.arange(attention_mask.size(1), device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(dim=-1)


class ScalarModel(nn.Module):
    """Backbone + linear head giving one scalar per token."""

    layout = RowLayout()  # padded unless set up otherwise (--packing_samples, --ring_attn_size)

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype,
        flag: str,
        attn_implementation: str = "sdpa",
        lora_rank: int = 0,
        lora_alpha: int = 16,
        lora_dropout: float = 0.0,
        target_modules: list[str] | None = None,
        gradient_checkpointing: bool = False,
        reentrant_checkpointing: bool = False,
        use_liger_kernel: bool = False,
        torch_compile: bool = False,
        freeze_moe_router: bool = False,
    ) -> ScalarModel:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        path = resolve_model_path(path, flag)
        config = AutoConfig.from_pretrained(path, trust_remote_code=True)
        config.num_labels = 1
        config.use_cache = False
        if getattr(config, "pad_token_id", None) is None:
            # HF's classification forward needs one; ours never uses it.
            config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
        model = AutoModelForSequenceClassification.from_pretrained(
            path,
            config=config,
            dtype=dtype,
            attn_implementation=attention_kernel(attn_implementation, dtype),
            trust_remote_code=True,
        )
        enable_varlen_attention(model)  # packed rows without an N x N mask (plain sdpa for padded batches)
        return cls(
            finish_model(
                model,
                task_type="SEQ_CLS",
                lora_rank=lora_rank,
                lora_alpha=lora_alpha,
                lora_dropout=lora_dropout,
                target_modules=target_modules,
                gradient_checkpointing=gradient_checkpointing,
                reentrant_checkpointing=reentrant_checkpointing,
                use_liger_kernel=use_liger_kernel,
                torch_compile=torch_compile,
                freeze_moe_router=freeze_moe_router,
            )
        )

    @property
    def hf_model(self) -> nn.Module:
        """The transformers model (under any PEFT wrapper)."""
        return base_model(self.model)

    @property
    def config(self):
        return self.hf_model.config

    def normalization(self) -> tuple[float, float]:
        return float(getattr(self.config, "value_mean", 0.0)), float(getattr(self.config, "value_std", 1.0))

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        normalize: bool = False,
        return_aux_loss: bool = False,
        prompt_lens: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Per-token scalars [B, T] (fp32) of a right-padded batch, computed in the model's `layout`; with
        `return_aux_loss` (a mixture-of-experts model, --aux_loss_coef) also the router's load-balancing loss.
        `prompt_lens` [B]: with a shared-prompt layout, rows with the same prompt compute it once."""
        rows = self.layout.rows(input_ids, attention_mask, position_ids, prompt_lens)
        hf = self.hf_model
        backbone = getattr(hf, hf.base_model_prefix)
        inputs = dict(input_ids=rows.input_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids)
        if return_aux_loss:
            inputs["output_router_logits"] = True
        out = backbone(**inputs, use_cache=False)
        values = rows.to_grid(hf.score(out.last_hidden_state).squeeze(-1).float())
        if normalize:
            mean, std = self.normalization()
            values = (values - mean) / std
        if return_aux_loss:
            return values, router_aux_loss(hf, out.router_logits, rows.router_weights())
        return values

    def score_last(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, *, normalize: bool = False
    ) -> torch.Tensor:
        """Reward-model score of each right-padded sequence, read at its last real token: [B]."""
        values = self.forward(input_ids, attention_mask, normalize=normalize)
        return values.gather(1, last_token_index(attention_mask).unsqueeze(1)).squeeze(1)
