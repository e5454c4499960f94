"""What an RL run reports: each step's timing and throughput, the end-of-run summary, and the bottleneck advice.

Throughput (pure arithmetic on token counts and stage timings). All rates are over wall time of the stage that did
the work: generated tokens over `timing/generate`, trained tokens over `timing/actor_train`, samples and generated
tokens per hour over the whole step (`timing/step`). `timing/idle` is the part of the step outside every timed
stage (collation, metrics, controller work, waits).

The summary (`RunHistory`, `summary_table`): how the reward moved and where the time went, from memory that does not
grow with the run.

The advisor (`advise(history, cfg, host_memory_gib)`) is pure: it looks at the mean of every logged `timing/*` and
`perf/*` over the run (the first step is left out when there are more, because it pays the warm-ups) and returns
one `Advice` per rule that fires, with the numbers that fired it. Thresholds are shares of the step's wall time
(`timing/step`). A rule only suggests flags the run did not already use.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from openppo.ppo.config import PPOConfig, engines_colocated

# -- throughput ---------------------------------------------------------------------------------------------------

# Dense bf16/fp16 tensor-core peak per device, in FLOP/s (vendor data sheets, SXM parts without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}

_STAGE_EXCLUDED = ("timing/step", "timing/idle")


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The device's dense peak for `dtype` ("bf16"/"fp16"), or None when unknown (fp32, CPUs, unlisted parts)."""
    if dtype not in ("bf16", "fp16"):
        return None
    name = device_name.upper()
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def train_flops(num_params: int, tokens: int, gradient_checkpointing: bool = False) -> float:
    """FLOPs of forward + backward over `tokens` tokens: 6 N per token (2 forward, 4 backward; Kaplan et al. 2020),
    8 N with activation checkpointing, which repeats the forward."""
    return (8 if gradient_checkpointing else 6) * num_params * tokens


def attention_flops(
    num_layers: int, attention_width: int, seq_lens: list[int], gradient_checkpointing: bool = False
) -> float:
    """FLOPs of the attention scores and their weighted sum, forward + backward, over sequences of `seq_lens` tokens,
    which `train_flops` leaves out: 12 x layers x width x L per token of a sequence of L (PaLM, Chowdhery et al.
    2022, appendix B, as torchtitan counts it: no halving for the causal mask), 16 with activation checkpointing.
    `attention_width`: heads x head dim of the queries."""
    per = 16 if gradient_checkpointing else 12
    return per * num_layers * attention_width * sum(n * n for n in seq_lens)


def mfu(flops: float, seconds: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over `devices` x the peak."""
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * devices)


def idle_seconds(timing: dict[str, float], step_seconds: float) -> float:
    """The step's wall time outside every stage timed on the step's own thread. With --async_train (the step then
    has `timing/wait_rollout`) generation and scoring ran on the producer thread, beside the step."""
    overlapped = ("timing/generate", "timing/reward") if "timing/wait_rollout" in timing else ()
    staged = sum(v for k, v in timing.items() if k.startswith("timing/") and k not in _STAGE_EXCLUDED + overlapped)
    return max(0.0, step_seconds - staged)


def step_throughput(
    *, generated_tokens: int, trained_tokens: int, samples: int, timing: dict[str, float]
) -> dict[str, float]:
    """perf/* rates of one step from its token counts and `timing/*` seconds (missing stages give no rate)."""
    out: dict[str, float] = {}
    generate, train, step = (timing.get(k, 0.0) for k in ("timing/generate", "timing/actor_train", "timing/step"))
    if generate > 0:
        out["perf/generate_tokens_per_s"] = generated_tokens / generate
    if train > 0:
        out["perf/train_tokens_per_s"] = trained_tokens / train
    if step > 0:
        out["perf/samples_per_s"] = samples / step
        out["perf/generated_tokens_per_hour"] = generated_tokens / step * 3600
    return out


@contextlib.contextmanager
def timed(timing: dict[str, float], stage: str) -> Iterator[None]:
    """Adds the block's wall time to `timing["timing/<stage>"]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{stage}"
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - start


# -- the end-of-run summary ---------------------------------------------------------------------------------------


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summarized(key: str) -> bool:
    return key.startswith(("timing/", "perf/"))


class RunHistory:
    """What the end-of-run table and advice read from the steps, in memory that does not grow with the run: running
    sums of every `timing/*` and `perf/*` value, the first step's values (the advice leaves out the warm-up), the
    first and last `KEEP` rewards and the first and last response length. A 10k-step run holds what a 20-step
    one does."""

    KEEP = 16

    def __init__(self) -> None:
        self.steps = 0
        self._sums: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._after_first: set[str] = set()  # keys seen in a step other than the first
        self._rewards_first: list[float] = []
        self._rewards_last: deque[float] = deque(maxlen=self.KEEP)
        self.response_length: tuple[float, float] = (float("nan"), float("nan"))  # first, last

    @classmethod
    def of(cls, steps: Iterable[dict[str, float]]) -> RunHistory:
        history = cls()
        for metrics in steps:
            history.add(metrics)
        return history

    def __len__(self) -> int:
        return self.steps

    def add(self, metrics: dict[str, float]) -> None:
        timed = {k: float(v) for k, v in metrics.items() if _summarized(k)}
        if self.steps == 0:
            self._first = timed
        else:
            self._after_first.update(timed)
        for k, v in timed.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        self.steps += 1
        reward = float(metrics.get("train/reward", float("nan")))
        if len(self._rewards_first) < self.KEEP:
            self._rewards_first.append(reward)
        self._rewards_last.append(reward)
        length = float(metrics.get("train/response_length", float("nan")))
        self.response_length = (length if self.steps == 1 else self.response_length[0], length)

    def means(self, skip_first: bool = False) -> dict[str, float]:
        """Mean of each timing/perf value over the steps (a step without it counts 0); `skip_first` leaves out the
        first step when there are more."""
        if skip_first and self.steps > 1:
            return {k: (self._sums[k] - self._first.get(k, 0.0)) / (self.steps - 1) for k in self._after_first}
        return {k: v / self.steps for k, v in self._sums.items()} if self.steps else {}

    def rewards(self, window: int) -> tuple[list[float], list[float]]:
        """The first and last `window` (at most KEEP) steps' mean rewards."""
        window = min(window, self.KEEP, self.steps)
        return self._rewards_first[:window], list(self._rewards_last)[len(self._rewards_last) - window :]


def summary_table(history: RunHistory, window: int = 5) -> str:
    """A plain-text table: reward over the first vs last `window` steps, then each stage's mean seconds and share."""
    if not history.steps:
        return "no steps were run"
    first, last = history.rewards(window)
    lines = [
        f"steps: {history.steps}",
        f"reward, mean of first {len(first)} steps: {_mean(first):.3f}",
        f"reward, mean of last {len(last)} steps:  {_mean(last):.3f}",
        f"response length, first -> last step: {history.response_length[0]:.1f} -> {history.response_length[1]:.1f}",
        "",
        f"{'stage':<22}{'s/step':>10}{'share':>9}",
    ]
    all_means = history.means()
    # timing/step is the whole step's wall time, not a stage: it is the total the stages are shares of
    means = {k: v for k, v in all_means.items() if k.startswith("timing/") and k != "timing/step"}
    # --async_train: generation and scoring ran beside the step, on the producer thread
    overlapped = {"timing/generate", "timing/reward"} if "timing/wait_rollout" in means else set()
    staged = sum(v for k, v in means.items() if k not in overlapped)
    has_step = "timing/step" in all_means
    total = (all_means["timing/step"] if has_step else staged) or 1.0
    if has_step and "timing/idle" not in means and total - staged > 0.005 * total:
        means["timing/idle"] = total - staged  # collation, metrics, controller work between the stages
    for key in sorted(means, key=lambda k: -means[k]):
        name = key.split("/", 1)[1] + (" (async)" if key in overlapped else "")
        lines.append(f"{name:<22}{means[key]:>10.2f}{means[key] / total:>8.0%}")
    lines.append(f"{'step':<22}{total:>10.2f}")
    return "\n".join(lines)


# -- the bottleneck advisor ---------------------------------------------------------------------------------------

GENERATION_SHARE = 0.4  # generation (or, async, the wait for it) above this share of the step
REWARD_SHARE = 0.25
TRAIN_SHARE = 0.5
FORWARD_SHARE = 0.3  # old log-probs + reference log-probs + values
SYNC_SHARE = 0.1
# Larger buckets are advised from this many a sync: below it they save few messages (SmolLM2's 257 MiB in 2 buckets
# of 256 MiB against 1 of 1024: 1.16 against 1.07 s a sync on a 2-core CPU, the same within noise)
MANY_BUCKETS = 4
SWAP_SHARE = 0.2
IDLE_SHARE = 0.2
PADDING_SHARE = 0.2  # of the positions the training step computed
MEMORY_SHARE = 0.9  # of the device's (or host's) memory


@dataclass
class Advice:
    rule: str
    evidence: str  # the measured numbers that fired the rule
    flags: list[str]  # what to try, most promising first

    def __str__(self) -> str:
        return f"{self.rule}: {self.evidence} -> try {', '.join(self.flags)}"


def run_means(history: RunHistory) -> dict[str, float]:
    """Mean of every timing/* and perf/* value over the steps (without the first step when there are more)."""
    return history.means(skip_first=True)


def _share(means: dict[str, float], *stages: str) -> tuple[float, float]:
    seconds = sum(means.get(f"timing/{s}", 0.0) for s in stages)
    step = means.get("timing/step", 0.0)
    return seconds, (seconds / step if step > 0 else 0.0)


def _fmt(stage: str, seconds: float, share: float, step: float) -> str:
    return f"{stage} takes {share:.0%} of the step ({seconds:.2f} s of {step:.2f} s)"


def _generation(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    r, v = cfg.rollout, cfg.vllm
    stage = "wait_rollout" if r.async_train else "generate"
    seconds, share = _share(means, stage)
    if share < (GENERATION_SHARE / 2 if r.async_train else GENERATION_SHARE):
        return None
    flags = []
    if not engines_colocated(cfg):
        flags.append(f"--vllm_num_engines {v.vllm_num_engines * 2}")
    if v.vllm_gpu_memory_utilization < 0.9 and not engines_colocated(cfg):
        flags.append("--vllm_gpu_memory_utilization 0.9 (a larger KV cache, more sequences at once)")
    if r.n_samples_per_prompt > 1 and not v.enable_prefix_caching:
        flags.append("--enable_prefix_caching (the samples of a prompt share its KV cache)")
    if not r.async_train and not engines_colocated(cfg):
        flags.append("--async_train (generate the next batch while this one trains)")
    what = "waiting for generation" if r.async_train else "generation"
    return Advice(
        "generation-bound",
        _fmt(what, seconds, share, means["timing/step"]),
        flags or ["more engines: generation has the devices to itself already"],
    )


def _reward(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "reward")
    if share < REWARD_SHARE:
        return None
    flags = []
    if not cfg.rollout.async_train:
        flags.append("--async_train (score the next batch while this one trains)")
    if cfg.model.remote_rm_url and cfg.model.remote_rm_url.startswith("http"):
        flags.append("more reward servers in --remote_rm_url (a comma list is load-balanced)")
    if cfg.model.reward_pretrain:
        flags.append("--reward_num_gpus_per_node (more reward-model ranks)")
    return Advice(
        "reward-bound",
        _fmt("reward scoring", seconds, share, means["timing/step"]),
        flags or ["a faster reward function"],
    )


def _padding(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    padding = means.get("perf/actor_padding_share", 0.0)
    if padding < PADDING_SHARE:
        return None
    flags = [] if cfg.rollout.packing_samples else ["--packing_samples (no padding is computed)"]
    if not cfg.rollout.use_dynamic_batch:
        flags.append("--use_dynamic_batch --train_max_tokens_per_gpu N (micro-batches filled by tokens)")
    if not flags:
        return None
    return Advice("padding-heavy", f"{padding:.0%} of the positions the training step computed were padding", flags)


def _training(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "actor_train", "critic_train")
    if share < TRAIN_SHARE:
        return None
    flags = []
    if not cfg.rollout.packing_samples:
        flags.append("--packing_samples")
    if not cfg.rollout.use_dynamic_batch:
        flags.append(
            f"--use_dynamic_batch (micro-batches of --micro_train_batch_size "
            f"{cfg.train.micro_train_batch_size} rows become token-filled ones)"
        )
    if cfg.model.gradient_checkpointing and means.get("perf/actor_gpu_peak_gib", 0.0) < 0.5 * means.get(
        "perf/actor_gpu_total_gib", 0.0
    ):
        flags.append(
            "dropping --gradient_checkpointing (it recomputes the forward; memory is at "
            f"{means['perf/actor_gpu_peak_gib']:.1f} of {means['perf/actor_gpu_total_gib']:.1f} GiB)"
        )
    if cfg.train.max_epochs > 1:
        flags.append(f"--max_epochs 1 (now {cfg.train.max_epochs} passes over each batch)")
    if not flags:
        return None
    return Advice("training-bound", _fmt("training", seconds, share, means["timing/step"]), flags)


def _forwards(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "old_logprob", "ref_logprob", "values")
    if share < FORWARD_SHARE:
        return None
    r = cfg.rollout
    flags = (
        [f"--micro_rollout_batch_size {r.micro_rollout_batch_size * 2} (forward-only passes keep no activations)"]
        if not r.use_dynamic_batch
        else ["--rollout_max_tokens_per_gpu (a larger budget for the forward-only passes)"]
    )
    if not r.packing_samples:
        flags.append("--packing_samples")
    return Advice(
        "scoring-forwards", _fmt("old/reference log-probs and values", seconds, share, means["timing/step"]), flags
    )


def _sync(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "weight_sync")
    if share < SYNC_SHARE:
        return None
    flags = []
    mib = cfg.vllm.vllm_sync_bucket_mb
    buckets = means.get("perf/weight_sync_buckets", math.ceil(means.get("perf/weight_sync_mb", 0.0) / mib))
    if buckets >= MANY_BUCKETS:
        flags.append(f"--vllm_sync_bucket_mb {mib * 4} (fewer, larger messages: {buckets:.0f} a sync now)")
    if cfg.vllm.vllm_sync_backend != "nccl":
        flags.append("--vllm_sync_backend nccl (on GPUs)")
    if not flags:
        return None
    return Advice("weight-sync", _fmt("the weight sync", seconds, share, means["timing/step"]), flags)


def _swap(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "swap")
    if share < SWAP_SHARE:
        return None
    return Advice(
        "memory-swap",
        _fmt("sleeping/waking engines and offloading states", seconds, share, means["timing/step"]),
        [
            "dropping --deepspeed_enable_sleep / --vllm_enable_sleep where the models fit side by side",
            "separate devices for engines and trainer (no --colocate_all_models)",
        ],
    )


def _memory(cfg: PPOConfig, means: dict[str, float], host_memory_gib: float) -> Advice | None:
    peak, total = means.get("perf/actor_gpu_peak_gib"), means.get("perf/actor_gpu_total_gib")
    if peak is not None and total:
        used, of, where = peak, total, "the actor's peak GPU memory"
    else:
        used = means.get("perf/actor_rss_gib", 0.0) + means.get("perf/driver_rss_gib", 0.0)
        of, where = host_memory_gib, "driver + actor resident memory"
    if not of or used / of < MEMORY_SHARE:
        return None
    flags = []
    if not cfg.model.gradient_checkpointing:
        flags.append("--gradient_checkpointing")
    if cfg.ds.zero_stage < 3:
        flags.append("--zero_stage 3")
    on_gpu = peak is not None and bool(total)
    # offloading moves states from device to host memory: on a CPU run they already live there
    if on_gpu and not cfg.ds.adam_offload and not cfg.ds.deepspeed_enable_sleep:
        flags.append("--adam_offload")
    if on_gpu and not cfg.model.ref_reward_offload:
        flags.append("--ref_reward_offload")
    flags.append("a smaller --train_max_tokens_per_gpu / --micro_train_batch_size")
    return Advice("memory-bound", f"{where} is {used:.1f} of {of:.1f} GiB ({used / of:.0%})", flags)


def _idle(cfg: PPOConfig, means: dict[str, float]) -> Advice | None:
    seconds, share = _share(means, "idle")
    if share < IDLE_SHARE:
        return None
    return Advice(
        "controller-idle",
        _fmt("time outside every stage", seconds, share, means["timing/step"]),
        ["--profile_steps A,B (torch profiler traces of the driver and every rank show where it goes)"],
    )


def advise(history: RunHistory, cfg: PPOConfig, host_memory_gib: float = 0.0) -> list[Advice]:
    """Every rule that fires on the run's mean stage shares, most expensive stage first."""
    if not history:
        return []
    means = run_means(history)
    if means.get("timing/step", 0.0) <= 0:
        return []
    rules = (
        _generation(cfg, means),
        _reward(cfg, means),
        _training(cfg, means),
        _padding(cfg, means),
        _forwards(cfg, means),
        _sync(cfg, means),
        _swap(cfg, means),
        _memory(cfg, means, host_memory_gib),
        _idle(cfg, means),
    )
    return [a for a in rules if a is not None]


def advice_text(advice: list[Advice]) -> str:
    if not advice:
        return "bottleneck advice: no stage stands out (no rule fired)"
    return "bottleneck advice:\n" + "\n".join(f"- {a}" for a in advice)
