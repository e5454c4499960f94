"""From a record's prompt and response (or a whole conversation) to the exact tokens the model sees, with the
tokens a loss is taken on.

Text. A prompt value is a string or a list of chat messages `[{"role": ..., "content": ...}]`.

* With `--apply_chat_template` a string becomes one user message; the prompt text is the chat template's
  rendering with the generation prompt (what a serving engine would send), and a response text is what the
  template adds after it for the assistant message. `--input_template` is then ignored (the dataset logs it).
* Without it, `--input_template` (a format string with one `{}`) wraps the string, or the string is used as is.

Every response text ends with the tokenizer's EOS token, so SFT teaches the model to stop and the reward model
can read its score at that token. Chat templates put a newline after the end-of-turn token as a separator
before the next turn; it is cut off, since it is not part of what the model generates.

Conversations (multi-turn SFT). The text trained on is the chat template's rendering of the whole conversation,
`full`. Each assistant turn i starts where the rendering of messages[:i] with the generation prompt ends (that
prefix is what the model was given when it produced the turn) and ends where the rendering of messages[:i+1] ends.

Some templates are not prefix-stable: Qwen3's, for example, gives the last assistant turn an empty
`<think>...</think>` block but strips it from earlier turns, so messages[:i+1] rendered alone is not a prefix
of `full`. For such a turn the end is the first EOS (end-of-turn) token after its start in `full`. Either way
the newline a template puts after the end-of-turn token belongs to the context, and text after the last
assistant turn (it carries no loss) is dropped.

Tokens. Each segment (prompt, response, or a conversation turn) is tokenized on its own and the ids are
concatenated. That is how the tokens arise at inference too: the prompt is tokenized alone and the response is
generated after it, so no BPE merge ever crosses the prompt/response boundary, and the target mask is exact.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

import torch
from jinja2 import TemplateError

from openppo.errors import UserError

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


def validate_template_options(tokenizer, *, apply_chat_template: bool, input_template: str | None) -> None:
    """Check the template flags once per dataset: fail on a bad combination, log an ignored option. `tokenizer`: what
    renders the data (a `ProcessorTemplate` for image data)."""
    if input_template is not None and "{}" not in input_template:
        raise UserError(f"--input_template must contain '{{}}' where the prompt goes, got {input_template!r}")
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            owner = "processor" if isinstance(tokenizer, ProcessorTemplate) else "tokenizer"
            raise UserError(
                f"--apply_chat_template: the {owner} of --pretrain has no chat template; "
                "drop --apply_chat_template (and pass --input_template if needed)"
            )
        if input_template is not None:
            logger.warning("--input_template is ignored because --apply_chat_template is set")
    if tokenizer.eos_token is None:
        raise UserError("--pretrain: the tokenizer defines no eos_token; set eos_token in its tokenizer_config.json")


class ProcessorTemplate:
    """A vision-language model's processor as the template functions here read a tokenizer: the processor's chat
    template (the one that renders image items for it, and the one RL's image prompts use), the tokenizer's EOS."""

    def __init__(self, processor):
        self.processor = processor
        self.eos_token = processor.tokenizer.eos_token
        self.chat_template = getattr(processor, "chat_template", None)

    def apply_chat_template(self, messages: Messages, **kwargs: Any) -> str:
        return self.processor.apply_chat_template(messages, **kwargs)


def as_messages(value: Any, key_flag: str) -> Messages:
    """`value` as a list of chat messages, or UserError naming the column's flag."""
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m for m in value):
        raise UserError(
            f"{key_flag}: expected a string or a list of {{'role', 'content'}} messages, "
            f"got {type(value).__name__}; fix the data or pass another {key_flag}"
        )
    # Arrow gives every message the union of the keys seen in the column, filling the missing ones with None;
    # drop those so templates that test `'tool_calls' in message` see the original message.
    return [{k: v for k, v in m.items() if v is not None} for m in value]


def chat_text(
    tokenizer, messages: Messages, *, generation_prompt: bool, key_flag: str, tools: list | None = None
) -> str:
    """The chat template's rendering of `messages` (with `tools`, OpenAI-format function schemas, where the template
    places them); a template error becomes a UserError naming the column."""
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools or None, tokenize=False, add_generation_prompt=generation_prompt
        )
    except TemplateError as err:
        raise UserError(f"{key_flag}: the chat template rejected a conversation ({err}); fix the data") from err


def render_prompt(
    value: str | Messages,
    tokenizer,
    *,
    apply_chat_template: bool,
    input_template: str | None,
    key_flag: str = "--input_key",
    tools: list | None = None,
) -> str:
    """The prompt text: chat-template rendering with the generation prompt (and the row's `tools`), or the
    (templated) string."""
    if apply_chat_template:
        messages = _user_or_messages(value, key_flag)
        return chat_text(tokenizer, messages, generation_prompt=True, key_flag=key_flag, tools=tools)
    if not isinstance(value, str):
        as_messages(value, key_flag)  # a non-message value gets the type error rather than the flag hint
        raise UserError(f"{key_flag} holds chat messages; pass --apply_chat_template to render them")
    if input_template is None:
        return value
    if "{}" not in input_template:
        raise UserError(f"--input_template must contain '{{}}' where the prompt goes, got {input_template!r}")
    return input_template.replace("{}", value, 1)


def row_tools(value: Any, where: str) -> list[dict] | None:
    """A row's tool schemas (`--tools_key`): a list of OpenAI-format tools or its JSON text; None or empty: none."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise UserError(f"{where}: not JSON ({err.msg} at character {err.pos}); store a list of tools") from err
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise UserError(f"{where}: expected a list of tools ({{'type': 'function', ...}} each), got {value!r}")
    return value


def render_response(
    prompt: str | Messages,
    response: str | Messages,
    tokenizer,
    *,
    apply_chat_template: bool,
    input_template: str | None,
    prompt_flag: str = "--input_key",
    response_flag: str = "--output_key",
) -> str:
    """The text that follows `render_prompt(prompt)` for this response, ending with the EOS token.

    `response` is the assistant's text, or (with the chat template) a list of messages that follow the prompt.
    """
    if not apply_chat_template:
        if not isinstance(response, str):
            raise UserError(f"{response_flag} holds chat messages; pass --apply_chat_template to render them")
        return end_with_eos(response, tokenizer)
    prompt_msgs = _user_or_messages(prompt, prompt_flag)
    if isinstance(response, str):
        reply = [{"role": "assistant", "content": response}]
    else:
        reply = as_messages(response, response_flag)
    prompt_text = chat_text(tokenizer, prompt_msgs, generation_prompt=True, key_flag=prompt_flag)
    full_text = chat_text(tokenizer, prompt_msgs + reply, generation_prompt=False, key_flag=response_flag)
    if full_text.startswith(prompt_text):
        return end_with_eos(full_text[len(prompt_text) :].rstrip(), tokenizer)
    # A template that renders the prompt differently once a reply follows it: the prompt rendering with the
    # generation prompt is what the model is given at inference, so keep it and append the bare reply.
    logger.debug("chat template: prompt rendering is not a prefix of the full rendering; using the bare reply")
    return end_with_eos("".join(str(m.get("content") or "") for m in reply), tokenizer)


def _user_or_messages(value: str | Messages, key_flag: str) -> Messages:
    """A string becomes one user message; a message list is checked and kept."""
    return [{"role": "user", "content": value}] if isinstance(value, str) else as_messages(value, key_flag)


def end_with_eos(text: str, tokenizer) -> str:
    """`text` ending with the EOS token (appended unless the template already put it there)."""
    return text if text.endswith(tokenizer.eos_token) else text + tokenizer.eos_token


# -- conversations ----------------------------------------------------------------------------------------------------

Segments = list[tuple[str, bool]]  # (text, is_target) in order; concatenated they form the training text


def conversation_segments(messages: Messages, tokenizer, *, key_flag: str = "--input_key") -> Segments:
    """Context and assistant-turn segments of `messages`; empty when no assistant turn follows a prompt."""
    full = chat_text(tokenizer, messages, generation_prompt=False, key_flag=key_flag)
    eos = tokenizer.eos_token
    segments: Segments = []
    pos = 0
    for i, message in enumerate(messages):
        # A leading assistant message has no prompt to answer; it stays context.
        if message.get("role") != "assistant" or i == 0:
            continue
        prompt = chat_text(tokenizer, messages[:i], generation_prompt=True, key_flag=key_flag)
        if not full.startswith(prompt) or len(prompt) < pos:
            raise UserError(
                f"--multiturn: the chat template renders the start of a conversation in {key_flag} "
                f"differently from the whole, so assistant turns cannot be located; "
                f"train without --multiturn on single-turn rows instead"
            )
        start = len(prompt)
        upto = chat_text(tokenizer, messages[: i + 1], generation_prompt=False, key_flag=key_flag)
        if full.startswith(upto):
            end = len(upto)
        else:
            found = full.find(eos, start)
            if found < 0:
                raise UserError(
                    f"--multiturn: cannot find the end of an assistant turn in {key_flag} (the chat "
                    f"template rewrites earlier turns and marks no end with {eos!r})"
                )
            end = found + len(eos)
        end = start + len(full[start:end].rstrip())
        segments.append((full[pos:start], False))
        segments.append((full[start:end], True))
        pos = end
    return [(text, target) for text, target in segments if text]


# -- tokens -----------------------------------------------------------------------------------------------------------


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
