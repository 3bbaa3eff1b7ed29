"""A recipe is read and validated without importing torch or transformers (about 5 s of imports here), so a
typo in a config is refused in about a second. The config models live in torch-free modules next to their
components (``relayrl/engines/training/config.py``, ``relayrl/models/lora_config.py``, ...); this test fails
when one of them, or a package ``__init__`` above it, imports torch again."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Every shipped recipe, as written on a machine with no GPU driver (on one with a driver, device auto or cuda
# with extra pools asks torch how many GPUs there are: there, on model.device=cpu), two of them as written
# anyway, and `relayrl train` refusing a typo.
PROBE = """
import os
import sys
from pathlib import Path

import pytest

from relayrl.cli.main import main
from relayrl.config.loader import load_run_config
from relayrl.config.schema import GPU_NODES

over = ["model.device=cpu"] if any(os.path.exists(p) for p in GPU_NODES) else []
for recipe in sorted(Path("recipes").glob("*.yaml")):
    load_run_config(recipe, over)
load_run_config("recipes/arith_grpo.yaml")
load_run_config("recipes/toolsum_grpo.yaml")
code = main(["train", "recipes/arith_grpo.yaml", "engine.optim.lr=abc"])
print(code, "torch" in sys.modules, "transformers" in sys.modules, file=sys.stderr)
"""


@pytest.mark.slow  # (over half a second; the full make test runs it)
def test_recipes_validate_and_a_bad_one_is_refused_without_importing_torch():
    r = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert "engine.optim.lr: Input should be a valid number" in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == "2 False False", r.stderr[-2000:]
