"""Prompts for RL: the rendered prompt, its token ids, the label the reward function checks against.

`prompt_ids` are the tokens to hand to the generation engine (BOS included where the tokenizer defines one
and no chat template is used); `prompt` is the same text for logs and for engines that take strings.

Image prompts (`max_images > 0`): the row's images (the `image_key` column, see `openppo.datasets.images`) are
checked once here and kept as references in `images`; their placeholders stay unexpanded in `prompt_ids`,
which is what vLLM takes with the images beside it (it expands them itself, as the processor does).
`max_prompt_len` counts such a prompt expanded (the processor's tokens for it), which is what the engines' context
has to hold: counted unexpanded, a prompt with a few large images passed the filter and then stopped the run when
vLLM refused it as longer than the model's context.
"""

from __future__ import annotations

import logging
from typing import Any

import datasets
from torch.utils.data import Dataset
from tqdm import tqdm

from openppo.datasets.images import MAX_BAD_ROWS_LOGGED, BadImage, check_row_images, report_bad_images
from openppo.datasets.loading import require_columns
from openppo.datasets.sft import PROGRESS_MIN_SAMPLES
from openppo.datasets.templates import (
    ProcessorTemplate,
    as_messages,
    bos_ids,
    encode_segments,
    render_prompt,
    row_tools,
    validate_template_options,
)
from openppo.errors import UserError, require

logger = logging.getLogger(__name__)

DATASOURCE_COLUMN = "datasource"  # optional column naming a row's origin, for per-source reward metrics
DEFAULT_DATASOURCE = "default"


class PromptDataset(Dataset):
    """Item = {"prompt": str, "prompt_ids": list[int], "label": Any | None, "datasource": str, "index": int}.

    `index` is the row's position in `ds`, so it stays a stable id when rows are dropped for length or for bad
    images. With `max_images > 0` items also carry "images", the row's image references (possibly empty), and
    the chat template is the one of `processor` (a VLM's processor renders image items; its tokenizer may not).
    With `keep_messages` they also carry "messages" (the prompt as chat messages, unrendered: a string becomes one
    user message) and "tools" (the row's tool schemas, or None), the task of an agent that calls the endpoint.
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
        image_key: str | None = None,
        max_images: int = 0,
        processor=None,
        tools_key: str | None = None,
        keep_messages: bool = False,
    ):
        require(max_images >= 0, f"--max_images_per_prompt must be 0 (text only) or more, got {max_images}")
        require(
            max_prompt_len is None or max_prompt_len > 0, f"--prompt_max_len must be positive, got {max_prompt_len}"
        )
        image_key = image_key if max_images > 0 else None
        # image prompts render with the processor's chat template (a VLM's processor renders image items)
        renderer = ProcessorTemplate(processor) if image_key is not None and processor is not None else tokenizer
        validate_template_options(renderer, apply_chat_template=apply_chat_template, input_template=input_template)
        require(
            image_key is None or apply_chat_template,
            "--image_key: image prompts are chat messages with image items; pass --apply_chat_template",
        )
        require(
            tools_key is None or apply_chat_template,
            "--tools_key: the chat template renders the tools into the prompt; pass --apply_chat_template",
        )
        keys = {"--input_key": input_key, "--label_key": label_key, "--image_key": image_key, "--tools_key": tools_key}
        require_columns(ds, keys, "the prompt data")
        prefix = bos_ids(tokenizer, apply_chat_template=apply_chat_template)
        has_source = DATASOURCE_COLUMN in ds.column_names
        columns = [c for c in (input_key, label_key, image_key, tools_key, has_source and DATASOURCE_COLUMN) if c]
        rows = ds.select_columns(list(dict.fromkeys(columns)))

        self.items: list[dict[str, Any]] = []
        too_long = 0
        bad_images: list[str] = []
        for index, row in enumerate(tqdm(rows, desc="tokenizing prompts", disable=len(rows) <= PROGRESS_MIN_SAMPLES)):
            extra: dict[str, Any] = {}
            images: list[Any] = []
            if image_key is not None:
                try:
                    extra["images"], images = check_row_images(
                        row[input_key], row[image_key], max_images=max_images, image_flag=f"--image_key {image_key!r}"
                    )
                except BadImage as err:
                    bad_images.append(f"row {index}: {err}")
                    if len(bad_images) <= MAX_BAD_ROWS_LOGGED:
                        logger.warning("prompt data: skipping %s", bad_images[-1])
                    continue
            tools = row_tools(row[tools_key], f"--tools_key {tools_key!r}, row {index}") if tools_key else None
            prompt = render_prompt(
                row[input_key],
                renderer,
                apply_chat_template=apply_chat_template,
                input_template=input_template,
                tools=tools,
            )
            prompt_ids, _ = encode_segments(tokenizer, [(prompt, False)], prefix)
            if max_prompt_len is not None and _length(prompt_ids, prompt, images, processor) > max_prompt_len:
                too_long += 1
                continue
            if keep_messages:  # an agent program's task: the prompt before any template, and its tools
                value = row[input_key]
                user = [{"role": "user", "content": value}]
                extra["messages"] = user if isinstance(value, str) else as_messages(value, "--input_key")
                extra["tools"] = tools
            self.items.append(
                {
                    "prompt": prompt,
                    "prompt_ids": prompt_ids,
                    "label": row[label_key] if label_key is not None else None,
                    "datasource": _datasource(row) if has_source else DEFAULT_DATASOURCE,
                    "index": index,
                    **extra,
                }
            )
        report_bad_images("prompt data", "prompts", bad_images, len(rows), image_key)
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


def _length(prompt_ids: list[int], prompt: str, images: list[Any], processor) -> int:
    """The prompt's length as the model sees it: with images, each placeholder expanded into the image's tokens by
    the processor (as vLLM's processor expands it: the engine's context must hold that), else `prompt_ids`'. The
    processor tokenizes the same text as `prompt_ids` (a chat template's prompt: no prefix) and replaces each
    placeholder, so the difference is the images' alone."""
    if not images:
        return len(prompt_ids)
    return len(processor(text=[prompt], images=[images], add_special_tokens=False)["input_ids"][0])


def _datasource(row: dict[str, Any]) -> str:
    value = row[DATASOURCE_COLUMN]
    return DEFAULT_DATASOURCE if value is None or value == "" else str(value)
