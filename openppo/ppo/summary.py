"""The end-of-run summary: how the reward moved and where the time went."""

from __future__ import annotations


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def summary_view(metrics: dict[str, float]) -> dict[str, float]:
    """What the end-of-run table and advice read from one step's metrics. The run keeps only this per step, so a
    long run's driver memory does not grow with every metric of every step."""
    return {k: v for k, v in metrics.items()
            if k.startswith(("timing/", "perf/")) or k in ("rollout/reward", "response_length")}


def summary_table(history: list[dict[str, float]], window: int = 5) -> str:
    """A plain-text table: reward over the first vs last `window` steps, then each stage's mean seconds and share."""
    if not history:
        return "no steps were run"
    rewards = [h["rollout/reward"] for h in history]
    lines = [f"steps: {len(history)}",
             f"reward, mean of first {min(window, len(rewards))} steps: {_mean(rewards[:window]):.3f}",
             f"reward, mean of last {min(window, len(rewards))} steps:  {_mean(rewards[-window:]):.3f}",
             f"response length, first -> last step: {history[0]['response_length']:.1f} -> "
             f"{history[-1]['response_length']:.1f}",
             "", f"{'stage':<22}{'s/step':>10}{'share':>9}"]
    # timing/step is the whole step's wall time, not a stage: it is the total the stages are shares of
    stages = sorted({k for h in history for k in h if k.startswith("timing/") and k != "timing/step"})
    means = {k: _mean([h.get(k, 0.0) for h in history]) for k in stages}
    # --async_train: generation and scoring ran beside the step, on the producer thread
    overlapped = {"timing/generate", "timing/reward"} if "timing/wait_rollout" in means else set()
    staged = sum(v for k, v in means.items() if k not in overlapped)
    has_step = any("timing/step" in h for h in history)
    total = (_mean([h.get("timing/step", 0.0) for h in history]) if has_step else staged) or 1.0
    if has_step and "timing/idle" not in means and total - staged > 0.005 * total:
        means["timing/idle"] = total - staged  # collation, metrics, controller work between the stages
    for key in sorted(means, key=lambda k: -means[k]):
        name = key.split("/", 1)[1] + (" (async)" if key in overlapped else "")
        lines.append(f"{name:<22}{means[key]:>10.2f}{means[key] / total:>8.0%}")
    lines.append(f"{'step':<22}{total:>10.2f}")
    return "\n".join(lines)
