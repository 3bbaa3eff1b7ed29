"""Load test of ``relayrl serve``: many concurrent clients vs the same requests one at a time.

Starts ``relayrl serve`` on the tiny default model (4.3M parameters, built
locally) in a subprocess on loopback, then, with the official ``openai``
client (``AsyncOpenAI``, no retries):

1. **concurrent**: ``--clients`` clients (64) each send ``/v1/completions``
   requests back to back for ``--duration`` seconds (60);
2. **sequential**: one client sends the same requests one at a time for
   ``--sequential-duration`` seconds (default: ``--duration``).

Each request is a 2-digit sum with ``max_tokens=--max-tokens`` (32),
``temperature=1`` and ``ignore_eos`` (fixed-length work). A request is
*answered* (200), *refused* (a 4xx or 503: the server said no) or *lost*
(anything else: a dropped connection, a timeout, a 5xx). Prints requests/s,
p50/p99 latency, generated tokens/s and the three counts for each phase, and
the throughput ratio (the issue's target: >= 4x). The machine is shared, so
compare the ratio rather than absolute figures.

Run: ``.venv/bin/python benchmarks/serve_load.py [--duration 60] [--clients 64]``
(``--duration 10`` while developing).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    latencies: list[float] = field(default_factory=list)
    tokens: int = 0
    answered: int = 0
    refused: int = 0
    lost: int = 0
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def line(self, name: str) -> str:
        lat = sorted(self.latencies) or [float("nan")]
        p50 = statistics.median(lat)
        p99 = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
        return (f"{name:>10s}: {self.answered / self.seconds:7.2f} req/s  p50 {1000 * p50:7.1f} ms  "
                f"p99 {1000 * p99:7.1f} ms  {self.tokens / self.seconds:8.1f} tokens/s  "
                f"answered {self.answered}  refused {self.refused}  lost {self.lost}")


def start_server(model: Path, threads: int, max_batch: int) -> tuple[subprocess.Popen, str]:
    log = open(os.devnull, "w")
    proc = subprocess.Popen([sys.executable, "-m", "relayrl.cli.main", "serve", str(model), "--port", "0",
                             "--name", "tiny", "--threads", str(threads), "--max-batch", str(max_batch)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=log, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    line = ""
    deadline = time.monotonic() + 180
    while "http://" not in line:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"relayrl serve did not start (exit {proc.returncode})")
    return proc, "http://" + line.split("http://", 1)[1].split()[0]


async def one(client, openai, tally: Tally, rng: random.Random, max_tokens: int) -> None:
    prompt = f"{rng.randint(10, 99)}+{rng.randint(10, 99)}="
    t0 = time.perf_counter()
    try:
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=1.0,
                                            extra_body={"ignore_eos": True})
    except openai.APIStatusError as e:
        if 400 <= e.status_code < 500 or e.status_code == 503:
            tally.refused += 1
        else:
            tally.lost += 1
            tally.errors.append(f"{e.status_code}: {e.message[:200]}")
        return
    except Exception as e:  # noqa: BLE001 - a connection error or a timeout: the request was lost
        tally.lost += 1
        tally.errors.append(repr(e)[:200])
        return
    tally.latencies.append(time.perf_counter() - t0)
    tally.tokens += r.usage.completion_tokens
    tally.answered += 1


async def phase(url: str, clients: int, seconds: float, max_tokens: int, seed: int) -> Tally:
    import openai

    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=300.0)
    tally = Tally()
    end = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.perf_counter() < end:
            await one(client, openai, tally, rng, max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    tally.seconds = time.perf_counter() - t0  # includes the requests in flight at the deadline
    await client.close()
    return tally


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of the concurrent phase")
    ap.add_argument("--sequential-duration", type=float, default=None, help="seconds of the one-at-a-time phase")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=64, help="the server's --max-batch")
    ap.add_argument("--server-threads", type=int, default=1, help="torch threads of the server (the clients "
                    "share the machine)")
    ap.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    args = ap.parse_args()
    model = args.model
    if model is None:
        from relayrl.models.tiny import TinyModelConfig, build_tiny

        model = build_tiny(TinyModelConfig(), verbose=False)
    proc, url = start_server(model, args.server_threads, args.max_batch)
    try:
        asyncio.run(phase(url, 4, 2.0, args.max_tokens, seed=99))  # warm-up
        conc = asyncio.run(phase(url, args.clients, args.duration, args.max_tokens, seed=0))
        seq = asyncio.run(phase(url, 1, args.sequential_duration or args.duration, args.max_tokens, seed=0))
    finally:
        proc.terminate()
        proc.wait(30)
    print(f"relayrl serve load test: tiny model, {args.clients} clients x {args.duration:g} s, max_tokens "
          f"{args.max_tokens}, server threads {args.server_threads}, max_batch {args.max_batch}")
    print(conc.line("concurrent"))
    print(seq.line("sequential"))
    ratio = (conc.tokens / conc.seconds) / max(seq.tokens / seq.seconds, 1e-9)
    print(f"throughput ratio concurrent/sequential: {ratio:.1f}x (target >= 4x); lost requests: "
          f"{conc.lost + seq.lost}")
    for e in (conc.errors + seq.errors)[:5]:
        print(f"  lost: {e}")


if __name__ == "__main__":
    main()
