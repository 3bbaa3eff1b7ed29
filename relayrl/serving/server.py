"""Start ``relayrl serve``: load the model, start the batcher, bind, run uvicorn.

The socket is bound here before uvicorn starts, so ``--port 0`` picks a free
port and the first line printed names it (tests and scripts read it). Binding
to anything but a loopback address without a bearer token is refused: the
server would otherwise hand generation, and weight loading from a path, to
anyone who can reach it.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from relayrl.errors import UserError
from relayrl.serving.guard import is_loopback
from relayrl.serving.protocol import ServeLimits

__all__ = ["ServeError", "is_loopback", "build_state", "serve"]


class ServeError(UserError, ValueError):
    """A serve option that cannot work, with the fix in the message."""


SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
"""The sampling fields a request may leave out whose default the model's ``generation_config.json`` can set."""


def sampling_defaults(model_dir: str) -> dict[str, float]:
    """The defaults of a request's sampling fields that the model's ``generation_config.json`` sets away from
    Hugging Face's (``{"temperature": 0.6, "top_p": 0.95, "top_k": 20}`` for Qwen3), as ``vllm serve`` takes
    them with its default ``--generation-config auto``; a field the file leaves alone keeps OpenAI's default."""
    from relayrl.models.eos import checkpoint_generation_config

    given = checkpoint_generation_config(model_dir).to_diff_dict()
    return {k: float(given[k]) if k != "top_k" else int(given[k]) for k in SAMPLING_DEFAULTS
            if given.get(k) is not None}


def build_state(model_dir: str, *, limits: ServeLimits, api_key: str | None, max_batch: int = 64,
                dtype: str = "float32", device: str = "cpu", seed: int = 0, name: str | None = None,
                generation_config: str = "auto"):
    """The server's shared state: model and tokenizer from ``model_dir``, an engine and its batcher;
    ``generation_config``: ``auto`` takes the requests' sampling defaults from the model's generation config
    (:func:`sampling_defaults`), ``none`` keeps OpenAI's."""
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.models.load import load_model, load_tokenizer
    from relayrl.serving.app import ServerState
    from relayrl.serving.batcher import Batcher

    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, dtype=dtype, device=device, attn_implementation="auto")
    engine = NativeGenerationEngine(model, tok, max_batch=max_batch, device=device, decode="dynamic",
                                    log=lambda *_: None)
    batcher = Batcher(engine, max_waiting=limits.max_waiting, seed=seed)
    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return ServerState(batcher=batcher, tokenizer=tok, model_name=name or Path(model_dir).resolve().name,
                       limits=limits, api_key=api_key, max_model_len=int(model.config.max_position_embeddings),
                       max_weights_bytes=4 * n_bytes + (64 << 20),  # float32 copies of bf16 weights, plus headers
                       sampling_defaults=sampling_defaults(model_dir) if generation_config == "auto" else {})


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening (port 0: any free one): connections queue from now on,
    so a client may connect as soon as the address is printed."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot bind {host}:{port}: {e.strerror}; pick another --port (0: any free one)") from None
    sock.listen(2048)
    return sock


def serve(model_dir: str, *, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          limits: ServeLimits | None = None, max_batch: int = 64, dtype: str = "float32", device: str = "auto",
          seed: int = 0, threads: int = 0, name: str | None = None, generation_config: str = "auto",
          log=print) -> None:
    """Serve until interrupted."""
    import torch
    import uvicorn

    from relayrl.models.load import check_model_dir
    from relayrl.serving.app import build_app

    if not is_loopback(host) and not api_key:
        raise ServeError(f"--host {host} exposes the server beyond this machine; set a bearer token first "
                         f"(RELAYRL_API_KEY=... or --api-key-file FILE), or bind to 127.0.0.1")
    check_model_dir(model_dir, "", f"relayrl serve {model_dir}")  # a run's directory: its model/ is suggested
    if threads:
        torch.set_num_threads(threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device.startswith("cuda") and not torch.cuda.is_available():  # (else a traceback as the model moves)
        raise ServeError(f"relayrl serve: --device {device} but torch sees no GPU here (torch {torch.__version__}); "
                         f"give --device cpu (or auto)")
    state = build_state(model_dir, limits=limits or ServeLimits(), api_key=api_key, max_batch=max_batch,
                        dtype=dtype, device=device, seed=seed, name=name, generation_config=generation_config)
    app = build_app(state)
    sock = listening_socket(host, port)
    bound = sock.getsockname()[1]
    log(f"relayrl serve: {state.model_name} on http://{host}:{bound}/v1 (max_batch={max_batch}, device={device}, "
        f"auth={'bearer' if api_key else 'none'}, pid={os.getpid()})", flush=True)
    if state.sampling_defaults:  # (as vllm serve says it)
        log(f"relayrl serve: a request that leaves them out samples with the model's generation_config.json: "
            f"{state.sampling_defaults} (--generation-config none: OpenAI's defaults)", flush=True)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        state.batcher.close()
        sock.close()
