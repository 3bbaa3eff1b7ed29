"""Two Ray hosts on this machine: network namespaces joined by a virtual ethernet pair.

Each namespace has its own address (10.77.S.1 and 10.77.S.2, S from the pid) and nothing else on its
network. A Ray head runs in the first, a Ray worker node in the second (``ray start --block``, each in a
process group of its own, each with its own temporary directory), and drivers run in the first namespace
(``TwoHosts.run``). Teardown kills both process groups, checks that no process of either node is left,
and deletes the namespaces. A real cluster is the same two ``ray start`` commands on two machines.

Needs root (``ip netns``); the fixture skips otherwise.
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = str(Path(sys.executable).with_name("ray"))
PORT = 6379
# The head marks a silent node dead after about 2 s instead of Ray's default ~15-25 s (initial delay 5 s, then
# 5 missed checks 3 s apart): a lost host is the event the tests wait for.
HEALTH_CHECKS = {"RAY_health_check_initial_delay_ms": "1000", "RAY_health_check_period_ms": "500",
                 "RAY_health_check_timeout_ms": "500", "RAY_health_check_failure_threshold": "3"}


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class TwoHosts:
    """The cluster's two hosts: ``head`` and ``worker`` are their IP addresses."""

    head: str
    worker: str
    ns: tuple[str, str]
    root: Path
    env: dict[str, str]
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"{self.head}:{PORT}"

    def exec(self, host: str, argv: list[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace."""
        return ["ip", "netns", "exec", self.ns[0 if host == "head" else 1], *argv]

    def run(self, argv: list[str], timeout: float = 600, **kw) -> subprocess.CompletedProcess:
        """Run ``argv`` on the head host (a driver) with the cluster's environment."""
        return subprocess.run(self.exec("head", argv), env={**os.environ, **self.env, **kw.pop("env", {})},
                              capture_output=True, text=True, timeout=timeout, **kw)

    def start_node(self, host: str) -> None:
        """``ray start --block`` on ``host`` (the head first), in a process group of its own."""
        ip = self.head if host == "head" else self.worker
        tmp = self.root / host
        tmp.mkdir(exist_ok=True)
        role = ["--head", f"--port={PORT}", "--include-dashboard=false"] if host == "head" else \
            [f"--address={self.address}"]
        log = open(tmp / "ray-start.log", "a")
        self.procs[host] = subprocess.Popen(
            self.exec(host, [RAY, "start", "--block", *role, f"--node-ip-address={ip}", "--num-cpus=4",
                             "--disable-usage-stats", f"--temp-dir={tmp}"]),
            env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_nodes(self, n: int, timeout: float = 120.0) -> None:
        """Until the cluster has ``n`` live nodes."""
        probe = ("import ray, sys; ray.init(address=sys.argv[1], logging_level='ERROR'); "
                 "print(sum(1 for x in ray.nodes() if x['Alive']))")
        deadline = time.monotonic() + timeout
        while True:
            out = self.run([sys.executable, "-c", probe, self.address], timeout=60)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two-host Ray cluster has no {n} live nodes after {timeout:.0f} s:\n"
                                   f"{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
            time.sleep(1.0)

    def kill_node(self, host: str) -> None:
        """Kill every process of ``host``'s Ray node at once (a machine that disappears)."""
        proc = self.procs.pop(host, None)
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        _wait_group_gone(proc.pid)

    def close(self) -> None:
        try:
            self._stop_nodes()
        finally:
            for ns in self.ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(self.root, ignore_errors=True)

    def _stop_nodes(self) -> None:
        for host in ("worker", "head"):
            proc = self.procs.pop(host, None)
            if proc is None:
                continue
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=3)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)  # reap it: a zombie still counts as a process of the group
            _wait_group_gone(proc.pid)


def _group_pids(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getpgid(int(entry)) == pgid:
                    pids.append(int(entry))
            except ProcessLookupError:
                pass
    return pids


def _wait_group_gone(pgid: int, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while _group_pids(pgid):
        if time.monotonic() > deadline:
            for pid in _group_pids(pgid):
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
            if _group_pids(pgid):
                raise RuntimeError(f"processes of Ray node group {pgid} survive teardown: {_group_pids(pgid)}")
            return
        time.sleep(0.2)


def usable() -> str | None:
    """Why the fixture cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root for ip netns"
    if shutil.which("ip") is None:
        return "needs the ip command (iproute2)"
    if not Path(RAY).is_file():
        return f"needs Ray's command line ({RAY})"
    return None


def start_two_hosts(env: dict[str, str] | None = None) -> TwoHosts:
    """Create the namespaces and the link, start the head and the worker node (their processes, and the
    drivers ``run`` starts, get ``env`` too); the caller closes."""
    tag = f"rr{os.getpid() % 100000}"
    subnet = 1 + os.getpid() % 250
    ns = (f"{tag}h", f"{tag}w")
    head, worker = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
    root = Path(tempfile.mkdtemp(prefix=f"{tag}-", dir="/tmp"))  # short: Ray's socket paths live under it
    token = root / "auth_token"
    token.write_text(secrets.token_hex(32))
    hosts = TwoHosts(head, worker, ns, root, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                                              "RAY_USAGE_STATS_ENABLED": "0", **HEALTH_CHECKS, **(env or {})})
    try:
        for n in ns:
            _ip("netns", "add", n)
        _ip("link", "add", f"{tag}a", "type", "veth", "peer", "name", f"{tag}b")
        for n, dev, ip in ((ns[0], f"{tag}a", head), (ns[1], f"{tag}b", worker)):
            _ip("link", "set", dev, "netns", n)
            _ip("-n", n, "addr", "add", f"{ip}/24", "dev", dev)
            _ip("-n", n, "link", "set", dev, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        hosts.start_node("head")
        hosts.wait_nodes(1)
        hosts.start_node("worker")
        hosts.wait_nodes(2)
    except BaseException:
        hosts.close()
        raise
    return hosts
