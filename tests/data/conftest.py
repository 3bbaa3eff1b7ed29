"""Fixtures of the data tests: the tiny tokenizer, built once per session."""

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny default tokenizer (ChatML template); reuses ``$RELAYRL_CACHE`` when set, else builds in a temp dir."""
    from relayrl.models.load import load_tokenizer
    from relayrl.models.tiny import build_tiny

    cache = Path(os.environ["RELAYRL_CACHE"]) if os.environ.get("RELAYRL_CACHE") else tmp_path_factory.mktemp("tiny")
    return load_tokenizer(build_tiny(cache_dir=cache, verbose=False))
