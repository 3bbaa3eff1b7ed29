"""Continuous batching across requests: one background thread steps the native engine for every client.

The HTTP handlers (``app.py``) never touch the model. They submit a
:class:`Request` and read its events; the batcher thread owns the
:class:`~relayrl.engines.generation.native.NativeGenerationEngine` and runs

::

    handlers (event loop) ──submit──► waiting deque ──admit when slots free──► RunningBatch
          ▲                                                                       │ one decode step
          └──────── events (token, done) via Request.emit ◄── sample per request ◄┘
    weight loads ──► queued; applied when the running batch has drained (admission pauses meanwhile)

Each step admits waiting requests into the rows that finished (Periodic Asynchrony's
continuous batching on the engine's left-padded dynamic cache), samples every
request's rows with its own sampling settings (rows with equal settings share
one ``sample_next`` call), and drops the rows of requests whose client went
away. A sampling call that raises (settings the sampler cannot sample with) fails the rows of that call's
requests alone, with the cause; the other rows go on, and so does the loop. Any other failure inside a step (the
engine's prefill or decode, a CUDA out-of-memory error, a tokenizer error in a stop-string check) fails the
requests with rows in the running batch (their tokens may be half-sampled: none is retried), resets the batch
(KV cache, rows) and the loop goes on with the waiting requests. It stops (:attr:`Batcher.error` set; the
waiting requests and every later one are refused with :class:`Unhealthy`) when the reset itself fails, when a
writing a checked weight load failed (the device: :class:`Unrecoverable`), or after ``max_failures`` failed steps
in a row with no good step between. A seeded request's sample ``k`` draws from its own generator seeded
``seed + k``, as vLLM seeds the ``n`` samples of a request
(``ParentRequest._get_child_sampling_params``): a sample does not depend on
``n`` or on the rows beside it. New weights are applied between steps once no row is
in flight, so every completion comes from exactly one weight version (vLLM
pauses generation for a weight update the same way).

Departure from the engine's ``generate``: log-probs are the same quantity
(``softmax(logits / T)`` before the penalty and top-p/top-k/min-p), but rows of different
requests are sampled with different settings in one batch.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import torch

from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine, RunningBatch, sample_next

__all__ = ["Request", "TokenEvent", "DoneEvent", "Batcher", "Overloaded", "Unhealthy", "Unrecoverable",
           "WeightLoadTimeout"]

log = logging.getLogger("relayrl.serve")


class Overloaded(RuntimeError):
    """The waiting queue is full; the server answers 503."""


class Unhealthy(RuntimeError):
    """The generation loop has stopped (``Batcher.error`` says why); the server answers 503 naming the cause."""


class WeightLoadTimeout(TimeoutError):
    """A weight load did not finish within its deadline; the message says whether it was dropped (old weights
    serve on) or is still being written (the new ones serve once it ends), which version serves, and the fix."""


class Unrecoverable(RuntimeError):
    """Raised inside the generation loop by a failure it cannot reset from (the copies of a checked weight load
    failed, leaving the weights part new, part old): the loop stops rather than serve from a state it cannot
    vouch for."""


@dataclass(frozen=True)
class TokenEvent:
    """One sampled token of one sample of a request."""

    sample: int
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()
    """The ``Request.top_logprobs`` most likely tokens and their log-probs (same distribution as ``logprob``)."""


@dataclass(frozen=True)
class DoneEvent:
    """A sample finished (``error``: the request failed as a whole, e.g. weights could not be loaded)."""

    sample: int
    finish_reason: Literal["stop", "length", "cancelled", "error"]
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    weight_version: int = 0
    error: str | None = None
    unavailable: bool = False
    """The request was never decoded: the loop stopped (the server answers 503, not 500)."""


@dataclass(eq=False)
class Request:
    """A generation request as the batcher sees it: token ids, sampling settings, an event sink."""

    prompt: list[int]
    params: SamplingParams
    emit: Callable[[Any], None]
    """Called from the batcher thread with each :class:`TokenEvent` and :class:`DoneEvent` (must not block)."""
    seed: int | None = None
    top_logprobs: int = 0
    stream_tokens: bool = True
    """Emit a :class:`TokenEvent` per token (streaming, top log-probs); else only each sample's
    :class:`DoneEvent`."""
    cancelled: bool = False
    """Set by the handler when its client disconnected; the rows leave the batch at the next step."""
    id: int = field(default_factory=itertools.count().__next__)
    generators: list[torch.Generator] | None = None
    """One per sample when seeded (sample ``k``: ``seed + k``); None draws from the batcher's generator."""
    left: int = 0  # samples not yet finished

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(eq=False)
class _WeightJob:
    apply: Callable[[], int]
    done: threading.Event = field(default_factory=threading.Event)
    version: int | None = None
    error: BaseException | None = None


class Batcher:
    """Owns the engine; ``submit`` requests from any thread, ``load_weights`` between steps."""

    def __init__(self, engine: NativeGenerationEngine, *, max_waiting: int = 1024, seed: int = 0,
                 max_failures: int = 3) -> None:
        if engine.static is not None:
            raise ValueError("the server batches on the dynamic KV cache; build the engine with decode='dynamic'")
        self.engine = engine
        self.max_waiting = max_waiting
        self._waiting: deque[Request] = deque()
        self._weights: deque[_WeightJob] = deque()
        self._cond = threading.Condition()
        self._stop = False
        self._batch = RunningBatch()
        self._reqs: dict[int, Request] = {}  # id -> request with rows in the batch
        self._generator = torch.Generator(device=engine.device).manual_seed(seed)
        self.steps = 0
        self.generated_tokens = 0
        self.error: BaseException | None = None
        """Why the generation loop stopped (None while it runs)."""
        self.max_failures = max_failures  # failed steps in a row (no good step between) before the loop stops
        self.failures = 0  # the current run of failed steps
        self.recovered = 0  # failed steps the loop reset from, in all
        self._thread = threading.Thread(target=self._run, name="relayrl-batcher", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ client side
    def submit(self, req: Request) -> None:
        """Queue ``req``; raises :class:`Overloaded` when ``max_waiting`` requests already wait."""
        self.submit_all([req])

    def submit_all(self, reqs: list[Request]) -> None:
        """Queue the prompts of one client request together or none of them: :class:`Overloaded` when the
        queue has no room for all of them now (room comes as it drains), ``ValueError`` when they are more
        than the queue holds at all (waiting would never help)."""
        if len(reqs) > self.max_waiting:
            raise ValueError(f"{len(reqs)} prompts in one request exceed the {self.max_waiting} this server "
                             f"queues (relayrl serve --max-waiting); send at most {self.max_waiting} per request")
        for req in reqs:
            if not req.prompt:
                raise ValueError("the prompt is empty")
            if req.params.n > self.engine.max_batch:
                raise ValueError(f"n={req.params.n} exceeds the server's batch of {self.engine.max_batch} "
                                 "sequences")
            if req.seed is not None:
                # (a 64-bit seed plus k < n stays below 2**64, the most manual_seed takes)
                req.generators = [torch.Generator(device=self.engine.device).manual_seed(req.seed + k)
                                  for k in range(req.params.n)]
            req.left = req.params.n
        with self._cond:
            self._check_alive()
            if len(self._waiting) + len(reqs) > self.max_waiting:
                raise Overloaded(f"{len(self._waiting)} requests are waiting (at most {self.max_waiting}); "
                                 "retry later")
            self._waiting.extend(reqs)
            self._cond.notify()

    def load_weights(self, apply: Callable[[], int], timeout_s: float = 600.0, version: int | None = None) -> int:
        """Run ``apply`` (loads weights into the engine, returns the new version) in the batcher thread once
        the running batch has drained; blocks until done and returns the version. Past ``timeout_s``: a load
        still queued is dropped (nothing written); one being written cannot be stopped; either way
        :class:`WeightLoadTimeout` says which, and what serves now."""
        job = _WeightJob(apply)
        with self._cond:
            self._check_alive()
            self._weights.append(job)
            self._cond.notify()
        if not job.done.wait(timeout_s):
            raise self._timed_out(job, timeout_s, version)
        if job.error is not None:
            raise job.error
        assert job.version is not None
        return job.version

    def _timed_out(self, job: _WeightJob, timeout_s: float, version: int | None) -> WeightLoadTimeout:
        """Drop ``job`` if it has not started; the error naming what happened and what serves now."""
        what = "the weight load" if version is None else f"the weight load of version {version}"
        fix = "raise relayrl serve's --weight-load-timeout-s"
        with self._cond:
            queued = job in self._weights
            if queued:
                self._weights.remove(job)
            rows, waiting, served = len(self._batch), len(self._waiting), self.engine.weight_version
        if job.done.is_set():  # (it ended between the wait and the lock: its outcome stands)
            if job.error is not None:
                return WeightLoadTimeout(f"{what} ended after the {timeout_s:g} s deadline with {job.error!r}; "
                                         f"version {served} serves")
            return WeightLoadTimeout(f"{what} ended just after the {timeout_s:g} s deadline; version {served} "
                                     "serves now (GET /v1/relayrl/weights)")
        if queued:
            return WeightLoadTimeout(
                f"{what} did not start within {timeout_s:g} s: the running batch did not drain ({rows} rows still "
                f"decoding, {waiting} requests waiting); it was dropped and nothing was written, the old weights "
                f"(version {served}) serve on. Send it again, give requests a smaller max_tokens, or {fix}")
        return WeightLoadTimeout(
            f"{what} is still being written after {timeout_s:g} s (a slow device or disk?); it cannot be stopped "
            f"halfway: version {served} is the one served before it, nothing decodes until it ends, then the new "
            f"weights serve (GET /v1/relayrl/weights shows the version). Sending it again queues a second write; wait for it, or {fix}")

    def _check_alive(self) -> None:
        """Raise :class:`Unhealthy` once the loop has stopped (held: ``self._cond``), so nothing waits on it."""
        if self.error is not None:
            raise Unhealthy(f"the generation loop stopped: {self.error!r}; restart relayrl serve")
        if self._stop or not self._thread.is_alive():
            raise Unhealthy("the generation loop is not running (the server is shutting down?); restart relayrl serve")

    def problem(self) -> str | None:
        """Why the server cannot generate (the loop stopped), or None while it can."""
        with self._cond:
            try:
                self._check_alive()
            except Unhealthy as e:
                return str(e)
        return None

    def stats(self) -> dict[str, int]:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._batch), "steps": self.steps,
                    "generated_tokens": self.generated_tokens, "weight_version": self.engine.weight_version,
                    "recovered_failures": self.recovered}

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------ batcher thread
    def _run(self) -> None:
        try:
            with torch.no_grad():
                while self._wait_for_work():
                    try:
                        self._step()
                    except Exception as e:  # noqa: BLE001 - fails the running batch; _recover decides if it goes on
                        self._recover(e)
        except BaseException as e:  # noqa: BLE001 - reported to every waiting and running request
            self._fail_all(e)
            if not isinstance(e, Unrecoverable):
                raise
            log.error("relayrl serve: the generation loop stopped: %s", e)

    def _recover(self, e: Exception) -> None:
        """A step raised: fail the requests with rows in the batch (500, the cause named; not retried, their
        tokens may be half-sampled), reset the batch, and go on; raise :class:`Unrecoverable` when that cannot
        help (the reset failed, ``e`` is one, or ``max_failures`` steps failed in a row)."""
        failed = list(self._reqs.values())
        self._reqs.clear()
        self.failures += 1
        cause = f"generation failed: {e!r}"
        reset_error: Exception | None = None
        if not isinstance(e, Unrecoverable):
            try:
                self._reset()
            except Exception as r:  # noqa: BLE001 - a loop that cannot reset its state stops
                reset_error = r
        for req in failed:
            req.emit(DoneEvent(-1, "error", weight_version=self.engine.weight_version, error=cause))
        if isinstance(e, Unrecoverable):
            raise e
        log.warning("relayrl serve: a generation step failed (%d request(s) answered 500): %r", len(failed), e)
        if reset_error is not None:
            raise Unrecoverable(f"resetting the generation loop after {e!r} failed: {reset_error!r}") from reset_error
        if self.failures >= self.max_failures:
            raise Unrecoverable(f"{self.failures} generation steps failed in a row (the last: {e!r})") from e
        self.recovered += 1

    def _reset(self) -> None:
        """A fresh running batch (the KV cache and rows of the failed one dropped) and the engine's caches freed."""
        self._batch = RunningBatch()
        self.engine.release()
        if self.engine.device.type == "cuda":
            torch.cuda.empty_cache()  # (after an out-of-memory error, the failed batch's blocks)

    def _wait_for_work(self) -> bool:
        with self._cond:
            while not self._stop and not self._waiting and not len(self._batch) and not self._weights:
                self._cond.wait()
            return not self._stop

    def _step(self) -> None:
        eng, batch = self.engine, self._batch
        if self._weights and not len(batch):  # the batch drained: new weights go in before anything is admitted
            self._apply_weights()
            return
        if not self._weights:  # while a weight load waits, admit nothing: the running rows drain
            self._admit()
        if not len(batch):
            return
        self._drop_cancelled()
        if not len(batch):
            return
        tok = torch.empty(len(batch), dtype=torch.long, device=eng.device)
        logp = torch.empty(len(batch), dtype=torch.float32, device=eng.device)
        logits = batch.next_logits.float()
        tops: dict[int, tuple[tuple[int, float], ...]] = {}
        failed: dict[int, str] = {}  # row position -> why its sampling failed
        for params, pos in self._sampling_groups():
            idx = torch.tensor(pos, device=eng.device)
            seen = eng.seen_tokens(batch)[idx] if params.repetition_penalty != 1.0 else None
            u = self._uniforms(pos) if params.temperature > 0 else None
            try:
                t, lp = sample_next(logits[idx], params, uniforms=u, seen=seen)
            except Exception as e:  # noqa: BLE001 - settings it cannot sample with fail their rows, not the loop
                failed.update((p, f"sampling failed: {e!r}") for p in pos)
                tok[idx], logp[idx] = 0, 0.0
                continue
            tok[idx], logp[idx] = t, lp
            k = max(self._reqs[batch.rows[p][0]].top_logprobs for p in pos)
            if k:
                scaled = logits[idx] / params.temperature if params.temperature > 0 else logits[idx]
                v, i = torch.log_softmax(scaled, dim=-1).topk(min(k, scaled.shape[-1]), dim=-1)
                for j, p in enumerate(pos):
                    n_top = self._reqs[batch.rows[p][0]].top_logprobs
                    tops[p] = tuple(zip(i[j, :n_top].tolist(), v[j, :n_top].tolist()))
        tok_l, logp_l = tok.tolist(), logp.tolist()
        keep: list[int] = []
        for r, (rid, sample) in enumerate(batch.rows):
            req = self._reqs[rid]
            if r in failed:  # (the request's rows share its settings: all of them fail, the other rows go on)
                self._finish(req, sample, "error", batch.tokens[r], batch.logps[r], failed[r])
                continue
            batch.tokens[r].append(tok_l[r])
            batch.logps[r].append(logp_l[r])
            batch.versions[r].append(eng.weight_version)
            if req.stream_tokens:
                req.emit(TokenEvent(sample, tok_l[r], logp_l[r], tops.get(r, ())))
            reason = eng.finish_reason(batch.tokens[r], req.params, eng.stop_ids(req.params))
            if reason:
                self._finish(req, sample, reason, batch.tokens[r], batch.logps[r])
            else:
                keep.append(r)
        self.generated_tokens += len(batch)
        self.steps += 1
        if len(keep) < len(batch):
            eng.retain(batch, keep)
            tok = tok[keep]
        if len(batch):
            eng.advance(batch, tok)
        self.failures = 0  # a good step ends a run of failed ones

    def _admit(self) -> None:
        eng, batch = self.engine, self._batch
        free = eng.max_batch - len(batch)
        with self._cond:
            admit: list[Request] = []
            while self._waiting and free >= self._waiting[0].params.n:
                req = self._waiting.popleft()
                if req.cancelled:
                    req.emit(DoneEvent(-1, "cancelled"))
                    continue
                admit.append(req)
                free -= req.params.n
        for r in admit:  # (all of them before any prefill: a failed one fails them all, none is lost)
            self._reqs[r.id] = r
        # one prefill per distinct n (the engine repeats each prompt's cache n times)
        for n in sorted({r.params.n for r in admit}):
            group = [r for r in admit if r.params.n == n]
            eng.admit(batch, [r.prompt for r in group], [r.id for r in group], n)

    def _sampling_groups(self) -> list[tuple[SamplingParams, list[int]]]:
        """Row positions grouped by sampling settings: each group is one ``sample_next`` call (seeded or not,
        each row's uniform comes from :meth:`_uniforms`)."""
        groups: dict[tuple, list[int]] = {}
        for r, (rid, _) in enumerate(self._batch.rows):
            p = self._reqs[rid].params
            groups.setdefault((p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty), []).append(r)
        return [(self._reqs[self._batch.rows[pos[0]][0]].params, pos) for pos in groups.values()]

    def _uniforms(self, pos: list[int]) -> torch.Tensor:
        """The uniform [len(pos)] float64 that samples each row's next token: a seeded request's sample ``k``
        draws one from its generator per token (what ``sample_next`` draws for a one-row call, so sample 0 of
        ``n=3`` is the ``n=1`` sample); the other rows draw from the batcher's generator."""
        dev = self.engine.device
        rows = [self._batch.rows[p] for p in pos]
        free = [j for j, (rid, _) in enumerate(rows) if self._reqs[rid].generators is None]
        u = torch.empty(len(pos), dtype=torch.float64, device=dev)
        if free:
            u[free] = torch.rand(len(free), generator=self._generator, dtype=torch.float64, device=dev)
        for j, (rid, sample) in enumerate(rows):
            gens = self._reqs[rid].generators
            if gens is not None:
                u[j] = torch.rand(1, generator=gens[sample], dtype=torch.float64, device=dev)[0]
        return u

    def _drop_cancelled(self) -> None:
        batch = self._batch
        gone = {rid for rid, _ in batch.rows if self._reqs[rid].cancelled}
        if not gone:
            return
        keep = [r for r, (rid, _) in enumerate(batch.rows) if rid not in gone]
        self.engine.retain(batch, keep)
        for rid in gone:
            self._reqs.pop(rid).emit(DoneEvent(-1, "cancelled"))

    def _finish(self, req: Request, sample: int, reason: str, toks: list[int], logps: list[float],
                error: str | None = None) -> None:
        req.emit(DoneEvent(sample, reason, tuple(toks), tuple(logps),  # type: ignore[arg-type]
                           self.engine.weight_version, error))
        req.left -= 1
        if req.left == 0:
            self._reqs.pop(req.id, None)

    def _apply_weights(self) -> None:
        with self._cond:
            job = self._weights.popleft()
        t0 = time.perf_counter()
        try:
            job.version = job.apply()
        except BaseException as e:  # noqa: BLE001 - handed to the caller of load_weights, who raises it
            job.error = e
        self.last_weight_load_s = time.perf_counter() - t0
        job.done.set()
        if isinstance(job.error, Unrecoverable):  # (the weights may be neither the old nor the new ones)
            raise job.error

    def _fail_all(self, e: BaseException) -> None:
        """The loop stops: every request it holds is refused (503, never decoded) and so is every later one."""
        with self._cond:
            self.error = e
            running = list(self._reqs.values())
            waiting = list(self._waiting)
            self._waiting.clear()
            self._reqs.clear()
            jobs = list(self._weights)
            self._weights.clear()
        for r in running:
            r.emit(DoneEvent(-1, "error", error=f"generation failed: {e!r}"))
        for r in waiting:
            r.emit(DoneEvent(-1, "error", error=f"the generation loop stopped: {e!r}; restart relayrl serve",
                             unavailable=True))
        for j in jobs:
            j.error = Unhealthy(f"the generation loop stopped: {e!r}; restart relayrl serve")
            j.done.set()
