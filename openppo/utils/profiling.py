"""`--profile_steps A,B`: torch profiler traces (Chrome trace JSON, open in chrome://tracing or Perfetto).

One `StepProfiler` per process: the driver and every rank of every model group profile the chosen steps and
write `<save_path>/profile/step<N>/<who>.json`. CPU activity always, CUDA kernels where a GPU is present.
"""

from __future__ import annotations

from pathlib import Path

import torch


def parse_profile_steps(value: str | None) -> list[int]:
    """ "3,5" -> [3, 5]; raises ValueError on anything but positive integers."""
    if not value:
        return []
    steps = [int(part) for part in value.split(",") if part.strip()]
    if any(s <= 0 for s in steps):
        raise ValueError(f"steps must be positive, got {value}")
    return sorted(set(steps))


class StepProfiler:
    def __init__(self) -> None:
        self._profile: torch.profiler.profile | None = None

    def start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities, record_shapes=True)
        self._profile.__enter__()

    def stop(self, path: str | Path) -> str | None:
        """Stop and write the trace; None when nothing was started."""
        if self._profile is None:
            return None
        profile, self._profile = self._profile, None
        profile.__exit__(None, None, None)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        profile.export_chrome_trace(str(path))
        return str(path)
