"""train_ppo_ray end to end on real Ray + DeepSpeed (2 actor ranks, ZeRO-3) + vLLM CPU (1 engine), tiny model."""

from __future__ import annotations

import json
import math

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, read_metrics, run_cli, series
from tests.engines import vllm_shm_files, vllm_shm_left_behind
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow

SYNC_CHECKED = "--vllm_sync_check: 1 engine(s) compute with the trainer's weights: "
STEP_METRICS = [
    "train/policy_loss",
    "train/kl",
    "train/reward",
    "train/clip_ratio",
    "train/entropy",
    "train/response_length",
    "rollout/logprob_diff",
    "timing/generate",
    "timing/reward",
    "timing/old_logprob",
    "timing/actor_train",
    "timing/weight_sync",
    "timing/idle",
    "perf/generate_tokens_per_s",
    "perf/train_tokens_per_s",
    "perf/samples_per_s",
    "perf/generated_tokens_per_hour",
    "perf/driver_rss_gib",
    "perf/actor_rss_gib",
]


def test_grpo_with_py_reward(tmp_path):
    """GRPO with a Python reward, the default KV cache, top-k/top-p sampling and IS correction; the 2 actor ranks
    form one ring (--ring_attn_size 2): each packed row is split between them and attention runs across the halves,
    and the log-probs still equal those of the engine, which is tensor-parallel (2 worker processes, each holding
    half of every layer, both synced; the second sync is a delta sync (--vllm_sync_delta); --vllm_sync_check reads
    both halves back after each of the two and compares them with the ZeRO-3 gathered weights). Step 2 is traced by
    the torch profiler; the run ends with the stage table and the bottleneck advice, and the engine is shut down,
    leaving nothing in /dev/shm. Flags are spelled in OpenRLHF >= 0.10's dotted names, --data.max_len among them.
    """
    prompts = write_jsonl(make_rows(16, seed=1), tmp_path / "prompts.jsonl")
    save = tmp_path / "out"
    shm_before = vllm_shm_files()
    # OpenRLHF >= 0.10's dotted names, with openppo's own flags (no dotted spelling) mixed in; --data.max_len 33
    # leaves the 23-token prompts 10 tokens of response, under --rollout.max_new_tokens 16
    dotted = (
        "--data.input_key input --data.label_key label --data.apply_chat_template "
        "--algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 4 --rollout.batch_size 4 "
        "--train.batch_size 8 --train.micro_batch_size 2 --rollout.micro_batch_size 4 --actor.num_gpus_per_node 2 "
        "--vllm.num_engines 1 --algo.kl.init_coef 0 --rollout.max_new_tokens 16 --data.max_len 33 "
        "--prompt_max_len 64 --ds.zero_stage 3 --ds.param_dtype fp32 --max_steps 2 --actor.adam.lr 1e-4 "
        "--ds.packing_samples --ds.ring_attn_size 2 --ds.ring_attn_head_stride 1 --profile_steps 2 "
        "--vllm.tensor_parallel_size 2 --rollout.top_p 0.9 --top_k 1000 --algo.advantage.is_correction_enable "
        "--vllm_sync_check --vllm_sync_delta"
    ).split()
    proc = run_cli(
        "train_ppo_ray",
        [
            "--actor.model_name_or_path",
            str(tiny_model_dir()),
            "--reward.remote_url",
            str(REPO / "examples/reward_funcs/arithmetic.py"),
            "--data.prompt_dataset",
            str(prompts),
            "--ckpt.output_dir",
            str(save),
            *dotted,
        ],
        nproc=1,
        timeout=600,
    )
    assert proc.stdout.count(SYNC_CHECKED) == 2  # after the full sync and after the delta sync
    # the run shut its engine down before the end: the TP workers' message queues are gone from /dev/shm
    assert vllm_shm_left_behind(shm_before) == set()
    # no --vllm_kv_cache_bytes: sized from the run (16 sequences of 33 tokens, two of the engine's 32-token blocks
    # each; a TP-2 worker holds 1 of the 2 KV heads: 2 layers x 1 head x 32 x 4 B x 2 = 512 B a token) and logged
    # in one line
    sized = [line for line in proc.stdout.splitlines() if "vLLM KV cache per engine:" in line]
    assert len(sized) == 1 and "16 seqs x 64 tokens x 0.5 KiB/token" in sized[0], sized
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2]
    # the first sync sends everything, the delta sync what changed: nothing when every reward of step 2 was 0 (the
    # tiny random model does not do arithmetic), which leaves GRPO nothing to learn from (its KL coefficient is 0)
    changed = [r["perf/weight_sync_changed"] for r in records]
    assert changed[0] == 1.0 and (changed[1] == 0.0) == (records[1]["train/reward"] == 0.0), changed
    assert "(delta: " in proc.stdout
    assert all(0 < r["train/response_length"] <= 10 for r in records), series(records, "train/response_length")
    for key in STEP_METRICS:
        assert all(key in r for r in records), key
    for r in records:  # the stages and the idle rest add up to the step (sync run: nothing overlaps)
        staged = sum(v for k, v in r.items() if k.startswith("timing/") and k != "timing/step")
        assert staged == pytest.approx(r["timing/step"], rel=1e-6)
        generated = r["train/response_length"] * 16  # 4 prompts x 4 samples
        assert r["perf/generate_tokens_per_s"] == pytest.approx(generated / r["timing/generate"], rel=1e-6)
    traces = sorted(p.name for p in (save / "profile" / "step2").iterdir())
    assert traces == ["actor_rank0.json", "actor_rank1.json", "driver.json"], traces
    assert json.loads((save / "profile" / "step2" / "actor_rank0.json").read_text())["traceEvents"]
    summary = (save / "summary.txt").read_text()
    assert "actor_train" in summary and "bottleneck advice" in summary
    # fp32 engine and trainer agree on the sampled tokens before and after a weight sync, under the engine's top-k
    # and top-p truncation, which the trainer recomputes through the ring: IS weights 1
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
    assert all(r["rollout/outside_support"] == 0.0 for r in records), series(records, "rollout/outside_support")
    assert all(abs(r["train/is_ratio_mean"] - 1) < 1e-4 for r in records), series(records, "train/is_ratio_mean")
    # each rank ran half of every row (plus at most one pad token per row) through the model
    shares = series(records, "perf/actor_ring_token_share")
    assert len(shares) == len(records) and all(0.5 <= share < 0.52 for _, share in shares), shares
    assert (save / "model.safetensors").is_file()
    assert json.loads((save / "run_info.json").read_text())["config"]["algo"]["advantage_estimator"] == "group_norm"


# GRPO on the label reward (rewards by response parity for "mixed" rows), 2 samples per prompt, no KL
GRPO_BY_LABEL = [
    "--remote_rm_url",
    str(REPO / "tests/ppo/label_reward.py"),
    "--advantage_estimator",
    "group_norm",
    "--n_samples_per_prompt",
    "2",
    "--init_kl_coef",
    "0",
]


def _common(prompts, save):
    return [
        "--pretrain",
        str(tiny_model_dir()),
        "--prompt_data",
        str(prompts),
        "--input_key",
        "input",
        "--label_key",
        "label",
        "--apply_chat_template",
        "--rollout_batch_size",
        "4",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "2",
        "--micro_rollout_batch_size",
        "4",
        "--actor_num_gpus_per_node",
        "2",
        "--vllm_num_engines",
        "1",
        "--vllm_kv_cache_bytes",
        str(256 * 2**20),
        "--generate_max_len",
        "16",
        "--prompt_max_len",
        "64",
        "--zero_stage",
        "3",
        "--param_dtype",
        "fp32",
        "--max_steps",
        "2",
        "--actor_learning_rate",
        "1e-4",
        "--save_path",
        str(save),
    ]


def test_ppo_with_critic_reward_model_and_reference(tmp_path):
    """gae: critic + reward-model groups + reference (KL penalty in the reward); the reference shares the actor's
    2 devices (--colocate_actor_ref), critic and reward model share one (--colocate_critic_reward). Every forward
    and training step runs packed, with token-budget micro-batches (ZeRO-3: ranks must agree on their count),
    gradient checkpointing (its recompute must see the packed rows again), optimizer states on CPU
    (--adam_offload), frozen models' parameters offloaded (--ref_reward_offload) and --overlap_comm. The KL
    coefficient adapts (--kl_target, in nats per response). The run's own flags are spelled in OpenRLHF >= 0.10's
    dotted names."""
    prompts = write_jsonl(make_rows(16, seed=2), tmp_path / "prompts.jsonl")
    save = tmp_path / "out"
    proc = run_cli(
        "train_ppo_ray",
        _common(prompts, save)
        + ["--reward.model_name_or_path", str(tiny_model_dir())]
        # the dotted names of OpenRLHF >= 0.10 on top of _common's flat ones (generations mix across flags)
        + (
            "--algo.advantage.estimator gae --rollout.n_samples_per_prompt 2 --algo.kl.init_coef 0.01 "
            "--critic.num_gpus_per_node 1 --ref.num_gpus_per_node 2 --reward.num_gpus_per_node 1 "
            "--critic.adam.lr 1e-4 --reward.normalize_enable --train.colocate_actor_ref --train.colocate_critic_reward "
            "--ds.packing_samples --train.dynamic_batch_enable --train.max_tokens_per_gpu 60 "
            "--rollout.max_tokens_per_gpu 90 --actor.gradient_checkpointing_enable --ds.adam_offload "
            "--ref.offload --reward.offload --ds.overlap_comm --algo.kl.target 6 --algo.kl.horizon 100 "
            "--critic.save_value_network"
        ).split(),
        nproc=1,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert "colocated (actor_ref): actor, reference share 2 device(s), 0.5 of each" in log
    assert "colocated (critic_reward): critic, reward share 1 device(s), 0.5 of each" in log
    records = read_metrics(save)
    assert len(records) == 2
    for key in STEP_METRICS + ["train/value_loss", "timing/values", "timing/ref_logprob", "timing/critic_train"]:
        assert all(key in r for r in records), key
    # a NaN would be logged as such (never dropped): finite means the critic trained
    assert all(math.isfinite(r["train/value_loss"]) for r in records), series(records, "train/value_loss")
    # The adaptive controller sees nats per response: the per-token mean x the mean response length. Each step it
    # moves beta by clip(KL / 6 - 1, +-0.2) x 8 samples / 100 (Ziegler et al.), from --init_kl_coef 0.01.
    beta = 0.01
    for r in records:
        per_response = r["train/kl"] * r["train/response_length"]
        assert r["train/kl_per_response"] == pytest.approx(per_response, rel=1e-4, abs=1e-9)
        beta *= 1 + min(max(r["train/kl_per_response"] / 6 - 1, -0.2), 0.2) * 8 / 100
        assert r["train/kl_coef"] == pytest.approx(beta, rel=1e-9)
    assert records[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # step 1: policy == reference
    assert records[1]["train/kl"] != 0.0  # after one update the policy has moved away from the reference
    # packed log-probs equal the engine's; no padding was computed; 4 rows of ~40 tokens per rank and step do not
    # fit one 60-token budget
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records)
    assert all(r["perf/actor_padding_share"] == 0.0 and r["perf/actor_micro_batches"] >= 2 for r in records), records
    # --save_value_network: the trained critic as an HF folder beside the actor's, OpenRLHF's <save_path>_critic
    critic = json.loads((tmp_path / "out_critic" / "config.json").read_text())
    assert critic["architectures"][0].endswith("ForSequenceClassification") and len(critic["id2label"]) == 1


def test_reinforce_baseline_with_http_reward_and_lora(tmp_path, request):
    """REINFORCE++-baseline scored by a running serve_rm (a reward .py served over HTTP on localhost), training
    LoRA adapters: the engines get base + adapter weights, so their log-probs equal the trainer's after a sync.
    The hybrid engine (--colocate_all_models) with one engine of TP 2 on the 2 actor ranks' devices: each rank hands
    the merged weights to the worker on its device through shared memory, with no gloo group."""
    from tests.rewards.conftest import start_servers

    # label "mixed": rewards 0.25/0.75 by response parity, so advantages are non-zero and the adapters train
    (server,) = start_servers(request, ["--reward_func", str(REPO / "tests/ppo/label_reward.py"), "--port", "0"])
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(16, seed=3)], tmp_path / "prompts.jsonl")
    save = tmp_path / "out"
    proc = run_cli(
        "train_ppo_ray",
        _common(prompts, save)
        + [
            "--remote_rm_url",
            server.url,
            "--advantage_estimator",
            "reinforce_baseline",
            "--n_samples_per_prompt",
            "2",
            "--init_kl_coef",
            "0.01",
            "--use_kl_loss",
            "--kl_estimator",
            "k3",
            "--lora_rank",
            "8",
            "--lora_alpha",
            "16",
            "--actor_learning_rate",
            "2e-2",
            "--lr_warmup_ratio",
            "0",
            "--colocate_all_models",
            "--vllm_tensor_parallel_size",
            "2",
            "--ref_num_gpus_per_node",
            "2",
            "--vllm_sync_check",
        ],
        nproc=1,
        timeout=600,
    )
    assert "weight sync: engine(s) 0 via shared memory from actor rank(s) 0,1" in proc.stdout
    # both engine workers compute with base + adapters, tensor by tensor (after step 1's update)
    assert SYNC_CHECKED in proc.stdout
    assert "weight sync group ready" not in proc.stdout
    records = read_metrics(save)
    assert len(records) == 2 and all("train/reward" in r and "train/kl_loss" in r for r in records)
    # Step 2 samples come from the synced engine. The trained adapters moved the policy away from the reference
    # (the base model): an engine without them would be off by about the KL; it agrees 100x more closely.
    assert records[1]["train/kl"] > 1e-3, records[1]["train/kl"]
    assert records[1]["rollout/logprob_diff"] < min(1e-4, records[1]["train/kl"] / 100), records[1]
    assert (save / "adapter_config.json").is_file()


def test_multi_turn_agent(tmp_path):
    """guess_number over 3 turns: environment feedback sits in the sequence but outside the loss and the
    engine/trainer log-prob comparison (1 actor rank, 1 engine). 4 samples per step and --train_batch_size 4: the
    update's own log-probs serve as the old ones. Packed rows, so the 2 episodes of a prompt share their initial
    prompt (--share_prompt_in_group auto) and the update's log-probs come from the shared row."""
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    subprocess.run([sys.executable, str(REPO / "examples/agents/guess_number.py"), str(prompts), "8"], check=True)
    save = tmp_path / "out"
    run_cli(
        "train_ppo_ray",
        [
            "--pretrain",
            str(tiny_model_dir()),
            "--agent_func_path",
            str(REPO / "examples/agents/guess_number.py"),
            "--agent_max_turns",
            "3",
            "--prompt_data",
            str(prompts),
            "--input_key",
            "input",
            "--label_key",
            "label",
            "--apply_chat_template",
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "2",
            "--rollout_batch_size",
            "2",
            "--train_batch_size",
            "4",
            "--micro_train_batch_size",
            "2",
            "--packing_samples",
            "--vllm_kv_cache_bytes",
            str(128 * 2**20),
            "--init_kl_coef",
            "0",
            "--generate_max_len",
            "6",
            "--prompt_max_len",
            "96",  # the prompt, then 3 turns of 6 tokens and 2 feedbacks of up to 12 tokens
            "--param_dtype",
            "fp32",
            "--zero_stage",
            "0",
            "--max_steps",
            "2",
            "--actor_learning_rate",
            "1e-4",
            "--save_path",
            str(save),
        ],
        nproc=1,
        timeout=600,
    )
    records = read_metrics(save)
    assert len(records) == 2
    for r in records:
        # a random tiny model seldom names a digit (10 of its 8192 tokens) and then seldom the secret: the episodes
        # run all 3 turns and collect feedback, but for one that guessed right (reward 1)
        assert r["rollout/agent_turns"] == 3 or 0 < r["env/guess_number/solved"] <= 0.25, r
        assert r["rollout/agent_turns"] >= 2.5
        assert r["train/response_length"] > 3 * 6 * 0.5  # model turns plus feedback tokens
        assert r["rollout/logprob_diff"] < 1e-4
        # the batch is one on-policy optimizer step: no separate old-log-prob pass, the gap is measured in the update
        assert "timing/old_logprob" not in r
        # each micro-batch of 2 rows is one prompt's 2 episodes: its initial prompt computed once
        assert r["perf/actor_shared_prompt_share"] > 0.15  # 0.25 measured


def test_async_grpo_with_oversampling(tmp_path):
    """--async_train: a batch is generated while the step before trains, from weights one sync old (bounded by
    --async_queue_size 1), and importance-weighted; the first batch is fresh. --vllm_generate_batch_size 8 (two
    batches of 4 prompts): a round generates for two steps, so steps 2 and 4 take the groups left by steps 1 and 3
    without generating, and train on samples one version older still. --vllm_sync_with_ray: the weights reach the
    engine through Ray's object store, in no group, exactly (--vllm_sync_check). --partial_rollout: the engine is
    advanced a few steps per call and tags each token with its weight version (whether a sync lands mid-batch
    depends on timing: tests/rollout/test_engine.py places one there). --eval_dataset: evaluations run beside the
    producer, each after the producer's batch in flight if there is one (whether one is depends on timing:
    tests/rollout/test_engine.py places one there)."""
    # label "mixed": rewards 0.25/0.75 by response parity, so advantages are non-zero and the weights move
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(16, seed=4)], tmp_path / "prompts.jsonl")
    evals = write_jsonl([{**row, "label": "mixed"} for row in make_rows(2, seed=5)], tmp_path / "evals.jsonl")
    save = tmp_path / "out"
    proc = run_cli(
        "train_ppo_ray",
        _common(prompts, save)
        + GRPO_BY_LABEL
        + [
            "--max_steps",
            "4",
            "--async_train",
            "--async_queue_size",
            "1",
            "--vllm_generate_batch_size",
            "8",
            "--top_p",
            "0.9",
            "--vllm_sync_with_ray",
            "--vllm_sync_check",
            "--partial_rollout",
            "--eval_dataset",
            str(evals),
            "--eval_steps",
            "2",
            "--eval_n_samples_per_prompt",
            "2",
        ],
        nproc=1,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    assert "--async_train: samples from older weights are importance-weighted" in log
    assert "weight sync: engine(s) 0 via Ray's object store" in log and "weight sync group ready" not in log
    assert SYNC_CHECKED in log
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # batch 3 is generated by the weights of step 1's sync while step 2 trains
    assert [r["rollout/staleness_max"] for r in records] == [0.0, 1.0, 1.0, 2.0], records
    assert [r["rollout/groups_ahead"] for r in records] == [4, 0, 4, 0]
    rounds = {r["step"]: r for r in map(json.loads, (save / "rollouts.jsonl").read_text().splitlines())}
    assert [len(rounds[step]["taken"]) for step in (1, 2, 3, 4)] == [8, 0, 8, 0]
    assert rounds[2]["prompts"] == rounds[1]["taken"][4:] and rounds[4]["prompts"] == rounds[3]["taken"][4:]
    assert all("timing/wait_rollout" in r and "train/is_ratio_mean" in r for r in records), records[0].keys()
    assert all(0.0 <= r["rollout/mixed_version_share"] <= 1.0 for r in records)
    assert [r["step"] for r in records if "eval/pass@1" in r] == [2, 4]  # 2 prompts x 2 samples, rewards 0.25/0.75
    assert all(0.25 <= r["eval/pass@1"] <= 0.75 for r in records if "eval/pass@1" in r)
    # fresh engine == trainer at step 1 (under the engine's top-p truncation, recomputed in the update: weights 1);
    # later the samples' log-probs are those of the previous weights
    assert records[0]["rollout/logprob_diff"] < 1e-4
    assert abs(records[0]["train/is_ratio_mean"] - 1) < 1e-4 and records[0]["rollout/outside_support"] == 0
    assert all(r["rollout/logprob_diff"] > 1e-4 for r in records[1:]), series(records, "rollout/logprob_diff")


def test_grpo_on_a_mixture_of_experts_with_the_router_loss(tmp_path):
    """--aux_loss_coef on the tiny Qwen3-MoE (4 experts, 2 per token): vLLM generates with it, the update adds the
    router's load-balancing loss (train/aux_loss: transformers' Switch loss, top-k = 2 at a perfect balance, at most
    the expert count), and after the sync of step 1's update the
    engine's log-probs equal the trainer's (the fused expert weights arrived). ZeRO-3 over 2 actor ranks."""
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(8, seed=6)], tmp_path / "prompts.jsonl")
    save = tmp_path / "out"
    args = _common(prompts, save)
    args[args.index("--pretrain") + 1] = str(tiny_model_dir(arch="qwen3_moe"))
    run_cli(
        "train_ppo_ray",
        args
        + GRPO_BY_LABEL
        + [
            "--actor.aux_loss_coef",
            "0.01",
            "--actor_learning_rate",
            "1e-3",
        ],
        nproc=1,
        timeout=600,
    )
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2]
    assert all(2.0 <= r["train/aux_loss"] <= 4.0 for r in records), series(records, "train/aux_loss")
    # step 2 samples from the synced engine: an engine left with the initial weights would be off by what a 1e-3
    # step of nonzero advantages moved the policy, far above 1e-4
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
