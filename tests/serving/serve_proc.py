"""Helpers of the serving tests: start ``relayrl serve`` as a subprocess on a free loopback port."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class Server:
    """A running ``relayrl serve`` process and its base URL."""

    def __init__(self, proc: subprocess.Popen, url: str, log: Path) -> None:
        self.proc, self.url, self.log = proc, url, log

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def start_server(model_dir: Path, log: Path, *args: str, env: dict | None = None, timeout: float = 120) -> Server:
    """Start ``relayrl serve MODEL_DIR --port 0`` and wait for the line naming its port."""
    out = open(log, "w")
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli.main", "serve", str(model_dir), "--port", "0",
                             "--threads", "1", *args], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text()
        if "relayrl serve:" in text and "http://" in text:
            url = text.split("http://", 1)[1].split()[0]
            return Server(proc, f"http://{url}", log)
        if proc.poll() is not None:
            raise RuntimeError(f"relayrl serve exited ({proc.returncode}):\n{text[-3000:]}")
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"relayrl serve did not start in {timeout} s:\n{log.read_text()[-3000:]}")
