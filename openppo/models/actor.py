"""The actor: a causal LM that scores given tokens (per-token log-probs at a temperature, optional entropy).

Used for the policy in RL, for SFT and for DPO (policy and reference). It takes a right-padded batch with its
attention mask (or a row packed by the caller: `position_ids` restarting at 0, no mask) and runs it in its
`RowLayout` (padded, packed or ring: `openppo.models.row_layout`), chosen once when the model is set up.
`use_cache=False` always: with transformers 5 a packed row is silently mis-attended when the cache is on.
"""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple

import torch
from torch import nn

from openppo.algorithms import (
    SamplingFilter,
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_from_logits,
    sampling_log_probs,
)
from openppo.models.hf import (
    attention_kernel,
    base_model,
    finish_model,
    first_rank,
    resolve_model_path,
    router_aux_loss,
)
from openppo.models.lm_head import head_scores, unsupported_reason
from openppo.models.row_layout import RowLayout, SharedPrompts
from openppo.models.varlen_attention import enable_varlen_attention
from openppo.models.vision import (
    end_placeholders,
    freeze_vision_tower,
    image_placeholder_ids,
    is_vision_language,
    pixel_inputs,
)
from openppo.utils.images import decode_image_rows
from openppo.utils.transfer import upload

logger = logging.getLogger(__name__)


class ActorOutput(NamedTuple):
    """A NamedTuple, not a dataclass: ZeRO-3 hooks only see tensors inside tuples, lists and dicts."""

    log_probs: torch.Tensor  # [B, T-1]: log p(token t+1 | tokens <= t)
    entropy: torch.Tensor | None  # [B, T-1] or None
    logits: torch.Tensor | None  # [B, T, V] only when asked for
    # [B, T-1] under the rollout engine's top-k/top-p truncation, no gradient; only when a `sampling` filter is given
    sampling_log_probs: torch.Tensor | None = None
    # a mixture-of-experts model's router load-balancing loss (scalar), only with `return_aux_loss`
    aux_loss: torch.Tensor | None = None


class Actor(nn.Module):
    """Wraps an HF causal LM (optionally with LoRA adapters)."""

    layout = RowLayout()  # padded unless set up otherwise (--packing_samples, --ring_attn_size)
    head_chunk_tokens = 0  # --lm_head_chunk_tokens: scored positions per chunk of the vocabulary projection; 0 = off
    processor = None  # a vision-language model's processor: turns the rows' images into its pixel inputs
    compiled_scoring = False  # --torch_compile: the log-probs' and entropy's chunk math compiled too

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # transformers' causal LMs take `logits_to_keep` (an index tensor since 4.50); remote-code models may not
        self._takes_logits_to_keep = "logits_to_keep" in inspect.signature(self.hf_model.forward).parameters

    @property
    def hf_model(self) -> nn.Module:
        """The transformers causal LM (under LoRA: the one the adapters were put into)."""
        return base_model(self.model)

    def chunk_head(self, chunk_tokens: int) -> str | None:
        """Score through the LM head `chunk_tokens` positions at a time (`openppo.models.lm_head`; 0: the model's
        own full logits). Returns why it cannot for this model (the full logits are then kept), else None."""
        why = unsupported_reason(self.hf_model) if chunk_tokens else None
        self.head_chunk_tokens = 0 if why else chunk_tokens
        return why

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        dtype: torch.dtype,
        flag: str = "--pretrain",
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
        freeze_visual_encoder: bool = False,
    ) -> Actor:
        """A vision-language checkpoint loads as transformers' image-text-to-text model (the decoder, its vision
        tower and connector); `freeze_visual_encoder` then freezes all but its language model
        (`openppo.models.vision`). Its rows are never packed (image prompts refuse --packing_samples), so its
        attention stays transformers' own."""
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

        path = resolve_model_path(path, flag)
        vision = is_vision_language(AutoConfig.from_pretrained(path, trust_remote_code=True))
        model = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
            path, dtype=dtype, attn_implementation=attention_kernel(attn_implementation, dtype), trust_remote_code=True
        )
        model.config.use_cache = False
        if vision:
            if freeze_visual_encoder:
                freeze_vision_tower(model)
        else:
            enable_varlen_attention(model)  # packed rows without an N x N mask (plain sdpa for padded batches)
        actor = cls(
            finish_model(
                model,
                task_type="CAUSAL_LM",
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
        actor.compiled_scoring = torch_compile
        if vision:
            from transformers import AutoProcessor

            actor.processor = AutoProcessor.from_pretrained(path, trust_remote_code=True)
        return actor

    @property
    def config(self):
        return self.model.config

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        return_entropy: bool | str = False,
        return_logits: bool = False,
        score_mask: torch.Tensor | None = None,
        sampling: SamplingFilter | None = None,
        return_aux_loss: bool = False,
        pixels: dict[str, torch.Tensor] | None = None,
        images: torch.Tensor | None = None,
    ) -> ActorOutput:
        """`attention_mask` and `score_mask` may be the host's copies for a model on a GPU (`fit_experience` passes
        them so): the row layout is then read on the host, without waiting on the GPU (`openppo.models.row_layout`).

        `return_entropy`: True for an entropy with gradient (an entropy loss term), "log" for a detached one
        (logging only: no graph is kept through the full-vocabulary softmax).

        `score_mask` [B, T-1] (the action mask): only the positions it selects are scored; the others hold 0. The LM
        head and the full-vocabulary softmax then skip the prompt, often most of an RL row (as TRL's
        `logits_to_keep`). Ignored with a ring or `return_logits`.

        `sampling` (an active top-k/top-p filter): also score the tokens under the engine's truncated distribution,
        from the same logits (`openppo.algorithms.sampling`), for comparisons with the engine's log-probs.

        `return_aux_loss` (a mixture-of-experts model, --aux_loss_coef): also the router's load-balancing loss over
        the row's tokens, as transformers computes it (Switch Transformer's, Fedus et al. 2021, eq. 4).

        With a shared-prompt layout the rows' prompts end where `score_mask` first selects a position; the scored
        positions are then read from the shared row (`SharedScoring`), each against its own row's next token.

        `pixels` (a vision-language model; `openppo.models.vision.pixel_inputs` of the rows' images): the image
        inputs, which the model encodes into its rows' image-token positions. Padded rows only. `images` (a training
        batch's `images`, `openppo.utils.images.encode_image_rows`): the rows' images, which the model's processor
        makes into `pixels` here.
        """
        if images is not None and pixels is None:
            pixels = self.pixels_of(images)
        prompt_lens = prompt_lengths(score_mask) if score_mask is not None and self.layout.share_prompts else None
        rows = self.layout.rows(input_ids, attention_mask, position_ids, prompt_lens)
        model_ids = rows.input_ids  # what the model reads; `rows.labels` keep the sampled tokens
        placeholders = image_placeholder_ids(self.config) if self.processor is not None else []
        if placeholders and rows.attention_mask is not None:  # padded rows, the ones that carry images
            # a response the engine stopped at a sampled image placeholder ends with it
            model_ids = end_placeholders(model_ids, rows.attention_mask, placeholders, self.config.pad_token_id or 0)
            if not pixels and bool(torch.isin(model_ids, torch.tensor(placeholders, device=model_ids.device)).any()):
                # the image tokens would be scored as text: log-probs off by ~0.04 nats, with no error of its own
                raise ValueError("rows with image tokens reached the model without their images")
        assert rows.ring is None or not return_logits, "ring attention returns per-token values, not logits"
        assert rows.shared is None or not return_logits, "a shared-prompt row returns per-token values, not logits"
        chunked = self.head_chunk_tokens > 0 and not return_logits
        takes_keep = self._takes_logits_to_keep or chunked
        keep = shared = None
        if rows.shared is not None:
            shared = SharedScoring(rows.shared, input_ids, score_mask)
            keep = shared.keep if takes_keep else None
        elif score_mask is not None and rows.ring is None and not return_logits and takes_keep:
            keep = upload(scored_positions(score_mask, rows.token_mask), rows.input_ids.device)
        inputs = dict(input_ids=model_ids, attention_mask=rows.attention_mask, position_ids=rows.position_ids)
        assert not pixels or (rows.ring is None and rows.shared is None), "image rows are padded rows"
        inputs.update(pixels or {})
        if self.processor is not None and rows.attention_mask is not None:
            # a vision-language model places its positions itself (Qwen2-VL's 3-D M-RoPE over the image grid); on
            # right-padded rows a 1-D model's own positions are the mask's
            inputs["position_ids"] = None
        router = {"output_router_logits": True} if return_aux_loss else {}
        if chunked:  # the decoder's hidden states, to go through the head chunk by chunk (`openppo.models.lm_head`)
            # (a vision-language model's own base model: it puts the image features into the decoder's input)
            body = self.hf_model.model if pixels else self.hf_model.get_decoder()
            out = body(**inputs, use_cache=False, **router)
            scores = out.last_hidden_state
            if keep is not None:
                scores = scores[:, keep]
        else:
            out = self.model(**inputs, use_cache=False, **router, **({} if keep is None else {"logits_to_keep": keep}))
            scores = out.logits
        # Position t scores token t + 1 (`rows.labels`; with a ring, this rank's chunk scores its own tokens'
        # successors, across into the next chunk). Every position is scored, the last one against a wrapped-around
        # label, and its value dropped afterwards: slicing the [B, T, V] logits instead would make autograd build a
        # zero-filled full-vocabulary gradient for the slice. The temperature is applied chunk by chunk, without a
        # divided copy.
        if shared is not None:  # every scored position of the grid, against its own row's next token
            scores = (scores[0] if keep is not None else scores[0, shared.keep]).index_select(0, shared.expand)
            scores, labels = scores.unsqueeze(0), shared.labels
        else:
            labels = rows.labels if keep is None else rows.labels[:, keep]
        if chunked:
            log_probs, entropy, behaviour = head_scores(
                scores,
                self.hf_model.get_output_embeddings(),
                labels,
                temperature,
                chunk_tokens=self.head_chunk_tokens,
                entropy=return_entropy,
                sampling=sampling,
                compiled=self.compiled_scoring,
            )
        else:
            log_probs, entropy, behaviour = _logit_scores(
                scores, labels, temperature, return_entropy, sampling, self.compiled_scoring
            )

        def per_token(values: torch.Tensor | None) -> torch.Tensor | None:
            """Values of the scored positions -> [B, T-1] on the caller's (padded) grid."""
            if values is None:
                return None
            if shared is not None:
                return shared.to_grid(values)
            if keep is not None:  # back on the row's positions, zeros where nothing was scored
                values = scatter_positions(values, keep, rows.input_ids.size(1))
            return rows.next_token_grid(values)

        return ActorOutput(
            log_probs=per_token(log_probs),
            entropy=per_token(entropy),
            logits=rows.to_grid(out.logits) if return_logits else None,
            sampling_log_probs=per_token(behaviour),
            aux_loss=self._aux_loss(out, rows) if return_aux_loss else None,
        )

    def pixels_of(self, images: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The pixel inputs of a batch's encoded image rows (None when no row has an image)."""
        rows = decode_image_rows(images)
        if not any(rows):
            return None
        assert self.processor is not None, "image rows need a vision-language model"
        param = next(p for p in self.model.parameters() if p.is_floating_point())
        return {
            k: v.to(device=param.device, dtype=param.dtype if v.is_floating_point() else v.dtype)
            for k, v in pixel_inputs(self.processor, rows).items()
        }

    def _aux_loss(self, out, rows) -> torch.Tensor:
        """transformers' router loss, but over a shared-prompt row weighted as the rows it stands for (and from the
        decoder's router logits when the head is chunked: the causal LM's forward, which adds it, did not run)."""
        if rows.shared is None and getattr(out, "aux_loss", None) is not None:
            return out.aux_loss
        weights = rows.attention_mask if rows.shared is None else rows.router_weights()
        return router_aux_loss(self.hf_model, out.router_logits, weights)


def use_chunked_head(model: nn.Module, chunk_tokens: int) -> None:
    """--lm_head_chunk_tokens on a model of a run (`Actor.chunk_head`); one line (rank 0) where it has no effect."""
    if not chunk_tokens:
        return
    why = model.chunk_head(chunk_tokens) if isinstance(model, Actor) else "a scalar-head model has no vocabulary head"
    if why and first_rank():
        logger.warning("--lm_head_chunk_tokens has no effect on %s: %s", type(model).__name__, why)


def _logit_scores(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    entropy: bool | str,
    sampling: SamplingFilter | None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`head_scores` from the model's own logits; `compiled`: the log-probs' chunk math compiled."""
    if entropy == "log":  # for logging: from the same pass as the log-probs, no gradient
        log_probs, ent = log_probs_and_entropy(logits, labels, temperature, compiled=compiled)
    else:
        log_probs = log_probs_from_logits(logits, labels, temperature, compiled=compiled)
        ent = entropy_from_logits(logits, temperature) if entropy else None
    active = sampling is not None and sampling.active
    return log_probs, ent, sampling_log_probs(logits, labels, temperature, sampling) if active else None


def prompt_lengths(score_mask: torch.Tensor) -> torch.Tensor:
    """[B] tokens before each row's first scored token: position t scores token t + 1, so a row whose first scored
    position is t has a prompt of t + 1 tokens (a row with none scored: all of it)."""
    first = torch.where(score_mask.bool().any(-1), score_mask.bool().int().argmax(-1), score_mask.size(1))
    return first + 1


class SharedScoring:
    """Which positions of a shared-prompt row score which tokens of the padded grid.

    Grid position (b, t) scores token (b, t + 1) from the row's position `grid_index[b, t]`. The last prompt
    position of a group scores a different first response token for each of its rows, so the row's positions
    (`keep`, once each, for the LM head) are expanded to one per scored grid position (`expand`). Worked out on
    the host (the row's host grid, the host's score mask) and uploaded: on a GPU nothing waits for it."""

    def __init__(self, row: SharedPrompts, input_ids: torch.Tensor, score_mask: torch.Tensor | None):
        grid_index = row.host_grid_index if row.host_grid_index is not None else row.grid_index
        wanted = (grid_index[:, :-1] >= 0) & (grid_index[:, 1:] >= 0)
        if score_mask is not None:
            wanted &= score_mask.bool().to(wanted.device)
        b, t = wanted.nonzero(as_tuple=True)
        if b.numel() == 0:  # a no-op micro-batch still scores one position: its backward reaches every weight
            b, t = b.new_zeros(1), t.new_zeros(1)
        keep, expand = torch.unique(grid_index[b, t], return_inverse=True)
        device = input_ids.device
        self.b, self.t, self.keep, self.expand = (upload(x, device) for x in (b, t, keep, expand))
        self.labels = input_ids[self.b, self.t + 1].unsqueeze(0)
        self.shape = (grid_index.size(0), grid_index.size(1) - 1)

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """[1, K] values of the scored positions -> [B, T-1] with zeros elsewhere (autograd-aware)."""
        return values.new_zeros(self.shape).index_put((self.b, self.t), values[0])


def scored_positions(score_mask: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """The model-input positions to score [K] for a next-token mask [B, T-1]: on the packed row when `token_mask`
    (the packed tokens' places on the padded grid) is given, else every column some row needs. Never empty: a
    micro-batch with nothing to score (a no-op one) still scores position 0, so its backward reaches every weight
    as the other ranks' collectives expect."""
    grid = torch.nn.functional.pad(score_mask.bool(), (0, 1))  # [B, T]: position t scores token t + 1
    wanted = grid[token_mask] if token_mask is not None else grid.any(0)
    keep = wanted.nonzero().squeeze(1)
    return keep if keep.numel() else keep.new_zeros(1)


def scatter_positions(values: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
    """[B, K] values of the scored positions -> [B, width] with zeros elsewhere (autograd-aware)."""
    return values.new_zeros((values.size(0), width)).index_copy(1, keep, values)
