"""A damaged model directory is a ModelLoadError (a user error) naming the directory, the file and what is
wrong with it: truncated or foreign safetensors, weights of another shape, JSON files that do not parse."""

import json

import pytest

from relayrl.errors import is_user_error
from relayrl.models.load import ModelLoadError, load_model, load_tokenizer

TRUNCATED = "model.safetensors is truncated or not a safetensors file"


def _refused(load, path, *says: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        load(path)
    assert is_user_error(e.value)
    msg = str(e.value)
    assert f"model directory {path}" in msg
    for s in says:
        assert s in msg, msg
    return msg


@pytest.mark.parametrize("damage,detail", [
    (lambda b: b[: len(b) // 2], "file not fully covered"),  # a copy cut short
    (lambda b: b"", "header too small"),
    (lambda b: bytes(range(256)) * 64, "header too large"),  # not safetensors at all
], ids=["cut-short", "empty", "random-bytes"])
def test_a_damaged_safetensors_file_is_named(model_copy, damage, detail):
    weights = model_copy / "model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    _refused(load_model, model_copy, TRUNCATED, detail, "copy it again from the original model")


def test_a_missing_shard_of_a_sharded_model_is_named(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors",
                                            "model.embed_tokens.weight": "model-00002-of-00002.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    _refused(load_model, model_copy, "lacks model-00002-of-00002.safetensors (named in "
             "model.safetensors.index.json)")


def test_weights_of_another_shape_name_the_first_mismatched_tensor(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    width, vocab = cfg["hidden_size"], cfg["vocab_size"]
    cfg.update(hidden_size=2 * width, intermediate_size=4 * width)  # the weights stay those of `width`
    (model_copy / "config.json").write_text(json.dumps(cfg))
    msg = _refused(load_model, model_copy, "the weights do not match config.json: ")
    assert f"model.embed_tokens.weight is [{vocab}, {width}] in the weights but [{vocab}, {2 * width}] by " \
           f"config.json (and " in msg


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json", "tokenizer.json"])
def test_a_json_file_that_does_not_parse_is_named_with_its_position(model_copy, name):
    (model_copy / name).write_text('{"architectures": [')
    load = load_model if name == "config.json" else load_tokenizer
    _refused(load, model_copy, f"{name} is not valid JSON (Expecting value at line 1 column 20)")
    if name == "config.json":  # the tokenizer reads it too
        _refused(load_tokenizer, model_copy, f"{name} is not valid JSON")


def test_a_config_that_is_not_an_object_is_refused(model_copy):
    (model_copy / "config.json").write_text("[1, 2]")
    _refused(load_model, model_copy, "config.json holds a JSON list, not an object")
    _refused(load_tokenizer, model_copy, "config.json holds a JSON list, not an object")


def test_a_truncated_bin_checkpoint_is_named(model_copy):
    import torch
    from safetensors.torch import load_file

    weights = model_copy / "model.safetensors"
    torch.save(load_file(weights), model_copy / "pytorch_model.bin")
    weights.unlink()
    load_model(model_copy)  # whole, it loads
    data = (model_copy / "pytorch_model.bin").read_bytes()
    (model_copy / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    _refused(load_model, model_copy, "a *.bin weight file is truncated or not a PyTorch checkpoint")


def test_a_damaged_reward_model_names_its_key_and_file(tiny_dir, tiny_tokenizer, tmp_path):
    from relayrl.models.load import load_value_model
    from relayrl.models.reward import export_reward_model, load_reward_model

    path = tmp_path / "rm"
    export_reward_model(load_value_model(tiny_dir, bias=False), tiny_tokenizer, path)
    load_reward_model(path)
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[:100])
    msg = _refused(load_reward_model, path, TRUNCATED)
    assert msg.startswith(f"reward.model: model directory {path}: ")
    (path / "config.json").write_text("{")
    _refused(load_reward_model, path, "config.json is not valid JSON")


def test_a_whole_directory_still_loads_its_weights(model_copy):
    import torch
    from safetensors.torch import load_file

    load_tokenizer(model_copy)
    params = dict(load_model(model_copy).named_parameters())
    for name, t in load_file(model_copy / "model.safetensors").items():
        torch.testing.assert_close(params[name].detach(), t)


def _drop(path, keep):
    """Rewrite ``path/model.safetensors`` with only the tensors whose name ``keep`` accepts."""
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    save_file({k: v for k, v in weights.items() if keep(k)}, path / "model.safetensors", metadata={"format": "pt"})


def test_weights_missing_from_the_directory_are_named_not_initialised_at_random(model_copy):
    """transformers starts a tensor missing from the weights at random and only logs a report (fails before)."""
    _drop(model_copy, lambda k: k != "model.layers.1.mlp.down_proj.weight")
    _refused(load_model, model_copy, "the weights lack 1 of the model's tensors (model.layers.1.mlp.down_proj.weight), "
             "which would start at random; copy the weights again")
    _drop(model_copy, lambda k: ".layers.0." not in k)  # and a whole layer: a few names, then how many more
    _refused(load_model, model_copy, "the weights lack 13 of the model's tensors (model.layers.0.input_layernorm."
             "weight, model.layers.0.mlp.down_proj.weight, model.layers.0.mlp.gate_proj.weight, model.layers.0.mlp."
             "up_proj.weight, model.layers.0.post_attention_layernorm.weight and 8 more)")


def test_a_tied_head_is_not_in_the_file_and_loads(model_copy):
    """lm_head.weight tied to the embeddings is saved once (as the embeddings) and is not missing."""
    from safetensors import safe_open

    with safe_open(str(model_copy / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    model = load_model(model_copy)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight


def test_an_untied_head_missing_from_the_file_is_refused(tiny_dir, tmp_path):
    import torch

    model = load_model(tiny_dir)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    path = tmp_path / "untied"
    model.save_pretrained(path)
    load_tokenizer(tiny_dir).save_pretrained(path)
    assert not load_model(path).config.tie_word_embeddings  # whole: it loads
    _drop(path, lambda k: k != "lm_head.weight")
    _refused(load_model, path, "the weights lack 1 of the model's tensors (lm_head.weight)")


@pytest.mark.parametrize("field,value,says", [("hidden_size", "big", "Field 'hidden_size' expected int"),
                                              ("num_hidden_layers", -2, "num_hidden_layers")])
def test_a_config_value_transformers_refuses_is_a_message_not_a_traceback(model_copy, field, value, says):
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, field: value}))
    for load in (load_model, load_tokenizer):
        _refused(load, model_copy, "config.json is not a model config transformers accepts", says)


def test_a_config_without_its_shape_is_refused_before_the_default_7b_model_is_built(model_copy, monkeypatch):
    """Qwen2's defaults describe a 7B model: the shapes are compared on the meta device, nothing is allocated."""
    import transformers

    (model_copy / "config.json").write_text(json.dumps({"model_type": "qwen2", "vocab_size": 10}))

    def no_build(*a, **kw):
        raise AssertionError("the model was built")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_build)
    _refused(load_model, model_copy, "model.embed_tokens.weight is [", "but [10, 4096] by config.json")


def test_shards_without_their_index_are_named(model_copy):
    """Sharded weights without model.safetensors.index.json: transformers looks for model.safetensors only."""
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    _refused(load_model, model_copy, "has sharded weights (model-00001-of-00002.safetensors) but no "
             "model.safetensors.index.json", "copy model.safetensors.index.json from the original model")


def test_an_architecture_transformers_does_not_know_is_named_with_what_to_do(model_copy):
    cfg = json.loads((model_copy / "config.json").read_text())
    (model_copy / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen9",
                                                        "architectures": ["Qwen9ForCausalLM"]}))
    for load in (load_model, load_tokenizer):
        msg = _refused(load, model_copy, "config.json's model_type 'qwen9' (Qwen9ForCausalLM) is not an "
                       "architecture transformers", "docs/models.md")
        assert "pip install" not in msg  # (transformers' own advice, for a hub model; relayrl names its own)


def test_a_model_that_is_not_a_causal_lm_is_refused_before_its_weights_load(model_copy):
    """A T5 directory (an encoder-decoder) given as model.path: refused up front with what relayrl trains, not
    AutoModelForCausalLM's list of 170 config classes from a worker."""
    from transformers import T5Config

    from relayrl.models.load import check_model_dir

    conf = T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2, d_kv=8).to_dict()
    (model_copy / "config.json").write_text(json.dumps({**conf, "architectures": ["T5ForConditionalGeneration"]}))
    says = ("T5Config (T5ForConditionalGeneration), for which transformers has no causal LM class",
            "relayrl trains decoder-only causal LMs")
    _refused(load_model, model_copy, *says)
    with pytest.raises(ModelLoadError, match="model.path=X: model directory .* T5Config"):
        check_model_dir(model_copy, "model.path", "model.path=X")


def test_an_encoder_with_bidirectional_attention_is_refused_though_transformers_gives_it_an_lm_head(model_copy):
    """BERT loads through AutoModelForCausalLM (BertLMHeadModel), but without is_decoder its attention sees the
    tokens after each position: its log-probs would be of text it already read."""
    from transformers import BertConfig

    conf = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32).to_dict()
    (model_copy / "config.json").write_text(json.dumps({**conf, "architectures": ["BertForMaskedLM"]}))
    _refused(load_model, model_copy, "BertConfig (BertForMaskedLM), an encoder: its attention is bidirectional",
             "relayrl trains decoder-only causal LMs")


def test_a_tokenizer_without_its_vocabulary_files_is_refused(model_copy):
    """tokenizer_config.json without tokenizer.json: transformers builds a tokenizer of its 3 special tokens
    that encodes every prompt as nothing (the run then failed in a worker: 'prompt 0 is empty')."""
    (model_copy / "tokenizer.json").unlink()
    _refused(load_tokenizer, model_copy, "the tokenizer's vocabulary is missing: ",
             "reads tokenizer.json", "copy the tokenizer files from the original model")


def test_a_tokenizer_larger_than_the_embedding_is_refused(model_copy):
    """Token ids past the embedding's rows: a prompt holding one would index past it (on CUDA a device-side
    assert), and the model can never sample those tokens; an embedding larger than the tokenizer is normal."""
    cfg = json.loads((model_copy / "config.json").read_text())
    tokens = len(load_tokenizer(model_copy))
    (model_copy / "config.json").write_text(json.dumps({**cfg, "vocab_size": tokens - 3}))
    _refused(load_tokenizer, model_copy, f"the tokenizer has {tokens} tokens (ids up to {tokens - 1}) but the "
             f"model's embedding has {tokens - 3} rows (vocab_size in config.json)", "resize_token_embeddings")
    (model_copy / "config.json").write_text(json.dumps({**cfg, "vocab_size": tokens + 64}))
    load_tokenizer(model_copy)


def test_a_tokenizer_saved_as_its_tokenizer_json_keeps_its_trained_pre_tokenizer(model_copy):
    """The tiny default's tokenizer (``tokenizers``-trained, every digit its own piece) is saved by transformers 5
    as ``TokenizersBackend``; AutoTokenizer would load it as the config's model type's (Qwen2Tokenizer), with that
    tokenizer's regex in place of the trained pre-tokenizer. It loads as its tokenizer.json says."""
    from tokenizers import Tokenizer

    assert json.loads((model_copy / "tokenizer_config.json").read_text())["tokenizer_class"] in (
        "TokenizersBackend", "PreTrainedTokenizerFast")
    tok = load_tokenizer(model_copy)
    raw = Tokenizer.from_file(str(model_copy / "tokenizer.json"))
    assert str(tok.backend_tokenizer.pre_tokenizer) == str(raw.pre_tokenizer)
    assert "Digits(individual_digits=True)" in str(tok.backend_tokenizer.pre_tokenizer)


def test_weights_with_tensors_the_config_has_no_place_for_are_refused(model_copy):
    """A config.json with fewer layers than its weights: transformers drops the extra layers and only logs a
    table (a 2-layer model trained from 4 layers' weights; passed before)."""
    cfg = json.loads((model_copy / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    cfg["num_hidden_layers"] = layers - 1
    if "layer_types" in cfg:
        cfg["layer_types"] = cfg["layer_types"][:layers - 1]
    (model_copy / "config.json").write_text(json.dumps(cfg))
    msg = _refused(load_model, model_copy, "tensors that the model config.json describes has no place for "
                   f"(model.layers.{layers - 1}.", "put the config.json saved with these weights beside them")
    assert f"model.layers.{layers - 2}." not in msg
