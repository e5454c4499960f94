"""SFTDataset loss masks (decoded back to text) and the padded / packed collates."""

import copy
import logging

import datasets
import pytest
import torch

from openppo.datasets import SFTDataset, collate_packed, collate_padded
from openppo.errors import UserError

CHAT = dict(apply_chat_template=True, input_template=None)


def make(rows, tokenizer, **kw):
    args = dict(max_len=256, input_key="input", output_key="output", **CHAT)
    args.update(kw)
    return SFTDataset(datasets.Dataset.from_list(rows), tokenizer, **args)


def masked_text(tokenizer, item):
    return tokenizer.decode(item["input_ids"][item["loss_mask"].bool()])


def target_spans(tokenizer, item):
    """Decoded runs of consecutive target tokens."""
    spans, run = [], []
    for tok, m in zip(item["input_ids"].tolist(), item["loss_mask"].tolist()):
        if m:
            run.append(tok)
        elif run:
            spans.append(tokenizer.decode(run))
            run = []
    return spans + ([tokenizer.decode(run)] if run else [])


def test_single_turn_chat_mask_is_exactly_the_response(tokenizer):
    item = make([{"input": "What is 2+2?", "output": "4"}], tokenizer)[0]
    assert item["input_ids"].dtype == torch.long and item["loss_mask"].dtype == torch.long
    assert tokenizer.decode(item["input_ids"]) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>"
    )
    assert masked_text(tokenizer, item) == "<think>\n\n</think>\n\n4<|im_end|>"
    assert item["input_ids"][-1].item() == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_single_turn_plain_mask_is_response_plus_eos(tokenizer):
    ds = make(
        [{"input": "What is 2+2?", "output": "four"}], tokenizer, apply_chat_template=False, input_template="Q: {}\nA: "
    )
    assert tokenizer.decode(ds[0]["input_ids"]) == "Q: What is 2+2?\nA: four<|im_end|>"
    assert masked_text(tokenizer, ds[0]) == "four<|im_end|>"


def test_pretrain_mode_learns_the_plain_text_whole(tokenizer):
    """--pretrain_mode: the input column as is, no template or EOS, every token a target, cut at --max_len."""
    text = "The quick brown fox jumps over the lazy dog."
    [item] = make([{"input": text}], tokenizer, output_key=None, pretrain_mode=True, input_template="Q: {}")
    assert tokenizer.decode(item["input_ids"]) == text and item["loss_mask"].tolist() == [1] * len(item["loss_mask"])
    [cut] = make([{"input": text}], tokenizer, output_key=None, pretrain_mode=True, max_len=4)
    assert cut["input_ids"].tolist() == item["input_ids"][:4].tolist()
    with pytest.raises(UserError, match="--pretrain_mode: column 'input' must hold plain text"):
        make([{"input": [{"role": "user", "content": "hi"}]}], tokenizer, output_key=None, pretrain_mode=True)


def test_bos_is_added_once_without_chat_template(tokenizer):
    with_bos = copy.deepcopy(tokenizer)
    with_bos.bos_token = "<|endoftext|>"
    bos = with_bos.bos_token_id
    for template in ("Q: {}\nA: ", "<|endoftext|>Q: {}\nA: "):  # the second writes BOS itself
        item = make([{"input": "hi", "output": "yo"}], with_bos, apply_chat_template=False, input_template=template)[0]
        assert item["input_ids"][0].item() == bos and item["input_ids"][1].item() != bos
        assert item["loss_mask"][0].item() == 0
        assert masked_text(with_bos, item) == "yo<|im_end|>"
    # the chat template writes its own special tokens: no BOS in front of it
    assert make([{"input": "hi", "output": "yo"}], with_bos)[0]["input_ids"][0].item() != bos


def test_multiturn_masks_every_assistant_turn_and_no_user_text(tokenizer):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "alpha reply"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "beta reply"},
        {"role": "user", "content": "third question"},
        {"role": "assistant", "content": "gamma reply"},
    ]
    item = make([{"input": conversation}], tokenizer, output_key=None, multiturn=True)[0]
    # Qwen3 strips the think block from earlier turns and keeps an empty one in the last: both are as rendered.
    assert target_spans(tokenizer, item) == [
        "alpha reply<|im_end|>",
        "beta reply<|im_end|>",
        "<think>\n\n</think>\n\ngamma reply<|im_end|>",
    ]
    assert "question" not in masked_text(tokenizer, item) and "Be brief" not in masked_text(tokenizer, item)
    full = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(item["input_ids"]) == full.rstrip()  # the training text is the template's own
    # --train_on_last_turn_only (Molt's --data.train_on_last_turn_only): the same tokens, only the last turn learned
    last = make([{"input": conversation}], tokenizer, output_key=None, multiturn=True, last_turn_only=True)[0]
    assert torch.equal(last["input_ids"], item["input_ids"])
    assert target_spans(tokenizer, last) == ["<think>\n\n</think>\n\ngamma reply<|im_end|>"]


# ChatML without Qwen3's think handling: every prefix renders as a prefix of the whole conversation.
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_multiturn_with_a_prefix_stable_template(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer, "chat_template", CHATML)
    conversation = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "alpha"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "beta"},
    ]
    item = make([{"input": conversation}], tokenizer, output_key=None, multiturn=True)[0]
    assert target_spans(tokenizer, item) == ["alpha<|im_end|>", "beta<|im_end|>"]
    assert tokenizer.decode(item["input_ids"]) == (
        "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\nalpha"
        "<|im_end|>\n<|im_start|>user\nq2<|im_end|>\n<|im_start|>"
        "assistant\nbeta<|im_end|>"
    )
    # a template whose generation prompt is not a prefix of the whole rendering cannot give turn boundaries
    monkeypatch.setattr(
        tokenizer, "chat_template", CHATML.replace("<|im_start|>assistant\n{% endif %}", "ASSISTANT:{% endif %}")
    )
    with pytest.raises(UserError, match="--multiturn: the chat template renders the start of a conversation"):
        make([{"input": conversation}], tokenizer, output_key=None, multiturn=True)


def test_multiturn_drops_conversations_without_assistant_turn(tokenizer, caplog):
    rows = [
        {"input": [{"role": "user", "content": "hi"}]},
        {"input": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    with caplog.at_level(logging.WARNING, logger="openppo.datasets.sft"):
        ds = make(rows, tokenizer, output_key=None, multiturn=True)
    assert len(ds) == 1 and "dropped 1 of 2 conversations" in caplog.text
    with pytest.raises(UserError, match="--input_key: no conversation"):
        make(rows[:1], tokenizer, output_key=None, multiturn=True)
    with pytest.raises(UserError, match="--multiturn needs --apply_chat_template"):
        make(rows, tokenizer, output_key=None, multiturn=True, apply_chat_template=False)


def test_long_prompts_dropped_and_long_samples_truncated(tokenizer, caplog):
    rows = [
        {"input": "word " * 50, "output": "x"},  # prompt alone is over max_len
        {"input": "hi", "output": "one two three four five six seven eight nine ten"},
    ]
    with caplog.at_level(logging.WARNING, logger="openppo.datasets.sft"):
        ds = make(rows, tokenizer, max_len=16)
    assert "dropped 1 of 2 samples whose prompt alone has >= 16 tokens (--max_len)" in caplog.text
    assert len(ds) == 1
    item = ds[0]
    assert len(item["input_ids"]) == 16 and item["loss_mask"][-1].item() == 1
    with pytest.raises(UserError, match="--max_len 16: every sample's prompt"):
        make(rows[:1], tokenizer, max_len=16)


def test_missing_column_and_output_key(tokenizer):
    with pytest.raises(
        UserError,
        match=r"--output_key: column 'answer' not found in the SFT data \(columns: input, "
        r"output\)",
    ):
        make([{"input": "a", "output": "b"}], tokenizer, output_key="answer")
    with pytest.raises(UserError, match="--output_key is required"):
        make([{"input": "a", "output": "b"}], tokenizer, output_key=None)


def test_collate_padded_shapes_and_masks(tokenizer):
    ds = make(
        [{"input": "hi", "output": "yo"}, {"input": "a longer question here", "output": "a longer answer"}], tokenizer
    )
    lengths = [len(ds[0]["input_ids"]), len(ds[1]["input_ids"])]
    batch = collate_padded([ds[0], ds[1]], pad_token_id=tokenizer.pad_token_id)
    assert set(batch) == {"input_ids", "attention_mask", "loss_mask"}
    assert batch["input_ids"].shape == (2, max(lengths)) == batch["attention_mask"].shape == batch["loss_mask"].shape
    assert batch["attention_mask"].sum(1).tolist() == lengths
    short = lengths.index(min(lengths))
    assert (batch["input_ids"][short, min(lengths) :] == tokenizer.pad_token_id).all()
    assert batch["loss_mask"][short, min(lengths) :].sum() == 0
    assert torch.equal(batch["loss_mask"][short, : min(lengths)], ds[short]["loss_mask"])


def test_collate_packed_positions_restart_and_first_tokens_are_not_targets():
    items = [
        {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1])},
        {"input_ids": torch.tensor([8, 9]), "loss_mask": torch.tensor([1, 1])},  # empty prompt, no BOS
        {"input_ids": torch.tensor([4, 3, 2, 1]), "loss_mask": torch.tensor([0, 0, 1, 1])},
    ]
    batch = collate_packed(items)
    assert batch["seq_lens"] == [3, 2, 4]
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 4, 3, 2, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    # token 8 would be predicted from token 7 of the previous sequence: not a target
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 0, 1, 0, 0, 1, 1]]
    assert items[1]["loss_mask"].tolist() == [1, 1]  # the items themselves are left unchanged
    assert "attention_mask" not in batch


def test_dataloader_num_workers_collate_the_same_batches_in_worker_processes(tokenizer):
    """--dataloader_num_workers: the supervised trainer's loader collates in that many processes (the collate
    functions must pickle), giving the batches it gives in-process."""
    import functools

    from torch.utils.data import SequentialSampler

    from openppo.trainers.loop import SupervisedTrainer

    ds = make([{"input": f"What is {i}+{i}?", "output": str(2 * i)} for i in range(6)], tokenizer)
    loaders = []
    for workers in (0, 2):
        trainer = object.__new__(SupervisedTrainer)  # only what data_loader reads
        trainer.micro, trainer.num_workers = 2, workers
        trainer.collate_fn = functools.partial(collate_padded, pad_token_id=tokenizer.pad_token_id)
        loaders.append(trainer.data_loader(ds, SequentialSampler(ds)))
    assert loaders[1].num_workers == 2
    for a, b in zip(*loaders, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
