"""render_prompt / render_response against the Qwen3 chat template, written out by hand."""

import pytest

from openppo.datasets import render_prompt, render_response
from openppo.datasets.templates import validate_template_options
from openppo.errors import UserError

QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
# Qwen3's template gives the final assistant turn an empty think block; the newline after <|im_end|> is cut.
QWEN3_RESPONSE = "<think>\n\n</think>\n\n4<|im_end|>"


def test_chat_template_string_and_messages(tokenizer):
    chat = dict(apply_chat_template=True, input_template=None)
    assert render_prompt("What is 2+2?", tokenizer, **chat) == QWEN3_PROMPT
    assert render_prompt([{"role": "user", "content": "What is 2+2?"}], tokenizer, **chat) == QWEN3_PROMPT
    assert render_response("What is 2+2?", "4", tokenizer, **chat) == QWEN3_RESPONSE
    assert render_response("What is 2+2?", [{"role": "assistant", "content": "4"}], tokenizer, **chat) == QWEN3_RESPONSE


def test_system_prompt_and_arrow_none_fields(tokenizer):
    # Arrow fills keys missing from some messages with None; they must not reach the template.
    msgs = [{"role": "system", "content": "Be brief.", "name": None}, {"role": "user", "content": "Hi", "name": None}]
    text = render_prompt(msgs, tokenizer, apply_chat_template=True, input_template=None)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_plain_text_with_and_without_input_template(tokenizer):
    assert render_prompt("x", tokenizer, apply_chat_template=False, input_template="Q: {}\nA: ") == "Q: x\nA: "
    assert render_prompt("x", tokenizer, apply_chat_template=False, input_template=None) == "x"
    # a literal brace elsewhere in the template is kept as is
    assert render_prompt("x", tokenizer, apply_chat_template=False, input_template="{}. Use {a}") == "x. Use {a}"
    assert render_response("x", "4", tokenizer, apply_chat_template=False, input_template=None) == "4<|im_end|>"


def test_messages_without_chat_template_name_the_flag(tokenizer):
    msgs = [{"role": "user", "content": "hi"}]
    with pytest.raises(UserError, match="--input_key holds chat messages; pass --apply_chat_template"):
        render_prompt(msgs, tokenizer, apply_chat_template=False, input_template=None)
    with pytest.raises(UserError, match="--chosen_key holds chat messages; pass --apply_chat_template"):
        render_response(
            "hi", msgs, tokenizer, apply_chat_template=False, input_template=None, response_flag="--chosen_key"
        )
    with pytest.raises(UserError, match="--input_key: expected a string or a list of"):
        render_prompt(7, tokenizer, apply_chat_template=True, input_template=None)


def test_input_template_without_placeholder(tokenizer):
    with pytest.raises(UserError, match="--input_template must contain '{}'"):
        render_prompt("x", tokenizer, apply_chat_template=False, input_template="Question: ")
    with pytest.raises(UserError, match="--input_template must contain '{}'"):
        validate_template_options(tokenizer, apply_chat_template=False, input_template="Question: ")


def test_tokenizer_without_chat_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(UserError, match="--apply_chat_template: the tokenizer of --pretrain has no chat template"):
        validate_template_options(tokenizer, apply_chat_template=True, input_template=None)


# Renders the last user turn as "U:" plus "A:" only when a reply follows: the generation-prompt rendering is then
# not a prefix of the full one, and the response falls back to the bare reply text plus EOS.
NOT_PREFIX_STABLE = (
    "{% for m in messages %}{% if m.role == 'user' %}U: {{ m.content }}\n{% else %}A: {{ m.content }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}"
)


def test_response_fallback_for_a_template_that_is_not_prefix_stable(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", NOT_PREFIX_STABLE)
    chat = dict(apply_chat_template=True, input_template=None)
    assert render_prompt("hi", tokenizer, **chat) == "U: hi\nASSISTANT:"
    assert render_response("hi", "yo", tokenizer, **chat) == "yo<|im_end|>"


def test_tokenizer_chat_template_replaces_the_models_own(tmp_path):
    """--tokenizer_chat_template (OpenRLHF's --data.tokenizer_chat_template) renders the prompts and is saved."""
    from openppo.models.hf import load_tokenizer
    from tests.model_cache import tiny_model_dir

    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    tokenizer = load_tokenizer(str(tiny_model_dir()), chat_template=template)
    text = render_prompt("What is 2 + 2?", tokenizer, apply_chat_template=True, input_template=None)
    assert text == "[user] What is 2 + 2?\n[assistant] "
    assert "<|im_start|>" in render_prompt(
        "x", load_tokenizer(str(tiny_model_dir())), apply_chat_template=True, input_template=None
    )
    tokenizer.save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).chat_template == template


def test_disable_fast_tokenizer_says_when_the_model_has_no_slow_one(caplog):
    """--disable_fast_tokenizer asks transformers for the slow tokenizer; the tests' Qwen tokenizer has none in
    transformers 5, so the fast one is used and one warning says the flag had no effect."""
    import logging

    from openppo.models.hf import load_tokenizer
    from tests.model_cache import tiny_model_dir

    with caplog.at_level(logging.WARNING, logger="openppo.models.hf"):
        fast = load_tokenizer(str(tiny_model_dir()))
        assert not caplog.records
        slow = load_tokenizer(str(tiny_model_dir()), use_fast=False)
    assert slow.is_fast and slow("2 + 2").input_ids == fast("2 + 2").input_ids
    [warning] = caplog.records
    assert warning.getMessage().startswith("--disable_fast_tokenizer has no effect")
