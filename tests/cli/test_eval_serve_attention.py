"""``relayrl eval --model`` and ``relayrl serve`` take no attention key, so they load a model with the attention
that computes it (``inference_attention``): eager for Gemma 2's capped scores and GPT-OSS's sinks. Before, both
loaded with SDPA and refused a Gemma 2 model (its own export included), telling the user to set
model.attn_implementation, which neither command takes."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from test_cli_errors import run  # (the in-process runner)
from tests.models.architectures import build


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    pass


@pytest.fixture()
def gemma2_dir(tiny_tokenizer, tmp_path):
    out = tmp_path / "gemma2"
    build("gemma2", vocab=len(tiny_tokenizer)).save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("arch, attention", [("gemma2", "eager"), ("gpt_oss", "eager"), ("llama", "sdpa"),
                                             ("gemma3_text", "sdpa")])
def test_the_attention_a_standalone_load_picks(arch, attention):
    from relayrl.models.load import inference_attention

    assert inference_attention(AutoConfig.for_model(arch)) == attention


def test_eval_and_serve_load_a_gemma2_model(capsys, gemma2_dir, tmp_path):
    code, err = run(capsys, "eval", "--model", str(gemma2_dir), "--task", "arith", "--size", "2",
                    "--max-new-tokens", "2", "--device", "cpu", "--out", str(tmp_path / "e"))
    assert code == 0, err
    assert (tmp_path / "e" / "eval.json").is_file()

    from relayrl.serving.protocol import ServeLimits
    from relayrl.serving.server import build_state

    state = build_state(str(gemma2_dir), limits=ServeLimits(), api_key=None, device="cpu")
    assert state.batcher.engine.model.config._attn_implementation == "eager"


def test_the_planner_measures_a_gemma2_models_lengths(gemma2_dir):
    """``relayrl plan``'s length measurement loads the model with the attention it computes with (it loaded with
    SDPA and so refused a Gemma 2 model, naming model.attn_implementation)."""
    from relayrl.planner.from_config import measure_lengths

    lengths = measure_lengths(str(gemma2_dir), [[1, 2, 3]], n=2, max_new_tokens=3, threads=1)
    assert len(lengths) == 2 and all(1 <= n <= 3 for n in lengths)
