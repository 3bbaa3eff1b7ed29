"""A fake OpenAI-compatible completions server in the test process (``rollout.engine=openai``) that fails the
requests of some prompts: random token ids and log-probs for the others (the trainer recomputes its own)."""

from __future__ import annotations

import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Sequence


def every_third(prompt: Sequence[int]) -> bool:
    """The prompts that fail: those whose token ids sum to a multiple of 3 (about a third)."""
    return sum(prompt) % 3 == 0


STATUS_503 = {  # how: (message, code), as relayrl serve words them
    "busy": ("the server is busy: 1024 requests are waiting; retry later", 503),
    "stopped": ("the generation loop stopped: RuntimeError('CUDA error: an illegal memory access was "
                "encountered'); restart relayrl serve", "generation_stopped")}


class FakeServer:
    """``/v1/models`` and ``/v1/completions`` on a free loopback port. A request for a prompt that ``fails``
    answers 500 (``how="error"``), no reply for ``hang_s`` seconds (``how="hang"``), 503 as a busy server
    (``how="busy"``, code 503) or as ``relayrl serve`` whose generation loop stopped (``how="stopped"``, code
    ``generation_stopped``); with ``times`` a prompt fails only its first ``times`` requests. ``sampled_only``:
    only requests with temperature > 0 fail (greedy evaluations get answers). ``choices``: the reply's choices
    for a request body (None: random ids and log-probs). Every request body is kept in ``bodies``."""

    def __init__(self, fails: Callable[[Sequence[int]], bool] = every_third, how: str = "error",
                 hang_s: float = 3.0, sampled_only: bool = False,
                 choices: Callable[[dict], list[dict]] | None = None, times: int | None = None) -> None:
        self.fails, self.how, self.hang_s, self.sampled_only = fails, how, hang_s, sampled_only
        self.choices, self.times = choices, times
        self.failed: list[list[int]] = []  # the prompts of the requests that failed
        self.bodies: list[dict] = []  # every completions request, as sent
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # (quiet)
                pass

            def _reply(self, code: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply(200, {"data": [{"id": "fake"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.bodies.append(body)
                prompt = list(body["prompt"])
                again = server.times is None or server.failed.count(prompt) < server.times
                if server.fails(prompt) and (body["temperature"] > 0 or not server.sampled_only) and again:
                    server.failed.append(prompt)
                    if server.how in STATUS_503:
                        message, code = STATUS_503[server.how]
                        return self._reply(503, {"error": {"message": message, "type": "server_error",
                                                           "param": None, "code": code}})
                    if server.how == "hang":
                        time.sleep(server.hang_s)
                        return self._reply(200, {"choices": []})
                    return self._reply(500, {"error": {"message": "the model crashed on this prompt"}})
                if server.choices is not None:
                    return self._reply(200, {"choices": server.choices(body)})
                rng = random.Random(body.get("seed", 0))
                choices = []
                for i in range(body["n"]):
                    ids = [rng.randrange(10, 60) for _ in range(rng.randint(1, body["max_tokens"]))]
                    choices.append({"index": i, "token_ids": ids, "finish_reason": "length",
                                    "logprobs": {"token_logprobs": [-rng.random() for _ in ids]}})
                self._reply(200, {"choices": choices})

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="fake-openai", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
