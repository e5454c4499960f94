"""The one training loop for actor and critic on a batch of experience, inside a DeepSpeed rank.

Each optimizer step takes a fixed number of rows on every rank, cut into micro-batches by a row count or a token
budget (`openppo.ppo.batching`); every rank runs the same number of micro-batches. Before the first of them the
step's global normalisers (response tokens and responses over all its micro-batches and ranks) are all-reduced, so
the loss is one exact token-mean (or sequence-mean) over the step, not a mean of micro-batch means, however the rows
were cut. We own the accumulation boundary (the micro-batch count varies) and backpropagate each contribution
unscaled by DeepSpeed's accumulation count, times the world size to undo its gradient averaging over ranks (see
openppo.algorithms.reductions).

`actor_loss` and `critic_loss` are the two objectives; `fit_experience` is shared. `WeightAverage` is the
actor's --enable_ema average of its weights, updated after each optimizer step.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from openppo.algorithms import (
    SamplingFilter,
    aggregate_loss,
    clip_bounds,
    default_loss_agg_mode,
    engine_gap,
    kl_loss,
    loss_normalizers,
    masked_mean,
    policy_loss,
    value_loss,
)
from openppo.models.actor import prompt_lengths
from openppo.ppo.batching import (
    Batching,
    all_reduce,
    noop_rows,
    plan_on_all_ranks,
    prompt_groups,
    prompt_shares,
    row_lengths,
    select_rows,
)
from openppo.ppo.config import AlgoConfig
from openppo.strategy.step_guard import StepGuard
from openppo.utils.images import BATCH_KEY as IMAGES
from openppo.utils.transfer import host_tensor, read_values, to_device, upload

# metrics as floats or 0-dim tensors: `fit_experience` reads tensors once, at its end (see utils.transfer)
LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict[str, float | torch.Tensor]]]


def fit_experience(
    engine,
    data: dict[str, torch.Tensor],
    loss_fn: LossFn,
    *,
    batching: Batching,
    rows_per_step: int,
    epochs: int,
    world_size: int,
    seed: int,
    device: torch.device,
    ring_size: int = 1,
    tensor_parallel_size: int = 1,
    guard: StepGuard | None = None,
    after_step: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Train `engine` on `data` (this rank's share) for `epochs`; returns the step metrics, averaged over steps.

    Each epoch shuffles the rows (seeded, so a resume repeats it) and takes `rows_per_step` rows per optimizer step,
    cut into micro-batches by `batching` (a row count, or a token budget with --use_dynamic_batch).
    `loss_fn(micro_batch, normalizers)` returns (contribution to the step loss, metrics). `normalizers` is the
    all-reduced int64 [2] (num_tokens, num_seqs) of the step's action masks. The metrics named `*_loss` are the
    micro-batch's share of a step loss: summed over micro-batches and averaged over ranks they are the mean step loss;
    the others are means over a micro-batch's response tokens (entropy, approx_kl, clip_ratio, ...), which this
    returns as means over the response tokens of every applied step on every rank, the same on all ranks: a plain
    mean of micro-batch means would change with the micro-batch cut (a 1-token row weighing as much as 6 tokens).

    With `ring_size` K > 1 the K ranks of a ring hold the same rows and each backpropagates its chunk's part of the
    gradient: the parts sum to the row's gradient, so the backward scale stays `world_size`, while token counts and
    the logged losses, identical on the K ranks, are counted once per ring. With `tensor_parallel_size` P > 1 the
    P ranks of a tensor-parallel group also hold the same rows, each owning a slice of the weights; DeepSpeed then
    averages gradients over the data-parallel group only (world / P ranks), which sets the backward scale.

    `guard` (the role's, so that a run of bad steps is counted across calls) skips an optimizer step whose loss or
    gradient is NaN/Inf and stops the run after too many in a row; the metrics leave skipped steps out and
    `guard.metric` counts them. Without one the engine is stepped directly (test doubles, benchmarks).
    `after_step` runs after every optimizer step that was applied (`WeightAverage.update`).
    """
    replicas = ring_size * tensor_parallel_size  # ranks holding the same rows
    data_parallel = world_size // replicas
    grad_scale = world_size // tensor_parallel_size  # the ranks DeepSpeed averages gradients over
    # (floats or 0-dim device tensors: a micro-batch's metrics are read from the device once, after the last step)
    losses: dict[str, float | torch.Tensor] = defaultdict(float)
    sums: dict[str, float | torch.Tensor] = defaultdict(float)  # token-mean metrics times their micro-batch's tokens
    steps = skipped = scored = micro_steps = computed = real_tokens = shared_tokens = 0
    engine.train()
    size = data["sequences"].size(0)
    lengths = row_lengths(data)
    # --share_prompt_in_group: the rows of a group stay together when shuffled, so their prompt is computed once
    shares = prompt_shares(data) if batching.share_prompts else [0] * size
    groups = prompt_groups(shares)
    for epoch in range(epochs):
        order = shuffled(groups, seed + epoch)
        step_rows = [order[i : i + rows_per_step] for i in range(0, size, rows_per_step)]
        step_shares = [
            [shares[r] if k and rows[k - 1] == r - 1 else 0 for k, r in enumerate(rows)] for rows in step_rows
        ]
        plans = plan_on_all_ranks(
            batching, [[lengths[r] for r in rows] for rows in step_rows], world_size, device, step_shares
        )
        for rows, step_share, plan in zip(step_rows, step_shares, plans):
            micros = [select_rows(data, [rows[j] for j in m]) if m else noop_rows(data) for m in plan]
            if batching.share_prompts:  # prompt tokens a micro-batch's rows share with the row before them
                shared_tokens += sum(step_share[j] for m in plan for j in m[1:])
            counts = sum(loss_normalizers(b["action_mask"]) for b in micros)
            normalizers = all_reduce(upload(counts, device), world_size) // replicas
            step_losses: dict[str, float | torch.Tensor] = defaultdict(float)
            step_sums: dict[str, float | torch.Tensor] = defaultdict(float)
            step_scored = 0
            for i, (host, planned) in enumerate(zip(micros, plan)):
                # The boundary is ours: the number of micro-batches varies per step with a token budget.
                engine.set_gradient_accumulation_boundary(i == len(micros) - 1)
                # counted on the host, and the metrics kept on the device: the host then never waits on the GPU
                # within a step, and queues the next micro-batch while the GPU runs this one
                batch = to_device(host, device)
                contribution, metrics = loss_fn(batch, normalizers)
                # DeepSpeed averages gradients over ranks; the contributions already sum to the step loss.
                if guard is not None:
                    guard.backward(contribution * grad_scale, scale_wrt_gas=False)
                    applied = guard.step()
                else:
                    engine.backward(contribution * grad_scale, scale_wrt_gas=False)
                    engine.step()
                    applied = True
                tokens = int(host["action_mask"].sum()) if planned else 0
                for key, value in metrics.items():
                    if isinstance(value, torch.Tensor):
                        value = value.detach()
                    if key.endswith("_loss"):
                        step_losses[key] += value * data_parallel
                    else:  # every rank lists every key, also for its padding micro-batches (weight 0)
                        step_sums[key] += value * tokens if tokens else 0.0
                if planned:
                    step_scored += tokens
                    real = int(host["attention_mask"].sum())
                    computed += real if batching.packed else host["attention_mask"].numel()
                    real_tokens += real
            if applied and after_step is not None:
                after_step()
            if applied:  # a skipped step's (NaN) metrics would poison the means
                for key, value in step_losses.items():
                    losses[key] += value
                for key, value in step_sums.items():
                    sums[key] += value
                scored += step_scored
                steps += 1
            else:
                skipped += 1
            micro_steps += len(plan)
    # perf/*: the effect of packing and token budgets (padding positions computed, micro-steps per optimizer step)
    perf = {
        "perf/padding_share": 1.0 - real_tokens / max(computed, 1),
        "perf/micro_batches": micro_steps / max(steps + skipped, 1),
    }
    if batching.share_prompts:  # the share of the rows' tokens computed once for several rows, not per row
        perf["perf/shared_prompt_share"] = shared_tokens / max(real_tokens, 1)
    return {
        **read_values({k: v / max(steps, 1) for k, v in losses.items()}),
        **token_means(sums, scored, world_size, device),
        **perf,
        **({guard.metric: float(skipped)} if guard is not None else {}),
    }


def token_means(
    sums: dict[str, float | torch.Tensor], tokens: int, world_size: int, device: torch.device
) -> dict[str, float]:
    """Token-weighted sums over every rank divided by the response tokens of every rank (one collective, one read).
    Ranks holding the same rows (a ring, a tensor-parallel group) add the same sums and tokens, which cancel."""
    keys = sorted(sums)
    values = [torch.as_tensor(sums[k]).reshape(()).to(device, torch.float64) for k in keys] + [
        torch.tensor(float(tokens), dtype=torch.float64, device=device)
    ]
    totals = all_reduce(torch.stack(values), world_size)
    *read, total = totals.tolist()
    return {k: v / max(total, 1.0) for k, v in zip(keys, read)}


def shuffled(groups: list[list[int]], seed: int) -> list[int]:
    """The rows in a random order of their groups (`prompt_groups`), keeping the rows of a group together and in
    order; one row a group gives a plain random order of the rows."""
    order = torch.randperm(len(groups), generator=torch.Generator().manual_seed(seed)).tolist()
    return [i for g in order for i in groups[g]]


def actor_loss(
    engine,
    algo: AlgoConfig,
    *,
    kl_coef: float,
    temperature: float,
    generate_max_len: int,
    is_correction: str | None,
    is_threshold: tuple[float, float],
    sampling: SamplingFilter | None = None,
    aux_loss_coef: float = 0.0,
) -> LossFn:
    """Policy loss (+ KL loss, - entropy bonus, + MoE load-balancing loss) of one micro-batch, as a contribution to
    the step loss.

    `sampling`: the engine's top-k/top-p truncation. Engine log-probs are compared (IS weights, the log-prob gap)
    with the old policy under that truncation: the batch's `old_sampling_log_probs`, or, without an old-policy pass,
    this forward's own. `aux_loss_coef` (--aux_loss_coef): the router's load-balancing loss of each micro-batch,
    weighted by its share of the step's action tokens, so the step adds coef x the token-weighted mean."""
    low, high = clip_bounds(algo.eps_clip, algo.eps_clip_low_high)
    mode = algo.loss_agg_mode or default_loss_agg_mode(algo.advantage_estimator, algo.policy_loss_type)
    # The entropy is always logged; it carries a gradient only when it is a loss term.
    entropy_in_loss = bool(algo.entropy_loss_coef)

    def loss_fn(batch: dict[str, torch.Tensor], normalizers: torch.Tensor):
        mask = batch["action_mask"]
        on_policy = "old_log_probs" not in batch  # no separate pass scored the batch: this forward is pi_old
        out = engine(
            batch["sequences"],
            host_tensor(batch, "attention_mask"),  # the row layout is read from the host's masks (Actor.forward)
            temperature=temperature,
            return_entropy=True if entropy_in_loss else "log",
            score_mask=host_tensor(batch, "action_mask"),
            sampling=sampling if on_policy and "rollout_log_probs" in batch else None,
            return_aux_loss=aux_loss_coef > 0,
            images=batch.get(IMAGES),
        )

        def agg(per_token):
            return aggregate_loss(
                per_token,
                mask,
                mode,
                num_tokens_global=normalizers[0],
                num_seqs_global=normalizers[1],
                norm_len=generate_max_len,
            )

        if on_policy:  # one on-policy step per batch (see plan.RunPlan.old_logprob_pass): old = current
            old = out.log_probs.detach()
            old_sampling = out.sampling_log_probs
        else:
            old, old_sampling = batch["old_log_probs"], batch.get("old_sampling_log_probs")
        per_token, pg_metrics = policy_loss(
            out.log_probs,
            old,
            batch["advantages"],
            mask,
            eps_clip_low=low,
            eps_clip_high=high,
            dual_clip=algo.dual_clip,
            loss_type=algo.policy_loss_type,
            rollout_log_probs=batch.get("rollout_log_probs") if is_correction else None,
            is_correction=is_correction,
            is_threshold=is_threshold,
            old_sampling_log_probs=old_sampling,
        )
        loss = agg(per_token)
        metrics = {"train/policy_loss": loss.detach(), **{f"train/{k}": v for k, v in pg_metrics.items()}}
        if on_policy and "rollout_log_probs" in batch:
            # the engine-vs-trainer log-prob gap, measured here since no separate pass measured it
            metrics.update(
                {
                    f"rollout/{k}": v
                    for k, v in engine_gap(
                        batch["rollout_log_probs"], old if old_sampling is None else old_sampling, mask
                    ).items()
                }
            )
        if algo.use_kl_loss and "ref_log_probs" in batch:
            kl_term = agg(
                kl_loss(
                    out.log_probs,
                    batch["ref_log_probs"],
                    mask,
                    algo.kl_estimator,
                    unbiased_gradient=algo.kl_unbiased_gradient,
                    old_log_probs=old,
                )
            )
            loss = loss + kl_coef * kl_term
            metrics["train/kl_loss"] = kl_term.detach()
        if entropy_in_loss:
            loss = loss - algo.entropy_loss_coef * agg(out.entropy)
        if out.aux_loss is not None:
            # a step-loss contribution like the others (*_loss metrics add up over a step's micro-batches)
            aux = out.aux_loss * mask.sum() / normalizers[0]
            loss = loss + aux_loss_coef * aux
            metrics["train/aux_loss"] = aux.detach()
        # a plain mean of this micro-batch (averaged over micro-batches and ranks), not a step-loss contribution
        metrics["train/entropy"] = masked_mean(out.entropy.detach(), mask)
        return loss, metrics

    return loss_fn


def critic_loss(engine, algo: AlgoConfig) -> LossFn:
    """Clipped value loss of one micro-batch (token-mean over the step)."""

    def loss_fn(batch: dict[str, torch.Tensor], normalizers: torch.Tensor):
        mask = batch["action_mask"]
        # the row layout is read from the host's masks, as the actor's is (`actor_loss`)
        host_mask = host_tensor(batch, "action_mask")
        values = engine(
            batch["sequences"], host_tensor(batch, "attention_mask"), prompt_lens=prompt_lengths(host_mask)
        )[:, :-1]
        per_token, v_metrics = value_loss(values, batch["old_values"], batch["returns"], mask, algo.value_clip)
        loss = aggregate_loss(per_token, mask, "token-mean", num_tokens_global=normalizers[0])
        return loss, {
            "train/value_loss": loss.detach(),
            "train/values": masked_mean(values.detach(), mask),
            **{f"train/{k}": v for k, v in v_metrics.items()},
        }

    return loss_fn


# -- --enable_ema -----------------------------------------------------------------------------------------------------


class WeightAverage:
    """--enable_ema: an exponential moving average of the model's weights, e <- beta e + (1 - beta) w after each
    optimizer step, starting from the initial weights (OpenRLHF's --enable_ema / --ema_beta, default 0.992).

    Rank 0 holds the average of the full weights, in fp32 on the host (4 bytes per parameter), so a bf16 model's
    average does not round away the (1 - beta) share of each step. Every rank enters `update` and `restart`: under
    ZeRO-3 and AutoTP the full weights are gathered layer by layer (read-only gathers, as the weight sync's), which
    is also what OpenRLHF's average costs. `state` is the average as an HF state dict (rank 0; None elsewhere).
    `module` is the model (the same object before and after DeepSpeed wraps it).
    """

    def __init__(self, module: torch.nn.Module, beta: float, rank: int):
        self.module, self.beta, self.rank = module, beta, rank
        self.average: dict[str, torch.Tensor] = {}
        self.restart()

    def _weights(self):
        from openppo.rollout.sender import iter_full_weights

        return iter_full_weights(self.module, rank=self.rank)

    @torch.no_grad()
    def restart(self) -> None:
        """The average := the current weights."""
        self.average = {name: w.to("cpu", torch.float32, copy=True) for name, w in self._weights()}

    @torch.no_grad()
    def update(self) -> None:
        for name, w in self._weights():
            self.average[name].mul_(self.beta).add_(w.to("cpu", torch.float32), alpha=1 - self.beta)

    def state(self, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        return {name: e.to(dtype) for name, e in self.average.items()} if self.average else None

    def state_dict(self) -> dict:
        return {"beta": self.beta, "average": self.average}

    def load_state_dict(self, state: dict) -> None:
        if set(state["average"]) != set(self.average):
            raise ValueError("the checkpoint's EMA holds other weights than this model: resume with the same model")
        for name, value in state["average"].items():
            self.average[name].copy_(value)
