"""Two Ray nodes on this box, each with an IP address of its own, as on a real two-machine cluster.

The head node runs in this network namespace on one end of a veth pair; the second node runs in a network namespace of
its own on the other end, where the only other interface is its loopback. So every byte between the nodes (Ray's
object transfers, gloo's collectives of a ZeRO-3 group, the weight sync to an engine) crosses the veth link, and a
process that assumed one machine (a 127.0.0.1 address, a hostname that resolves to the box) fails as it would
between two machines. Needs root (CI runs as root) and the `ip` tool.

The namespaces share the box's process table and files: /tmp is "storage both nodes see". Each node is started with
`ray start`; `ray stop` would stop every Ray process of the box (another test worker's cluster too), so teardown
kills the processes of this cluster only, found by its temp dir in their command line.

Each node's Ray workers and vLLM processes fork from zygotes of its own, started in its namespace
(tests/engine_zygote, as the session cluster's): 7 engine actors, 7 engine cores and 6 trainer ranks started fresh
took 330 of the test's 490 CPU-s. The runs of tests/cli/helpers.BackgroundRun (killed engines, a killed save) keep
the start users get.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tests.engine_zygote import for_cluster

START_TIMEOUT_S = 120


def why_not() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` tool (iproute2) is not installed"
    return None


@dataclass(frozen=True)
class TwoNodes:
    head_ip: str
    worker_ip: str
    address: str  # the head's GCS, host:port (RAY_ADDRESS)
    dashboard: str  # the head's dashboard, http://host:port (`ray job submit --address`)
    netns: str  # the second node's network namespace

    def env(self) -> dict[str, str]:
        """What a driver on the head needs to join the cluster."""
        return {"RAY_ADDRESS": self.address}


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    _run(cmd, timeout=30)


def _run(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None) -> str:
    """Run `cmd`; if it fails, raise with its output (a bare exit status says nothing)."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _kill_tree_of(marker: str) -> None:
    """SIGKILL every process whose command line names `marker` (this cluster's temp dir), and their descendants: the
    agents a raylet starts rename themselves (`ray::DashboardAgent`), and outlive a killed raylet."""
    victims = set()
    for proc in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(marker in part for part in proc.info["cmdline"] or ()):
                victims.update([proc, *proc.children(recursive=True)])
    for proc in victims:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    psutil.wait_procs(list(victims), timeout=30)


@contextlib.contextmanager
def two_nodes(env: dict[str, str], *, head_cpus: int, worker_cpus: int) -> Iterator[TwoNodes]:
    """Start the head (`head_cpus` Ray CPUs) and the second node (`worker_cpus`), each with `env` plus the gloo
    interface of its end of the link, wait until both are alive, and remove everything at the end."""
    tag = f"{os.getpid() % 100000}"
    netns, head_dev, worker_dev = f"opn{tag}", f"opa{tag}", f"opb{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() // 50 % 250}"
    head_ip, worker_ip = f"{subnet}.1", f"{subnet}.2"
    temp = Path(tempfile.mkdtemp(prefix="rn", dir="/tmp"))  # short: Ray's socket paths must stay under 108 bytes
    ray = str(Path(sys.executable).parent / "ray")
    env = {"RAY_AUTH_MODE": "disabled", **env}  # as tests/ray_cluster.py's cluster, which the CLIs also join
    zygotes = []
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", head_dev, "type", "veth", "peer", "name", worker_dev)
        _ip("link", "set", worker_dev, "netns", netns)
        _ip("addr", "add", f"{head_ip}/24", "dev", head_dev)
        _ip("link", "set", head_dev, "up")
        _ip("addr", "add", f"{worker_ip}/24", "dev", worker_dev, netns=netns)
        _ip("link", "set", worker_dev, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        port = _free_port(head_ip)
        dashboard_port = _free_port(head_ip)
        head = ["--head", "--port", str(port), "--temp-dir", str(temp), "--dashboard-host", head_ip]
        # the head's agent, which starts a job's driver, listens on all interfaces, by default on port 52365: the
        # agent of any other Ray cluster on the box (a test worker's) holds that one, and the head then takes no job
        head += ["--dashboard-port", str(dashboard_port), "--dashboard-agent-listen-port", str(_free_port(""))]
        for where, ip, cpus, dev, role in (
            ([], head_ip, head_cpus, head_dev, head),
            (["ip", "netns", "exec", netns], worker_ip, worker_cpus, worker_dev, ["--address", f"{head_ip}:{port}"]),
        ):
            node = ["--node-ip-address", ip, "--num-cpus", str(cpus), "--num-gpus", "0", "--disable-usage-stats"]
            # gloo binds to the address of this hostname unless told the interface: that is the box's, not the node's
            node_env = {**env, "GLOO_SOCKET_IFNAME": dev}
            node_zygotes = for_cluster(node_env, prefix=tuple(where))
            if node_zygotes is not None:
                zygotes.append(node_zygotes)
                node_env = node_zygotes.env
            _run([*where, ray, "start", *role, *node], timeout=START_TIMEOUT_S, env=node_env)
        nodes = TwoNodes(head_ip, worker_ip, f"{head_ip}:{port}", f"http://{head_ip}:{dashboard_port}", netns)
        _wait_for_nodes(nodes, env)
        yield nodes
    finally:
        _kill_tree_of(str(temp))  # (a zygote's children end with the processes that asked for them)
        for node_zygotes in zygotes:
            node_zygotes.close()
        with contextlib.suppress(RuntimeError):
            _ip("link", "del", head_dev)
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", netns)
        shutil.rmtree(temp, ignore_errors=True)


def _wait_for_nodes(nodes: TwoNodes, env: dict[str, str]) -> None:
    script = (
        "import ray, time\n"
        "ray.init(logging_level='ERROR')\n"
        f"deadline = time.monotonic() + {START_TIMEOUT_S}\n"
        "while sum(n['Alive'] for n in ray.nodes()) < 2:\n"
        "    assert time.monotonic() < deadline, ray.nodes()\n"
        "    time.sleep(0.5)\n"
        "print(sorted(n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']))\n"
    )
    out = _run([sys.executable, "-c", script], timeout=START_TIMEOUT_S + 30, env={**env, **nodes.env()})
    assert out.strip() == str(sorted([nodes.head_ip, nodes.worker_ip])), out
    _wait_for_jobs(nodes)


def _wait_for_jobs(nodes: TwoNodes) -> None:
    """Until the head takes jobs: its dashboard answers before the agent that starts a job's driver is up ("No
    available agent to submit job"), which on a busy box took longer than the nodes; a job that runs `true` goes
    through once it is."""
    from ray.job_submission import JobSubmissionClient

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            client = JobSubmissionClient(nodes.dashboard)
            job = client.submit_job(entrypoint="true")
            break
        except (RuntimeError, OSError) as exc:  # a 500 from the dashboard, or no answer yet
            if time.monotonic() > deadline:
                raise RuntimeError(f"the head at {nodes.dashboard} took no job in {START_TIMEOUT_S} s: {exc}") from exc
            time.sleep(1)
    while not client.get_job_status(job).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)
        time.sleep(0.5)
