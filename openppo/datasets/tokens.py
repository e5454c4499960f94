"""Tokenizing rendered text segment by segment, with a per-token target mask.

Each segment (prompt, response, or a conversation turn) is tokenized on its own and the ids are concatenated.
That is how the tokens arise at inference too: the prompt is tokenized alone and the response is generated
after it, so no BPE merge ever crosses the prompt/response boundary, and the target mask is exact.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from openppo.datasets.conversation import Segments


def bos_ids(tokenizer, *, apply_chat_template: bool) -> list[int]:
    """Tokens to put before the text: none with a chat template (it writes its own), else BOS if defined."""
    if apply_chat_template or tokenizer.bos_token_id is None:
        return []
    return [tokenizer.bos_token_id]


def encode_segments(tokenizer, segments: Segments, prefix: Sequence[int] = ()) -> tuple[list[int], list[int]]:
    """(token ids, target mask) of the concatenated segments; `prefix` tokens are never targets.

    `add_special_tokens=False`: special tokens written in the text (chat markers, the EOS appended to a
    response) are still parsed as such, but the tokenizer adds no BOS/EOS of its own.
    """
    encoded = tokenizer([text for text, _ in segments], add_special_tokens=False)["input_ids"] if segments else []
    ids: list[int] = []
    mask: list[int] = []
    for seg_ids, (_, target) in zip(encoded, segments):
        ids.extend(seg_ids)
        mask.extend([int(target)] * len(seg_ids))
    # The text may already start with BOS (an --input_template that writes it): do not double it.
    if prefix and ids[: len(prefix)] != list(prefix):
        ids = list(prefix) + ids
        mask = [0] * len(prefix) + mask
    return ids, mask


def num_context_tokens(mask: Sequence[int]) -> int:
    """Tokens before the first target: the part of a sample that is prompt only."""
    for i, m in enumerate(mask):
        if m:
            return i
    return len(mask)


def as_tensors(ids: list[int], mask: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    # A large pre-tokenized set stays small as int32 ids and uint8 masks; items are cast to long on access.
    return torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.uint8)
