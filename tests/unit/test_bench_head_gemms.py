"""bench/head_gemms.py, the GPU sitting's LM-head matmul part, runs on a CPU at toy sizes and records every GEMM of
every shape it is asked for (benches rot unseen between GPU sittings: a broken import once cost a sitting's table)."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.head_gemms import GEMMS, padded
from tests.cli.helpers import REPO


def test_the_vocabulary_pads_up_to_the_multiple():
    assert padded(151936, 256) == 152064 and padded(151936, 128) == 151936 and padded(1, 64) == 64


def test_the_bench_times_each_gemm_of_each_shape_on_a_cpu():
    cmd = [sys.executable, "bench/head_gemms.py", "--hidden", "32", "--vocab", "1000", "--tokens", "16", "48"]
    out = subprocess.run(cmd + ["--square", "64", "--repeats", "2"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    record = json.loads([line for line in out.stdout.splitlines() if line.startswith("{")][-1])
    assert record["bench"] == "head_gemms" and record["device"] and record["square_tflops"] > 0
    shapes = {(r["blas"], r["vocab"], r["tokens"], r["gemm"]) for r in record["rows"]}
    assert shapes == {("default", v, t, g) for v in (1000, 1024) for t in (16, 48) for g in GEMMS}
    assert all(r["ms"] > 0 and r["tflops"] > 0 and r["kernels"] for r in record["rows"]), record["rows"]
