"""Where a step's batch comes from: prompts in a resumable order, a rollout source that turns them into scored
samples, dynamic filtering, generating ahead (--async_train), and the eval set's pass@k.

    Collector.collect: PromptStream.take -> RolloutSource.generate (engines) -> Scorer.score -> [filter]

The rollout source and the scorer are chosen once per run. Source: `SingleTurn` (one response per request) or
`AgentEpisodes` (multi-turn episodes of an --agent_func_path environment). Scorer: `TextRewards` (a reward function
or an HTTP reward server), `RewardGroup` (the reward model's ranks, ppo/groups.py) or, for agents, the episodes'
own rewards.

Prompt order. Every episode is a fresh random permutation of the prompt set, seeded by `(seed, episode)` alone, so
a resumed run rebuilds the same order without replaying earlier episodes. Each episode uses a whole number of
rollout batches (the remainder of a permutation is skipped, as a `drop_last` loader would). The only state is the
cursor: how many prompts have been handed out. Dynamic filtering takes more prompts per step than the batch
holds, so steps and prompts are counted apart.

Dynamic filtering (DAPO dynamic sampling, Yu et al. 2025, arXiv:2503.14476, section 3.2): a group whose samples all
score the same gives every sample a zero group-normalised advantage, so it costs compute and teaches nothing. Such
groups are dropped and the batch is refilled with new prompts. OpenRLHF's rule is kept: a group stays when
`lo < mean score < hi` (strict), which for 0/1 rewards and the default range (0, 1) is exactly "not all wrong and
not all right".

Generating ahead (`RolloutProducer`) runs `Collector.collect` on a background thread, so the engines generate
batch k+1 while the trainer works on batch k. Staleness is bounded by `--async_queue_size` Q: batch b (trained at
step b, with policy version b-1) may only start once b-1-Q steps are done, so every sample it holds was generated
by a policy at most Q versions old. The engine pool's lock keeps generation and weight syncs apart; each sample
records the version that generated it.

Eval: pass@1 and pass@k over k samples per prompt, overall and per datasource. With a 0/1 correctness reward,
pass@1 is the mean success rate and pass@k the share of prompts with at least one success among k samples
(k = --eval_n_samples_per_prompt; the plain estimator with n = k, Chen et al. 2021, arXiv:2107.03374). With graded
rewards the same numbers read as mean reward and mean best-of-k reward.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from openppo.ppo.config import PPOConfig
from openppo.ppo.reporting import timed
from openppo.rollout.pool import EnginePool, Sample

# -- prompt order ------------------------------------------------------------------------------------------------


class PromptStream:
    def __init__(self, num_prompts: int, *, rollout_batch_size: int, num_episodes: int, seed: int):
        if num_prompts < rollout_batch_size:
            raise ValueError(f"{num_prompts} prompts do not fill one rollout batch of {rollout_batch_size}")
        self.num_prompts = num_prompts
        self.per_episode = (num_prompts // rollout_batch_size) * rollout_batch_size
        self.num_episodes = num_episodes
        self.seed = seed
        self.cursor = 0
        self._orders: dict[int, list[int]] = {}

    @property
    def total(self) -> int:
        return self.per_episode * self.num_episodes

    @property
    def episode(self) -> int:
        return self.cursor // self.per_episode

    def remaining(self) -> int:
        return self.total - self.cursor

    def _order(self, episode: int) -> list[int]:
        if episode not in self._orders:
            self._orders = {
                episode: torch.randperm(
                    self.num_prompts, generator=torch.Generator().manual_seed(self.seed * 100_003 + episode)
                ).tolist()
            }
        return self._orders[episode]

    def take(self, n: int) -> list[int]:
        """The next `n` prompt indices (fewer, possibly none, when the episodes are used up)."""
        out = []
        while len(out) < n and self.cursor < self.total:
            episode, offset = divmod(self.cursor, self.per_episode)
            out.append(self._order(episode)[offset])
            self.cursor += 1
        return out

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "per_episode": self.per_episode}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["per_episode"] != self.per_episode:
            raise ValueError(
                f"the checkpoint was taken with {state['per_episode']} prompts per episode, this run has "
                f"{self.per_episode}: resume with the same --prompt_data, --max_samples and "
                f"--rollout_batch_size"
            )
        self.cursor = int(state["cursor"])


# -- dynamic filtering ------------------------------------------------------------------------------------------


def keep_groups(scores: torch.Tensor, n_samples_per_prompt: int, reward_range: tuple[float, float]) -> torch.Tensor:
    """bool [num_groups]: which groups of `n_samples_per_prompt` consecutive scores to keep."""
    if scores.numel() % n_samples_per_prompt:
        raise ValueError(f"{scores.numel()} scores do not form groups of {n_samples_per_prompt}")
    lo, hi = reward_range
    means = scores.float().view(-1, n_samples_per_prompt).mean(dim=1)
    return (means > lo) & (means < hi)


# -- rollout sources ---------------------------------------------------------------------------------------------


class RolloutSource:
    """Prompts -> samples. `generate` returns the n samples of each prompt consecutively, prompts in order; `seed`
    (--full_determinism) reseeds the engines' sampling; `version` is the weight version at the start of the
    generation (the oldest that can have produced a sample)."""

    drops_episodes = False  # some samples may come back `dropped` (their groups leave the batch)

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg

    def generate(
        self, items: list[dict], *, n: int, temperature: float, seed: int | None, version: int
    ) -> list[Sample]:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the source holds (the agent endpoint's server); the run is over."""


class Scorer(Protocol):
    """Samples -> raw rewards [len(samples)] and extra metrics to log: `TextRewards` (a reward function or HTTP
    server), `RewardGroup` (the reward model's ranks) or `AgentEpisodes` (the environment's rewards)."""

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]: ...


class NoReward:
    """Distillation alone (--teacher_pretrain without a reward source): every sample's task reward is 0, and the
    teachers' log-probs are the whole signal."""

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.zeros(len(samples), dtype=torch.float32), {}


class TextRewards:
    """Rewards of the decoded prompt + response texts from a `RewardSource` (--remote_rm_url: a Python file or an
    HTTP server), with each sample's label."""

    def __init__(self, reward_source: Any, tokenizer):
        self.reward_source, self.tokenizer = reward_source, tokenizer

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        responses = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
        prompts = [s.prompt_text for s in samples]
        result = self.reward_source.score(
            [p + r for p, r in zip(prompts, responses)], prompts, [s.label for s in samples]
        )
        extra = {f"reward/{k}": sum(v) / len(v) for k, v in result.extra_logs.items() if v}
        return torch.tensor(result.rewards, dtype=torch.float32), extra


class SingleTurn(RolloutSource):
    """One response per request, the prompts dealt round-robin over the engines. An agent's turn is one such
    generation of its contexts (`AgentEpisodes`)."""

    def __init__(self, engines: EnginePool, cfg: PPOConfig):
        super().__init__(cfg)
        self.engines = engines

    def generate(
        self,
        items: list[dict],
        *,
        n: int,
        temperature: float,
        seed: int | None,
        version: int,
        max_new_tokens: Sequence[int] | None = None,
        top_p: float | None = None,
    ) -> list[Sample]:
        """`VLLMEngine.generate` of the items' `prompt_ids`, one request per engine (prompt i goes to engine
        i mod E), through `EnginePool.run`: waiting at most the pool's timeout, under the pool's lock so that no weight
        sync lands mid-generation (with --partial_rollout the engines are advanced a few steps a call outside it),
        and sending a dead engine's prompts again to its replacement. `max_new_tokens`: a budget per item (default:
        what --generate_max_len and --max_len leave after the prompt). With a `seed`, engine e reseeds with
        `seed + 1000 e` (--full_determinism), its replacement too. `top_p`: the eval's own (default --top_p)."""
        r, d, pool = self.cfg.rollout, self.cfg.data, self.engines
        if max_new_tokens is None:
            max_new_tokens = [d.response_budget(len(it["prompt_ids"])) for it in items]
        sampling = dict(n=n, temperature=temperature, top_p=r.top_p if top_p is None else top_p, top_k=r.top_k)
        # image prompts: each prompt's images go to its engine beside it (text runs send no images argument)
        images = [it.get("images") or () for it in items] if any(it.get("images") for it in items) else None
        slots = {e: list(range(e, len(items), len(pool))) for e in range(min(len(pool), len(items)))}
        results = pool.run(
            {
                e: dict(
                    prompt_token_ids=[items[i]["prompt_ids"] for i in chunk],
                    max_new_tokens=[max_new_tokens[i] for i in chunk],
                    seed=None if seed is None else seed + 1_000 * e,
                    **sampling,
                    **({} if images is None else {"images": [images[i] for i in chunk]}),
                )
                for e, chunk in slots.items()
            }
        )
        completions: list = [None] * len(items)
        for e, chunk in slots.items():
            for i, result in zip(chunk, results[e]):
                completions[i] = result
        return [
            Sample(
                # an image prompt's ids as the engine expanded its images (what the trainer scores)
                prompt_ids=list(c.get("prompt_token_ids") or item["prompt_ids"]),
                response_ids=c["token_ids"],
                rollout_log_probs=c["logprobs"],
                finish_reason=c["finish_reason"],
                group=item["index"],
                label=item.get("label"),
                prompt_text=item.get("prompt", ""),
                # the engine's tags (--partial_rollout: a sync may land mid-response; versions never decrease), or
                # the version the pool held through the generation
                policy_version=c["versions"][0] if c.get("versions") else c.get("version", version),
                token_versions=c.get("versions") or [c.get("version", version)] * len(c["token_ids"]),
                images=list(item["images"]) if item.get("images") else None,
            )
            for item, group in zip(items, completions)
            for c in group
        ]


class AgentEpisodes(RolloutSource):
    """Multi-turn episodes of an --agent_func_path environment; `episodes(generate, items, n)` plays them
    (`openppo.agents.run_agent_episodes`), each turn one `SingleTurn.generate` of the running episodes' contexts,
    and each sample carries its episode's reward."""

    def __init__(self, turns: SingleTurn, episodes: Callable):
        super().__init__(turns.cfg)
        self.turns, self.episodes = turns, episodes

    def generate(
        self, items: list[dict], *, n: int, temperature: float, seed: int | None, version: int
    ) -> list[Sample]:
        turn_numbers = itertools.count()  # each turn reseeds with its own number
        versions: list[int] = []  # of every turn (--async_train: a sync may land between two turns)

        def one_turn(ids: list[list[int]], budgets: list[int], images: list | None = None) -> list[dict]:
            turn = next(turn_numbers)
            contexts = [{"prompt_ids": x, "index": i} for i, x in enumerate(ids)]
            for context, given in zip(contexts, images or ()):  # image prompts: each context's images beside it
                context["images"] = given
            samples = self.turns.generate(
                contexts,
                n=1,
                temperature=temperature,
                seed=None if seed is None else seed + turn,
                version=version,
                max_new_tokens=budgets,
            )
            versions.extend(s.policy_version for s in samples)
            return [
                {
                    "token_ids": s.response_ids,
                    "logprobs": s.rollout_log_probs,
                    "finish_reason": s.finish_reason,
                    "prompt_token_ids": s.prompt_ids,  # (as the engine expanded the context's images)
                }
                for s in samples
            ]

        samples = self.episodes(one_turn, items, n)
        for s in samples:
            s.policy_version = min(versions, default=version)  # (the round's oldest: a bound on the episode's)
        return samples

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        return torch.tensor([s.reward for s in samples], dtype=torch.float32), mean_extra(samples)


def mean_extra(samples: list[Sample]) -> dict[str, float]:
    """The batch means of the samples' own metrics (`Sample.extra`; a sample without one counts 0)."""
    keys = sorted({k for s in samples for k in s.extra})
    return {k: sum(s.extra.get(k, 0.0) for s in samples) / len(samples) for k in keys}


# -- one rollout batch -------------------------------------------------------------------------------------------


@dataclass
class _Group:
    """The n scored samples of one prompt, and where the prompt sits in the stream (a resume draws it again)."""

    samples: list[Sample]
    scores: torch.Tensor  # [n]
    position: int  # PromptStream cursor at which the prompt was drawn


_EVAL_POSITIONS = 1 << 40  # eval rounds' seeds sit at prompt positions past any training round's


class Collector:
    """One rollout batch of `--rollout_batch_size` groups per `collect()`, drawn from `stream`.

    Oversampling (--vllm_generate_batch_size G above the batch size B): every generation round draws the groups the
    batch still misses plus G - B more, and the groups beyond the batch wait in `ahead` for the next batches, which
    then need fewer rounds (none when G is a multiple of B). Such samples are staler by the steps they wait.
    """

    def __init__(
        self,
        cfg: PPOConfig,
        prompts,
        source: RolloutSource,
        scorer: Scorer,
        stream: PromptStream,
        version: Callable[[], int],
    ):
        self.cfg, self.prompts, self.source, self.scorer, self.stream = cfg, prompts, source, scorer, stream
        self.version = version  # the weight version the engines generate with now
        r = cfg.rollout
        self.surplus = (r.vllm_generate_batch_size or r.rollout_batch_size) - r.rollout_batch_size
        self.ahead: list[_Group] = []  # scored groups generated for later batches

    def round_seed(self, cursor: int) -> int:
        """The sampling seed of the generation round that starts at prompt position `cursor` (each request of the
        round adds its own offset, each agent turn one more)."""
        return (self.cfg.train.seed * 1_000_003 + cursor) * 1_000_000 % 2**62

    def eval_seed(self, start: int) -> int | None:
        """--full_determinism: the seed of the eval round that starts at eval prompt `start`, the same at every
        eval (the steps' evals then differ by their weights alone, and an eval of the same weights repeats);
        positions past any training round's. None otherwise (the engines' own RNG)."""
        return self.round_seed(_EVAL_POSITIONS + start) if self.cfg.train.full_determinism else None

    def collect(self) -> Rollout | None:
        """The next batch, or None when the prompts ran out first. With `--dynamic_filtering`, groups outside the
        reward range are dropped and only the missing number of new prompts (plus the oversampling surplus) is
        generated in the next round."""
        r = self.cfg.rollout
        n, want = r.n_samples_per_prompt, r.rollout_batch_size
        timing: dict[str, float] = {}
        generated: list[torch.Tensor] = []
        scored: list[tuple[int, dict[str, float]]] = []  # each round's samples and the scorer's metrics of them
        taken: list[int] = []
        kept = dropped_episodes = 0
        while len(self.ahead) < want:
            # --full_determinism: the round's seed follows from the prompt position, which a resume restores
            seed = self.round_seed(self.stream.cursor) if self.cfg.train.full_determinism else None
            first = self.stream.cursor
            indices = self.stream.take(want - len(self.ahead) + self.surplus)
            if not indices:
                return None
            items = [self.prompts[j] for j in indices]
            taken += [item["index"] for item in items]
            with timed(timing, "generate"):
                new = self.source.generate(items, n=n, temperature=r.temperature, seed=seed, version=self.version())
            with timed(timing, "reward"):
                new_scores, round_logs = self.scorer.score(new)
            scored.append((len(new), round_logs))
            generated.append(new_scores)
            groups = [
                _Group(new[g * n : (g + 1) * n], new_scores[g * n : (g + 1) * n], first + g) for g in range(len(items))
            ]
            dropped = sum(1 for s in new if s.dropped)
            if dropped:  # an --agent_program episode failed: its group leaves (served_agents.py), more are drawn
                if dropped == len(new):
                    raise RuntimeError(f"every agent episode of the round failed; the first: {new[0].dropped}")
                dropped_episodes += dropped
                groups = [group for group in groups if not any(s.dropped for s in group.samples)]
            if r.dynamic_filtering and groups:
                keep = keep_groups(torch.cat([g.scores for g in groups]), n, tuple(r.dynamic_filtering_reward_range))
                groups = [group for group, k in zip(groups, keep.tolist()) if k]
            kept += len(groups)
            self.ahead += groups
        batch, self.ahead = self.ahead[:want], self.ahead[want:]
        logs = _weighted_means(scored)
        if r.dynamic_filtering and generated:
            drawn = torch.cat(generated)
            logs.update(
                {
                    "rollout/generate_rounds": len(generated),
                    "rollout/filtered_ratio": 1.0 - kept * n / drawn.numel(),
                    "rollout/reward_before_filter": drawn.mean().item(),
                }
            )
        if self.surplus:
            logs["rollout/groups_ahead"] = len(self.ahead)
        if self.source.drops_episodes:
            logs["rollout/agent_dropped"] = float(dropped_episodes)
        # a checkpoint after this batch resumes at the first group generated ahead: a resume generates it again
        stream_state = self.stream.state_dict()
        if self.ahead:
            stream_state["cursor"] = self.ahead[0].position
        samples = [s for group in batch for s in group.samples]
        scores = torch.cat([group.scores for group in batch])
        return Rollout(samples, scores, logs, taken, stream_state, timing)

    def evaluate(
        self,
        items: list[dict],
        n: int,
        temperature: float,
        *,
        top_p: float | None = None,
        max_new_tokens: int | None = None,
        batch_size: int | None = None,
    ) -> dict[str, float]:
        """pass@1 / pass@k of `n` samples per eval prompt with the current weights (`eval_metrics`), generated
        `batch_size` prompts at a time (all at once by default). `top_p` and `max_new_tokens` (capped by what
        --max_len leaves after each prompt) replace the rollout's for single-turn generation (validation refuses
        them with an agent, whose turns keep the rollout's sampling)."""
        d = self.cfg.data
        extra: dict = {} if top_p is None else {"top_p": top_p}
        samples: list[Sample] = []
        step = batch_size or len(items)
        for start in range(0, len(items), step):
            chunk = items[start : start + step]
            if max_new_tokens is not None:
                extra["max_new_tokens"] = [
                    min(max_new_tokens, d.response_budget(len(it["prompt_ids"]))) for it in chunk
                ]
            samples += self.source.generate(
                chunk, n=n, temperature=temperature, seed=self.eval_seed(start), version=self.version(), **extra
            )
        scores, _ = self.scorer.score(samples)
        return eval_metrics(
            scores.view(len(items), n),
            [it.get("datasource", "default") for it in items],
            torch.tensor([len(s.response_ids) for s in samples]),
        )


def _weighted_means(rounds: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The scorer's metrics of a batch's generation rounds, each a mean over its samples: per metric, the mean over
    the samples of the rounds that logged it."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for count, logs in rounds:
        for key, value in logs.items():
            totals[key][0] += count * value
            totals[key][1] += count
    return {key: total / count for key, (total, count) in totals.items()}


# -- generating ahead (--async_train) ------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One collected rollout batch and where it came from."""

    samples: list[Sample]
    scores: torch.Tensor  # [B] raw rewards, group order
    logs: dict[str, float]
    taken: list[int]  # dataset indices of every prompt drawn for it (dynamic filtering draws more)
    stream_state: dict  # the PromptStream state right after this batch was drawn: a checkpoint's data position
    timing: dict[str, float] = field(default_factory=dict)


def staleness(samples: list[Sample], version: int, partial: bool = False) -> dict[str, float]:
    """How many weight versions behind the trained policy the samples' oldest tokens were; with `partial`
    (--partial_rollout, or agent episodes, whose calls a sync can fall between) also the share of samples whose tokens
    come from more than one version."""
    lags = [version - s.policy_version for s in samples]
    out = {"rollout/staleness_mean": sum(lags) / len(lags), "rollout/staleness_max": float(max(lags))}
    if partial:
        mixed = [bool(s.token_versions) and s.token_versions[0] != s.token_versions[-1] for s in samples]
        out["rollout/mixed_version_share"] = sum(mixed) / len(mixed)
    return out


class RolloutProducer:
    """Calls `produce()` on a thread, at most `ahead` batches ahead of the finished steps (see module doc)."""

    def __init__(self, produce: Callable[[], Rollout | None], *, ahead: int, limit: int, timeout_s: float):
        self._produce = produce
        self._ahead = ahead
        self._limit = limit  # batches still to train: none is generated beyond the run's last step
        self._timeout_s = timeout_s
        self._ready: queue.Queue = queue.Queue()
        self._done_steps = 0
        self._started = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    # batch number `_started + 1` is trained with version `_started`: it may start once
                    # `_started - ahead` steps are done
                    self._cond.wait_for(lambda: self._stop or self._done_steps >= self._started - self._ahead)
                    if self._stop or self._started == self._limit:
                        return
                    self._started += 1
                rollout = self._produce()
                self._ready.put(rollout)
                if rollout is None:
                    return
        except BaseException as err:  # handed to the trainer, which raises it
            self._ready.put(err)

    def get(self) -> tuple[Rollout | None, float]:
        """The next batch (None when the prompts ran out) and the seconds the trainer waited for it."""
        start = time.perf_counter()
        try:
            item = self._ready.get(timeout=self._timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"no rollout batch within {self._timeout_s:.0f} s (--dist_timeout): the engines or "
                f"the reward source stopped answering"
            ) from None
        if isinstance(item, BaseException):
            raise RuntimeError(f"rollout generation failed: {item}") from item
        return item, time.perf_counter() - start

    def step_done(self) -> None:
        """A training step and its weight sync are finished: one more batch may start."""
        with self._cond:
            self._done_steps += 1
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=self._timeout_s)


# -- eval ------------------------------------------------------------------------------------------------------


def pass_at_k(rewards: torch.Tensor) -> dict[str, float]:
    """rewards [num_prompts, k] -> {"pass@1", "pass@k"} (k is the literal sample count in the key)."""
    k = rewards.size(1)
    out = {"pass@1": rewards.float().mean().item()}
    if k > 1:
        out[f"pass@{k}"] = rewards.float().max(dim=1).values.mean().item()
    return out


def eval_metrics(rewards: torch.Tensor, datasources: list[str], response_lengths: torch.Tensor) -> dict[str, float]:
    """`eval/pass@1`, `eval/pass@k`, `eval/response_length`, and `eval/<datasource>/pass@...` when there are several."""
    metrics = {f"eval/{key}": value for key, value in pass_at_k(rewards).items()}
    metrics["eval/response_length"] = response_lengths.float().mean().item()
    rows: dict[str, list[int]] = defaultdict(list)
    for row, source in enumerate(datasources):
        rows[source].append(row)
    if len(rows) > 1:
        for source, idx in rows.items():
            metrics.update({f"eval/{source}/{key}": value for key, value in pass_at_k(rewards[idx]).items()})
    return metrics
