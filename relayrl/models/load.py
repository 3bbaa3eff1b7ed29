"""Load Hugging Face causal LMs and tokenizers from a local directory.

No hub is reachable from relayrl's machines, so loading is always local
(``local_files_only=True``): a missing or incomplete directory is reported with
what is missing instead of an attempted download. A damaged directory is
reported naming the file and what is wrong with it: a JSON file that does not
parse (with the line and column), a truncated or foreign ``*.safetensors`` file,
weights whose shapes do not match ``config.json`` (the first mismatched tensor),
weights that lack some of the model's tensors (named: transformers would start
them at random and only log a report) or hold tensors the model has no place for (dropped, only logged), shards without their index. A tied weight (``lm_head.weight`` tied to
``model.embed_tokens.weight``) is saved once, and its absence is not refused. A ``model_type`` this transformers
does not know, a model that is not a causal LM (T5), a tokenizer without its vocabulary files (transformers
builds one of its special tokens alone) and a tokenizer with ids past the embedding are refused, saying what to do.
"""

from __future__ import annotations

import json
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

import torch

from relayrl.errors import UserError

__all__ = ["attention_windows", "load_model", "load_tokenizer", "load_pretrained", "read_json", "resolve_dtype",
           "absent_weights", "few_names", "progress_bars", "ModelLoadError", "decoder_layers", "check_attention",
           "check_causal_lm", "inference_attention"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer directory that cannot be loaded, with the reason."""


def resolve_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


_JSON_FILES = ("config.json", "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json",
               "added_tokens.json", "model.safetensors.index.json")
"""The JSON files of a model directory that ``from_pretrained`` cannot do without (it skips a damaged
``generation_config.json``)."""

_REFETCH = "copy it again from the original model (or save the model again)"


def read_json(path: Path, name: str) -> dict:
    """``path/name`` as a JSON object, or a :class:`ModelLoadError` naming the file and where it breaks."""
    try:
        data = json.loads((path / name).read_bytes())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"model directory {path}: {name} is not valid JSON ({e.msg} at line {e.lineno} "
                             f"column {e.colno}); fix it, or {_REFETCH}") from None
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"model directory {path}: {name} is not UTF-8 text (byte {e.start}); "
                             f"{_REFETCH}") from None
    if not isinstance(data, dict):
        raise ModelLoadError(f"model directory {path}: {name} holds a JSON {type(data).__name__}, not an object "
                             f"({{...}}); {_REFETCH}")
    return data


def _name_bad_json(path: Path) -> None:
    """Raise the :class:`ModelLoadError` of the first JSON file in ``path`` that does not parse (if any)."""
    for name in _JSON_FILES:
        if (path / name).is_file():
            read_json(path, name)


def _safetensors_files(path: Path) -> list[Path]:
    """The ``*.safetensors`` files ``from_pretrained`` reads: the shards of the index, else ``model.safetensors``."""
    if (path / "model.safetensors.index.json").is_file():
        shards = sorted(set(read_json(path, "model.safetensors.index.json").get("weight_map", {}).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise ModelLoadError(f"model directory {path} lacks {', '.join(missing)} (named in "
                                 f"model.safetensors.index.json); copy the missing shards")
        return [path / s for s in shards]
    return [path / "model.safetensors"] if (path / "model.safetensors").is_file() else []


def _check_index(path: Path) -> None:
    """Refuse shards (``model-00001-of-00004.safetensors``) without the index that maps tensors to them:
    ``from_pretrained`` then looks for one ``model.safetensors`` and says only that it is not there."""
    for weights, index in (("model.safetensors", "model.safetensors.index.json"),
                           ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        stem, ext = weights.split(".")
        shards = sorted(f.name for f in path.glob(f"{stem}-*-of-*.{ext}"))
        if shards and not (path / weights).is_file() and not (path / index).is_file():
            raise ModelLoadError(f"model directory {path} has sharded weights ({few_names(shards, 2)}) but no "
                                 f"{index}, which says which tensors each shard holds; copy {index} from the "
                                 f"original model")


def _check_safetensors(path: Path) -> None:
    """Read the header of each weight file (cheap: no tensor is read); a damaged one is named."""
    from safetensors import SafetensorError, safe_open

    for file in _safetensors_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()  # the header: names, shapes and offsets
        except SafetensorError as e:
            raise ModelLoadError(f"model directory {path}: {file.name} is truncated or not a safetensors file "
                                 f"({e}); {_REFETCH}") from None


def model_config(path: Path):
    """``config.json`` as transformers reads it; a value it refuses (``hidden_size: "big"``, a negative layer
    count) or a ``model_type`` it does not know is a :class:`ModelLoadError` naming the directory and the field,
    not a library traceback."""
    from transformers import AutoConfig

    _check_model_type(path)
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - invalid fields raise huggingface_hub's StrictDataclassError too
        _name_bad_json(path)
        why = " ".join(str(e).split())
        raise ModelLoadError(f"model directory {path}: config.json is not a model config transformers accepts "
                             f"({why}); put the config.json saved with these weights beside them") from None


def _check_model_type(path: Path) -> None:
    """Refuse a ``config.json`` whose ``model_type`` this transformers has no config class for (transformers'
    own message says to upgrade it from the hub, or from source: relayrl says what it trains instead)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if not (path / "config.json").is_file():
        return
    conf = read_json(path, "config.json")
    kind = conf.get("model_type")
    if kind is None or kind in CONFIG_MAPPING:  # (none: AutoConfig guesses from the name and says why not)
        return
    named = f" ({', '.join(map(str, conf['architectures']))})" if conf.get("architectures") else ""
    raise ModelLoadError(f"model directory {path}: config.json's model_type {kind!r}{named} is not an "
                         f"architecture transformers {transformers.__version__} knows, so relayrl cannot build "
                         f"the model; relayrl trains the causal LMs transformers implements (docs/models.md lists "
                         f"those tested): check that model_type is the one saved with these weights, or install "
                         f"a transformers release that has {kind!r}")


_ENCODERS = frozenset({"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                       "megatron-bert", "rembert", "roc_bert", "roberta", "roberta-prelayernorm", "roformer",
                       "xlm-roberta", "xlm-roberta-xl", "xmod"})
"""Encoders that ``AutoModelForCausalLM`` loads with an LM head (``BertLMHeadModel``, ...) whose attention is
bidirectional unless their config says ``is_decoder``: every position would see the tokens after it."""


def check_causal_lm(config, path: Path) -> None:
    """Refuse a config that ``AutoModelForCausalLM`` has no class for (an encoder-decoder such as T5, an encoder
    such as RoBERTa), or an encoder it loads with an LM head but bidirectional attention (BERT without
    ``is_decoder``), before any weights load and in words, not as the list of the ~170 classes it has."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    if getattr(config, "model_type", None) in _ENCODERS and not getattr(config, "is_decoder", False):
        named = f" ({', '.join(config.architectures)})" if getattr(config, "architectures", None) else ""
        raise ModelLoadError(f"model directory {path}: config.json describes a {type(config).__name__}{named}, an "
                             f"encoder: its attention is bidirectional (is_decoder is false), so each position "
                             f"would see the tokens it is to predict; relayrl trains decoder-only causal LMs "
                             f"(docs/models.md); give such a model's directory")
    if type(config) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    named = f" ({', '.join(config.architectures)})" if getattr(config, "architectures", None) else ""
    raise ModelLoadError(f"model directory {path}: config.json describes a {type(config).__name__}{named}, for "
                         f"which transformers has no causal LM class (AutoModelForCausalLM): relayrl trains "
                         f"decoder-only causal LMs (docs/models.md); give such a model's directory")


def _check_shapes(auto_class, config, path: Path) -> None:
    """Compare the weights' shapes (safetensors headers) with the model ``config`` describes, on the meta
    device, before any memory is allocated: a config.json that lacks its shape keys describes the
    architecture's defaults (7B for Qwen2), which would otherwise be built in full before the mismatch shows."""
    from safetensors import safe_open

    files = _safetensors_files(path)
    if not files:
        return
    with torch.device("meta"):
        want = {n: tuple(t.shape) for n, t in auto_class.from_config(config).state_dict().items()}
    mismatched = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = tuple(f.get_slice(name).get_shape())
                if name in want and shape != want[name]:
                    mismatched.append((name, shape, want[name]))
    if mismatched:
        raise _mismatch_error(path, mismatched)


def _unreadable_bin(e: BaseException) -> bool:
    """Whether ``torch.load`` failed on the bytes of a ``*.bin`` file (rather than on a bug)."""
    return isinstance(e, (EOFError, pickle.UnpicklingError)) or "PytorchStreamReader" in str(e)


def _mismatch_error(path: Path, mismatched) -> ModelLoadError:
    """The error for weights whose shapes differ from the model ``config.json`` describes; ``mismatched`` holds
    ``(name, shape in the weights, shape by config.json)``, as transformers reports them."""
    rows = sorted((str(k), list(a), list(b)) for k, a, b in mismatched)
    name, ckpt, want = rows[0]
    more = f" (and {len(rows) - 1} more tensors)" if len(rows) > 1 else ""
    return ModelLoadError(f"model directory {path}: the weights do not match config.json: {name} is {ckpt} in the "
                          f"weights but {want} by config.json{more}; put the config.json saved with these weights "
                          f"beside them (or weights saved with this config.json)")


def few_names(names: list[str], n: int = 5) -> str:
    """The first ``n`` of ``names``, then "and N more"."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def check_loaded(what: str, missing: Iterable[str], unexpected: Iterable[str]) -> None:
    """Refuse a state (``what``: "checkpoint", ...) that left parameters of the model unloaded or held names it
    does not have, naming a few of each."""
    problems = [f"{kind} {few_names(names)}" for kind, names in (("missing", list(missing)),
                                                                 ("unexpected", sorted(unexpected))) if names]
    if problems:
        raise ValueError(f"{what} does not match the model: {'; '.join(problems)}")


def absent_weights(model: torch.nn.Module, present: Iterable[str]) -> list[str]:
    """The names of ``model``'s state dict that ``present`` lacks, sorted. A tied weight (one tensor under
    several names: ``lm_head.weight`` tied to ``model.embed_tokens.weight``) counts as present when any of its
    names is."""
    present = set(present)
    names_of: dict[int, list[str]] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(t), []).append(name)
    return sorted(n for names in names_of.values() if present.isdisjoint(names) for n in names)


def _missing_error(path: Path, missing: list[str]) -> ModelLoadError:
    return ModelLoadError(f"model directory {path}: the weights lack {len(missing)} of the model's tensors "
                          f"({few_names(missing)}), which would start at random; copy the weights again from the "
                          f"original model (or save the model again), or put the config.json saved with these "
                          f"weights beside them")


def _check_dir(path: Path, needed: tuple[str, ...]) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory (relayrl loads models from local paths only)")
    missing = [f for f in needed if not (path / f).exists()]
    if missing:
        raise ModelLoadError(f"model directory {path} lacks {', '.join(missing)}")


def check_model_dir(path: str | Path, key: str, label: str) -> Path:
    """``path`` as a model directory, checked before anything loads: it exists, has ``tokenizer_config.json`` (else
    :func:`not_a_model` says what it is) and ``config.json``. Errors start with ``label`` (e.g.
    ``"trainer.init_from=DIR"`` or ``"--model DIR"``); ``key`` is the option :func:`not_a_model` suggests."""
    path = Path(path)
    if not path.is_dir():
        what = "a file, not a directory" if path.exists() else "no such directory"
        raise ModelLoadError(f"{label}: {what}; give a local Hugging Face model directory (e.g. the "
                             f"RUN_DIR/model of an earlier run)")
    if not any(path.iterdir()):
        raise ModelLoadError(f"{label}: the directory is empty; give a local Hugging Face model directory (its "
                             f"config.json, tokenizer files and weights; e.g. the RUN_DIR/model of an earlier run)")
    if not (path / "tokenizer_config.json").exists():
        raise ModelLoadError(f"{label}: {not_a_model(path, key)}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{label}: model directory {path} lacks config.json; copy it from the original model")
    try:
        check_causal_lm(model_config(path), path)
    except ModelLoadError as e:
        raise ModelLoadError(f"{label}: {e}") from None
    if not has_weights(path):  # (found only when the actor loaded it, after the data and the other checks)
        raise ModelLoadError(f"{label}: {no_weights(path)}; copy them from the original model")
    return path


def has_weights(path: Path) -> bool:
    """Whether ``path`` holds weight files transformers can load (``*.safetensors`` or ``*.bin``)."""
    return any(path.glob("*.safetensors")) or any(path.glob("*.bin"))


def no_weights(path: Path) -> str:
    return f"model directory {path} has config.json but no *.safetensors or *.bin weights"


def not_a_model(path: Path, key: str) -> str:
    """Why ``path`` (no ``tokenizer_config.json``) is not a model directory, with the likely fix: a run's
    directory, checkpoints or a checkpoint given where its ``model/`` was meant (``key``: the option, e.g.
    ``trainer.init_from`` or ``--model``; empty for a positional argument)."""
    from relayrl.checkpoint.format import _STEP_DIR, MANIFEST

    checkpoint = (path / MANIFEST).is_file() or bool(_STEP_DIR.match(path.name))
    run = path.parent.parent if checkpoint else path.parent if path.name == "checkpoints" else path
    meant = (f"; did you mean {f'{key}=' if key else ''}{run / 'model'}?"
             if (run / "model" / "tokenizer_config.json").exists() else "")
    if checkpoint:
        return (f"{path} is a checkpoint (a run's training state), not a model directory"
                f"{meant or '; give a model directory (the RUN_DIR/model a run exports)'} (run.resume={path} "
                f"continues that run from the checkpoint)")
    if path.name == "checkpoints":
        return f"{path} is a run's checkpoints directory, not a model directory{meant}"
    if meant:
        return f"{path} is a run directory, not a model directory{meant}"
    return (f"model directory {path} lacks tokenizer_config.json; give a local Hugging Face model directory (e.g. "
            f"the RUN_DIR/model of an earlier run)")


_PLAIN_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""``tokenizer_class`` of a tokenizer that is its ``tokenizer.json`` and nothing else (transformers 5 saves
``PreTrainedTokenizerFast`` as ``TokenizersBackend``)."""


def load_tokenizer(path: str | Path, *, chat_template: str | None = None):
    """Load a tokenizer; left padding, with a pad token (EOS when it has none). ``chat_template``: a Jinja
    template that replaces the directory's (a run's policy: ``cfg.model.template()``, the text of
    ``model.chat_template``); its ``save_pretrained`` then writes it with the tokenizer files."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    path = Path(path)
    _check_dir(path, ("tokenizer_config.json",))
    cfg = read_json(path, "tokenizer_config.json")
    if (path / "config.json").is_file():  # AutoTokenizer reads it too
        read_json(path, "config.json")
        model_config(path)
    try:
        if cfg.get("tokenizer_class") in _PLAIN_FAST and (path / "tokenizer.json").exists():
            # Trained with `tokenizers` (like the tiny default): AutoTokenizer would swap its pre-tokenizer for
            # the model type's (a qwen2 config.json: Qwen2Tokenizer's regex, not the trained digit split).
            tok = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
        else:
            tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:  # a JSON error carries no file name: find the file
        _name_bad_json(path)
        raise ModelLoadError(f"could not load the tokenizer from {path}: {e}") from e
    _check_vocabulary(path, tok)
    if tok.pad_token is None:
        if tok.eos_token is None:
            raise ModelLoadError(f"tokenizer in {path} has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _check_vocabulary(path: Path, tok) -> None:
    """Refuse a tokenizer loaded without its vocabulary (transformers then builds one of the special tokens
    ``tokenizer_config.json`` names, which encodes any text as nothing) and one whose ids run past the model's
    embedding (``vocab_size`` in ``config.json``; a larger embedding, padded to a multiple, is normal)."""
    files = sorted(set(type(tok).vocab_files_names.values()), key=lambda f: (f != "tokenizer.json", f))
    if files and not any((path / f).is_file() for f in files):
        other = f" (or {', '.join(files[1:])})" if len(files) > 1 else ""
        raise ModelLoadError(f"model directory {path}: the tokenizer's vocabulary is missing: {type(tok).__name__} "
                             f"reads {files[0]}{other}, and the directory has none of them (transformers would "
                             f"build a tokenizer of {len(tok)} special tokens); copy the tokenizer files from the "
                             f"original model")
    if not (path / "config.json").is_file():
        return
    config = model_config(path)
    rows = getattr(config.get_text_config(), "vocab_size", None)
    top = max(tok.get_vocab().values(), default=-1)
    if rows and top >= rows:
        past = sorted(((i, t) for t, i in tok.get_vocab().items() if i >= rows), reverse=True)  # (added last)
        raise ModelLoadError(f"model directory {path}: the tokenizer has {len(tok)} tokens (ids up to {top}) but "
                             f"the model's embedding has {rows} rows (vocab_size in config.json): a text holding "
                             f"{few_names([repr(t) for _, t in past], 3)} would index past it, and the model "
                             f"cannot write them. Use the tokenizer saved with these weights, or grow the "
                             f"embedding to the tokenizer (transformers' model.resize_token_embeddings("
                             f"len(tokenizer)), then save_pretrained) and train from that")


def load_model(path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
               attn_implementation: str = "sdpa"):
    """Load a causal LM from ``path`` in ``dtype`` on ``device``, in train mode (an attention implementation
    that would skip part of the model's attention is refused first: :func:`check_attention`; ``auto``: the
    one :func:`inference_attention` picks)."""
    from transformers import AutoModelForCausalLM

    config = model_config(Path(path))
    check_causal_lm(config, Path(path))
    if attn_implementation == "auto":
        attn_implementation = inference_attention(config)
    check_attention(config, attn_implementation, Path(path))
    model = load_pretrained(AutoModelForCausalLM, Path(path), dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device)


def check_attention(config, attn_implementation: str, path: Path) -> None:
    """Refuse an attention implementation that computes another model than ``config`` describes: Gemma 2 caps
    its attention scores (``attn_logit_softcapping``, 50), and transformers passes the cap to its eager
    attention only (SDPA and FlashAttention kernels take no cap and drop it without a word)."""
    conf = config.get_text_config() if hasattr(config, "get_text_config") else config
    cap = getattr(conf, "attn_logit_softcapping", None)
    if cap and attn_implementation != "eager":
        raise ModelLoadError(f"model directory {path}: {type(config).__name__} caps its attention scores "
                             f"(attn_logit_softcapping={cap:g}), which attn_implementation={attn_implementation!r} "
                             f"skips (transformers applies the cap in eager attention only); set "
                             f"model.attn_implementation=eager")


def inference_attention(config) -> str:
    """The attention ``relayrl eval --model`` and ``relayrl serve`` load a model with (they take no attention
    key): eager where SDPA would compute another model (Gemma 2's capped scores, :func:`check_attention`) or where
    transformers has no SDPA path for the architecture (GPT-OSS's attention sinks), else sdpa."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    conf = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(conf, "attn_logit_softcapping", None):
        return "eager"
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return "eager" if model_class is not None and not getattr(model_class, "_supports_sdpa", True) else "sdpa"


_DROPOUT_RATES = ("attention_dropout", "attn_dropout", "dropout")


def disable_dropout(model) -> int:
    """Set every dropout rate of ``model`` to 0: the ``p`` of its ``nn.Dropout`` layers, and the float rates
    attention modules keep as attributes (``attention_dropout`` in Llama/Qwen2-style attention, passed to the
    attention kernel in train mode). The model's config is not changed (an export keeps the original rates).
    Returns how many layers or attributes were nonzero."""
    from torch import nn

    changed = 0
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
            continue
        for name in _DROPOUT_RATES:
            rate = getattr(module, name, None)
            if isinstance(rate, float) and not isinstance(rate, bool):
                changed += rate > 0
                setattr(module, name, 0.0)
    return changed


BAR_BYTES = 1 << 30
"""Weights below this load and save without transformers' progress bars (:func:`progress_bars`)."""


@contextmanager
def progress_bars(nbytes: int) -> Iterator[None]:
    """transformers' progress bars ("Loading weights", "Writing model shards") only for weights of ``nbytes``
    >= :data:`BAR_BYTES`, where a load or save takes long enough to want one; below, they are off for the
    duration (a bar that flashes by at every export and in every worker's log is noise)."""
    from transformers.utils import logging as hf_logging

    if nbytes >= BAR_BYTES or not hf_logging.is_progress_bar_enabled():
        yield
        return
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.enable_progress_bar()


def load_pretrained(auto_class, path: Path, *, dtype: str = "float32", **kwargs):
    """``auto_class.from_pretrained(path)`` from local files, in ``dtype``; a missing, damaged or mismatched
    directory is a :class:`ModelLoadError` naming the file and what is wrong (see the module docstring)."""
    _check_dir(path, ("config.json",))
    read_json(path, "config.json")
    if not has_weights(path):
        raise ModelLoadError(no_weights(path))
    _check_index(path)
    _check_safetensors(path)
    _check_shapes(auto_class, model_config(path), path)
    try:
        # Mismatched shapes are loaded (and re-initialised) so that they come back listed, then refused below.
        with progress_bars(sum(f.stat().st_size for f in [*path.glob("*.safetensors"), *path.glob("*.bin")])):
            model, info = auto_class.from_pretrained(path, dtype=resolve_dtype(dtype), local_files_only=True,
                                                     ignore_mismatched_sizes=True, output_loading_info=True, **kwargs)
    except (OSError, ValueError) as e:
        _name_bad_json(path)
        attn = kwargs.get("attn_implementation")
        if attn and "does not support an attention implementation" in str(e):  # (GPT-OSS: eager only)
            raise ModelLoadError(f"could not load model from {path} with model.attn_implementation={attn}: "
                                 f"transformers has no {attn} attention for this architecture; set "
                                 f"model.attn_implementation=eager ({str(e).split('. ')[0]})") from None
        raise ModelLoadError(f"could not load model from {path}: {e}") from e
    except (RuntimeError, EOFError, pickle.UnpicklingError) as e:
        if not _safetensors_files(path) and _unreadable_bin(e):
            raise ModelLoadError(f"model directory {path}: a *.bin weight file is truncated or not a PyTorch "
                                 f"checkpoint ({str(e).split('. ')[0]}); {_REFETCH}") from e
        raise
    if info.get("mismatched_keys"):
        raise _mismatch_error(path, info["mismatched_keys"])
    unexpected = sorted(info.get("unexpected_keys") or ())  # (what transformers ignores by design is not listed)
    if unexpected:
        raise ModelLoadError(f"model directory {path}: the weights hold {len(unexpected)} tensors that the model "
                             f"config.json describes has no place for ({few_names(unexpected)}), which would be "
                             f"dropped unsaid (weights of a larger model: more layers or another architecture); "
                             f"put the config.json saved with these weights beside them")
    reported = set(info.get("missing_keys") or ())
    if reported:
        missing = absent_weights(model, set(model.state_dict()) - reported)
        if missing:
            raise _missing_error(path, missing)
    return model


def load_value_model(path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
                     attn_implementation: str = "sdpa", bias: bool = True):
    """A critic: the causal LM at ``path`` with its output head replaced by a scalar value head
    (``Linear(hidden, 1)``, zero-initialised, so every value starts at 0). The engine reads the head
    through ``get_output_embeddings``, as for the policy. ``bias=False``: a head without bias (a reward
    model's, whose Bradley-Terry loss cannot see a bias; Hugging Face's sequence classifiers have none)."""
    from torch import nn

    model = load_model(path, dtype=dtype, device=device, attn_implementation=attn_implementation)
    hidden = model.get_output_embeddings().in_features
    head = nn.Linear(hidden, 1, bias=bias, device=device, dtype=resolve_dtype(dtype))
    nn.init.zeros_(head.weight)
    if bias:
        nn.init.zeros_(head.bias)
    model.config.tie_word_embeddings = False  # the value head is not the embedding matrix
    model.set_output_embeddings(head)
    return model


def attention_windows(conf) -> tuple[set[str], int | None, bool]:
    """(the model's layer types, its sliding window or None, whether the window is per layer type): the config's
    ``layer_types`` when it lists them (Gemma 2 and 3, Qwen2 with ``use_sliding_window``, hybrids: a window for the
    ``sliding_attention`` layers); otherwise every layer slides when ``sliding_window`` is set, as Mistral, Mixtral,
    Phi-3 and StarCoder2 apply it (Phi-3-mini-4k's is 2047 tokens), and none does when it is not."""
    window = getattr(conf, "sliding_window", None)
    listed = getattr(conf, "layer_types", None)
    if listed:
        types = set(listed)
        return types, (window if "sliding_attention" in types else None), True
    return ({"sliding_attention"} if window else {"full_attention"}), window or None, False


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks: modules of the classes ``model._no_split_modules`` names (Hugging Face's
    decoder layers), which FSDP2 shards one at a time, ``engine.compile`` compiles one at a time and LoRA's
    default targets come from."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class in _no_split_modules ({sorted(names)}); "
                         "relayrl shards, compiles and adapts (LoRA's default targets) one decoder layer at a time")
    return layers
