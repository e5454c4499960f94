"""Multi-turn SFT: split a rendered conversation into context text and assistant-turn text.

The text trained on is the chat template's rendering of the whole conversation, `full`. Each assistant turn i
starts where the rendering of messages[:i] with the generation prompt ends (that prefix is what the model was
given when it produced the turn) and ends where the rendering of messages[:i+1] ends.

Some templates are not prefix-stable: Qwen3's, for example, gives the last assistant turn an empty
`<think>...</think>` block but strips it from earlier turns, so messages[:i+1] rendered alone is not a prefix
of `full`. For such a turn the end is the first EOS (end-of-turn) token after its start in `full`. Either way
the newline a template puts after the end-of-turn token belongs to the context, and text after the last
assistant turn (it carries no loss) is dropped.
"""

from __future__ import annotations

from openppo.datasets.templates import Messages, chat_text
from openppo.errors import UserError

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
