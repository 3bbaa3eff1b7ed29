import shutil
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def one_thread(one_torch_thread):
    """Every test here runs torch on one thread (tests/conftest.py)."""


@pytest.fixture()
def model_copy(tiny_dir, tmp_path) -> Path:
    """A writable copy of the tiny model's directory, to damage."""
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))
