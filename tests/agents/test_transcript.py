"""An agent episode's calls -> training segments (openppo/agents/transcript.py), on the real Qwen3 chat template of the
suite's tokenizer: a prompt that extends the segment grows it (template and environment tokens masked, generated ones
trained with their engine log-probs), and one that does not (Qwen3 drops earlier <think> blocks) seals it."""

from __future__ import annotations

import pytest

from openppo.agents.transcript import Call, Transcript
from tests.model_cache import tiny_model_dir


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir())


def _render(tok, messages) -> list[int]:
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def _call(tok, messages, answer: str, version: int) -> Call:
    out = tok.encode(answer, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return Call(_render(tok, messages), out, [-0.5 - i for i in range(len(out))], version)


def test_calls_that_extend_the_conversation_make_one_row(tok):
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    first = _call(tok, chat, "Let me use the calculator.", version=4)
    chat += [{"role": "assistant", "content": "Let me use the calculator."}, {"role": "user", "content": "tool: 5"}]
    second = _call(tok, chat, "The answer is 5.", version=5)
    t = Transcript()
    t.add(first)
    t.add(second)
    assert t.sealed == 0 and len(t.segments) == 1
    seg = t.segments[0]
    assert seg.prompt_ids == list(first.prompt_ids)
    assert seg.prompt_ids + seg.response_ids == list(second.prompt_ids) + list(second.output_ids)
    # trained: exactly the generated ids, each with its engine log-prob; the template's and the tool's: masked
    gap = len(second.prompt_ids) - len(first.prompt_ids) - len(first.output_ids)
    assert seg.action_mask == [1] * len(first.output_ids) + [0] * gap + [1] * len(second.output_ids)
    trained = [i for i, m in zip(seg.response_ids, seg.action_mask) if m]
    assert trained == list(first.output_ids) + list(second.output_ids)
    assert [lp for lp, m in zip(seg.log_probs, seg.action_mask) if m] == list(first.log_probs) + list(second.log_probs)
    assert all(lp == 0.0 for lp, m in zip(seg.log_probs, seg.action_mask) if not m)
    assert seg.versions == [4] * len(first.output_ids) + [5] * len(second.output_ids)
    assert "tool: 5" in tok.decode([i for i, m in zip(seg.response_ids, seg.action_mask) if not m])


def test_a_template_that_rewrites_history_seals_the_segment(tok):
    chat = [{"role": "user", "content": "What is 2 + 3?"}]
    thinking = "<think>\nadd them\n</think>\n\n5"
    first = _call(tok, chat, thinking, version=1)
    # Qwen3's template renders the earlier answer without its <think> block: the ids sampled are not in the prompt
    chat += [{"role": "assistant", "content": thinking}, {"role": "user", "content": "And 3 + 4?"}]
    second = _call(tok, chat, "7", version=1)
    assert "<think>" not in tok.decode(second.prompt_ids)
    t = Transcript()
    t.add(first)
    t.add(second)
    assert t.sealed == 1 and len(t.segments) == 2
    # each row holds only what its own call generated; nothing re-tokenized is trained
    for seg, call in zip(t.segments, (first, second)):
        assert seg.prompt_ids == list(call.prompt_ids)
        assert seg.response_ids == list(call.output_ids) and seg.action_mask == [1] * len(call.output_ids)


def test_log_probs_must_match_the_output():
    with pytest.raises(ValueError, match="2 output ids and 1 log-probs"):
        Call([1, 2], [3, 4], [-0.1], version=0)
