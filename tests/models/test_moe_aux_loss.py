"""--aux_loss_coef: a mixture-of-experts model's router load-balancing loss, on the tiny Qwen3-MoE of the zoo (4
experts, 2 per token), fp32, in process.

The value is transformers' own (`Qwen3MoeForCausalLM(output_router_logits=True).aux_loss`): our Actor returns it
padded or packed, our ScalarModel (which skips the CausalLM forward) computes the same from its backbone's router
logits, and the PPO, SFT, RM and DPO losses each add coef x it.
"""

from __future__ import annotations

import pytest
import torch

from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import ragged_rows

LENGTHS = [9, 4, 13, 7]


@pytest.fixture(scope="module")
def moe_dir():
    return tiny_model_dir(arch="qwen3_moe")


@pytest.fixture(scope="module")
def batch():
    return ragged_rows(LENGTHS, 5000, torch.Generator().manual_seed(0))


def _expected(moe_dir, batch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    with torch.no_grad():
        out = hf(batch["sequences"], attention_mask=batch["attention_mask"], output_router_logits=True, use_cache=False)
    return out.aux_loss


def test_actor_and_scalar_model_return_transformers_router_loss_padded_or_packed(moe_dir, batch):
    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from openppo.models.scalar import ScalarModel

    expected = _expected(moe_dir, batch)
    assert 2.0 <= expected <= 4.0  # top-k (2) at a perfect balance, at most the expert count (4)
    actor = Actor.from_pretrained(str(moe_dir), dtype=torch.float32)
    scalar = ScalarModel.from_pretrained(str(moe_dir), dtype=torch.float32, flag="--pretrain")
    seqs, attn = batch["sequences"], batch["attention_mask"]
    for packed in (False, True):
        actor.layout = scalar.layout = RowLayout(packed=packed)
        out = actor(seqs, attn, return_aux_loss=True)
        assert out.aux_loss.item() == pytest.approx(expected.item(), abs=1e-6), packed
        _, aux = scalar(seqs, attn, return_aux_loss=True)
        assert aux.item() == pytest.approx(expected.item(), abs=1e-6), packed
    assert actor(seqs, attn).aux_loss is None  # not asked: no router logits are kept
    # the loss trains the routers: its gradient reaches every layer's gate
    actor(seqs, attn, return_aux_loss=True).aux_loss.backward()
    gates = {n: p.grad for n, p in actor.named_parameters() if n.endswith("mlp.gate.weight")}
    assert len(gates) == 2 and all(g is not None and g.abs().max() > 0 for g in gates.values())


def test_shared_prompt_rows_return_the_unshared_router_loss(moe_dir):
    """--share_prompt_in_group: a group's prompt sits once in the row but stands for one copy per response, so the
    router loss weighs its tokens by the group's size: transformers' loss over the padded rows, Actor and ScalarModel
    (the plain shared row would give each prompt the weight of one response)."""
    from openppo.models.actor import Actor, prompt_lengths
    from openppo.models.row_layout import RowLayout
    from openppo.models.scalar import ScalarModel
    from tests.ppo.rank_helpers import grouped_rows

    rows = grouped_rows([(9, [4, 7, 2]), (5, [6, 3])])
    seqs, attn, mask = rows["sequences"], rows["attention_mask"], rows["action_mask"]
    expected = _expected(moe_dir, rows).item()
    actor = Actor.from_pretrained(str(moe_dir), dtype=torch.float32)
    scalar = ScalarModel.from_pretrained(str(moe_dir), dtype=torch.float32, flag="--pretrain")
    actor.layout = scalar.layout = RowLayout(packed=True, share_prompts=True)
    assert actor(seqs, attn, score_mask=mask, return_aux_loss=True).aux_loss.item() == pytest.approx(expected, abs=1e-6)
    _, aux = scalar(seqs, attn, prompt_lens=prompt_lengths(mask), return_aux_loss=True)
    assert aux.item() == pytest.approx(expected, abs=1e-6)
    plain = RowLayout(packed=True).rows(seqs, attn, None)  # the same tokens, each prompt once per row
    assert plain.input_ids.size(1) > actor.layout.rows(seqs, attn, None, prompt_lengths(mask)).input_ids.size(1)


def test_ppo_actor_loss_adds_coef_times_the_token_share(moe_dir, batch):
    """Each micro-batch adds coef x aux x (its action tokens / the step's): a step sums to coef x the
    token-weighted mean."""
    from openppo.models.actor import Actor
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss

    actor = Actor.from_pretrained(str(moe_dir), dtype=torch.float32)
    data = {k: v for k, v in batch.items() if k != "noise"}
    with torch.no_grad():
        data["old_log_probs"] = actor(data["sequences"], data["attention_mask"]).log_probs
    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0)
    normalizers = torch.tensor([3.0 * data["action_mask"].sum().item(), 3 * len(LENGTHS)])  # one third of a step

    def contribution(coef):
        loss_fn = actor_loss(
            actor,
            algo,
            kl_coef=0.0,
            temperature=1.0,
            generate_max_len=16,
            is_correction=None,
            is_threshold=(0.5, 5.0),
            aux_loss_coef=coef,
        )
        with torch.no_grad():
            return loss_fn(data, normalizers)

    plain, plain_metrics = contribution(0.0)
    with_aux, metrics = contribution(0.5)
    assert "train/aux_loss" not in plain_metrics
    # the metric is the micro-batch's share too: a step's micro-batches add up to its token-weighted mean
    # (the loop's metrics are 0-dim tensors, read once per fit: openppo.utils.transfer)
    aux = float(metrics["train/aux_loss"])
    assert aux == pytest.approx(_expected(moe_dir, batch).item() / 3, abs=1e-6)
    assert (with_aux - plain).item() == pytest.approx(0.5 * aux, abs=1e-6)


def test_supervised_losses_add_coef_times_the_router_loss(moe_dir, batch):
    """SFT, RM and DPO: compute_loss with --aux_loss_coef 0.5 is the plain loss + 0.5 x the forward's router loss."""
    from openppo.models.actor import Actor
    from openppo.models.scalar import ScalarModel
    from openppo.trainers.stages import DPOTrainer, RewardModelTrainer, SFTTrainer

    seqs, attn = batch["sequences"], batch["attention_mask"]
    sft = object.__new__(SFTTrainer)  # only what compute_loss reads
    sft.engine = Actor.from_pretrained(str(moe_dir), dtype=torch.float32)
    rm = object.__new__(RewardModelTrainer)
    rm.engine = ScalarModel.from_pretrained(str(moe_dir), dtype=torch.float32, flag="--pretrain")
    rm.loss_kind, rm.margin = "sigmoid", 0.0
    dpo = object.__new__(DPOTrainer)
    dpo.engine = dpo.ref_engine = sft.engine
    dpo.beta, dpo.label_smoothing, dpo.ipo, dpo.nll_loss_coef = 0.1, 0.0, False, 0.0
    data = {"input_ids": seqs, "attention_mask": attn, "loss_mask": attn}
    expected = _expected(moe_dir, batch).item()
    for trainer in (sft, rm, dpo):
        losses = {}
        for coef in (0.0, 0.5):
            trainer.aux_loss_coef = coef
            with torch.no_grad():
                losses[coef] = trainer.compute_loss(data)
        (plain, plain_metrics), (with_aux, metrics) = losses[0.0], losses[0.5]
        assert "train/aux_loss" not in plain_metrics and metrics["train/aux_loss"] == pytest.approx(expected, abs=1e-6)
        assert (with_aux - plain).item() == pytest.approx(0.5 * expected, abs=1e-6), type(trainer).__name__


@pytest.mark.parametrize("kind", ["actor", "critic"])
def test_freeze_moe_router_holds_exactly_the_routers(moe_dir, batch, kind, caplog):
    """--freeze_moe_router: after an Adam step on the aux loss plus the model's output, every router (each layer's
    `mlp.gate`, a transformers `*Router`) is as loaded and the attention moved; the weight sync leaves the routers
    out. Unfrozen, the same step moves them. A dense model says in one line that it has no router."""
    from openppo.models.actor import Actor
    from openppo.models.hf import moe_router_parameter_names
    from openppo.models.scalar import ScalarModel
    from openppo.rollout.sender import iter_full_weights

    def build(**kwargs):
        if kind == "actor":
            return Actor.from_pretrained(str(moe_dir), dtype=torch.float32, **kwargs)
        return ScalarModel.from_pretrained(str(moe_dir), dtype=torch.float32, flag="--critic_pretrain", **kwargs)

    def step(model) -> set[str]:
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        if kind == "actor":
            out = model(batch["sequences"], batch["attention_mask"], return_aux_loss=True)
            loss = out.aux_loss - out.log_probs.sum()
        else:
            values, aux = model(batch["sequences"], batch["attention_mask"], return_aux_loss=True)
            loss = aux + values.square().sum()
        loss.backward()
        optimizer.step()
        return {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}

    frozen = build(freeze_moe_router=True)
    routers = {n for n, p in frozen.named_parameters() if not p.requires_grad}
    assert {n.rpartition("layers.")[2] for n in routers} == {"0.mlp.gate.weight", "1.mlp.gate.weight"}, routers
    moved = step(frozen)
    assert not moved & routers and {n for n in moved if ".self_attn." in n}
    assert routers <= step(build())  # unfrozen, the same step moves them
    if kind == "actor":
        sent = {name for name, _ in iter_full_weights(frozen, rank=0)}
        assert sent and not any(n.endswith("mlp.gate.weight") for n in sent)  # (checkpoint names)
        assert any(n.endswith("mlp.gate.weight") for n, _ in iter_full_weights(build(), rank=0))
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    assert moe_router_parameter_names(dense) == []  # its MLP's gate_proj is no router
    with caplog.at_level("WARNING"):
        Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, freeze_moe_router=True)
    assert "--freeze_moe_router has no effect on" in caplog.text
