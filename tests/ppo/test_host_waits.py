"""The actor's and the critic's updates never read a device value within a step, so that on a GPU the host queues
the next micro-batch while the GPU runs this one (`openppo.utils.transfer`); nor do their forward passes.

No GPU here: the tensors the training loop copies to the device are marked instead (a tensor subclass whose mark
every result computed from them keeps), and every read of a marked value is recorded: `.item()`, `.tolist()`, a
truth value, a boolean-mask index or a `nonzero`, whose result size the host must learn from the device. On a GPU
each of these makes the host wait for everything queued (`torch.cuda.set_sync_debug_mode` counts the same in
`bench/train_step_mfu.py --timeline`). The tiny model on one real DeepSpeed rank, packed and padded rows, with the
engine's log-probs in the batch (their gap to the trainer's is a metric)."""

from __future__ import annotations

import traceback

import pytest
import torch

from openppo.models import actor as actor_module
from openppo.models import row_layout, varlen_attention
from openppo.models.actor import Actor
from openppo.models.row_layout import RowLayout
from openppo.models.scalar import ScalarModel
from openppo.ppo.batching import Batching
from openppo.ppo.config import AlgoConfig
from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
from openppo.utils import transfer
from tests.model_cache import tiny_model_dir
from tests.ppo.test_fit import _prepare, _strategy

READS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique"}
READS |= {"masked_select", "equal", "allclose"}


class OnDevice(torch.Tensor):
    """A tensor the training loop copied to the device, or computed from one."""

    reads: list[str] | None = None  # where marked values were read, while a micro-batch runs

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        index = args[1] if name in ("__getitem__", "__setitem__") and len(args) > 1 else None
        indices = index if isinstance(index, tuple) else (index,)
        boolean = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices)
        if cls.reads is not None and (name in READS or boolean):
            where = next(f for f in reversed(traceback.extract_stack()[:-1]) if "test_host_waits" not in f.filename)
            cls.reads.append(f"{name} at {where.filename.rsplit('/', 2)[-1]}:{where.lineno}")
        return super().__torch_function__(func, types, args, kwargs)


def _marked_upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    marked = tensor.to(device).as_subclass(OnDevice)
    transfer._HOST_COPIES[marked] = tensor  # as `upload` keeps it on a GPU (`transfer.host_copy`)
    return marked


def _batch(rows: int = 8, length: int = 12) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(10, 1000, (rows, length), generator=gen)
    attn = torch.ones_like(seqs)
    mask = torch.zeros(rows, length - 1)
    for r in range(rows):  # ragged, right-padded: pairs of rows share prompts of 3-5 tokens; responses of 2-6
        prompt, response = 3 + (r // 2) % 3, 2 + r % 5
        seqs[r, :prompt] = seqs[r - r % 2, :prompt]
        attn[r, prompt + response :] = 0
        mask[r, prompt - 1 : prompt - 1 + response] = 1
    logps = -torch.rand(rows, length - 1, generator=gen) * mask
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "rollout_log_probs": logps,
        "advantages": torch.randn(rows, length - 1, generator=gen) * mask,
    }


def _engine(monkeypatch, model: str, layout: str):
    """(strategy, engine) of the tiny model as an actor or a critic on one DeepSpeed rank, uploads marked, its rows
    "packed", "padded" or "shared" (packed, each pair's prompt once)."""
    for module in (transfer, row_layout, varlen_attention, actor_module):
        monkeypatch.setattr(module, "upload", _marked_upload)
    strategy = _strategy(micro=2, accum=4)
    path = str(tiny_model_dir())
    if model == "actor":
        module = Actor.from_pretrained(path, dtype=torch.float32)
    else:
        module = ScalarModel.from_pretrained(path, dtype=torch.float32, flag="--critic_pretrain")
    engine = _prepare(strategy, module)
    engine.module.layout = RowLayout(packed=layout != "padded", share_prompts=layout == "shared")
    return strategy, engine


@pytest.mark.parametrize("model", ["actor", "critic"])
@pytest.mark.parametrize("layout", ["packed", "padded", "shared"])
def test_the_update_reads_no_device_value_between_optimizer_steps(monkeypatch, layout, model):
    strategy, engine = _engine(monkeypatch, model, layout)
    packed = layout != "padded"
    if model == "actor":
        loss_fn = actor_loss(
            engine,
            AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0),
            kl_coef=0.0,
            temperature=1.0,
            generate_max_len=7,
            is_correction=None,
            is_threshold=(0.5, 5.0),
        )
    else:
        loss_fn = critic_loss(engine, AlgoConfig(advantage_estimator="gae", value_clip=0.2))
    data = _batch()
    data["old_values"], data["returns"] = torch.randn(2, 8, 11, generator=torch.Generator().manual_seed(1))
    reads: list[str] = []
    seen = []

    def watched(batch, normalizers):  # the micro-batch: forward, loss, then (below) backward and step
        seen.append(isinstance(batch["sequences"], OnDevice))
        OnDevice.reads = reads
        return loss_fn(batch, normalizers)

    backward = engine.backward

    def watched_backward(*args, **kwargs):
        try:
            return backward(*args, **kwargs)
        finally:
            OnDevice.reads = None  # the step's end (metrics, the last optimizer step) may read

    monkeypatch.setattr(engine, "backward", watched_backward)
    try:
        metrics = fit_experience(
            engine,
            data,
            watched,
            batching=Batching(packed=packed, rows=2, share_prompts=layout == "shared"),
            rows_per_step=8,
            epochs=1,
            world_size=1,
            seed=0,
            device=strategy.device,
        )
    finally:
        OnDevice.reads = None
    assert seen == [True] * 4  # the batches the loss saw came through `upload`, so the test sees their reads
    assert reads == []
    assert metrics["perf/micro_batches"] == 4 and all(isinstance(v, float) for v in metrics.values())
    if model == "actor":
        assert 0 < metrics["train/entropy"] and 0 <= metrics["rollout/logprob_diff"]
    else:
        assert 0 < metrics["train/value_loss"]


@pytest.mark.parametrize("layout", ["packed", "shared"])
@pytest.mark.parametrize("model", ["actor", "critic", "reward"])
def test_a_forward_pass_reads_the_device_once_at_its_end(monkeypatch, model, layout):
    """The workers' forward passes (openppo.ppo.workers: the actor's log-probs, the critic's values, the reward
    model's scores), run as their methods on this rank's engine: host masks into the forward, the results kept on the
    device; only `ForwardChunks.result` reads them."""
    import types

    from openppo.ppo import batching
    from openppo.ppo.config import RolloutConfig
    from openppo.ppo.workers import ActorWorker, CriticWorker, RewardWorker

    strategy, engine = _engine(monkeypatch, "actor" if model == "actor" else "critic", layout)
    rollout = RolloutConfig(packing_samples=True, micro_rollout_batch_size=2, temperature=1.0)
    worker = types.SimpleNamespace(
        engine=engine,
        strategy=strategy,
        cfg=types.SimpleNamespace(rollout=rollout),
        role=types.SimpleNamespace(share_prompts=layout == "shared"),
    )
    data = _batch()
    reads: list[str] = []
    result = batching.ForwardChunks.result

    def watched_result(chunks):  # the passes' one read of the device
        OnDevice.reads = None
        return result(chunks)

    monkeypatch.setattr(batching.ForwardChunks, "result", watched_result)
    method = {"actor": ActorWorker.log_probs, "critic": CriticWorker.values, "reward": RewardWorker.scores}[model]
    OnDevice.reads = reads
    try:
        values = method(worker, data)
    finally:
        OnDevice.reads = None
    assert reads == []
    with torch.no_grad():
        if model == "actor":
            plain = engine(data["sequences"], data["attention_mask"], score_mask=data["action_mask"]).log_probs
            values, plain = values * data["action_mask"], plain * data["action_mask"]
        elif model == "critic":
            plain = engine(data["sequences"], data["attention_mask"])[:, :-1] * data["attention_mask"][:, 1:]
            values = values * data["attention_mask"][:, 1:]
        else:
            plain = engine.module.score_last(data["sequences"], data["attention_mask"])
    assert values.shape == plain.shape and torch.allclose(values, plain, atol=1e-5)
