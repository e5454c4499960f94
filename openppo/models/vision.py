"""Vision-language models: which models are, which of their parameters are the language model, the frozen vision
tower, and the pixel inputs of a batch of image prompts.

A vision-language checkpoint (transformers' `AutoModelForImageTextToText`: Idefics3/SmolVLM, Qwen2-VL, LLaVA...) has
a `vision_config`. Its parameters split into the language model (the decoder the text flows through, with its
embeddings, and the output head) and the rest: the vision tower and the connector that projects image features into
the decoder's space. `--freeze_visual_encoder` freezes the rest, as OpenRLHF does (it keeps `language_model.*` and
`lm_head` trainable; here the split is by the model's own `get_decoder()` and `get_output_embeddings()`, since the
decoder's name differs between architectures: `text_model` in Idefics3, `language_model` in Qwen2-VL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from openppo.models.hf import freeze_parameters


def is_vision_language(config) -> bool:
    """Whether a model config is a vision-language model's (it has a vision tower)."""
    return getattr(config, "vision_config", None) is not None


def language_parameter_names(model: nn.Module) -> set[str]:
    """Names (in `model.named_parameters()`) of the language model's parameters: the decoder's and the head's."""
    language = {id(p) for p in model.get_decoder().parameters()}
    head = model.get_output_embeddings()
    if head is not None:
        language |= {id(p) for p in head.parameters()}
    return {name for name, p in model.named_parameters() if id(p) in language}


def decoder_linear_names(model: nn.Module, suffixes: Sequence[str] | None) -> list[str]:
    """Full names of the decoder's linear layers (LoRA's targets in a vision-language model), those whose last name
    part is in `suffixes` (None: all of them). The LM head is not among them, as PEFT's own `all-linear` leaves it."""
    decoder = {id(m) for m in model.get_decoder().modules()}
    return [
        name
        for name, module in model.named_modules()
        if id(module) in decoder
        and isinstance(module, nn.Linear)
        and (suffixes is None or name.rpartition(".")[2] in suffixes)
    ]


def freeze_vision_tower(model: nn.Module) -> list[str]:
    """Freeze every parameter outside the language model (`--freeze_visual_encoder`); returns their names, which the
    model also keeps as `FROZEN_PARAMETERS`: the weight sync leaves them out, since the engines loaded the same
    tensors from the same checkpoint and nothing changes them."""
    keep = language_parameter_names(model)
    return freeze_parameters(model, [name for name, _ in model.named_parameters() if name not in keep])


def pixel_inputs(processor, images: Sequence[Sequence[Any]]) -> dict[str, torch.Tensor]:
    """The image processor's tensors (`pixel_values`, and the model's extra image inputs such as Idefics3's
    `pixel_attention_mask` or Qwen2-VL's `image_grid_thw`) for rows of images, in row order. A row may hold none
    (the processor pads it, or has nothing of it to place), but not every row: there would be no pixel input."""
    from openppo.utils.images import open_image

    assert any(images), "pixel_inputs: no row has an image"
    decoded = [[open_image(image) for image in row] for row in images]
    out = processor.image_processor(images=decoded, return_tensors="pt")
    return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}


def image_placeholder_ids(config) -> list[int]:
    """The token ids that the model's processor expands into image features and its forward fills with them.

    A policy can sample one (it is in the vocabulary). vLLM then feeds it back as a plain token, but transformers'
    forward would take it for an image slot and fail ("Number of elements of source < number of ones in mask"),
    so the engines stop a response at it (`VLLMEngine`) and the actor never feeds it back (`end_placeholders`).
    """
    ids = {getattr(config, name, None) for name in ("image_token_id", "image_token_index")}
    return sorted(i for i in ids if isinstance(i, int))


def end_placeholders(input_ids: torch.Tensor, attention_mask: torch.Tensor, placeholders: Sequence[int], filler: int):
    """`input_ids` with each row's last token replaced by `filler` where it is an image placeholder.

    A response the engine stopped at a sampled placeholder ends with it. Its log-prob comes from the position before,
    and no later position attends to it, so the model may read any other token there: the scores stay exact, and
    the model's image slots are the prompt's alone. Other placeholders are left for the caller's checks.
    """
    if not placeholders:
        return input_ids
    width = attention_mask.shape[1]
    last = width - 1 - attention_mask.flip(1).to(torch.long).argmax(1)  # each row's last real position
    rows = torch.arange(input_ids.shape[0], device=input_ids.device)
    ending = torch.isin(input_ids[rows, last], torch.tensor(list(placeholders), device=input_ids.device))
    ending &= attention_mask[rows, last].bool()  # an all-padding row has no last token
    if not bool(ending.any()):
        return input_ids
    out = input_ids.clone()
    out[rows[ending], last[ending]] = filler
    return out
