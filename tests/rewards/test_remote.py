"""RemoteReward against in-process fake servers: retries, timeouts, 4xx, bad answers, time to give up."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openppo.rewards import RemoteReward, RewardError


class Scripted:
    """An HTTP server on 127.0.0.1 answering POSTs from a script of (status, body) pairs (the last one repeats)."""

    def __init__(self, script):
        self.script, self.requests = list(script), []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(payload)
                status, body = owner.script[min(len(owner.requests), len(owner.script)) - 1]
                if callable(body):
                    body = body(payload)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/get_reward"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def lengths(payload):
    return {"rewards": [float(len(q)) for q in payload["query"]]}


@pytest.fixture
def scripted(request):
    def make(*script):
        server = Scripted(script)
        request.addfinalizer(server.close)
        return server

    return make


def batch(n):
    return ["x" * i for i in range(n)], [""] * n, [None] * n


def dead_url() -> str:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/get_reward"


def test_retries_a_5xx_then_succeeds(scripted):
    server = scripted((503, {"error": "warming up"}), (200, lengths))
    source = RemoteReward([server.url], max_retries=2, backoff_s=0.01)
    assert source.score(*batch(3)).rewards == [0.0, 1.0, 2.0]
    assert len(server.requests) == 2
    assert server.requests[0] == {"query": ["", "x", "xx"], "prompts": ["", "", ""], "labels": [None] * 3}


def test_4xx_is_not_retried(scripted):
    server = scripted((400, {"error": "'query' must be a list of strings"}))
    source = RemoteReward([server.url], max_retries=3, backoff_s=0.5)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"rejected 2 samples with HTTP 400 \(not retried\): 'query' must"):
        source.score(*batch(2))
    assert len(server.requests) == 1 and time.monotonic() - start < 0.5


def test_5xx_until_the_retries_are_spent(scripted):
    server = scripted((500, {"error": "RewardError: boom"}))
    with pytest.raises(RewardError, match=r"failed for 4 samples after 3 attempts .*HTTP 500: RewardError: boom"):
        RemoteReward([server.url], max_retries=2, backoff_s=0.01).score(*batch(4))
    assert len(server.requests) == 3


@pytest.mark.parametrize(
    "body, match",
    [
        ({"rewards": [1.0]}, "1 values for 2 queries"),
        ({"reward": [1.0, 2.0]}, "no 'rewards'"),
        ({"rewards": [1.0, None]}, r"rewards\[1\] is NoneType"),
    ],
)
def test_bad_answers_name_the_url(scripted, body, match):
    server = scripted((200, body))
    with pytest.raises(RewardError, match=match) as info:
        RemoteReward([server.url], max_retries=2).score(*batch(2))
    assert server.url in str(info.value) and len(server.requests) == 1


def test_dead_url_fails_within_the_budget():
    url = dead_url()
    source = RemoteReward([url], timeout_s=1.0, max_retries=2, backoff_s=0.05)
    start = time.monotonic()
    with pytest.raises(RewardError) as info:
        source.score(*batch(8))
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert url in text and "8 samples" in text and "3 attempts" in text and "ConnectionError" in text
    # Refused connections fail at once: the time is the backoff (0.05 + 0.1 s) plus overhead.
    assert 0.15 <= elapsed < 2.0, elapsed
    print(f"dead URL: gave up after {elapsed:.2f} s")


def test_silent_server_times_out_within_the_budget():
    # Listens but never accepts or answers: the hang users of remote reward models report.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/get_reward"
        source = RemoteReward([url], timeout_s=0.5, max_retries=1, backoff_s=0.1)
        start = time.monotonic()
        with pytest.raises(RewardError, match="after 2 attempts .*timeout_s=0.5.*ReadTimeout"):
            source.score(*batch(2))
        elapsed = time.monotonic() - start
    assert 1.0 <= elapsed <= source.worst_case_s + 1.0, elapsed
    print(f"silent server: gave up after {elapsed:.2f} s (worst case {source.worst_case_s:.2f} s)")


def test_default_reward_for_an_unavailable_server(scripted, caplog):
    good = scripted((200, lengths))
    source = RemoteReward([good.url, dead_url()], max_retries=1, backoff_s=0.01, batch_size=2, default_reward=-5.0)
    result = source.score(*batch(5))
    # Chunks [0,1] and [4] go to the good server, [2,3] to the dead one.
    assert result.rewards == [0.0, 1.0, -5.0, -5.0, 4.0]
    assert source.num_defaulted == 2
    assert "default_reward=-5.0 for these 2 samples" in caplog.text
    source.close()


def test_extra_logs_missing_from_a_chunk_are_dropped(scripted):
    with_logs = scripted((200, lambda p: {"rewards": [1.0] * len(p["query"]), "extra_logs": {"acc": 1}}))
    without = scripted((200, lengths))
    result = RemoteReward([with_logs.url, without.url], batch_size=1).score(*batch(2))
    assert result.rewards == [1.0, 1.0] and result.extra_logs == {}


def test_labels_must_be_json():
    with pytest.raises(RewardError, match="labels cannot be sent as JSON"):
        RemoteReward([dead_url()]).score(["a"], [""], [object()])
