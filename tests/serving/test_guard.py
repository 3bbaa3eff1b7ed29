"""The HTTP guard over a real uvicorn on loopback (no model): bodies over the limit get 413 and no more is read,
a body that does not arrive in time gets 408, and the server goes on serving others meanwhile."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests
import uvicorn
from fastapi import FastAPI, Request

from relayrl.serving.guard import Guard, HTTPRefusal
from relayrl.serving.server import listening_socket

LIMIT = 1 << 20


class Running:
    """A uvicorn server in a thread of this process."""

    def __init__(self, app) -> None:
        self.sock = listening_socket("127.0.0.1", 0)
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def echo():
    app = FastAPI()

    @app.exception_handler(HTTPRefusal)
    async def _refusal(_, e: HTTPRefusal):
        return e.response()

    @app.post("/v1/completions")
    async def completions(http: Request):
        return {"bytes": len(await http.body())}

    app.add_middleware(Guard, api_key=None, limit_for=lambda path: LIMIT, timeout_for=lambda path: 1.0)
    r = Running(app)
    yield r
    r.stop()


def raw(server: Running, head: str, body: bytes = b"") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    s.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{head}\r\n".encode()
              + body)
    return s


def read_until_closed(s: socket.socket) -> bytes:
    got = b""
    while chunk := s.recv(65536):
        got += chunk
    return got


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_the_official_client_gets_413_for_64_mib_and_the_server_goes_on(echo):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{echo.url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model="tiny", prompt="x" * (64 << 20))
    assert e.value.status_code == 413
    assert "exceeds the limit of 1048576 bytes" in e.value.body["message"]
    assert requests.post(f"{echo.url}/v1/completions", data=b"{}", timeout=10).json() == {"bytes": 2}


def test_a_declared_oversized_body_is_refused_before_it_is_read_and_the_connection_closed(echo):
    s = raw(echo, f"Content-Length: {64 << 20}\r\n", b"x" * 4096)  # 4 KiB of the 64 MiB declared, then nothing
    reply = read_until_closed(s)  # closed by the server: it reads none of the remaining body
    assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
    assert b'"code":413' in reply and b"exceeds the limit of 1048576 bytes" in reply
    s.close()


def test_a_chunked_body_over_the_limit_is_refused(echo):
    def chunks():
        for _ in range(64):
            yield b"x" * (64 << 10)
    r = requests.post(f"{echo.url}/v1/completions", data=chunks(), timeout=30)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


@pytest.mark.parametrize("sent", [0, 3])
@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_a_body_that_never_finishes_gets_408_and_others_are_served_meanwhile(echo, sent):
    t0 = time.monotonic()
    s = raw(echo, "Content-Length: 100\r\n", b"abc"[:sent])
    assert requests.post(f"{echo.url}/v1/completions", data=b"{}", timeout=10).status_code == 200
    reply = read_until_closed(s)
    assert 0.9 < time.monotonic() - t0 < 8
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply.lower()
    assert f"did not arrive within 1 s ({sent} bytes came)".encode() in reply
    s.close()


@pytest.mark.slow  # (over half a second; the full `make test` runs it)
def test_a_body_sent_slowly_gets_408_at_the_deadline(echo):
    s = raw(echo, "Transfer-Encoding: chunked\r\n")
    t0, reply = time.monotonic(), b""
    s.settimeout(0.2)
    while time.monotonic() - t0 < 8:  # one byte every 0.2 s: never idle long, never done
        try:
            s.sendall(b"1\r\nx\r\n")
            reply += s.recv(65536)
        except socket.timeout:
            continue
        except OSError:
            break
        if reply:
            break
    assert reply.startswith(b"HTTP/1.1 408"), reply
    assert time.monotonic() - t0 < 4
    s.close()


@pytest.mark.slow  # (over a second; the full `make test` runs it)
def test_the_dock_service_api_refuses_with_413_and_408():
    from relayrl.dock import Dock
    from relayrl.serving.dockapi import build_dock_app

    dock = Dock(units=1, backend="local")
    server = Running(build_dock_app(dock, max_body_bytes=4096, body_timeout_s=1.0))
    try:
        r = requests.post(f"{server.url}/v1/dock/put", data=b"x" * (1 << 20),
                          headers={"Content-Type": "application/x-relayrl-rows"}, timeout=30)
        assert r.status_code == 413 and "exceeds the limit of 4096 bytes" in r.json()["error"]["message"]
        s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        s.sendall(b"POST /v1/dock/put HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n")
        assert read_until_closed(s).startswith(b"HTTP/1.1 408")
        s.close()
        assert requests.get(f"{server.url}/v1/dock/weights", timeout=10).status_code == 200
    finally:
        server.stop()
        dock.shutdown()
