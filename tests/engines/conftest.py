import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    # The engine tests use tiny models; default threads on a shared 2-core machine oversubscribe
    # (test_training.py took ~65 s instead of ~8 s).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
