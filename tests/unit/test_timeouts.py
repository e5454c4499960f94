"""The suite's per-test bound holds for a test stuck in native code, where pytest-timeout's signal method never fires.

A C call that never checks for signals (here OpenSSL's PBKDF2 with 10^9 rounds, minutes of work) keeps a SIGALRM
handler from running until it returns: with the signal method such a test ran on until CI's own limit (the CPU
FlexAttention test stuck 17 minutes in an inductor kernel under AVX2 caps). The repository's pytest.ini uses the
thread method, which stops the session with every thread's stack.
"""

from __future__ import annotations

import subprocess
import sys
import time

from tests.conftest import REPO

STUCK = "import hashlib\n\ndef test_stuck():\n    hashlib.pbkdf2_hmac('sha256', b'x', b'y', 10**9)\n"


def test_a_test_stuck_in_native_code_fails_at_its_bound(tmp_path):
    (tmp_path / "test_stuck.py").write_text(STUCK)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", str(REPO / "pytest.ini"), "--rootdir", str(tmp_path)]
        + ["-p", "no:cacheprovider", "--timeout", "3", str(tmp_path / "test_stuck.py")],
        capture_output=True,
        text=True,
        timeout=120,  # the signal method would still be inside PBKDF2 here
    )
    took = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Timeout" in out and "pbkdf2_hmac" in out, out[-2000:]
    print(f"stopped after {took:.1f} s")
