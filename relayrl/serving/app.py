"""``relayrl serve``: an OpenAI-compatible HTTP server over the native engine (FastAPI on uvicorn).

Routes: ``/v1/completions``, ``/v1/chat/completions`` (the tokenizer's chat
template), both with streaming (server-sent events), ``logprobs``, ``n`` and
stop strings; ``/v1/models``; ``/health``; and relayrl's weight endpoint
``/v1/relayrl/weights`` (GET: the version; POST: new weights, as a safetensors
payload or a path), which the rollout adapter calls after every update
(``relayrl.engines.generation.remote``). Every request is handed to one
:class:`~relayrl.serving.batcher.Batcher`, so concurrent requests decode in one
batch (continuous batching across requests).

Guards (AsyncFlow §5 exposes the trainer as a service; a service must not
fall over on bad input): a bearer token on every route but ``/health`` when one
is set (``cli.serve`` refuses a non-loopback host without one), a body-size
limit checked before the body is read and a deadline for it (413/408), limits on ``max_tokens``, ``n``, prompts
and stop strings, a bounded queue (503 beyond). Malformed JSON, invalid UTF-8,
unknown fields, unknown models and out-of-range values get a 4xx with OpenAI's
error object; an unexpected failure of one request is a 500 for it alone. A failed generation step is a 500
for the requests in its batch (the loop resets and serves on); a loop that stopped is a 503 with the cause for
every request and ``/health`` (``relayrl.serving.batcher``; its error ``code`` is ``generation_stopped``, which
the rollout adapter does not retry); a weight load is checked whole before any tensor is written
(``relayrl.serving.weights``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request as HTTPRequest
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.remote import GENERATION_STOPPED as STOPPED
from relayrl.serving import responses as R
from relayrl.serving.batcher import (Batcher, DoneEvent, Overloaded, Request, TokenEvent, Unhealthy, Unrecoverable,
                                     WeightLoadTimeout)
from relayrl.serving.guard import Guard, HTTPRefusal, add_error_handlers
from relayrl.serving.protocol import ChatCompletionRequest, CompletionRequest, FieldError, ServeLimits, WeightsRequest
from relayrl.serving.weights import checked, write

__all__ = ["ServerState", "build_app", "ApiError"]

WEIGHTS_PATH = "/v1/relayrl/weights"
WEIGHT_LOAD_TIMEOUT = "weight_load_timeout"  # (a 503's code: the load missed --weight-load-timeout-s)


ApiError = HTTPRefusal  # a request the server refuses: status, message and OpenAI error type


@dataclass
class ServerState:
    """What the handlers share: the batcher (which owns the engine), the tokenizer and the limits."""

    batcher: Batcher
    tokenizer: Any
    model_name: str
    limits: ServeLimits
    api_key: str | None
    max_model_len: int
    max_weights_bytes: int
    default_max_tokens: int = 16
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    """A request's sampling fields left out take these (the model's generation config; else OpenAI's)."""


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="relayrl serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.relayrl = state
    add_error_handlers(app)  # (no such route or method: OpenAI's error object too)

    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return e.response()

    @app.exception_handler(Unhealthy)
    @app.exception_handler(Unrecoverable)  # (the weight load that stopped the loop)
    async def _unhealthy(_, e: Exception):  # the generation loop stopped: every request is refused, none waits
        return JSONResponse(R.error_body(str(e), 503, "server_error", code=STOPPED), status_code=503)

    @app.exception_handler(WeightLoadTimeout)
    async def _weights_late(_, e: WeightLoadTimeout):  # (the server goes on; the message says what serves)
        return JSONResponse(R.error_body(str(e), 503, "server_error", code=WEIGHT_LOAD_TIMEOUT), status_code=503)

    @app.exception_handler(Exception)
    async def _unexpected(_, e: Exception):  # one request failed; the server goes on
        return JSONResponse(R.error_body(f"internal error: {e!r}", 500, "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        b = state.batcher
        if (cause := b.problem()) is not None:
            return JSONResponse({"status": "error", "error": cause}, status_code=503)
        return {"status": "ok", **b.stats()}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": 0,
                                            "owned_by": "relayrl", "max_model_len": state.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        req = _parse(await _body(http), CompletionRequest)
        prompts = [_encode_prompt(state, p) for p in _checked_prompts(state, req)]
        return await _serve(state, http, req, prompts, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(http: HTTPRequest):
        req = _parse(await _body(http), ChatCompletionRequest)
        _check_model(state, req.model)
        return await _serve(state, http, req, [_render_chat(state, req)], chat=True)

    @app.get(WEIGHTS_PATH)
    async def weights_version():
        return {"version": state.batcher.engine.weight_version}

    @app.post(WEIGHTS_PATH)
    async def load_weights(http: HTTPRequest):
        ctype = http.headers.get("content-type", "").split(";")[0].strip()
        if ctype == "application/octet-stream":
            version = _int_query(http, "version")
            payload = await http.body()
            tensors = await run_in_threadpool(_load_payload, payload)
        else:
            w = _parse(await _body(http), WeightsRequest)
            version = w.version
            tensors = await run_in_threadpool(_load_path, w.path)
        eng = state.batcher.engine
        tensors = await run_in_threadpool(checked, eng.model, tensors)  # (all checked before any is written)
        t0 = time.perf_counter()
        got = await run_in_threadpool(state.batcher.load_weights, lambda: write(eng, tensors, version),
                                      state.limits.weight_load_timeout_s, version)
        return {"version": got, "tensors": len(tensors), "seconds": round(time.perf_counter() - t0, 4)}

    app.add_middleware(Guard, api_key=state.api_key,
                       limit_for=lambda path: state.max_weights_bytes if path == WEIGHTS_PATH
                       else state.limits.max_body_bytes,
                       timeout_for=lambda path: state.limits.weights_timeout_s if path == WEIGHTS_PATH
                       else state.limits.body_timeout_s)
    return app


# ------------------------------------------------------------------ request parsing
async def _body(http: HTTPRequest) -> Any:
    raw = await http.body()
    if not raw:
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column "
                       f"{e.colno}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json``'s ``object_pairs_hook``: an object with a key twice is a 400 naming it (``json`` would keep the
    last value unsaid, and another server may keep the first)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ApiError(400, f"{key}: given twice in one JSON object of the request body; give it once",
                           param=key)
        out[key] = value
    return out


def _parse(data: Any, cls):
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        errs = e.errors(include_url=False)
        problems = [f"{_loc(err)}: {_message(err)}" for err in errs[:_LISTED]]
        more = f" (and {len(errs) - _LISTED} more)" if len(errs) > _LISTED else ""
        raise ApiError(400, "; ".join(problems) + more, param=_loc(errs[0])) from None


_LISTED = 5  # (a request's invalid fields named in its error, each with the reason)


def _loc(err: dict) -> str:
    """The invalid field's dotted path; a check across fields (a model validator, located at the model) names
    its field with :class:`FieldError`."""
    loc = [str(x) for x in err["loc"]]
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        loc.append(cause.field)
    return ".".join(loc) or "body"


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field (relayrl serve does not support it)"
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):
        return cause.reason  # (its field is in the path already)
    if err["type"] == "value_error" and cause is not None:
        return str(cause)  # our own validators' words, without pydantic's "Value error, " in front
    return err["msg"]


def _int_query(http: HTTPRequest, name: str) -> int:
    v = http.query_params.get(name)
    if v is None or not v.isdigit():
        raise ApiError(400, f"give ?{name}=<non-negative integer> with a safetensors payload")
    return int(v)


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise ApiError(404, f"the model {model!r} does not exist; this server serves {state.model_name!r}",
                       "not_found_error", "model")


def _checked_prompts(state: ServerState, req: CompletionRequest) -> list[str | list[int]]:
    _check_model(state, req.model)
    prompts = req.prompt_list()
    if len(prompts) > state.limits.max_prompts:
        raise ApiError(400, f"{len(prompts)} prompts in one request; the limit is {state.limits.max_prompts}",
                       param="prompt")
    queue = state.batcher.max_waiting  # each prompt waits in the queue: more than it holds could never be served
    if len(prompts) > queue:
        raise ApiError(400, f"{len(prompts)} prompts in one request; this server queues at most {queue} "
                       f"(relayrl serve --max-waiting); send at most {queue} per request", param="prompt")
    return prompts


def _encode_prompt(state: ServerState, p: str | list[int]) -> list[int]:
    if isinstance(p, str):
        if not p:
            raise ApiError(400, "a prompt is empty", param="prompt")
        return list(state.tokenizer(p)["input_ids"])
    vocab = len(state.tokenizer)
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {vocab})", param="prompt")
    if not p:
        raise ApiError(400, "a prompt is empty", param="prompt")
    return list(p)


def _render_chat(state: ServerState, req: ChatCompletionRequest) -> list[int]:
    tok = state.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, f"the model {state.model_name!r} has no chat template; use /v1/completions")
    try:
        msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name is not None else {})}
                for m in req.messages]
        # the request's chat_template_kwargs go last, so they may set add_generation_prompt too (as vLLM's)
        extra = {"add_generation_prompt": bool(req.add_generation_prompt), **(req.chat_template_kwargs or {})}
        text = tok.apply_chat_template(msgs, tokenize=False, **extra)
    except ValueError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None
    except Exception as e:  # noqa: BLE001 - a template that fails on these messages (jinja raise_exception)
        raise ApiError(400, f"the chat template refused the messages: {e}", param="messages") from None
    return list(tok(text, add_special_tokens=False)["input_ids"])


def _sampling(state: ServerState, req, prompts: list[list[int]], chat: bool) -> SamplingParams:
    lim = state.limits
    longest = max(len(p) for p in prompts)
    room = state.max_model_len - longest
    if room < 1:
        raise ApiError(400, f"the prompt has {longest} tokens; the model's context is {state.max_model_len}",
                       param="prompt")
    max_tokens = req.max_tokens
    if max_tokens is None:
        max_tokens = min(lim.max_tokens, room) if chat else min(state.default_max_tokens, room)
    if max_tokens > lim.max_tokens:
        raise ApiError(400, f"max_tokens={max_tokens} exceeds this server's limit of {lim.max_tokens}",
                       param="max_tokens")
    if max_tokens > room:
        raise ApiError(400, f"max_tokens={max_tokens} plus the prompt's {longest} tokens exceed the model's context "
                       f"of {state.max_model_len}; lower max_tokens to <= {room}", param="max_tokens")
    n = req.n or 1
    if n > lim.max_n:
        raise ApiError(400, f"n={n} exceeds this server's limit of {lim.max_n}", param="n")
    if n > state.batcher.engine.max_batch:
        raise ApiError(400, f"n={n} exceeds the {state.batcher.engine.max_batch} sequences this server decodes "
                       f"together (relayrl serve --max-batch)", param="n")
    vocab = len(state.tokenizer)
    bad = [t for t in req.stop_token_ids or () if not 0 <= t < vocab]
    if bad:  # (it could never match)
        raise ApiError(400, f"stop token id {bad[0]} is outside the vocabulary [0, {vocab})",
                       param="stop_token_ids")
    stops = req.stops  # (an empty one is refused by the request record)
    if len(stops) > lim.max_stop:
        raise ApiError(400, f"stop: {len(stops)} stop strings; this server takes at most {lim.max_stop}",
                       param="stop")
    d = state.sampling_defaults

    def given(key: str, default: float):  # (the request's, else the model's, else OpenAI's)
        value = getattr(req, key)
        return d.get(key, default) if value is None else value

    top_k = given("top_k", 0)
    try:
        return SamplingParams(n=n, temperature=given("temperature", 1.0), top_p=given("top_p", 1.0),
                              top_k=top_k if top_k > 0 else 0, min_p=given("min_p", 0.0),
                              repetition_penalty=given("repetition_penalty", 1.0),
                              max_new_tokens=max_tokens,
                              stop_strings=stops, stop_token_ids=tuple(req.stop_token_ids or ()),
                              ignore_eos=bool(req.ignore_eos))
    except ValidationError as e:
        raise ApiError(400, e.errors(include_url=False)[0]["msg"]) from None


def _top_logprobs(state: ServerState, req, chat: bool) -> int:
    k = (req.top_logprobs or 0) if chat else (req.logprobs or 0)
    field = "top_logprobs" if chat else "logprobs"  # (chat's logprobs is a bool; the count is top_logprobs)
    if k > state.limits.max_top_logprobs:
        raise ApiError(400, f"{field}={k} exceeds the limit of {state.limits.max_top_logprobs}", param=field)
    return k


# ------------------------------------------------------------------ generation
async def _serve(state: ServerState, http: HTTPRequest, req, prompts: list[list[int]], chat: bool):
    params = _sampling(state, req, prompts, chat)
    top = _top_logprobs(state, req, chat)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    stream = bool(req.stream)
    reqs = []
    for i, p in enumerate(prompts):
        # every prompt takes the request's seed, as vLLM's server passes one SamplingParams to each: a prompt's
        # samples are those of a request for it alone, wherever it stands in the list
        r = Request(p, params, emit=lambda ev, i=i: loop.call_soon_threadsafe(queue.put_nowait, (i, ev)),
                    seed=req.seed, top_logprobs=top, stream_tokens=stream or top > 0)
        reqs.append(r)
    try:
        state.batcher.submit_all(reqs)  # all of the request's prompts or none: a 503 leaves nothing queued
    except Overloaded as e:
        raise ApiError(503, f"the server is busy: {e}", "server_busy") from None
    if stream:
        stream_fn = _stream_chat if chat else _stream_completion
        gen = stream_fn(state, req, reqs, queue, params)
        return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    try:
        samples = await _collect(state, req, reqs, queue, params, http)
    finally:
        for r in reqs:
            r.cancel()  # a no-op once done; frees the rows of a client that went away
    as_ids, ids = bool(req.return_tokens_as_token_ids), bool(req.return_token_ids)
    if chat:
        return R.chat_body(state.model_name, state.tokenizer, samples, prompts[0], logprobs=bool(req.logprobs),
                           top_logprobs=top, as_ids=as_ids, token_ids=ids)
    return R.completion_body(state.model_name, state.tokenizer, samples, prompts, logprobs=req.logprobs,
                             as_ids=as_ids, token_ids=ids)


async def _next(queue: asyncio.Queue, http: HTTPRequest | None) -> tuple[int, Any]:
    """The next event; while waiting, notice a client that disconnected (non-streaming requests)."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if http is not None and await http.is_disconnected():
                raise ApiError(499, "the client disconnected") from None


def _sample_text(state: ServerState, req, params: SamplingParams) -> R.SampleText:
    """A sample's text as vLLM's server returns it: cut at a stop string, a stop token's text left out."""
    return R.SampleText(state.tokenizer, params.stop_strings, frozenset(state.batcher.engine.stop_ids(params)),
                        bool(req.include_stop_str_in_output or req.no_stop_trim))


async def _collect(state: ServerState, req, reqs: list[Request], queue: asyncio.Queue, params: SamplingParams,
                   http: HTTPRequest) -> list[R.Sample]:
    n = params.n
    left = len(reqs) * n
    tops: dict[tuple[int, int], list] = {}
    out: list[R.Sample] = []
    while left:
        i, ev = await _next(queue, http)
        if isinstance(ev, TokenEvent):
            tops.setdefault((i, ev.sample), []).append(list(ev.top))
            continue
        _raise_failed(ev)
        if ev.finish_reason == "cancelled":
            continue
        text = _sample_text(state, req, params).full(ev.token_ids)
        out.append(R.Sample(i * n + ev.sample, text, list(ev.token_ids), list(ev.logprobs), ev.finish_reason,
                            reqs[i].prompt, tops.get((i, ev.sample), [])))
        left -= 1
    return sorted(out, key=lambda s: s.index)


def _raise_failed(ev: DoneEvent) -> None:
    if ev.finish_reason == "error":  # (503: the loop stopped before it decoded this request; else 500)
        raise ApiError(503 if ev.unavailable else 500, ev.error or "generation failed", "server_error",
                       code=STOPPED if ev.unavailable else None)


async def _events(reqs: list[Request], queue: asyncio.Queue, n: int) -> AsyncIterator[tuple[int, Any]]:
    """Events of a streamed request until every sample is done; cancels the rest if the client goes away."""
    left = len(reqs) * n
    try:
        while left:
            i, ev = await _next(queue, None)
            if isinstance(ev, DoneEvent):
                if ev.finish_reason == "cancelled":
                    continue
                left -= 1
            yield i, ev
    finally:
        for r in reqs:
            r.cancel()


def _lp_completion(state, req, ev: TokenEvent, top: int, offset: int) -> dict | None:
    """One streamed token's log-probs; ``offset`` is where its text starts in the sample's completion text (the
    running offset over the chunks before, as the non-streamed ``text_offset`` and vLLM's stream)."""
    if req.logprobs is None:
        return None
    as_ids = bool(req.return_tokens_as_token_ids)
    t = R.token_text(state.tokenizer, ev.token_id, as_ids)
    alts = {R.token_text(state.tokenizer, a, as_ids): v for a, v in ev.top[:top]} if top else None
    return {"tokens": [t], "token_logprobs": [ev.logprob], "top_logprobs": [alts] if alts is not None else None,
            "text_offset": [offset]}


def _lp_chat(state, req, ev: TokenEvent, top: int) -> dict | None:
    if not req.logprobs:
        return None
    as_ids = bool(req.return_tokens_as_token_ids)

    def entry(i: int, v: float) -> dict:
        text = R.token_text(state.tokenizer, i, as_ids)
        return {"token": text, "logprob": v, "bytes": list(text.encode("utf-8"))}

    e = entry(ev.token_id, ev.logprob)
    e["top_logprobs"] = [entry(a, v) for a, v in ev.top[:top]]
    return {"content": [e]}


async def _stream_completion(state: ServerState, req: CompletionRequest, reqs, queue, params) -> AsyncIterator[str]:
    cid, n, top = f"cmpl-{uuid.uuid4().hex}", params.n, req.logprobs or 0
    texts: dict[int, R.SampleText] = {}
    offsets: dict[int, int] = {}  # sample -> text_offset of its next token
    ids = bool(req.return_token_ids)
    completion_tokens = 0
    try:
        async for i, ev in _events(reqs, queue, n):
            k = i * n + ev.sample
            if k not in texts:
                texts[k] = _sample_text(state, req, params)
            st = texts[k]
            if isinstance(ev, TokenEvent):
                completion_tokens += 1
                delta = st.push(ev.token_id)
                lp = _lp_completion(state, req, ev, top, offsets.get(k, 0))
                offsets[k] = offsets.get(k, 0) + R.text_length(state.tokenizer, ev.token_id)
                yield R.sse(R.completion_chunk(cid, state.model_name, k, delta, None, lp,
                                               [ev.token_id] if ids else None))
            else:
                _raise_failed(ev)
                yield R.sse(R.completion_chunk(cid, state.model_name, k, st.finish(), ev.finish_reason, None,
                                               [] if ids else None))
        if req.include_usage:
            p = sum(len(r.prompt) for r in reqs)
            yield R.sse({"id": cid, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
                         "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": completion_tokens,
                                                  "total_tokens": p + completion_tokens}})
    except ApiError as e:
        yield R.sse(R.error_body(e.message, e.status, e.kind, code=e.code))
    except Exception as e:  # noqa: BLE001 - the stream's own failure (detokenizing): an error event, then the end
        yield R.sse(R.error_body(f"internal error: {e!r}", 500, "server_error"))
    yield "data: [DONE]\n\n"


async def _stream_chat(state: ServerState, req: ChatCompletionRequest, reqs, queue, params) -> AsyncIterator[str]:
    cid, n, top = f"chatcmpl-{uuid.uuid4().hex}", params.n, req.top_logprobs or 0
    texts: dict[int, R.SampleText] = {}
    ids = bool(req.return_token_ids)
    completion_tokens = 0
    for k in range(n):  # OpenAI opens each choice with the role
        yield R.sse(R.chat_chunk(cid, state.model_name, k, {"role": "assistant", "content": ""}, None, None))
    try:
        async for _, ev in _events(reqs, queue, n):
            k = ev.sample
            if k not in texts:
                texts[k] = _sample_text(state, req, params)
            st = texts[k]
            if isinstance(ev, TokenEvent):
                completion_tokens += 1
                delta = st.push(ev.token_id)
                yield R.sse(R.chat_chunk(cid, state.model_name, k, {"content": delta}, None,
                                         _lp_chat(state, req, ev, top), [ev.token_id] if ids else None))
            else:
                _raise_failed(ev)
                yield R.sse(R.chat_chunk(cid, state.model_name, k, {"content": st.finish()}, ev.finish_reason, None,
                                         [] if ids else None))
        if req.include_usage:
            p = len(reqs[0].prompt)
            yield R.sse({"id": cid, "object": "chat.completion.chunk", "created": int(time.time()),
                         "model": state.model_name, "choices": [],
                         "usage": {"prompt_tokens": p, "completion_tokens": completion_tokens,
                                   "total_tokens": p + completion_tokens}})
    except ApiError as e:
        yield R.sse(R.error_body(e.message, e.status, e.kind, code=e.code))
    except Exception as e:  # noqa: BLE001 - the stream's own failure (detokenizing): an error event, then the end
        yield R.sse(R.error_body(f"internal error: {e!r}", 500, "server_error"))
    yield "data: [DONE]\n\n"


# ------------------------------------------------------------------ weights
def _load_payload(payload: bytes) -> dict:
    from safetensors.torch import load

    if not payload:
        raise ApiError(400, "the weight payload is empty")
    try:
        return load(payload)
    except Exception as e:  # noqa: BLE001 - any parse failure of the client's bytes is a 400
        raise ApiError(400, f"the body is not a safetensors payload: {e}") from None


def _load_path(path: str) -> dict:
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else [p]
    if not files or not all(f.is_file() for f in files):
        raise ApiError(400, f"{path}: no safetensors file there (give a .safetensors file or a directory of them)",
                       param="path")
    out: dict = {}
    for f in files:
        try:
            out.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001 - a file that is not safetensors is the client's mistake
            raise ApiError(400, f"{f}: not a safetensors file: {e}", param="path") from None
    return out
