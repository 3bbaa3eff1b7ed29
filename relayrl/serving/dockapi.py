"""The dock's service API: external producers and consumers over HTTP (AsyncFlow §5).

AsyncFlow exposes its TransferQueue to an industrial workflow through a few
calls: ``put_prompts_data``, ``put_experience_data``, ``get_experience_data``
and ``weight_sync_notify`` (``init_engines`` starts its engines; here engines
are the trainer's and the server's own business). This app serves them over a
:class:`~relayrl.dock.Dock` in its process (``relayrl dock``); the Python
client is :class:`relayrl.dock.client.DockClient`.

=====================================  =====================================================
route                                  dock call
=====================================  =====================================================
``POST /v1/dock/partitions``           ``open_partition(name, rows, group_size, columns)``
``DELETE /v1/dock/partitions/{name}``  ``close_partition``
``POST /v1/dock/put``                  ``put`` (prompts and experience: rows as a safetensors
                                       payload, ``relayrl.dock.rowcodec``)
``POST /v1/dock/lease``                ``register_stage`` + ``acquire``: a leased batch
                                       (200), the partition is done (204), nothing within
                                       ``timeout_s`` (408)
``POST /v1/dock/ack``                  ``Batch.ack``: the rows this call retired
``POST /v1/dock/release``              ``release(consumer_id)``: a consumer declared dead
``GET /v1/dock/progress``              ``progress(partition, stage)``
``POST|GET /v1/dock/weights``          weight-sync notice: a version (and a path) that
                                       producers wait for with ``?after=V``
=====================================  =====================================================

Delivery is the in-process dock's: a lease expires after ``lease_s`` and its
rows are re-delivered; an ack retires each row exactly once (a late ack of a
re-leased row retires nothing). Added for the network: **idempotent puts**. A
put may carry a ``put_id``; a second put with the same id on the same
partition returns the first one's indexes without writing, so a producer that
died mid-put (it cannot know whether the put landed) re-sends its puts with
the same ids and no row is lost or duplicated. A put whose body did not arrive
whole writes nothing.
"""

from __future__ import annotations

import threading
from typing import Any

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from relayrl.dock import Dock, DockError, PartitionClosedError
from relayrl.dock.rowcodec import RowCodecError, decode_rows, encode_rows
from relayrl.serving.guard import Guard, HTTPRefusal, add_error_handlers, error_body

__all__ = ["build_dock_app", "DockService"]

ROW_PAYLOAD = "application/x-relayrl-rows"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


MAX_PARTITION_ROWS = 1 << 24
"""The most rows one partition opened over HTTP may hold (16.8M: a step of 512 prompts x 64 samples is 32,768);
more answered a 500 when the dock's per-row arrays could not be allocated."""


class OpenPartition(_Body):
    name: str = Field(min_length=1)
    rows: int = Field(ge=1, le=MAX_PARTITION_ROWS, description="rows of the partition (one step's samples)")
    group_size: int = Field(1, ge=1)
    columns: list[str] | None = None


class LeaseRequest(_Body):
    partition: str
    stage: str = Field(min_length=1)
    columns: list[str] = Field(min_length=1)
    batch_size: int = Field(ge=1)
    consumer_id: str = Field(min_length=1, description="the lease holder (one per consumer process)")
    whole_groups: bool = False
    eager: bool = False
    timeout_s: float = Field(30.0, gt=0, le=600)


class AckRequest(_Body):
    partition: str
    gen: int
    stage: str
    lease_id: int
    indexes: list[int]


class ReleaseRequest(_Body):
    consumer_id: str


class WeightNotice(_Body):
    version: int = Field(ge=0)
    path: str | None = Field(None, description="where the weights are (a directory, a file, a URL)")


class DockService:
    """The state behind the routes: the dock, the put ledger and the latest weight notice."""

    def __init__(self, dock: Dock) -> None:
        self.dock = dock
        self._lock = threading.Lock()
        self._puts: dict[tuple[str, str], list[int] | threading.Event] = {}  # (partition, put_id) -> indexes
        self._weights = WeightNotice(version=0)
        self._weights_cond = threading.Condition()

    def put(self, partition: str, columns: dict, indexes: list[int] | None,
            put_id: str | None) -> tuple[list[int], bool]:
        """``dock.put`` once per ``(partition, put_id)``; returns (indexes, whether it was a repeat)."""
        if put_id is None:
            return self.dock.put(partition, columns, indexes), False
        key = (partition, put_id)
        while True:
            with self._lock:
                got = self._puts.get(key)
                if got is None:
                    self._puts[key] = mine = threading.Event()
                    break
            if isinstance(got, list):
                return got, True
            got.wait(60.0)  # the same put is in flight (a retry raced its original): wait for its outcome
        try:
            idx = self.dock.put(partition, columns, indexes)
        except BaseException:
            with self._lock:
                del self._puts[key]
            mine.set()
            raise
        with self._lock:
            self._puts[key] = idx
        mine.set()
        return idx, False

    def closed(self, partition: str) -> None:
        with self._lock:
            for key in [k for k in self._puts if k[0] == partition]:
                del self._puts[key]

    def notify(self, notice: WeightNotice) -> WeightNotice:
        with self._weights_cond:
            if notice.version < self._weights.version:
                raise HTTPRefusal(409, f"weight version {notice.version} is older than the announced "
                                  f"{self._weights.version}")
            self._weights = notice
            self._weights_cond.notify_all()
            return notice

    def wait_weights(self, after: int, timeout_s: float) -> WeightNotice:
        with self._weights_cond:
            self._weights_cond.wait_for(lambda: self._weights.version > after, timeout_s)
            return self._weights


INPUT_ERRORS = (ValueError, KeyError, TypeError, IndexError)
"""What the dock raises for a caller's mistake (a 400); anything else it raises is a 500."""


def _refusal_message(e: Exception) -> str:
    # str(KeyError('x')) is "'x'" with the quotes: the message is its first argument
    return str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)


def _parse(data: Any, cls):
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        loc = ".".join(str(x) for x in first["loc"]) or "body"
        msg = first["msg"]
        if first["type"] == "less_than_equal" and loc == "rows":  # (say what the bound is for)
            msg = f"{first['input']} rows; a partition holds at most {MAX_PARTITION_ROWS} (one step's samples)"
        raise HTTPRefusal(400, f"{loc}: {msg}", param=loc) from None


async def _json(http: HTTPRequest, cls):
    import json

    try:
        data = json.loads((await http.body()).decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise HTTPRefusal(400, f"the request body is not valid JSON: {e}") from None
    return _parse(data, cls)


def build_dock_app(dock: Dock, *, api_key: str | None = None, max_body_bytes: int = 256 << 20,
                   body_timeout_s: float = 300.0) -> FastAPI:
    svc = DockService(dock)
    app = FastAPI(title="relayrl dock", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.service = svc
    add_error_handlers(app)

    @app.exception_handler(HTTPRefusal)
    async def _refusal(_, e: HTTPRefusal):
        return e.response()

    @app.exception_handler(PartitionClosedError)
    async def _closed(_, e: PartitionClosedError):
        return JSONResponse(error_body(str(e), 404, "not_found_error"), status_code=404)

    @app.exception_handler(DockError)
    async def _dock_error(_, e: DockError):
        return JSONResponse(error_body(str(e), 500, "server_error"), status_code=500)

    async def _bad_input(_, e: Exception):  # the dock names the bad input in a ValueError/KeyError/...
        return JSONResponse(error_body(_refusal_message(e), 400), status_code=400)

    # Registered per class, not for the base Exception: Starlette sends a base-Exception handler's answer from
    # its ServerErrorMiddleware, which then re-raises, so uvicorn logs a traceback and drops the keep-alive
    # connection (the client's next call on it failed with ConnectionResetError).
    for cls in INPUT_ERRORS:
        app.add_exception_handler(cls, _bad_input)

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):  # a bug: a 500 (logged, and the connection closed)
        return JSONResponse(error_body(str(e), 500, "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "partitions": dock.partitions()}

    @app.post("/v1/dock/partitions")
    async def open_partition(http: HTTPRequest):
        p = await _json(http, OpenPartition)
        await run_in_threadpool(dock.open_partition, p.name, p.rows, group_size=p.group_size, columns=p.columns)
        return {"partition": p.name, "rows": p.rows}

    @app.get("/v1/dock/partitions")
    async def partitions():
        return {"partitions": dock.partitions()}

    @app.delete("/v1/dock/partitions/{name}")
    async def close_partition(name: str):
        await run_in_threadpool(dock.close_partition, name)
        svc.closed(name)
        return {"closed": name}

    @app.post("/v1/dock/put")
    async def put(http: HTTPRequest):
        payload = await http.body()
        try:
            columns, meta = decode_rows(payload)
        except RowCodecError as e:
            raise HTTPRefusal(400, str(e)) from None
        partition = meta.get("partition")
        if not isinstance(partition, str):
            raise HTTPRefusal(400, "the payload's meta names no partition")
        idx, repeat = await run_in_threadpool(svc.put, partition, columns, meta.get("indexes"), meta.get("put_id"))
        return {"indexes": idx, "repeat": repeat}

    @app.post("/v1/dock/lease")
    async def lease(http: HTTPRequest):
        q = await _json(http, LeaseRequest)

        def acquire():
            dock.register_stage(q.stage, q.columns, whole_groups=q.whole_groups)
            return dock.acquire(q.partition, q.stage, batch_size=q.batch_size, consumer_id=q.consumer_id,
                                timeout_s=q.timeout_s, eager=q.eager)

        try:
            batch = await run_in_threadpool(acquire)
        except TimeoutError as e:
            raise HTTPRefusal(408, str(e), "timeout") from None
        if batch is None:
            return Response(status_code=204)
        meta = {"partition": q.partition, "stage": q.stage, "gen": batch.generation, "lease_id": batch.lease_id,
                "indexes": batch.indexes}
        body = encode_rows({c: batch[c] for c in batch.columns}, meta)
        return Response(body, media_type=ROW_PAYLOAD)

    @app.post("/v1/dock/ack")
    async def ack(http: HTTPRequest):
        a = await _json(http, AckRequest)
        rows = await run_in_threadpool(dock.ack, a.partition, a.gen, a.stage, a.lease_id, a.indexes)
        return {"acked": rows}

    @app.post("/v1/dock/release")
    async def release(http: HTTPRequest):
        r = await _json(http, ReleaseRequest)
        return {"requeued": await run_in_threadpool(dock.release, r.consumer_id)}

    @app.get("/v1/dock/progress")
    async def progress(partition: str, stage: str):
        return dock.progress(partition, stage)

    @app.post("/v1/dock/weights")
    async def weight_sync_notify(http: HTTPRequest):
        return (await run_in_threadpool(svc.notify, await _json(http, WeightNotice))).model_dump()

    @app.get("/v1/dock/weights")
    async def weights(after: int = -1, timeout_s: float = 0.0):
        if not 0 <= timeout_s <= 600:
            raise HTTPRefusal(400, f"timeout_s={timeout_s} must lie in [0, 600]")
        return (await run_in_threadpool(svc.wait_weights, after, timeout_s)).model_dump()

    app.add_middleware(Guard, api_key=api_key, limit_for=lambda path: max_body_bytes,
                       timeout_for=lambda path: body_timeout_s)
    return app


def serve_dock(*, host: str = "127.0.0.1", port: int = 8100, api_key: str | None = None, units: int = 1,
               lease_s: float = 60.0, max_body_bytes: int = 256 << 20, body_timeout_s: float = 300.0,
               log=print) -> None:
    """``relayrl dock``: serve a fresh in-process dock until interrupted."""
    import uvicorn

    from relayrl.serving.guard import is_loopback
    from relayrl.serving.server import ServeError, listening_socket

    if not is_loopback(host) and not api_key:
        raise ServeError(f"--host {host} exposes the dock beyond this machine; set a bearer token first "
                         f"(RELAYRL_API_KEY=... or --api-key-file FILE), or bind to 127.0.0.1")
    dock = Dock(units=units, backend="local", lease_s=lease_s)
    app = build_dock_app(dock, api_key=api_key, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    sock = listening_socket(host, port)
    log(f"relayrl dock: http://{host}:{sock.getsockname()[1]}/v1/dock (lease {lease_s:g} s, "
        f"auth={'bearer' if api_key else 'none'})", flush=True)
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False)).run(sockets=[sock])
    finally:
        dock.shutdown()
        sock.close()
