"""Prompts for RL: the rendered prompt, its token ids, the label the reward function checks against.

`prompt_ids` are the tokens to hand to the generation engine (BOS included where the tokenizer defines one
and no chat template is used); `prompt` is the same text for logs and for engines that take strings.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
from torch.utils.data import Dataset
from tqdm import tqdm

from openppo.datasets.loading import require_columns
from openppo.datasets.sft import PROGRESS_MIN_SAMPLES
from openppo.datasets.templates import bos_ids, encode_segments, render_prompt, validate_template_options
from openppo.errors import UserError, require

logger = logging.getLogger(__name__)

DATASOURCE_COLUMN = "datasource"  # optional column naming a row's origin, for per-source reward metrics
DEFAULT_DATASOURCE = "default"


class PromptDataset(Dataset):
    """Item = {"prompt": str, "prompt_ids": list[int], "label": Any | None, "datasource": str, "index": int}.

    `index` is the row's position in `ds`, so it stays a stable id when rows are dropped for length.
    """

    def __init__(
        self,
        ds: datasets.Dataset,
        tokenizer,
        *,
        input_key: str,
        label_key: str | None,
        apply_chat_template: bool,
        input_template: str | None,
        max_prompt_len: int | None = None,
    ):
        require(
            max_prompt_len is None or max_prompt_len > 0, f"--prompt_max_len must be positive, got {max_prompt_len}"
        )
        validate_template_options(tokenizer, apply_chat_template=apply_chat_template, input_template=input_template)
        require_columns(ds, {"--input_key": input_key, "--label_key": label_key}, "the prompt data")
        prefix = bos_ids(tokenizer, apply_chat_template=apply_chat_template)
        has_source = DATASOURCE_COLUMN in ds.column_names
        columns = [c for c in (input_key, label_key, DATASOURCE_COLUMN if has_source else None) if c is not None]
        rows = ds.select_columns(list(dict.fromkeys(columns)))

        self.items: list[dict[str, Any]] = []
        too_long = 0
        for index, row in enumerate(tqdm(rows, desc="tokenizing prompts", disable=len(rows) <= PROGRESS_MIN_SAMPLES)):
            prompt = render_prompt(
                row[input_key], tokenizer, apply_chat_template=apply_chat_template, input_template=input_template
            )
            prompt_ids, _ = encode_segments(tokenizer, [(prompt, False)], prefix)
            if max_prompt_len is not None and len(prompt_ids) > max_prompt_len:
                too_long += 1
                continue
            self.items.append(
                {
                    "prompt": prompt,
                    "prompt_ids": prompt_ids,
                    "label": row[label_key] if label_key is not None else None,
                    "datasource": _datasource(row) if has_source else DEFAULT_DATASOURCE,
                    "index": index,
                }
            )
        if too_long:
            logger.warning(
                "prompt data: dropped %d of %d prompts longer than %d tokens (--prompt_max_len)",
                too_long,
                len(rows),
                max_prompt_len,
            )
        if not self.items:
            raise UserError(
                f"--prompt_max_len {max_prompt_len}: every prompt is longer than that; "
                f"raise --prompt_max_len or shorten the prompts"
            )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return dict(self.items[index])  # a copy: a consumer that edits its item must not change the dataset


def _datasource(row: dict[str, Any]) -> str:
    value = row[DATASOURCE_COLUMN]
    return DEFAULT_DATASOURCE if value is None or value == "" else str(value)
