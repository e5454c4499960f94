"""Scoring texts with a reward-model folder (what `serve_rm --reward_pretrain` serves).

Each query is tokenized as is (`add_special_tokens=False`: the text already holds whatever template and special
tokens the policy produced) and the score is read at its last token, so a reward model trained by train_rm, whose
responses end with EOS, should receive queries that end with the EOS text; `append_eos` adds it to queries that
lack it (e.g. from a client that decoded with skip_special_tokens). A query longer than `max_len` tokens keeps its
last `max_len` tokens, where the response and the scored token are. Queries are sorted by length before batching
so that each forward pass pads little; results come back in query order.
"""

from __future__ import annotations

import torch

from openppo.models.hf import load_tokenizer, resolve_model_path
from openppo.models.row_layout import RowLayout
from openppo.models.scalar import ScalarModel
from openppo.rewards.base import RewardError, RewardResult, RewardSource, check_inputs


class ModelReward(RewardSource):
    """A scalar-head model scoring the last token of each query."""

    def __init__(
        self,
        path: str,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        max_len: int = 2048,
        batch_size: int = 16,
        normalize: bool = False,
        append_eos: bool = False,
        flag: str = "--reward_pretrain",
        use_fast_tokenizer: bool = True,
        attn_implementation: str = "sdpa",
        packed: bool = False,
    ):
        path = resolve_model_path(path, flag)
        self.name = f"reward model {path}"
        self.tokenizer = load_tokenizer(path, use_fast=use_fast_tokenizer)
        self.model = (
            ScalarModel.from_pretrained(path, dtype=dtype, flag=flag, attn_implementation=attn_implementation)
            .to(device)
            .eval()
        )
        self.model.layout = RowLayout(packed=packed)
        self.device = torch.device(device)
        self.max_len = max_len
        self.batch_size = batch_size
        self.normalize = normalize
        self.append_eos = append_eos

    def token_ids(self, queries: list[str]) -> list[list[int]]:
        """Token ids per query: EOS appended if asked, cut to the last `max_len` tokens."""
        eos = self.tokenizer.eos_token
        if self.append_eos:
            queries = [q if q.endswith(eos) else q + eos for q in queries]
        ids = self.tokenizer(list(queries), add_special_tokens=False)["input_ids"]
        return [row[-self.max_len :] for row in ids]

    @torch.inference_mode()
    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        check_inputs(queries, prompts, labels)
        rows = self.token_ids(queries)
        empty = [i for i, row in enumerate(rows) if not row]
        if empty:
            raise RewardError(
                f"{self.name}: query #{empty[0]} is empty (no tokens to score); "
                f"{len(empty)} of {len(rows)} queries are empty"
            )
        rewards = [0.0] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            width = max(len(rows[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for j, i in enumerate(batch):
                input_ids[j, : len(rows[i])] = torch.tensor(rows[i], dtype=torch.long)
                attention_mask[j, : len(rows[i])] = 1
            values = self.model.score_last(
                input_ids.to(self.device), attention_mask.to(self.device), normalize=self.normalize
            )
            for j, i in enumerate(batch):
                rewards[i] = float(values[j])
        return RewardResult(rewards=rewards)
