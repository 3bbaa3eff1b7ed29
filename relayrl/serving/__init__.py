"""Serving: an OpenAI-compatible HTTP server over the native engine (``relayrl serve``).

* ``batcher.py`` - continuous batching across requests (one thread owns the engine).
* ``protocol.py``, ``responses.py`` - the API's request and response records.
* ``app.py`` - the FastAPI routes, limits and the bearer-token guard.
* ``server.py`` - loading, binding and running uvicorn.

The rollout adapter that generates through such a server is
``relayrl.engines.generation.remote``; the dock's service API is ``relayrl.dock.service``.
"""
