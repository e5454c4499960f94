"""Per-device memory estimate of a train_ppo_ray run, before launch (`python -m openppo.cli.plan`).

Pure arithmetic on the model's shape and the flags. Per rank of each model group:
- weights, gradients and optimizer states by ZeRO stage (Rajbhandari et al. 2020: with mixed precision 2 bytes of
  weights + 2 of gradients + 12 of fp32 master copy and Adam moments per parameter; in fp32 4 + 4 + 12, the master
  copy being DeepSpeed's, not the paper's, and 4 + 4 + 8 under ZeRO-0), partitioned
  over the data-parallel ranks from stage 1 (optimizer), 2 (+ gradients) and 3 (+ weights); `--adam_offload` moves
  the optimizer states to host memory; AutoTP splits the layers' weights; `--optim muon` keeps one 4-byte momentum
  for the matrices in place of Adam's two moments;
- what the optimizer step holds beyond those (DeepSpeed's implementation, not the paper): with 16-bit weights the
  fp32 gradient of the rank's partition, the ZeRO-1/2 reduction bucket, and on CPU the scratch tensor of torch's
  AdamW (`working_state_items`); on a GPU only in their phase of the step, since DeepSpeed frees them after it;
- activations of one training micro-batch: the tensors a decoder layer keeps for its backward (`activation_bytes`, in
  bf16 values per token: 8 x hidden for the norms, 3 x the queries' width + 2 x the keys' for attention, 4 x
  intermediate for the MLP, as a real layer saves them; 8 x hidden + 1 x intermediate bytes fewer where Liger's
  kernels or the compiled layers fuse the norms and the SiLU), or only each layer's input with
  `--gradient_checkpointing` plus one layer's worth while it is recomputed;
- the logits of a micro-batch: the model-dtype logits and their gradient, and the fp32 working copies of one chunk
  of positions (`logits_bytes`), the largest single item for small models with a large vocabulary. Packed rows
  score only their response positions (--generate_max_len of each prompt + response); padded ones the whole row;
  --lm_head_chunk_tokens N makes only N positions' logits at a time, beside the head weight's fp32 gradient
  (`chunked_head_bytes`);
- each vLLM engine: weights (split by --vllm_tensor_parallel_size) and the KV cache (--vllm_kv_cache_bytes, or
  --vllm_gpu_memory_utilization of the device minus the weights).

On CPU the same estimate sizes the engines' default KV cache (`cpu_kv_cache_bytes`): what the rollouts need, capped
by the RAM the other processes of the run leave.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from openppo.algorithms.entropy import CPU_CHUNK_BYTES, DEFAULT_CHUNK_SIZE
from openppo.errors import UserError
from openppo.rollout.engine import CPU_BLOCK_SIZE
from openppo.strategy.config import REDUCE_BUCKET_SIZE

GIB = 2**30
KV_HEADROOM = 1.25
# torch, Ray and DeepSpeed in a worker process before any model is loaded (about 0.7 GiB seen on CPU)
PROCESS_OVERHEAD_BYTES = 0.8 * GIB


@dataclass
class ModelShape:
    num_params: int
    embedding_params: int  # input embedding + an untied LM head: AutoTP leaves them whole
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int = 0  # key/value heads of an attention layer (0: unknown)
    head_dim: int = 0
    heads: int = 0  # query heads of an attention layer (0: unknown, hidden / head_dim)
    model_type: str = ""  # the decoder's config.model_type ("" unknown)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of KV cache one token takes in every layer: a key and a value of kv_heads x head_dim each."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes


@dataclass
class Item:
    what: str
    bytes: float
    host: bool = False  # offloaded to host memory (not on the device)
    # the one phase of a step that holds it, when DeepSpeed allocates and frees it each time ("backward": the
    # gradient reduction; "step": the optimizer step): counted in the phase's peak, the group's working memory
    # (`_working_memory`), not beside it; "" for what stays allocated
    phase: str = ""

    @property
    def transient(self) -> bool:
        return bool(self.phase)


@dataclass
class DevicePlan:
    """What one device (one rank of each group placed on it) holds."""

    name: str
    items: list[Item] = field(default_factory=list)

    @property
    def device_bytes(self) -> float:
        return sum(i.bytes for i in self.items if not i.host and not i.transient)

    @property
    def host_bytes(self) -> float:
        return sum(i.bytes for i in self.items if i.host)


def dtype_bytes(param_dtype: str) -> int:
    return 4 if param_dtype == "fp32" else 2


def trained_items(
    role: str,
    shape: ModelShape,
    *,
    param_dtype: str,
    zero_stage: int,
    data_parallel: int,
    tensor_parallel: int = 1,
    adam_offload: bool = False,
    muon: bool = False,
) -> list[Item]:
    """Weights, gradients and optimizer states of one rank of a trained model (`muon`: with --optim muon)."""
    p = dtype_bytes(param_dtype)
    split = shape.num_params - shape.embedding_params
    params = shape.embedding_params + split / tensor_parallel  # held by one rank of a tensor-parallel group
    # Adam's m and v, and an fp32 master copy: DeepSpeed's ZeRO optimizers clone the rank's partition to fp32 even
    # when the model is fp32 already (stage 1/2: `single_partition_of_fp32_groups`, stage 3:
    # `fp32_partitioned_groups_flat`); only ZeRO-0 in fp32 steps the model's own parameters
    master = 4 if param_dtype != "fp32" or zero_stage >= 1 else 0
    optimizer = (8 + master) * params
    if muon:  # Muon keeps one fp32 momentum for the matrices outside the embeddings, where Adam keeps m and v (the
        # norms, biases and a scalar head among them, Adam's, are under 0.1 % of a model: counted as Muon's)
        optimizer -= 4 * split / tensor_parallel
    return [
        Item(f"{role} weights", p * params / (data_parallel if zero_stage >= 3 else 1)),
        Item(f"{role} gradients", p * params / (data_parallel if zero_stage >= 2 else 1)),
        Item(f"{role} optimizer states", optimizer / (data_parallel if zero_stage >= 1 else 1), host=adam_offload),
    ]


def working_state_items(
    role: str,
    shape: ModelShape,
    *,
    param_dtype: str,
    zero_stage: int,
    data_parallel: int,
    tensor_parallel: int = 1,
    adam_offload: bool = False,
    fused_adam: bool = True,
) -> list[Item]:
    """What DeepSpeed's optimizer step holds beyond the paper's model states, on one rank.

    - Mixed precision: the wrappers (ZeRO-1/2/3, and the bf16 one of ZeRO-0) turn the 16-bit gradient into an fp32
      gradient of the rank's partition before Adam runs: 4 bytes per parameter of the partition.
    - ZeRO-1/2 with `contiguous_gradients` copy each gradient into a reduction bucket as the backward produces it
      (`reduce_bucket_size` = 5e8 elements, so all of a small model's gradients) before reducing and partitioning.
    - torch's AdamW (CPU without --adam_offload; DeepSpeed's FusedAdam and CPU Adam need none) computes the
      denominator sqrt(v) + eps as one more fp32 tensor of the partition's size.
    Only ZeRO-0's fp32 gradients (the bf16 wrapper's accumulators) stay allocated. The bucket exists while a backward
    reduces (from the first gradient after the LM head's), the ZeRO-1/2/3 fp32 partition and AdamW's scratch while
    the optimizer steps: items of that `phase`, whose peaks `_working_memory` counts.
    """
    split = shape.num_params - shape.embedding_params
    whole = shape.embedding_params + split / tensor_parallel  # one rank of a tensor-parallel group
    params = whole / (data_parallel if zero_stage >= 1 else 1)
    items = []
    if zero_stage in (1, 2):
        bucket = dtype_bytes(param_dtype) * min(REDUCE_BUCKET_SIZE, whole)
        items.append(Item(f"{role} gradient reduction bucket", bucket, phase="backward"))
    if param_dtype != "fp32":
        phase = "step" if zero_stage >= 1 else ""
        items.append(Item(f"{role} fp32 gradient partition", 4 * params, host=adam_offload, phase=phase))
    if not fused_adam and not adam_offload:
        items.append(Item(f"{role} optimizer step scratch (torch AdamW)", 4 * params, phase="step"))
    return items


def frozen_items(
    role: str, shape: ModelShape, *, param_dtype: str, zero_stage: int, data_parallel: int, offload: bool = False
) -> list[Item]:
    """Weights of a frozen model (reference, reward): ZeRO-3 shards them, --ref_reward_offload moves them."""
    weights = dtype_bytes(param_dtype) * shape.num_params / (data_parallel if zero_stage == 3 else 1)
    return [Item(f"{role} weights", weights, host=offload and zero_stage == 3)]


def activation_bytes(
    shape: ModelShape, tokens: int, *, param_dtype: str, checkpointing: bool, fused: bool = False
) -> float:
    """What the decoder layers keep for the backward of one micro-batch of `tokens` tokens, per token and layer
    (p bytes a model-dtype value; a transformers Llama/Qwen-style layer through sdpa, counted from its saved tensors):
    - each of the two RMSNorms: its input in fp32 (4 x hidden bytes; the input itself in an fp32 model), its
      normalised value and its output (2 x p x hidden);
    - attention: the query, the output and the output projection's input (p x heads x head_dim each), and the key
      and value (p x kv_heads x head_dim each; sdpa runs grouped-query attention without repeating them);
    - the MLP: the gate and up projections, the SiLU and the product (4 x p x intermediate).
    `fused`: the layers' element-wise work runs in fused kernels (Liger's, or the compiled layers'), which keep
    neither the norms' fp32 inputs nor the SiLU output: 8 x hidden + p x intermediate bytes fewer.
    tests/ppo/test_memory_plan.py checks the count against a real layer's saved tensors; on an H200 the 0.5B shape's
    step peaked 3.12 GiB lower with either fused kind at 8192 tokens, where this counts 3.09."""
    p = dtype_bytes(param_dtype)
    h, inter = shape.hidden, shape.intermediate
    q = shape.heads * shape.head_dim or h
    kv = shape.kv_heads * shape.head_dim or q
    kept = 2 * (4 * h + 2 * p * h) + p * (3 * q + 2 * kv) + 4 * p * inter - ((8 * h + p * inter) if fused else 0)
    per_layer = tokens * kept
    if checkpointing:  # each layer's input, and one layer recomputed at a time
        return p * tokens * h * shape.num_layers + per_layer
    return per_layer * shape.num_layers


def logits_bytes(
    shape: ModelShape, tokens: int, *, param_dtype: str, backward: bool, chunk_positions: int = DEFAULT_CHUNK_SIZE
) -> float:
    """The full logits of `tokens` scored positions in the model dtype and, with a backward, their gradient; beside
    them the fp32 working copies of one chunk of `chunk_positions` positions (`openppo.algorithms.entropy`: the
    logits, their softmax or logsumexp: 8 bytes an entry)."""
    p = dtype_bytes(param_dtype)
    return (p * (2 if backward else 1) * tokens + 8 * min(tokens, chunk_positions)) * shape.vocab


def chunked_head_bytes(shape: ModelShape, chunk_tokens: int, *, param_dtype: str) -> float:
    """The LM head in chunks (`openppo.models.lm_head`) in a backward: the head weight's fp32 gradient, summed over
    the chunks, and one chunk at a time: its logits in the model dtype with their fp32 copy and softmax (p + 8 bytes
    an entry), or its gradient in the model dtype beside the chunk's share of the weight's gradient."""
    p = dtype_bytes(param_dtype)
    weight = shape.vocab * shape.hidden
    return 4 * weight + max((p + 8) * chunk_tokens * shape.vocab, p * chunk_tokens * shape.vocab + p * weight)


def engine_items(
    shape: ModelShape,
    *,
    kv_cache_bytes: int | None,
    memory_share: float,
    device_bytes: float,
    tensor_parallel: int = 1,
    engine_dtype_bytes: int = 2,
) -> list[Item]:
    """One vLLM engine's weights and KV cache on one of its devices."""
    weights = engine_dtype_bytes * shape.num_params / tensor_parallel
    kv = kv_cache_bytes if kv_cache_bytes is not None else max(0.0, memory_share * device_bytes - weights)
    return [Item("engine weights", weights), Item("engine KV cache", kv)]


def _micro_tokens(cfg, *, train: bool) -> int:
    """Tokens of one micro-batch on one rank (a ring splits each row over its ranks)."""
    r, d = cfg.rollout, cfg.data
    row = d.total_len()
    if r.use_dynamic_batch:
        tokens = r.train_tokens() if train else r.forward_tokens()
    else:
        tokens = (cfg.train.micro_train_batch_size if train else r.micro_rollout_batch_size) * row
    return -(-tokens // r.ring_attn_size)


def _scored_tokens(cfg, tokens: int) -> int:
    """Of a micro-batch's tokens, those the LM head scores: only the response positions of a packed row (the action
    mask); a padded batch keeps every column some row needs, up to the whole row."""
    if not cfg.rollout.packing_samples:
        return tokens
    d = cfg.data
    return -(-tokens * min(d.generate_max_len, d.total_len()) // d.total_len())


def _head_bytes(cfg, shape: ModelShape, tokens: int, *, backward: bool, on_gpu: bool) -> float:
    """What the LM head's scoring of a micro-batch of `tokens` tokens holds at once: the full logits of the scored
    positions, or with --lm_head_chunk_tokens those of one chunk (the chunk's full-logits math when forward-only)."""
    dtype = cfg.ds.param_dtype
    positions = DEFAULT_CHUNK_SIZE if on_gpu else max(1, CPU_CHUNK_BYTES // (4 * shape.vocab))
    scored, chunk = _scored_tokens(cfg, tokens), cfg.model.lm_head_chunk_tokens
    if not chunk:
        return logits_bytes(shape, scored, param_dtype=dtype, backward=backward, chunk_positions=positions)
    chunk = min(chunk, scored)
    if backward:
        return chunked_head_bytes(shape, chunk, param_dtype=dtype)
    return logits_bytes(shape, chunk, param_dtype=dtype, backward=False, chunk_positions=positions)


def fused_layers(cfg, shape: ModelShape, on_gpu: bool = True) -> bool:
    """The run's decoder layers run their element-wise work fused: --torch_compile, or --use_liger_kernel on GPUs for
    a model type Liger has kernels for."""
    from openppo.models.kernels import liger_model_types

    liger = cfg.model.use_liger_kernel and on_gpu and shape.model_type in liger_model_types()
    return bool(cfg.model.torch_compile or liger)


def _working_memory(
    role: str, shape: ModelShape, cfg, *, trained: bool, lm_head: bool, on_gpu: bool, transient: tuple[Item, ...] = ()
) -> Item:
    """The peak of what a model's micro-batches and steps hold beyond its resident states, the largest of:
    - a training micro-batch's backward as it starts: the layers' activations and the LM head's logits (or chunk);
    - its reduction: the activations beside the "backward" items, the gradient bucket (the logits are freed by then);
    - the optimizer step: the "step" items (fp32 gradient partition, AdamW's scratch);
    - a forward-only micro-batch's logits.
    (On an H200 the 0.5B shape's peaks at 8k and 32k tokens a micro-batch, eager, compiled, Liger and the chunked
    head, were 0.5-4 % above this: docs/benchmarks.md.)"""
    forward_tokens = _micro_tokens(cfg, train=False)
    forward = _head_bytes(cfg, shape, forward_tokens, backward=False, on_gpu=on_gpu) if lm_head else 0.0
    if not trained:
        return Item(f"{role} forward micro-batch", forward)
    tokens = _micro_tokens(cfg, train=True)
    fused = fused_layers(cfg, shape, on_gpu)
    layers = activation_bytes(
        shape, tokens, param_dtype=cfg.ds.param_dtype, checkpointing=cfg.model.gradient_checkpointing, fused=fused
    )
    head = _head_bytes(cfg, shape, tokens, backward=True, on_gpu=on_gpu) if lm_head else 0.0
    bucket = sum(i.bytes for i in transient if i.phase == "backward" and not i.host)
    step = sum(i.bytes for i in transient if i.phase == "step" and not i.host)
    return Item(f"{role} activations + logits of a micro-batch", max(layers + max(head, bucket), step, forward))


def plan_devices(cfg, shapes: dict[str, ModelShape], device_bytes: float, on_gpu: bool = True) -> list[DevicePlan]:
    """One DevicePlan per kind of device the run uses. `shapes` has "actor" and, when used, "critic", "reward".
    `on_gpu`: the run trains on GPUs (DeepSpeed's fused Adam) rather than on CPU (torch's AdamW)."""
    from openppo.ppo.config import engines_colocated
    from openppo.ppo.validate import actor_world_size, needs_critic_group, needs_reference

    res, ds, v = cfg.resources, cfg.ds, cfg.vllm
    tp = ds.ds_tensor_parallel_size

    def ranks(role: str) -> int:
        return getattr(res, f"{role}_num_nodes") * getattr(res, f"{role}_num_gpus_per_node")

    def trained(role: str, shape: ModelShape, data_parallel: int, tensor_parallel: int, lm_head: bool) -> list[Item]:
        kw = dict(param_dtype=ds.param_dtype, zero_stage=ds.zero_stage, data_parallel=data_parallel)
        kw.update(tensor_parallel=tensor_parallel, adam_offload=ds.adam_offload)
        states = trained_items(role, shape, muon=ds.optim == "muon", **kw)
        states += working_state_items(role, shape, fused_adam=on_gpu, **kw)
        if not on_gpu:  # the C heap keeps what a phase frees for the next: on CPU the process holds every phase's
            states = [dataclasses.replace(i, phase="") for i in states]
        transient = tuple(i for i in states if i.transient)
        work = _working_memory(role, shape, cfg, trained=True, lm_head=lm_head, on_gpu=on_gpu, transient=transient)
        return states + [work]

    actor = shapes["actor"]
    groups: dict[str, list[Item]] = {"actor": trained("actor", actor, actor_world_size(cfg) // tp, tp, lm_head=True)}
    if needs_reference(cfg):
        groups["ref"] = frozen_items(
            "reference",
            actor,
            param_dtype=ds.param_dtype,
            zero_stage=ds.zero_stage,
            data_parallel=ranks("ref"),
            offload=cfg.model.ref_reward_offload,
        ) + [_working_memory("reference", actor, cfg, trained=False, lm_head=True, on_gpu=on_gpu)]
    if needs_critic_group(cfg):
        groups["critic"] = trained("critic", shapes["critic"], ranks("critic"), 1, lm_head=False)
    if "reward" in shapes:
        groups["reward"] = frozen_items(
            "reward",
            shapes["reward"],
            param_dtype=ds.param_dtype,
            zero_stage=ds.zero_stage,
            data_parallel=ranks("reward"),
            offload=cfg.model.ref_reward_offload,
        )
    engine = engine_items(
        actor,
        kv_cache_bytes=v.vllm_kv_cache_bytes,
        memory_share=v.vllm_gpu_memory_utilization,
        device_bytes=device_bytes,
        tensor_parallel=v.vllm_tensor_parallel_size,
        engine_dtype_bytes=dtype_bytes(ds.param_dtype),
    )
    if engines_colocated(cfg):
        return [_colocated(groups, engine, cfg)]
    if res.colocate_all_models:  # (--async_train) the DeepSpeed models share the actor's devices, the engines not
        return [DevicePlan("DeepSpeed models' device", [i for items in groups.values() for i in items])] + [
            DevicePlan("engine device", engine)
        ]
    if res.colocate_actor_ref and "ref" in groups:
        groups["actor"] += groups.pop("ref")
    if res.colocate_critic_reward and "critic" in groups and "reward" in groups:
        groups["critic"] += groups.pop("reward")
    plans = [DevicePlan(f"{role} device", items) for role, items in groups.items()]
    return plans + [DevicePlan("engine device", engine)]


def _colocated(groups: dict[str, list[Item]], engine: list[Item], cfg) -> DevicePlan:
    """Everything on one device: the peak of the training phase and the generation phase. Sleeping engines free
    their memory while the trainer works; --deepspeed_enable_sleep moves optimizer states and gradients off the
    device while the engines generate; working memory only exists while its model runs."""
    items = [i for role in groups.values() for i in role]
    working = [i for i in items if "micro-batch" in i.what]
    resident = [i for i in items if i not in working and not i.host and not i.transient]
    states = [i for i in resident if "optimizer" in i.what or "gradient" in i.what]
    engine_total = sum(i.bytes for i in engine)
    train_phase = (
        sum(i.bytes for i in resident)
        + max(i.bytes for i in working)
        + (0.0 if cfg.vllm.vllm_enable_sleep else engine_total)
    )
    generate_phase = (
        sum(i.bytes for i in resident)
        + engine_total
        - (sum(i.bytes for i in states) if cfg.ds.deepspeed_enable_sleep else 0.0)
    )
    plan = DevicePlan("shared device (--colocate_all_models)", [i for i in items if i not in working] + engine)
    plan.items.append(Item("peak working memory (largest micro-batch)", max(i.bytes for i in working)))
    if cfg.vllm.vllm_enable_sleep or cfg.ds.deepspeed_enable_sleep:
        # the two phases never hold everything at once: report the larger one as the device total
        plan.items.append(
            Item("freed by sleep/offload at the peak", max(train_phase, generate_phase) - plan.device_bytes)
        )
    return plan


# On an H200 the 0.5B shape's step moved 1.35x (eager) and 1.47x (compiled layers) the tokens a second with 4x the
# tokens a micro-batch (docs/benchmarks.md, "Second GPU sitting of 2026-11-30"). The recorded peaks were 0.5-4 % above
# the plan (tests/ppo/test_memory_plan.py); the margin leaves room for that, the allocator's cached blocks and
# rows longer than planned.
BUDGET_SHARE = 0.8  # of the device that a suggested token budget's plan may take


@dataclass
class TokenBudget:
    tokens: int  # --train_max_tokens_per_gpu with --use_dynamic_batch
    planned_bytes: float  # the fullest device that runs micro-batches, with that budget


def largest_token_budget(
    cfg,
    shapes: dict[str, ModelShape],
    device_bytes: float,
    on_gpu: bool = True,
    share: float = BUDGET_SHARE,
    most: int = 2**20,
) -> TokenBudget | None:
    """The largest training token budget (a power of two from 1024 to `most` tokens a micro-batch, with
    --use_dynamic_batch) whose plan keeps every device that runs micro-batches within `share` of `device_bytes`;
    None when not even 1024 tokens do. The forward passes' budget is the run's --rollout_max_tokens_per_gpu, or 2x
    the training budget."""
    best = None
    for power in range(10, most.bit_length()):
        rollout = dataclasses.replace(cfg.rollout, use_dynamic_batch=True, train_max_tokens_per_gpu=2**power)
        plans = plan_devices(dataclasses.replace(cfg, rollout=rollout), shapes, device_bytes, on_gpu)
        # the devices whose micro-batches the budget sizes (training, and the forward passes at 2x), not the engines'
        sized = [p for p in plans if any("micro-batch" in i.what for i in p.items)]
        fullest = max(p.device_bytes for p in sized)
        if fullest > share * device_bytes:
            break
        best = TokenBudget(2**power, fullest)
    return best


def default_token_budget(
    cfg, device_bytes: float | None, on_gpu: bool, shapes: dict[str, ModelShape] | None = None
) -> tuple[int, str | None]:
    """--train_max_tokens_per_gpu, and the line that says how it was chosen when the run did not give it (None:
    nothing to say). With --use_dynamic_batch on GPUs of `device_bytes` each: the largest budget within
    `BUDGET_SHARE` of one (`largest_token_budget`; `shapes`: the run's, read when not given), at most
    `AUTO_TRAIN_TOKENS_MAX`. Otherwise, or where not even 1024 tokens fit, `DEFAULT_TRAIN_TOKENS`."""
    from openppo.ppo.config import AUTO_TRAIN_TOKENS_MAX, DEFAULT_TRAIN_TOKENS

    if cfg.rollout.train_max_tokens_per_gpu is not None:
        return cfg.rollout.train_max_tokens_per_gpu, None
    if not (cfg.rollout.use_dynamic_batch and on_gpu and device_bytes):
        return DEFAULT_TRAIN_TOKENS, None
    shapes = shapes or run_shapes(cfg)
    budget = largest_token_budget(cfg, shapes, device_bytes, on_gpu=True, most=AUTO_TRAIN_TOKENS_MAX)
    gpu = f"{device_bytes / GIB:.0f}-GiB GPU"
    if budget is None:
        return DEFAULT_TRAIN_TOKENS, (
            f"--train_max_tokens_per_gpu {DEFAULT_TRAIN_TOKENS}: not even 1024 tokens a micro-batch plan within "
            f"{BUDGET_SHARE:.0%} of one {gpu} (python -m openppo.cli.plan shows what does not fit)"
        )
    return budget.tokens, (
        f"--train_max_tokens_per_gpu {budget.tokens} (not given): the largest budget, up to {AUTO_TRAIN_TOKENS_MAX}, "
        f"whose plan stays within {BUDGET_SHARE:.0%} of one {gpu} ({budget.planned_bytes / GIB:.1f} GiB planned; "
        f"larger micro-batches move more tokens a second)"
    )


def plan_text(plans: list[DevicePlan], device_bytes: float) -> tuple[str, bool]:
    """The table, and whether every device fits."""
    lines, fits = [], True
    for plan in plans:
        lines.append(f"{plan.name}:")
        for item in plan.items:
            where = " (host)" if item.host else " (in its phase)" if item.transient else ""
            lines.append(f"  {item.what + where:<52}{item.bytes / GIB:>9.2f} GiB")
        total = plan.device_bytes
        ok = total <= device_bytes
        fits &= ok
        lines.append(
            f"  {'total on the device':<52}{total / GIB:>9.2f} GiB of {device_bytes / GIB:.2f} GiB"
            f"{'' if ok else '  <-- does NOT fit'}"
        )
    return "\n".join(lines), fits


def model_shape(path: str, flag: str, *, scalar: bool = False) -> ModelShape:
    """Parameter counts from a meta-device build of the model (no weights are read). A vision-language model counts
    its vision tower too; its shape (layers, widths, vocabulary) is its decoder's."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from openppo.models.hf import resolve_model_path
    from openppo.models.vision import is_vision_language

    full_config = AutoConfig.from_pretrained(resolve_model_path(path, flag), trust_remote_code=True)
    auto = AutoModelForImageTextToText if is_vision_language(full_config) else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(full_config, trust_remote_code=True)
    config = full_config.get_text_config()
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    num_params = sum(p.numel() for p in model.parameters())  # tied weights once
    if scalar:  # a value/reward model: the LM head is replaced by a hidden -> 1 head
        num_params -= 0 if tied else head.weight.numel()
        num_params += config.hidden_size
    heads = config.num_attention_heads
    return ModelShape(
        num_params=num_params,
        embedding_params=embed + (0 if tied or scalar else head.weight.numel()),
        num_layers=config.num_hidden_layers,
        hidden=config.hidden_size,
        intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
        vocab=config.vocab_size,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        heads=heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        model_type=getattr(config, "model_type", "") or "",
    )


def run_shapes(cfg) -> dict[str, ModelShape]:
    """The shapes of the models a train_ppo_ray config trains or runs: "actor", and "critic" / "reward" when used."""
    from openppo.ppo.validate import needs_critic_group

    m = cfg.model
    shapes = {"actor": model_shape(m.pretrain, "--pretrain")}
    if needs_critic_group(cfg):
        shapes["critic"] = model_shape(
            m.critic_pretrain or m.reward_pretrain or m.pretrain, "--critic_pretrain", scalar=True
        )
    if m.reward_pretrain:
        shapes["reward"] = model_shape(m.reward_pretrain, "--reward_pretrain", scalar=True)
    return shapes


def host_bytes_of_trainers(cfg, shapes: dict[str, ModelShape], *, eval_only: bool = False) -> float:
    """RAM the processes of a CPU run hold for the whole run, besides the engines' KV caches: each rank's weights,
    gradients and optimizer states, the engines' weights, and a fixed start-up cost per process. Working memory
    (a micro-batch's activations and logits, planned for the longest rows and so far above what short rollouts use)
    is left to the share of RAM the KV cache does not take (1 - --vllm_gpu_memory_utilization). `eval_only`
    (`launch.evaluates_pretrain`): the run starts the engines and a reward model only."""
    from openppo.ppo.validate import actor_world_size, needs_critic_group, needs_reference

    res, v = cfg.resources, cfg.vllm
    training = not eval_only
    ranks = {
        "actor": actor_world_size(cfg) if training else 0,
        "ref": res.ref_num_nodes * res.ref_num_gpus_per_node if needs_reference(cfg) and training else 0,
        "critic": res.critic_num_nodes * res.critic_num_gpus_per_node if needs_critic_group(cfg) and training else 0,
        "reward": res.reward_num_nodes * res.reward_num_gpus_per_node if "reward" in shapes else 0,
    }
    workers = v.vllm_num_engines * v.vllm_tensor_parallel_size
    total = (sum(ranks.values()) + workers) * PROCESS_OVERHEAD_BYTES
    # teachers (--teacher_pretrain): forward-only ranks holding their weights, ZeRO-3 sharded over each group
    from openppo.ppo.teachers import parse_teachers

    teacher_ranks = res.teacher_num_nodes * res.teacher_num_gpus_per_node
    for t in [] if eval_only else parse_teachers(cfg.model.teacher_pretrain):
        weights = model_shape(t.path, "--teacher_pretrain").num_params * dtype_bytes(cfg.ds.param_dtype)
        total += teacher_ranks * PROCESS_OVERHEAD_BYTES + weights * (1 if cfg.ds.zero_stage == 3 else teacher_ranks)
    # device_bytes 0: the planned KV cache is then 0 (it is what is being sized); on CPU nothing sleeps
    for plan in plan_devices(cfg, shapes, 0.0, on_gpu=False):
        held = sum(
            i.bytes
            for i in plan.items
            if not i.what.startswith(("freed by", "peak working")) and "micro-batch" not in i.what
        )
        role = plan.name.split(" ")[0]
        if role in ranks:
            total += ranks[role] * held
        elif plan.name == "engine device":
            total += workers * held
        elif eval_only:  # a shared device of which only the engine worker (and a reward rank) started
            started = ("engine", "reward") if ranks["reward"] else ("engine",)
            total += workers * sum(i.bytes for i in plan.items if i.what.startswith(started))
        else:  # the hybrid engine: one plan per shared device, one rank of every group and an engine worker on it
            total += ranks["actor"] * held
    return total


@dataclass(frozen=True)
class KVCacheSize:
    bytes: int  # per engine worker
    reason: str  # one log line


def cpu_kv_cache_bytes(
    *, per_token: int, sequences: int, max_model_len: int, available: float, others: float, share: float, engines: int
) -> KVCacheSize:
    """The default KV cache of each engine on CPU (pure).

    Wanted: the engine's share of the rollout batch (`sequences` running at once), each up to `max_model_len`
    tokens rounded up to the engine's KV block (`CPU_BLOCK_SIZE`), x `KV_HEADROOM`. Cap: `share`
    (--vllm_gpu_memory_utilization) of the RAM `available` minus what the run's other processes will hold (`others`;
    they may still be loading when the engines start), split over the `engines`. A cap below one full sequence is a
    UserError naming the flags.
    """
    tokens = math.ceil(max_model_len / CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE  # the engine allocates whole blocks
    wanted = int(sequences * tokens * per_token * KV_HEADROOM)
    cap = int(share * max(0.0, available - others) / engines)
    one = tokens * per_token
    if cap < one:
        raise UserError(
            f"the vLLM KV cache does not fit: one sequence of {max_model_len} tokens needs {one / GIB:.2f} GiB per "
            f"engine, and {available / GIB:.1f} GiB of free RAM minus {others / GIB:.1f} GiB for the trainers, x "
            f"--vllm_gpu_memory_utilization {share:g}, over {engines} engine(s) leaves {cap / GIB:.2f} GiB; pass "
            f"--vllm_kv_cache_bytes, raise --vllm_gpu_memory_utilization, or use fewer engines or a shorter "
            f"--prompt_max_len/--generate_max_len"
        )
    how = (
        f"{sequences} seqs x {tokens} tokens x {per_token / 1024:.1f} KiB/token x {KV_HEADROOM:g} headroom "
        f"(cap {cap / GIB:.2f} GiB: {share:g} x ({available / GIB:.1f} GiB free - {others / GIB:.1f} GiB for the "
        f"trainers) / {engines} engine(s))"
    )
    if wanted <= cap:
        return KVCacheSize(wanted, f"vLLM KV cache per engine: {wanted / GIB:.3f} GiB = {how}")
    return KVCacheSize(
        cap,
        f"vLLM KV cache per engine: {cap / GIB:.3f} GiB, the cap; {wanted / GIB:.2f} GiB wanted = "
        f"{how}: fewer sequences generate at once (--vllm_kv_cache_bytes sets it)",
    )
