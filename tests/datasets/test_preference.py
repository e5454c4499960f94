"""PreferenceDataset: response masks, EOS kept at the end under truncation, pair batches."""

import logging

import datasets
import pytest

from openppo.datasets import PreferenceDataset, collate_pairs
from openppo.errors import UserError

KEYS = dict(prompt_key="prompt", chosen_key="chosen", rejected_key="rejected")


def make(rows, tokenizer, **kw):
    args = dict(max_len=256, apply_chat_template=True, input_template=None, **KEYS)
    args.update(kw)
    return PreferenceDataset(datasets.Dataset.from_list(rows), tokenizer, **args)


def masked(tokenizer, ids, mask):
    return tokenizer.decode(ids[mask.bool()])


def test_chosen_and_rejected_masks_decode_to_the_responses(tokenizer):
    item = make([{"prompt": "Say hi", "chosen": "hi friend", "rejected": "go away"}], tokenizer)[0]
    assert set(item) == {"chosen_ids", "chosen_loss_mask", "rejected_ids", "rejected_loss_mask"}
    assert (
        masked(tokenizer, item["chosen_ids"], item["chosen_loss_mask"]) == "<think>\n\n</think>\n\nhi friend<|im_end|>"
    )
    assert (
        masked(tokenizer, item["rejected_ids"], item["rejected_loss_mask"])
        == "<think>\n\n</think>\n\ngo away<|im_end|>"
    )
    assert tokenizer.decode(item["chosen_ids"]).startswith("<|im_start|>user\nSay hi<|im_end|>\n")


def test_truncated_sequences_still_end_with_the_end_of_turn_token(tokenizer):
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    long = " ".join(["word"] * 40)
    ds = make([{"prompt": "Say hi", "chosen": long, "rejected": "short"}], tokenizer, max_len=20)
    item = ds[0]
    assert len(item["chosen_ids"]) == 20  # truncated
    assert len(item["rejected_ids"]) < 20  # untouched
    for side in ("chosen", "rejected"):
        assert item[f"{side}_ids"][-1].item() == end
        assert item[f"{side}_loss_mask"][-1].item() == 1
    assert masked(tokenizer, item["chosen_ids"], item["chosen_loss_mask"]).endswith("word word<|im_end|>")


def test_whole_conversations_without_prompt_key(tokenizer):
    def conv(reply):
        return [{"role": "user", "content": "Say hi"}, {"role": "assistant", "content": reply}]

    item = make([{"chosen": conv("hello"), "rejected": conv("no")}], tokenizer, prompt_key=None)[0]
    assert masked(tokenizer, item["chosen_ids"], item["chosen_loss_mask"]) == "<think>\n\n</think>\n\nhello<|im_end|>"
    assert masked(tokenizer, item["rejected_ids"], item["rejected_loss_mask"]) == "<think>\n\n</think>\n\nno<|im_end|>"
    with pytest.raises(UserError, match="--chosen_key: a conversation must end with an assistant message"):
        make([{"chosen": conv("x")[:1], "rejected": conv("no")}], tokenizer, prompt_key=None)
    with pytest.raises(UserError, match="--chosen_key holds plain strings: pass --prompt_key"):
        make([{"chosen": "a", "rejected": "b"}], tokenizer, prompt_key=None)


def test_plain_text_pairs(tokenizer):
    item = make(
        [{"prompt": "Q", "chosen": "good", "rejected": "bad"}],
        tokenizer,
        apply_chat_template=False,
        input_template="{}: ",
    )[0]
    assert tokenizer.decode(item["chosen_ids"]) == "Q: good<|im_end|>"
    assert masked(tokenizer, item["rejected_ids"], item["rejected_loss_mask"]) == "bad<|im_end|>"
    # no prompt column: the whole string is the response
    item = make([{"chosen": "good", "rejected": "bad"}], tokenizer, apply_chat_template=False, prompt_key=None)[0]
    assert item["chosen_loss_mask"].tolist() == [1] * len(item["chosen_ids"])


def test_pairs_with_long_prompts_are_dropped(tokenizer, caplog):
    rows = [{"prompt": "word " * 40, "chosen": "a", "rejected": "b"}, {"prompt": "hi", "chosen": "a", "rejected": "b"}]
    with caplog.at_level(logging.WARNING, logger="openppo.datasets.preference"):
        ds = make(rows, tokenizer, max_len=20)
    assert len(ds) == 1 and "dropped 1 of 2 pairs" in caplog.text
    with pytest.raises(UserError, match="--max_len 20"):
        make(rows[:1], tokenizer, max_len=20)
    with pytest.raises(UserError, match="--rejected_key: column 'rejected' not found"):
        make([{"prompt": "hi", "chosen": "a", "bad": "b"}], tokenizer)


def test_collate_pairs_puts_chosen_rows_first(tokenizer):
    ds = make(
        [{"prompt": "p1", "chosen": "c1", "rejected": "r1 longer"}, {"prompt": "p2", "chosen": "c2", "rejected": "r2"}],
        tokenizer,
    )
    batch = collate_pairs([ds[0], ds[1]], pad_token_id=tokenizer.pad_token_id)
    lengths = [
        len(ds[0]["chosen_ids"]),
        len(ds[1]["chosen_ids"]),
        len(ds[0]["rejected_ids"]),
        len(ds[1]["rejected_ids"]),
    ]
    assert batch["input_ids"].shape == (4, max(lengths))
    assert batch["attention_mask"].sum(1).tolist() == lengths
    rows = [tokenizer.decode(batch["input_ids"][i, :n]) for i, n in enumerate(lengths)]
    assert ["c1" in rows[0], "c2" in rows[1], "r1" in rows[2], "r2" in rows[3]] == [True] * 4
    assert masked(tokenizer, batch["input_ids"][2], batch["loss_mask"][2]).endswith("r1 longer<|im_end|>")


def test_margin_loss_uses_each_pairs_margin():
    """--margin_loss: the data's 'margin' column (0 where empty) is each pair's required gap in the sigmoid loss,
    checked through the reward-model trainer's loss on a real scalar model."""
    import torch
    from transformers import AutoTokenizer

    from openppo.algorithms.losses import pairwise_rm_loss
    from openppo.models.scalar import ScalarModel
    from openppo.trainers.stages import RewardModelTrainer
    from tests.model_cache import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())  # the model's own (cut) vocabulary

    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5},
        {"prompt": "3+3?", "chosen": "6", "rejected": "7", "margin": None},
    ]
    ds = make(rows, tokenizer, margin_key="margin")
    batch = collate_pairs([ds[0], ds[1]], tokenizer.pad_token_id)
    assert batch["margin"].tolist() == [1.5, 0.0]
    assert "margin" not in collate_pairs([make(rows, tokenizer)[0]], tokenizer.pad_token_id)
    with pytest.raises(UserError, match="--margin_loss: the preference data has no 'margin' column"):
        make([{k: v for k, v in r.items() if k != "margin"} for r in rows], tokenizer, margin_key="margin")

    trainer = object.__new__(RewardModelTrainer)  # only what compute_loss reads: the model and the loss options
    trainer.engine = ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--pretrain")
    trainer.loss_kind, trainer.margin, trainer.aux_loss_coef = "sigmoid", 0.0, 0.0
    with torch.no_grad():
        loss, _ = trainer.compute_loss(batch)
        chosen, rejected = trainer._score_last(batch)[0].chunk(2)
    assert loss.item() == pytest.approx(pairwise_rm_loss(chosen, rejected, margin=torch.tensor([1.5, 0.0])).item())
    assert loss.item() != pytest.approx(pairwise_rm_loss(chosen, rejected).item())


def test_packed_preference_pairs_give_the_padded_losses():
    """--packing_samples for train_rm and train_dpo: the models run each micro-batch as one packed row (their
    RowLayout); the reward-model and DPO losses equal the padded ones to 1e-5 (fp32)."""
    import torch
    from transformers import AutoTokenizer

    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from openppo.models.scalar import ScalarModel
    from openppo.trainers.stages import DPOTrainer, RewardModelTrainer
    from tests.model_cache import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())  # the model's own (cut) vocabulary

    rows = [
        {"prompt": "2+2?", "chosen": "4", "rejected": "five, I think"},
        {"prompt": "What is three plus three?", "chosen": "6", "rejected": "7"},
    ]
    batch = collate_pairs(list(make(rows, tokenizer)), tokenizer.pad_token_id)
    assert not batch["attention_mask"].all()  # ragged rows: padding that packing skips
    rm = object.__new__(RewardModelTrainer)  # only what compute_loss reads
    rm.engine = ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--pretrain")
    rm.loss_kind, rm.margin, rm.aux_loss_coef = "sigmoid", 0.0, 0.0
    dpo = object.__new__(DPOTrainer)
    dpo.engine = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    dpo.ref_engine = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    with torch.no_grad():
        dpo.ref_engine.model.lm_head.weight.mul_(1.1)  # a reference unlike the policy: a non-zero DPO margin
    dpo.beta, dpo.label_smoothing, dpo.ipo, dpo.nll_loss_coef, dpo.aux_loss_coef = 0.1, 0.0, False, 0.5, 0.0
    losses = {}
    for packed in (False, True):
        for model in (rm.engine, dpo.engine, dpo.ref_engine):
            model.layout = RowLayout(packed=packed)
        with torch.no_grad():
            losses[packed] = [trainer.compute_loss(batch)[0].item() for trainer in (rm, dpo)]
    assert losses[True] == pytest.approx(losses[False], abs=1e-5)
