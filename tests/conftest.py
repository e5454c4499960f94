"""Suite-wide settings: offline hubs, repo-local JIT cache, markers."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
# A Ray node starts one idle worker per CPU when its first driver connects. Most of the suite's actors carry
# runtime_env variables and cannot take one, so most were Pythons importing Ray for nothing (22 still idle at the end,
# 76 CPU-s, in the clusters tests start themselves, one suite run; four of those files: 216 -> 202 box CPU-s)
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
# A run with capped vector instructions (docs/platform.md, "Checking an AVX2-only CPU on a newer one") gets an Inductor
# cache of its own: the shared one holds an uncapped run's kernels, which scored NaN under the caps
if any(os.environ.get(cap) for cap in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")):
    import atexit
    import shutil
    import tempfile

    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="openppo-inductor-capped-")
        atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], True)


# The longest files, longest first (seconds one at a time on a 2-core box, 2026-11-27). `make test` runs two pytest
# workers, each taking whole files (`--dist loadfile`, module fixtures run once) in this order as it frees up: the
# long ones start early and the short ones fill the end, instead of one long file running alone at the end.
LONGEST_FIRST = (
    "tests/ppo/test_two_nodes.py",  # 150; 134 on the AMD EPYC beside test_engine_death, its nodes' zygotes' start in
    "tests/ppo/test_train_ppo_ray.py",  # 304
    "tests/ppo/test_golden_trace.py",  # 191: 143, and 48 for the PPO run's restart
    "tests/ppo/test_train_ppo_features.py",  # 132
    "tests/ppo/test_engine_death.py",  # 126
    "tests/ppo/test_distillation.py",  # 159 alone on a 2-core AMD EPYC (AVX2), which takes ~1.6x this list's box
    "tests/agents/test_served_agents.py",  # 115 alone on the AMD EPYC, building its tool-calling model (~50 s)
    "tests/ppo/test_crash_resume.py",  # 95
    "tests/ppo/test_vlm_grpo.py",  # 247 alone on the AMD EPYC (two runs)
    "tests/cli/test_supervised_parallel.py",  # 65
    "tests/agents/test_endpoint.py",  # 94 alone on the AMD EPYC
    "tests/rollout/test_engine_images.py",  # 125 alone on the AMD EPYC
    "tests/ppo/test_molt_quick_start.py",  # 56
    "tests/cli/test_lora_and_packing.py",  # 55
    "tests/ppo/test_memory_plan.py",  # 44
    "tests/agents/test_agent_rollout.py",  # 43
    "tests/ppo/test_learning.py",  # 42
    "tests/distributed/test_worker_group.py",  # 42
    "tests/cli/test_train_dpo.py",  # 41
    "tests/rollout/test_transport.py",  # 41
    "tests/ppo/test_shared_prompts_run.py",  # 41
    "tests/rollout/test_engine.py",  # 39
    "tests/rollout/test_engine_tensor_parallel.py",  # 38
    "tests/distributed/test_cluster_devices.py",  # 36
    "tests/cli/test_train_rm.py",  # 35
    "tests/cli/test_train_sft.py",  # 34
    "tests/models/test_zoo.py",  # 33
    "tests/cli/test_launchers.py",  # 28
    "tests/ppo/test_dp_gradients.py",  # 25
)


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    # stable: the tests of a file keep their order, and the files not listed theirs, after the listed ones
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a real multi-process CLI job (tens of seconds)")
    config.addinivalue_line("markers", "gpu: the GPU check suite (tests/gpu/; skipped without CUDA)")


def pytest_sessionfinish(session, exitstatus):
    from tests import ray_cluster

    ray_cluster.shutdown()
