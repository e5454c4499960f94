"""Preference pairs for reward-model and DPO training.

Two data layouts:
* `prompt_key` set: the prompt column (string or messages) is shared, `chosen_key` / `rejected_key` hold the
  two responses (strings, or with the chat template lists of messages that follow the prompt);
* `prompt_key` None: `chosen_key` / `rejected_key` hold whole conversations whose last message is the
  assistant reply; everything before it is that side's prompt. Plain strings then have an empty prompt
  (the whole text is the response), which needs no chat template.

Each side is tokenized like an SFT sample (loss mask = response tokens). A side longer than `max_len` keeps its
first `max_len - 1` tokens plus its final EOS token: the reward model reads its score at the last token, so
that token must be the end of the response for every sequence, truncated or not. A pair is dropped when the
prompt alone of either side has `max_len` tokens or more.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from openppo.datasets.loading import require_columns
from openppo.datasets.sft import PROGRESS_MIN_SAMPLES, collate_padded
from openppo.datasets.templates import (
    as_messages,
    as_tensors,
    bos_ids,
    encode_segments,
    num_context_tokens,
    render_prompt,
    render_response,
    validate_template_options,
)
from openppo.errors import UserError, require

logger = logging.getLogger(__name__)


class PreferenceDataset(Dataset):
    """Item = {"chosen_ids", "chosen_loss_mask", "rejected_ids", "rejected_loss_mask"}: LongTensor[L] each, and
    with `margin_key` (--margin_loss) "margin": the pair's required score gap from that column (0 where empty)."""

    def __init__(
        self,
        ds: datasets.Dataset,
        tokenizer,
        *,
        max_len: int,
        prompt_key: str | None,
        chosen_key: str,
        rejected_key: str,
        apply_chat_template: bool,
        input_template: str | None,
        margin_key: str | None = None,
    ):
        require(max_len > 1, f"--max_len must be at least 2 for preference pairs, got {max_len}")
        if margin_key is not None and margin_key not in ds.column_names:
            raise UserError(
                f"--margin_loss: the preference data has no '{margin_key}' column (columns: "
                f"{', '.join(ds.column_names)}); add the per-pair margins or drop --margin_loss"
            )
        validate_template_options(tokenizer, apply_chat_template=apply_chat_template, input_template=input_template)
        keys = {"--prompt_key": prompt_key, "--chosen_key": chosen_key, "--rejected_key": rejected_key}
        require_columns(ds, keys, "the preference data")
        self.tokenizer = tokenizer
        self.prompt_key, self.chosen_key, self.rejected_key = prompt_key, chosen_key, rejected_key
        self.options = dict(apply_chat_template=apply_chat_template, input_template=input_template)
        self.prefix = bos_ids(tokenizer, apply_chat_template=apply_chat_template)

        self.pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.margins: list[float] | None = [] if margin_key is not None else None
        too_long = 0
        rows = ds.select_columns([k for k in (*keys.values(), margin_key) if k is not None])
        for row in tqdm(rows, desc="tokenizing preference data", disable=len(rows) <= PROGRESS_MIN_SAMPLES):
            chosen = self._encode(row, chosen_key, "--chosen_key")
            rejected = self._encode(row, rejected_key, "--rejected_key")
            if max(num_context_tokens(chosen[1]), num_context_tokens(rejected[1])) >= max_len:
                too_long += 1
                continue
            self.pairs.append(
                (*as_tensors(*truncate_keep_end(*chosen, max_len)), *as_tensors(*truncate_keep_end(*rejected, max_len)))
            )
            if self.margins is not None:
                self.margins.append(float(row[margin_key] or 0.0))
        if too_long:
            logger.warning(
                "preference data: dropped %d of %d pairs whose prompt alone has >= %d tokens (--max_len)",
                too_long,
                len(rows),
                max_len,
            )
        if not self.pairs:
            raise UserError(
                f"--max_len {max_len}: every pair's prompt alone has >= {max_len} tokens; "
                f"raise --max_len or shorten the prompts"
            )

    def _encode(self, row: dict[str, Any], key: str, key_flag: str) -> tuple[list[int], list[int]]:
        prompt, response = self._prompt_and_response(row, key, key_flag)
        if prompt is None:
            segments = [(render_response("", response, self.tokenizer, **self.options, response_flag=key_flag), True)]
        else:
            prompt_flag = "--prompt_key" if self.prompt_key else key_flag
            segments = [
                (render_prompt(prompt, self.tokenizer, **self.options, key_flag=prompt_flag), False),
                (
                    render_response(
                        prompt,
                        response,
                        self.tokenizer,
                        **self.options,
                        prompt_flag=prompt_flag,
                        response_flag=key_flag,
                    ),
                    True,
                ),
            ]
        return encode_segments(self.tokenizer, segments, self.prefix)

    def _prompt_and_response(self, row: dict[str, Any], key: str, key_flag: str) -> tuple[Any, Any]:
        """(prompt value or None for no prompt, response value) of one side."""
        if self.prompt_key is not None:
            return row[self.prompt_key], row[key]
        value = row[key]
        if isinstance(value, str):
            if self.options["apply_chat_template"]:
                raise UserError(
                    f"{key_flag} holds plain strings: pass --prompt_key with the prompt column, "
                    f"or store whole conversations (lists of messages) in {key_flag}"
                )
            return None, value
        messages = as_messages(value, key_flag)
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise UserError(
                f"{key_flag}: a conversation must end with an assistant message after a prompt; "
                f"fix the data or pass --prompt_key"
            )
        return messages[:-1], messages[-1:]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chosen_ids, chosen_mask, rejected_ids, rejected_mask = self.pairs[index]
        item = {
            "chosen_ids": chosen_ids.long(),
            "chosen_loss_mask": chosen_mask.long(),
            "rejected_ids": rejected_ids.long(),
            "rejected_loss_mask": rejected_mask.long(),
        }
        if self.margins is not None:
            item["margin"] = torch.tensor(self.margins[index])
        return item


def truncate_keep_end(ids: list[int], mask: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """The first `max_len - 1` tokens plus the last one (the EOS), when longer than `max_len`."""
    if len(ids) <= max_len:
        return ids, mask
    return ids[: max_len - 1] + ids[-1:], mask[: max_len - 1] + mask[-1:]


def collate_pairs(items: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded [2B, T] input_ids, attention_mask, loss_mask: rows 0..B-1 chosen, rows B..2B-1 rejected; and
    "margin" [B] when the items carry one."""
    rows = [{"input_ids": it["chosen_ids"], "loss_mask": it["chosen_loss_mask"]} for it in items]
    rows += [{"input_ids": it["rejected_ids"], "loss_mask": it["rejected_loss_mask"]} for it in items]
    batch = collate_padded(rows, pad_token_id)
    if "margin" in items[0]:
        batch["margin"] = torch.stack([it["margin"] for it in items])
    return batch
