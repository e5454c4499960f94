"""`python -m openppo.cli.serve_rm` for real: subprocess servers on 127.0.0.1, real HTTP, a tiny reward model."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import requests
import torch

from openppo.cli.serve_rm import ServeRMConfig, host_warning, validate
from openppo.errors import UserError
from openppo.rewards import FunctionReward, RemoteReward, RewardError
from tests.cli.helpers import cli_env
from tests.rewards.conftest import EXAMPLES, REPO, start_servers

TARGET = str(EXAMPLES / "target_token.py")


@pytest.fixture(scope="module")
def func_servers(request):
    """Two servers of the target-token function; the first has small request limits."""
    return start_servers(
        request,
        ["--reward_func", TARGET, "--max_request_samples", "16", "--max_request_bytes", "4096"],
        ["--reward_func", TARGET],
    )


@pytest.fixture(scope="module")
def rm_server(request, rm_dir):
    (server,) = start_servers(
        request,
        [
            "--reward_pretrain",
            str(rm_dir),
            "--normalize_reward",
            "--max_len",
            "12",
            "--batch_size",
            "3",
            "--device",
            "cpu",
        ],
    )
    return server


def target_batch(n):
    prompts = [f"Say {'cat' if i % 2 else 'dog'} {i}:" for i in range(n)]
    responses = [" cat " * (i % 3) + " dog" * (i % 4) + " bird" for i in range(n)]
    return [p + r for p, r in zip(prompts, responses)], prompts, ["cat" if i % 2 else "dog" for i in range(n)]


def samples_scored(server) -> int:
    return requests.get(server.base + "/health", timeout=5).json()["samples"]


def test_function_servers_split_and_merge_in_order(func_servers):
    a, b = func_servers
    print(f"function server startup: {a.startup_s:.2f} s, {b.startup_s:.2f} s")
    queries, prompts, labels = target_batch(10)
    before = samples_scored(a), samples_scored(b)
    remote = RemoteReward([a.url, b.url], batch_size=3, timeout_s=10)
    got = remote.score(queries, prompts, labels)
    remote.close()
    want = FunctionReward(TARGET).score(queries, prompts, labels)
    assert got.rewards == want.rewards and got.scores == want.scores
    assert len(set(got.rewards)) > 3  # the batch really has different values, so the order is checked
    # Chunks of 3: [0-2] [6-8] to the first server, [3-5] [9] to the second.
    assert (samples_scored(a) - before[0], samples_scored(b) - before[1]) == (6, 4)


@pytest.mark.parametrize(
    "body, match",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (b'{"prompts": ["a"]}', "missing 'query'"),
        (b'{"query": "abc"}', "list of strings"),
        (b'{"query": [1]}', "list of strings"),
        (b'{"query": ["a"], "prompts": ["a", "b"], "labels": ["x"]}', "lengths disagree"),
        (b'{"query": ["a"], "prompts": [3]}', "'prompts' must be a list of strings"),
        (b'{"query": ["a"], "labels": "x"}', "'labels' must be a list"),
    ],
)
def test_malformed_request_is_400_and_server_keeps_serving(func_servers, body, match):
    server = func_servers[1]
    resp = requests.post(server.url, data=body, headers={"Content-Type": "application/json"}, timeout=10)
    assert resp.status_code == 400 and match in resp.json()["error"]
    ok = requests.post(server.url, json={"query": ["p cat"], "prompts": ["p"], "labels": ["cat"]}, timeout=10)
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0]


def test_oversized_requests_are_413(func_servers):
    server = func_servers[0]
    queries, prompts, labels = target_batch(17)
    resp = requests.post(server.url, json={"query": queries, "prompts": prompts, "labels": labels}, timeout=10)
    assert resp.status_code == 413 and "--max_request_samples" in resp.json()["error"]
    big = {"query": ["cat " * 2000], "prompts": [""], "labels": ["cat"]}
    resp = requests.post(server.url, json=big, timeout=10)
    assert resp.status_code == 413 and "--max_request_bytes" in resp.json()["error"]
    # Without Content-Length (chunked upload) the limit holds while reading.
    chunks = (b'{"query": ["' if i == 0 else b"cat " for i in range(2000))
    resp = requests.post(server.url, data=chunks, timeout=10)
    assert resp.status_code == 413
    ok = requests.post(server.url, json={"query": ["p cat"], "prompts": ["p"], "labels": ["cat"]}, timeout=10)
    assert ok.status_code == 200 and ok.json()["rewards"] == [1.0]


def test_reward_func_error_is_500_with_the_sample(func_servers):
    server = func_servers[1]
    resp = requests.post(server.url, json={"query": ["q"], "prompts": ["q"]}, timeout=10)
    assert resp.status_code == 500 and "needs the target word" in resp.json()["error"]
    remote = RemoteReward([server.url], max_retries=1, backoff_s=0.01)
    with pytest.raises(RewardError, match=r"HTTP 500: .*first failing sample #0: query='q'"):
        remote.score(["q"], ["q"], [None])
    health = requests.get(server.base + "/health", timeout=5).json()
    assert health["status"] == "ok" and health["failed"] >= 3 and "target_token.py" in health["source"]


def direct_scores(rm_dir, queries, max_len):
    from openppo.models.hf import load_tokenizer
    from openppo.models.scalar import ScalarModel

    model = ScalarModel.from_pretrained(str(rm_dir), dtype=torch.float32, flag="--reward_pretrain").eval()
    tokenizer = load_tokenizer(str(rm_dir))
    assert model.normalization() == (0.25, 2.0)
    out = []
    with torch.no_grad():
        for query in queries:  # one unpadded row at a time
            ids = torch.tensor([tokenizer(query, add_special_tokens=False)["input_ids"][-max_len:]])
            out.append(float(model.score_last(ids, torch.ones_like(ids), normalize=True)[0]))
    return out


def test_reward_model_server_matches_direct_scores(rm_server, rm_dir):
    print(f"reward-model server startup: {rm_server.startup_s:.2f} s")
    queries = [
        "Hello<|im_end|>",
        "a",
        "What is 2 + 2? 4<|im_end|>",
        "a long query " * 10 + "that is cut to its last twelve tokens<|im_end|>",
        "b c",
        "x y z w",
    ]
    resp = requests.post(rm_server.url, json={"query": queries, "prompts": [""] * 6, "labels": [None] * 6}, timeout=30)
    assert resp.status_code == 200, resp.text
    got = resp.json()
    want = direct_scores(rm_dir, queries, max_len=12)
    assert got["scores"] == got["rewards"] and got["extra_logs"] == {}
    assert max(abs(g - w) for g, w in zip(got["rewards"], want)) < 1e-5, (got["rewards"], want)
    remote = RemoteReward([rm_server.url], batch_size=4)
    start = time.monotonic()
    again = remote.score(queries, [""] * 6, [None] * 6).rewards
    print(f"reward-model request (6 queries): {time.monotonic() - start:.3f} s")
    # batched 4 + 2 instead of 6: GEMM blocking depends on the batch shape, so allow float rounding (3e-8 seen
    # on an AVX2 CPU), not equality
    assert again == pytest.approx(got["rewards"], rel=0, abs=1e-6)
    resp = requests.post(rm_server.url, json={"query": ["ok", ""]}, timeout=30)
    assert resp.status_code == 500 and "query #1 is empty" in resp.json()["error"]


def run_serve_rm(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "openppo.cli.serve_rm", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=cli_env(),
    )


@pytest.mark.parametrize(
    "args, match",
    [
        ([], "pass exactly one of --reward_pretrain"),
        (["--reward_pretrain", "no/such/folder"], "--reward_pretrain: model folder no/such/folder not found"),
        (["--reward_func", TARGET, "--normalize_reward"], "--normalize_reward only apply to --reward_pretrain"),
        (["--reward_func", TARGET, "--port", "70000"], "--port must be in 0..65535"),
        (["--reward_func", TARGET, "--batch_size", "x"], "argument --batch_size: invalid int value"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, match):
    proc = run_serve_rm(*args)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], proc.stderr


def test_port_in_use_is_a_user_error(func_servers):
    port = func_servers[1].url.split(":")[2].split("/")[0]
    proc = run_serve_rm("--reward_func", TARGET, "--port", port)
    assert proc.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in proc.stderr, proc.stderr


def test_validate_and_host_warning():
    validate(ServeRMConfig(reward_func=TARGET))
    with pytest.raises(UserError, match="exactly one"):
        validate(ServeRMConfig(reward_func=TARGET, reward_pretrain="x"))
    with pytest.raises(UserError, match="must be a .py file"):
        validate(ServeRMConfig(reward_func="reward.txt"))
    for host in ("127.0.0.1", "localhost", "::1", "127.0.0.2"):
        assert host_warning(host) is None
    assert host_warning("0.0.0.0").startswith("warning: --host 0.0.0.0 is not a loopback address")


def test_param_dtype_and_attn_implementation_reach_the_model(rm_dir):
    """serve_rm's --param_dtype bf16 (OpenRLHF's name for --bf16), --attn_implementation and --packing_samples
    build the model so (packed scores equal padded ones); --bf16 with --param_dtype fp32 disagree and stop."""
    import torch

    from openppo.cli.serve_rm import build_source

    source = build_source(
        ServeRMConfig(reward_pretrain=str(rm_dir), device="cpu", param_dtype="bf16", attn_implementation="eager")
    )
    assert next(source.model.parameters()).dtype == torch.bfloat16
    assert source.model.hf_model.config._attn_implementation == "eager"
    queries = ["Q: 2+2? A: 4", "Q: what is three plus three? A: six, I think"]  # ragged: padding to skip
    padded = build_source(ServeRMConfig(reward_pretrain=str(rm_dir), device="cpu"))
    packed = build_source(ServeRMConfig(reward_pretrain=str(rm_dir), device="cpu", packing_samples=True))
    assert packed.model.layout.packed and not padded.model.layout.packed
    want, got = (s.score(queries, queries, [None, None]).rewards for s in (padded, packed))
    assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(UserError, match="--bf16 and --param_dtype fp32 disagree"):
        validate(ServeRMConfig(reward_pretrain=str(rm_dir), bf16=True, param_dtype="fp32"))
