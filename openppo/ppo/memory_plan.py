"""Per-device memory estimate of a train_ppo_ray run, before launch (`python -m openppo.cli.plan`).

Pure arithmetic on the model's shape and the flags. Per rank of each model group:
- weights, gradients and optimizer states by ZeRO stage (Rajbhandari et al. 2020: with mixed precision 2 bytes of
  weights + 2 of gradients + 12 of fp32 master copy and Adam moments per parameter; in fp32 4 + 4 + 8), partitioned
  over the data-parallel ranks from stage 1 (optimizer), 2 (+ gradients) and 3 (+ weights); `--adam_offload` moves
  the optimizer states to host memory; AutoTP splits the layers' weights;
- what the optimizer step holds beyond those (DeepSpeed's implementation, not the paper): with 16-bit weights the
  fp32 gradient of the rank's partition, and on CPU the scratch tensor of torch's AdamW (`working_state_items`);
- activations of one training micro-batch: the tensors a decoder layer keeps for its backward (about 6 x hidden +
  4 x intermediate values per token with fused attention), or only each layer's input with
  `--gradient_checkpointing` plus one layer's worth while it is recomputed;
- the logits of a micro-batch: model-dtype logits, their fp32 log-softmax and its gradient (10 bytes per token per
  vocabulary entry in bf16), the largest single item for small models with a large vocabulary. Packed rows score
  only their response positions (--generate_max_len of each prompt + response); padded ones the whole row;
- each vLLM engine: weights (split by --vllm_tensor_parallel_size) and the KV cache (--vllm_kv_cache_bytes, or
  --vllm_gpu_memory_utilization of the device minus the weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from openppo.strategy.config import REDUCE_BUCKET_SIZE

GIB = 2**30


@dataclass
class ModelShape:
    num_params: int
    embedding_params: int  # input embedding + an untied LM head: AutoTP leaves them whole
    num_layers: int
    hidden: int
    intermediate: int
    vocab: int


@dataclass
class Item:
    what: str
    bytes: float
    host: bool = False  # offloaded to host memory (not on the device)


@dataclass
class DevicePlan:
    """What one device (one rank of each group placed on it) holds."""

    name: str
    items: list[Item] = field(default_factory=list)

    @property
    def device_bytes(self) -> float:
        return sum(i.bytes for i in self.items if not i.host)

    @property
    def host_bytes(self) -> float:
        return sum(i.bytes for i in self.items if i.host)


def dtype_bytes(param_dtype: str) -> int:
    return 4 if param_dtype == "fp32" else 2


def trained_items(role: str, shape: ModelShape, *, param_dtype: str, zero_stage: int, data_parallel: int,
                  tensor_parallel: int = 1, adam_offload: bool = False) -> list[Item]:
    """Weights, gradients and optimizer states of one rank of a trained model."""
    p = dtype_bytes(param_dtype)
    split = shape.num_params - shape.embedding_params
    params = shape.embedding_params + split / tensor_parallel  # held by one rank of a tensor-parallel group
    optimizer = (8 if param_dtype == "fp32" else 12) * params  # (fp32 master copy) + Adam m and v
    return [Item(f"{role} weights", p * params / (data_parallel if zero_stage >= 3 else 1)),
            Item(f"{role} gradients", p * params / (data_parallel if zero_stage >= 2 else 1)),
            Item(f"{role} optimizer states", optimizer / (data_parallel if zero_stage >= 1 else 1),
                 host=adam_offload)]


def working_state_items(role: str, shape: ModelShape, *, param_dtype: str, zero_stage: int, data_parallel: int,
                        tensor_parallel: int = 1, adam_offload: bool = False, fused_adam: bool = True) -> list[Item]:
    """What DeepSpeed's optimizer step holds beyond the paper's model states, on one rank.

    - Mixed precision: the wrappers (ZeRO-1/2/3, and the bf16 one of ZeRO-0) turn the 16-bit gradient into an fp32
      gradient of the rank's partition before Adam runs: 4 bytes per parameter of the partition.
    - ZeRO-1/2 with `contiguous_gradients` copy each gradient into a reduction bucket as the backward produces it
      (`reduce_bucket_size` = 5e8 elements, so all of a small model's gradients) before reducing and partitioning.
    - torch's AdamW (CPU without --adam_offload; DeepSpeed's FusedAdam and CPU Adam need none) computes the
      denominator sqrt(v) + eps as one more fp32 tensor of the partition's size.
    """
    split = shape.num_params - shape.embedding_params
    whole = shape.embedding_params + split / tensor_parallel  # one rank of a tensor-parallel group
    params = whole / (data_parallel if zero_stage >= 1 else 1)
    items = []
    if zero_stage in (1, 2):
        items.append(Item(f"{role} gradient reduction bucket", dtype_bytes(param_dtype) * min(REDUCE_BUCKET_SIZE, whole)))
    if param_dtype != "fp32":
        items.append(Item(f"{role} fp32 gradient partition", 4 * params, host=adam_offload))
    if not fused_adam and not adam_offload:
        items.append(Item(f"{role} optimizer step scratch (torch AdamW)", 4 * params))
    return items


def frozen_items(role: str, shape: ModelShape, *, param_dtype: str, zero_stage: int, data_parallel: int,
                 offload: bool = False) -> list[Item]:
    """Weights of a frozen model (reference, reward): ZeRO-3 shards them, --ref_reward_offload moves them."""
    weights = dtype_bytes(param_dtype) * shape.num_params / (data_parallel if zero_stage == 3 else 1)
    return [Item(f"{role} weights", weights, host=offload and zero_stage == 3)]


def activation_bytes(shape: ModelShape, tokens: int, *, param_dtype: str, checkpointing: bool) -> float:
    """What the decoder layers keep for the backward of one micro-batch of `tokens` tokens."""
    p = dtype_bytes(param_dtype)
    per_layer = p * tokens * (6 * shape.hidden + 4 * shape.intermediate)
    if checkpointing:  # each layer's input, and one layer recomputed at a time
        return p * tokens * shape.hidden * shape.num_layers + per_layer
    return per_layer * shape.num_layers


def logits_bytes(shape: ModelShape, tokens: int, *, param_dtype: str, backward: bool) -> float:
    """Logits in the model dtype and their fp32 log-softmax; with a backward also the fp32 gradient."""
    per_entry = dtype_bytes(param_dtype) + 4 + (4 if backward else 0)
    return per_entry * tokens * shape.vocab


def engine_items(shape: ModelShape, *, kv_cache_bytes: int | None, memory_share: float, device_bytes: float,
                 tensor_parallel: int = 1, engine_dtype_bytes: int = 2) -> list[Item]:
    """One vLLM engine's weights and KV cache on one of its devices."""
    weights = engine_dtype_bytes * shape.num_params / tensor_parallel
    kv = kv_cache_bytes if kv_cache_bytes is not None else max(0.0, memory_share * device_bytes - weights)
    return [Item("engine weights", weights), Item("engine KV cache", kv)]


def _micro_tokens(cfg, *, train: bool) -> int:
    """Tokens of one micro-batch on one rank (a ring splits each row over its ranks)."""
    r, d = cfg.rollout, cfg.data
    row = d.prompt_max_len + d.generate_max_len
    if r.use_dynamic_batch:
        tokens = r.train_max_tokens_per_gpu if train else (r.rollout_max_tokens_per_gpu
                                                           or 2 * r.train_max_tokens_per_gpu)
    else:
        tokens = (cfg.train.micro_train_batch_size if train else r.micro_rollout_batch_size) * row
    return -(-tokens // r.ring_attn_size)


def _scored_tokens(cfg, tokens: int) -> int:
    """Of a micro-batch's tokens, those the LM head scores: only the response positions of a packed row (the action
    mask); a padded batch keeps every column some row needs, up to the whole row."""
    if not cfg.rollout.packing_samples:
        return tokens
    d = cfg.data
    return -(-tokens * d.generate_max_len // (d.prompt_max_len + d.generate_max_len))


def _working_memory(role: str, shape: ModelShape, cfg, *, trained: bool, lm_head: bool) -> Item:
    """The larger of a training micro-batch's activations + logits and a forward-only micro-batch's logits."""
    dtype = cfg.ds.param_dtype
    forward_tokens = _scored_tokens(cfg, _micro_tokens(cfg, train=False))
    forward = logits_bytes(shape, forward_tokens, param_dtype=dtype, backward=False) if lm_head else 0.0
    if not trained:
        return Item(f"{role} forward micro-batch", forward)
    tokens = _micro_tokens(cfg, train=True)
    train = activation_bytes(shape, tokens, param_dtype=dtype, checkpointing=cfg.model.gradient_checkpointing)
    if lm_head:
        train += logits_bytes(shape, _scored_tokens(cfg, tokens), param_dtype=dtype, backward=True)
    return Item(f"{role} activations + logits of a micro-batch", max(train, forward))


def plan_devices(cfg, shapes: dict[str, ModelShape], device_bytes: float, on_gpu: bool = True) -> list[DevicePlan]:
    """One DevicePlan per kind of device the run uses. `shapes` has "actor" and, when used, "critic", "reward".
    `on_gpu`: the run trains on GPUs (DeepSpeed's fused Adam) rather than on CPU (torch's AdamW)."""
    from openppo.ppo.validate import actor_world_size, needs_critic_group, needs_reference

    res, ds, v = cfg.resources, cfg.ds, cfg.vllm
    tp = ds.ds_tensor_parallel_size

    def ranks(role: str) -> int:
        return getattr(res, f"{role}_num_nodes") * getattr(res, f"{role}_num_gpus_per_node")

    actor = shapes["actor"]
    groups: dict[str, list[Item]] = {
        "actor": trained_items("actor", actor, param_dtype=ds.param_dtype, zero_stage=ds.zero_stage,
                               data_parallel=actor_world_size(cfg) // tp, tensor_parallel=tp,
                               adam_offload=ds.adam_offload)
        + working_state_items("actor", actor, param_dtype=ds.param_dtype, zero_stage=ds.zero_stage,
                              data_parallel=actor_world_size(cfg) // tp, tensor_parallel=tp,
                              adam_offload=ds.adam_offload, fused_adam=on_gpu)
        + [_working_memory("actor", actor, cfg, trained=True, lm_head=True)]}
    if needs_reference(cfg):
        groups["ref"] = frozen_items("reference", actor, param_dtype=ds.param_dtype, zero_stage=ds.zero_stage,
                                     data_parallel=ranks("ref"), offload=cfg.model.ref_reward_offload) \
            + [_working_memory("reference", actor, cfg, trained=False, lm_head=True)]
    if needs_critic_group(cfg):
        groups["critic"] = trained_items("critic", shapes["critic"], param_dtype=ds.param_dtype,
                                         zero_stage=ds.zero_stage, data_parallel=ranks("critic"),
                                         adam_offload=ds.adam_offload) \
            + working_state_items("critic", shapes["critic"], param_dtype=ds.param_dtype, zero_stage=ds.zero_stage,
                                  data_parallel=ranks("critic"), adam_offload=ds.adam_offload, fused_adam=on_gpu) \
            + [_working_memory("critic", shapes["critic"], cfg, trained=True, lm_head=False)]
    if "reward" in shapes:
        groups["reward"] = frozen_items("reward", shapes["reward"], param_dtype=ds.param_dtype,
                                        zero_stage=ds.zero_stage, data_parallel=ranks("reward"),
                                        offload=cfg.model.ref_reward_offload)
    engine = engine_items(actor, kv_cache_bytes=v.vllm_kv_cache_bytes, memory_share=v.vllm_gpu_memory_utilization,
                          device_bytes=device_bytes, tensor_parallel=v.vllm_tensor_parallel_size,
                          engine_dtype_bytes=4 if ds.param_dtype == "fp32" else 2)
    if res.colocate_all_models:
        return [_colocated(groups, engine, cfg)]
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
    resident = [i for i in items if i not in working and not i.host]
    states = [i for i in resident if "optimizer" in i.what or "gradient" in i.what]
    engine_total = sum(i.bytes for i in engine)
    train_phase = sum(i.bytes for i in resident) + max(i.bytes for i in working) + \
        (0.0 if cfg.vllm.vllm_enable_sleep else engine_total)
    generate_phase = sum(i.bytes for i in resident) + engine_total - \
        (sum(i.bytes for i in states) if cfg.ds.deepspeed_enable_sleep else 0.0)
    plan = DevicePlan("shared device (--colocate_all_models)", [i for i in items if i not in working] + engine)
    plan.items.append(Item("peak working memory (largest micro-batch)", max(i.bytes for i in working)))
    if cfg.vllm.vllm_enable_sleep or cfg.ds.deepspeed_enable_sleep:
        # the two phases never hold everything at once: report the larger one as the device total
        plan.items.append(Item("freed by sleep/offload at the peak",
                               max(train_phase, generate_phase) - plan.device_bytes))
    return plan


def plan_text(plans: list[DevicePlan], device_bytes: float) -> tuple[str, bool]:
    """The table, and whether every device fits."""
    lines, fits = [], True
    for plan in plans:
        lines.append(f"{plan.name}:")
        for item in plan.items:
            where = " (host)" if item.host else ""
            lines.append(f"  {item.what + where:<52}{item.bytes / GIB:>9.2f} GiB")
        total = plan.device_bytes
        ok = total <= device_bytes
        fits &= ok
        lines.append(f"  {'total on the device':<52}{total / GIB:>9.2f} GiB of {device_bytes / GIB:.2f} GiB"
                     f"{'' if ok else '  <-- does NOT fit'}")
    return "\n".join(lines), fits
