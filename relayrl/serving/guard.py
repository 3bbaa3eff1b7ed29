"""The HTTP guard both services share (``relayrl serve`` and the dock's service API).

An ASGI middleware: a bearer token on every route but the open ones (``/health``)
when a token is set, compared in constant time; then a body-size limit per path,
checked on ``Content-Length`` before the body is read and on the bytes as they
arrive (chunked bodies); then a deadline for the whole body, so a client that
sends it slowly or never finishes it is answered 408 instead of holding the
request open. Refusals are OpenAI-style error objects (401, 408, 413); a 408 or
413 also closes the connection, so the server reads no more of a body it refused
than the limit (clients that send the whole body first, like ``openai``'s httpx,
still read the status).
``is_loopback`` is the rule both CLIs apply: a server bound beyond loopback needs
a token.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
from typing import Callable

from starlette.responses import JSONResponse

__all__ = ["Guard", "HTTPRefusal", "is_loopback", "error_body", "add_error_handlers"]


def error_body(message: str, status: int, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object; ``code`` is the status unless a name tells the client more (``generation_stopped``:
    a 503 that no retry can help)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status if code is None else code}}


class HTTPRefusal(Exception):
    """A request a service refuses: status, message and error type (rendered with :func:`error_body`)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 close: bool = False, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.close = close  # a refused body: close the connection rather than read the rest of it

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, self.kind, self.param, self.code),
                            status_code=self.status,
                            headers={"Connection": "close"} if self.close else None)


def add_error_handlers(app) -> None:
    """Answer what the framework refuses itself (no such route or method: 404/405; a query parameter of the
    wrong type or missing: 400) with the same error object as the services' own refusals."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(HTTPException)
    async def _http_error(_, e: HTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(e.detail), e.status_code, kind), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _bad_query(_, e: RequestValidationError):
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"][1:]) or "query"
        return JSONResponse(error_body(f"{loc}: {first['msg']}", 400, param=loc), status_code=400)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Guard:
    """ASGI middleware: bearer token, then the body-size limit ``limit_for(path)`` and the body deadline
    ``timeout_for(path)`` (seconds from the request's headers to the body's last byte)."""

    def __init__(self, app, api_key: str | None, limit_for: Callable[[str], int],
                 timeout_for: Callable[[str], float] = lambda path: 60.0, open_paths=("/health",)) -> None:
        self.app, self.api_key, self.limit_for, self.open_paths = app, api_key, limit_for, tuple(open_paths)
        self.timeout_for = timeout_for

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if self.api_key is not None and scope["path"] not in self.open_paths:
            got = headers.get("authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
                return await HTTPRefusal(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                                         "authentication_error").response()(scope, receive, send)
        limit = self.limit_for(scope["path"])
        length = headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                return await HTTPRefusal(400, f"bad Content-Length {length!r}").response()(scope, receive, send)
            if int(length) > limit:
                return await HTTPRefusal(413, f"request body of {int(length)} bytes exceeds the limit of {limit} "
                                         f"bytes", close=True).response()(scope, receive, send)
        seen, done = 0, False
        timeout = self.timeout_for(scope["path"])
        deadline = asyncio.get_running_loop().time() + timeout

        async def counted():
            nonlocal seen, done
            if done:  # the body is in: later receives wait for a disconnect (streaming responses)
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                raise HTTPRefusal(408, f"the request body did not arrive within {timeout:g} s ({seen} bytes "
                                  f"came); send it whole, or raise the server's body timeout", "timeout",
                                  close=True) from None
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    raise HTTPRefusal(413, f"request body exceeds the limit of {limit} bytes", close=True)
                done = not msg.get("more_body", False)
            else:
                done = True
            return msg

        await self.app(scope, counted, send)
