"""SFT samples: prompt + response tokens with a loss mask on the response, and their padded or packed batches.

`loss_mask[t] = 1` marks token t as a target (a response token). The trainer scores token t from the logits at
t-1, so it shifts the mask by one (`loss_mask[:, 1:]`); the dataset does not.

Single turn: the prompt comes from `input_key`, the response from `output_key` (see templates.py for the
rendering and the EOS at the end). Multi-turn: `input_key` holds a whole conversation and every assistant turn
is a target (see templates.py). Pretrain mode (`--pretrain_mode`): `input_key` holds plain text, used as is
(no template), and every token is a target. Samples are tokenized once, up front; a sample whose prompt alone
fills `max_len` is dropped (it has nothing left to learn), the others are cut to `max_len` tokens.

Images (`--image_key`, a vision-language model's `processor` given). A row's images go, in order, to the image
items of its prompt messages, which the processor's chat template (the one RL's image prompts use; the tokenizer's
may render image items otherwise, or not at all) writes as the processor's image placeholder
(`processor.image_token`). A segment holding placeholders is encoded by the processor, which expands each into the
model's image tokens, as its forward will fill them; the other segments by the tokenizer, as for text. Items then
also carry `images` (the row's references), which the collator passes on and the actor makes into pixel inputs.
A row is never cut inside its image tokens: one whose last image token lies beyond `max_len` is dropped and
counted. Bad images (missing or undecodable, more than `--max_images_per_prompt`, a count other than the prompt's
image items) skip their row with one log line (`openppo.datasets.images`), and the run stops only when no row is
left.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset
from tqdm import tqdm

from openppo.datasets.images import MAX_BAD_ROWS_LOGGED, check_row_images, report_bad_images
from openppo.datasets.loading import require_columns
from openppo.datasets.templates import (
    ProcessorTemplate,
    Segments,
    as_messages,
    as_tensors,
    bos_ids,
    conversation_segments,
    encode_segments,
    num_context_tokens,
    render_prompt,
    render_response,
    validate_template_options,
)
from openppo.errors import UserError, require
from openppo.utils.images import BadImage, encode_image_rows

logger = logging.getLogger(__name__)

PROGRESS_MIN_SAMPLES = 1000  # show a progress bar only when tokenizing takes noticeable time


class SFTDataset(Dataset):
    """Pre-tokenized SFT samples; item = {"input_ids": LongTensor[L], "loss_mask": LongTensor[L]}."""

    def __init__(
        self,
        ds: datasets.Dataset,
        tokenizer,
        *,
        max_len: int,
        input_key: str,
        output_key: str | None,
        apply_chat_template: bool,
        input_template: str | None,
        multiturn: bool = False,
        pretrain_mode: bool = False,
        last_turn_only: bool = False,
        image_key: str | None = None,
        max_images: int = 4,
        processor=None,
    ):
        require(max_len > 0, f"--max_len must be positive, got {max_len}")
        require(not (pretrain_mode and multiturn), "--pretrain_mode learns plain text: drop --multiturn")
        if pretrain_mode:
            output_key, apply_chat_template, input_template = None, False, None
        require(
            not multiturn or apply_chat_template,
            "--multiturn needs --apply_chat_template (turn boundaries come from the chat template)",
        )
        require(
            multiturn or pretrain_mode or output_key is not None,
            "--output_key is required unless --multiturn or --pretrain_mode is set",
        )
        # image samples render with the processor's chat template, as RL's image prompts do
        self.renderer = ProcessorTemplate(processor) if image_key is not None and processor is not None else tokenizer
        validate_template_options(self.renderer, apply_chat_template=apply_chat_template, input_template=input_template)
        if image_key is not None:
            require(max_images > 0, f"--max_images_per_prompt must be positive with --image_key, got {max_images}")
            require(
                apply_chat_template and not pretrain_mode,
                "--image_key: image samples are chat messages with image items; pass --apply_chat_template",
            )
            require(processor is not None, "--image_key needs a vision-language model (one with a processor)")
        keys = {"--input_key": input_key, "--output_key": output_key if not multiturn else None}
        keys["--image_key"] = image_key
        require_columns(ds, keys, "the SFT data")
        self.processor = processor if image_key is not None else None
        self.tokenizer = tokenizer
        self.input_key, self.output_key, self.multiturn = input_key, output_key, multiturn
        self.last_turn_only = last_turn_only
        self.pretrain_mode = pretrain_mode
        self.apply_chat_template, self.input_template = apply_chat_template, input_template
        prefix = bos_ids(tokenizer, apply_chat_template=apply_chat_template)

        self.samples: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.images: list[list[Any]] = []  # per sample, with --image_key
        too_long = no_target = images_cut = 0
        bad_images: list[str] = []
        rows = ds.select_columns([k for k in keys.values() if k is not None])
        for index, row in enumerate(tqdm(rows, desc="tokenizing SFT data", disable=len(rows) <= PROGRESS_MIN_SAMPLES)):
            refs: list[Any] = []
            if image_key is not None:
                try:
                    refs, images = check_row_images(
                        row[input_key], row[image_key], max_images=max_images, image_flag=f"--image_key {image_key!r}"
                    )
                    ids, mask = self._encode_with_images(self._segments(row), images, prefix)
                except BadImage as err:
                    bad_images.append(f"row {index}: {err}")
                    if len(bad_images) <= MAX_BAD_ROWS_LOGGED:
                        logger.warning("SFT data: skipping %s", bad_images[-1])
                    continue
            else:
                ids, mask = encode_segments(tokenizer, self._segments(row), prefix)
            num_prompt = num_context_tokens(mask)
            if num_prompt == len(mask):
                no_target += 1
            elif num_prompt >= max_len:
                too_long += 1
            elif refs and self._last_image_token(ids) >= max_len:
                images_cut += 1
            else:
                self.samples.append(as_tensors(ids[:max_len], mask[:max_len]))
                if image_key is not None:
                    self.images.append(refs)
        report_bad_images("SFT data", "samples", bad_images, len(rows), image_key)
        if images_cut:
            logger.warning(
                "SFT data: dropped %d of %d samples whose image tokens reach past --max_len %d (an image is never cut)",
                images_cut,
                len(rows),
                max_len,
            )
        if no_target:
            logger.warning(
                "SFT data: dropped %d of %d conversations in %s without an assistant turn after a prompt",
                no_target,
                len(rows),
                input_key,
            )
        if too_long:
            logger.warning(
                "SFT data: dropped %d of %d samples whose prompt alone has >= %d tokens (--max_len)",
                too_long,
                len(rows),
                max_len,
            )
        if not self.samples:
            if no_target == len(rows):
                raise UserError(
                    f"--input_key: no conversation in column '{input_key}' has an assistant turn "
                    f"after a prompt; pass the column holding the conversations"
                )
            raise UserError(
                f"--max_len {max_len}: every sample's prompt alone has >= {max_len} tokens; "
                f"raise --max_len or shorten the prompts"
            )

    def _segments(self, row: dict[str, Any]) -> Segments:
        value = row[self.input_key]
        if self.multiturn:
            segments = conversation_segments(as_messages(value, "--input_key"), self.renderer)
            if self.last_turn_only:  # the earlier assistant turns are context (per-turn-flattened data)
                last = max((i for i, (_, trained) in enumerate(segments) if trained), default=-1)
                segments = [(text, trained and i == last) for i, (text, trained) in enumerate(segments)]
            return segments
        if self.pretrain_mode:
            require(isinstance(value, str), f"--pretrain_mode: column '{self.input_key}' must hold plain text")
            return [(value, True)]
        options = dict(apply_chat_template=self.apply_chat_template, input_template=self.input_template)
        prompt = render_prompt(value, self.renderer, **options)
        response = render_response(value, row[self.output_key], self.renderer, **options)
        return [(prompt, False), (response, True)]

    def _encode_with_images(self, segments: Segments, images: list[Any], prefix) -> tuple[list[int], list[int]]:
        """`encode_segments`, but a segment holding image placeholders is encoded by the processor with its images
        (the next ones of the decoded `images`, in order), which expands each placeholder into the model's image
        tokens."""
        placeholder = self.processor.image_token
        counts = [text.count(placeholder) for text, _ in segments]
        if sum(counts) != len(images):
            raise BadImage(f"the chat template wrote {sum(counts)} image placeholder(s) for {len(images)} image(s)")
        ids: list[int] = []
        mask: list[int] = []
        taken = 0
        for (text, target), count in zip(segments, counts):
            if count:
                own = images[taken : taken + count]
                seg = self.processor(text=[text], images=[own], add_special_tokens=False)["input_ids"][0]
                taken += count
            else:
                seg = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            ids.extend(seg)
            mask.extend([int(target)] * len(seg))
        if prefix and ids[: len(prefix)] != list(prefix):
            ids, mask = list(prefix) + ids, [0] * len(prefix) + mask
        return ids, mask

    def _last_image_token(self, ids: list[int]) -> int:
        image_id = self.tokenizer.convert_tokens_to_ids(self.processor.image_token)
        return max((i for i, t in enumerate(ids) if t == image_id), default=-1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        ids, mask = self.samples[index]
        item: dict[str, Any] = {"input_ids": ids.long(), "loss_mask": mask.long()}
        if self.images:
            item["images"] = self.images[index]
        return item


def collate_padded(items: list[dict[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch: input_ids, attention_mask, loss_mask, each [B, T] with T the longest item."""
    width = max(len(item["input_ids"]) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    loss_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item["input_ids"])
        input_ids[row, :n] = item["input_ids"]
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = item["loss_mask"]
    batch = {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}
    if "images" in items[0]:  # image samples: their references ride the batch as bytes (`encode_image_rows`)
        batch["images"] = encode_image_rows([item["images"] for item in items])
    return batch


def collate_packed(items: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """All items in one row without padding: input_ids, position_ids, loss_mask [1, N]; seq_lens list[int].

    Position ids restart at 0 for each sequence, which is how the model keeps sequences from attending to one
    another when called with `attention_mask=None`. The first token of every sequence gets loss_mask 0: in the
    shifted loss it would be predicted from the previous sequence's last token.
    """
    seq_lens = [len(item["input_ids"]) for item in items]
    loss_masks = []
    for item in items:
        mask = item["loss_mask"].clone()
        mask[0] = 0
        loss_masks.append(mask)
    return {
        "input_ids": torch.cat([item["input_ids"] for item in items]).unsqueeze(0),
        "position_ids": torch.cat([torch.arange(n, dtype=torch.long) for n in seq_lens]).unsqueeze(0),
        "loss_mask": torch.cat(loss_masks).unsqueeze(0),
        "seq_lens": seq_lens,
    }
