import pytest


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture(scope="module")
def vllm_dir():
    """The vLLM tests' tiny model: heads of 32 dimensions (vLLM's CPU attention has no 16), 2 heads and 2
    key/value heads, so each of 2 tensor-parallel workers holds one of each."""
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    return build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
