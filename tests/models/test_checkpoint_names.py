"""Weights under their checkpoint's names and layout (relayrl.models.checkpoint_names), as the engines that load
checkpoints (vLLM) read them: transformers 5 fuses an MoE layer's experts in memory."""

import pytest
import torch
from safetensors.torch import load_file

from relayrl.models.checkpoint_names import CheckpointNames

from tests.models.architectures import build


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama", "gemma2"])
def test_each_tensor_maps_to_what_save_pretrained_writes(arch, tmp_path):
    """Tensor by tensor, the in-memory weights come out as the checkpoint save_pretrained writes: the same names
    (Qwen3-MoE's experts one tensor per expert, Mixtral's under block_sparse_moe) and the same values."""
    model = build(arch)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    names = CheckpointNames(model)
    assert names.identity == (arch in ("llama", "gemma2"))
    mapped = dict(names.stream(model.state_dict().items()))
    tied = {k for k in mapped if k not in saved and k.startswith("lm_head")}  # (a tied head is not saved)
    assert set(mapped) - tied == set(saved)
    for k, v in saved.items():
        torch.testing.assert_close(mapped[k], v, atol=0, rtol=0, msg=k)
    if not names.identity:
        assert set(mapped) != set(model.state_dict())  # (another layout than in memory)


def test_a_directory_gives_the_same_mapping(tmp_path):
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    t = model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    got = CheckpointNames.of_dir(tmp_path)("model.layers.0.mlp.experts.gate_up_proj", t)
    assert [n for n, _ in got] == [n for n, _ in CheckpointNames(model)("model.layers.0.mlp.experts.gate_up_proj", t)]
    experts = t.shape[0]
    assert len(got) == 2 * experts  # gate_proj and up_proj of every expert


def test_the_vllm_engine_sends_an_moe_models_weights_under_checkpoint_names(tmp_path):
    """The vLLM engine's weight stream (checked against the in-memory names) hands vLLM the checkpoint's names:
    before, Qwen3-MoE's fused experts went as ``mlp.experts.gate_up_proj``, which vLLM's loader skipped."""
    vllm_engine = pytest.importorskip("relayrl.engines.generation.vllm_engine")
    if not vllm_engine.vllm_available():
        pytest.skip("needs vLLM")
    model = build("qwen3_moe")
    model.save_pretrained(tmp_path)
    eng = vllm_engine.VLLMGenerationEngine.__new__(vllm_engine.VLLMGenerationEngine)  # (no vLLM started)
    eng.model_dir, eng._shapes, eng._head_copy = str(tmp_path), None, None
    shapes = eng.weight_shapes()
    sent = dict(eng._checked(shapes, model.state_dict().items(), copy_head=False))
    assert set(sent) == set(load_file(tmp_path / "model.safetensors"))
