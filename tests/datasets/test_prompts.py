"""PromptDataset: rendered prompts, ids, labels, datasource, length filter."""

import logging

import datasets
import pytest

from openppo.datasets import PromptDataset
from openppo.errors import UserError


def make(rows, tokenizer, **kw):
    args = dict(input_key="question", label_key="answer", apply_chat_template=True, input_template=None)
    args.update(kw)
    return PromptDataset(datasets.Dataset.from_list(rows), tokenizer, **args)


def test_items_carry_prompt_ids_label_and_index(tokenizer):
    ds = make([{"question": "2+2?", "answer": "4"}, {"question": "3+3?", "answer": "6"}], tokenizer)
    item = ds[1]
    assert set(item) == {"prompt", "prompt_ids", "label", "datasource", "index"}
    assert item["prompt"] == "<|im_start|>user\n3+3?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(item["prompt_ids"]) == item["prompt"]
    assert (item["label"], item["datasource"], item["index"]) == ("6", "default", 1)
    item["label"] = "changed"
    assert ds[1]["label"] == "6"


def test_no_label_key_and_datasource_column(tokenizer):
    ds = make(
        [{"question": "q", "datasource": "gsm8k"}],
        tokenizer,
        label_key=None,
        apply_chat_template=False,
        input_template="Q: {}\nA:",
    )
    assert ds[0]["label"] is None and ds[0]["datasource"] == "gsm8k"
    assert ds[0]["prompt"] == "Q: q\nA:"


def test_too_long_prompts_are_dropped(tokenizer, caplog):
    rows = [{"question": "hi", "answer": 1}, {"question": "word " * 30, "answer": 2}, {"question": "yo", "answer": 3}]
    with caplog.at_level(logging.WARNING, logger="openppo.datasets.prompts"):
        ds = make(rows, tokenizer, max_prompt_len=16)
    assert "dropped 1 of 3 prompts longer than 16 tokens (--prompt_max_len)" in caplog.text
    assert [ds[i]["label"] for i in range(len(ds))] == [1, 3]
    assert [ds[i]["index"] for i in range(len(ds))] == [0, 2]  # rows keep their position in the data
    with pytest.raises(UserError, match="--prompt_max_len 16"):
        make(rows[1:2], tokenizer, max_prompt_len=16)
    with pytest.raises(UserError, match="--label_key: column 'label' not found"):
        make(rows, tokenizer, label_key="label")


TOOL = {
    "type": "function",
    "function": {
        "name": "add_numbers",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}


def test_tools_key_renders_each_rows_tools_into_its_prompt(tokenizer):
    """--tools_key (Molt's --data.tools_key): the chat template places a row's tools (a list or its JSON) in the
    prompt, as `apply_chat_template(tools=...)` does; a row without tools renders as without the column."""
    import json

    rows = [
        {"question": "2+2?", "answer": "4", "tools": json.dumps([TOOL])},
        {"question": "3+3?", "answer": "6", "tools": ""},
    ]
    ds = make(rows, tokenizer, tools_key="tools")
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], tools=[TOOL], tokenize=False, add_generation_prompt=True
    )
    assert ds[0]["prompt"] == expected and "add_numbers" in expected and "<tools>" in expected
    assert ds[1]["prompt"] == make([{"question": "3+3?", "answer": "6"}], tokenizer)[0]["prompt"]
    assert make([{**rows[0], "tools": [TOOL]}], tokenizer, tools_key="tools")[0]["prompt"] == expected
    for bad, reason in (("[{", "not JSON"), (json.dumps({"a": 1}), "expected a list of tools")):
        with pytest.raises(UserError, match=f"--tools_key 'tools', row 0: {reason}"):
            make([{**rows[0], "tools": bad}], tokenizer, tools_key="tools")
    with pytest.raises(UserError, match="--tools_key: the chat template renders"):
        make(rows, tokenizer, tools_key="tools", apply_chat_template=False, input_template="{}")
    with pytest.raises(UserError, match="--tools_key: column 'schemas' not found"):
        make(rows, tokenizer, tools_key="schemas")
