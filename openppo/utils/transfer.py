"""Moving a training batch from the host to the device without waiting on the device.

A GPU runs the kernels the host queues while the host goes on; each time the host reads a device value (`.item()`,
a boolean-mask index whose size it must know, a copy back) or copies from pageable memory with `.to(device)`, it
waits until the GPU has run everything queued. In a step of many small kernels the GPU then idles while the host
queues the next ones. A batch moved by `to_device` keeps its host copy (`DeviceBatch.host`), so that the row
layout and the token counts are read from the host's tensors (a tensor `upload` moved also finds its host copy:
`host_copy`), and the copy itself does not wait: the host tensor is pinned and copied asynchronously (a CUDA-only
call, checked in tests/gpu/test_strategy_cuda.py; the CPU suite checks the rest in tests/ppo/test_host_waits.py).
"""

from __future__ import annotations

import torch
from torch.utils.weak import WeakIdKeyDictionary

# the host tensor each device tensor `upload` made was copied from, while the device tensor lives (`host_copy`)
_HOST_COPIES = WeakIdKeyDictionary()


class DeviceBatch(dict):
    """A batch's tensors on the training device, with the host tensors they were copied from (`host`)."""

    def __init__(self, tensors: dict[str, torch.Tensor], host: dict[str, torch.Tensor]):
        super().__init__(tensors)
        self.host = host


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`; a host tensor bound for a GPU goes through pinned memory without waiting on the GPU
    (its pinned block is not reused before the copy has run: PyTorch's host allocator records the copy)."""
    if tensor.device.type == "cpu" and device.type == "cuda":
        moved = tensor.pin_memory().to(device, non_blocking=True)
        _HOST_COPIES[moved] = tensor
        return moved
    return tensor.to(device)


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The host tensor `tensor` was uploaded from (`upload`), else `tensor` itself: what the host reads without
    waiting on the GPU (the token ids a shared-prompt layout compares, for one)."""
    return _HOST_COPIES.get(tensor, tensor)


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> DeviceBatch:
    """Every tensor of `batch` on `device` (`upload`), with `batch` kept as the result's `host`."""
    return DeviceBatch({k: upload(v, device) for k, v in batch.items()}, batch)


def host_tensor(batch: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The host copy of `batch[key]` when the batch has one (`to_device`), else the tensor itself."""
    host = getattr(batch, "host", None)
    return batch[key] if host is None else host[key]


def read_values(values: dict[str, float | torch.Tensor]) -> dict[str, float]:
    """`values` as floats, the tensors among them read in one transfer (one wait on the device, not one each)."""
    tensors = {k: v for k, v in values.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        return dict(values)
    device = next(iter(tensors.values())).device
    read = torch.stack([v.detach().reshape(()).to(device, torch.float64) for v in tensors.values()]).tolist()
    return {**values, **dict(zip(tensors, read))}
