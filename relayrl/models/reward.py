"""Reward models: a policy's network with a scalar head, trained by ``workflow: rm`` and saved as a Hugging
Face sequence classifier (``AutoModelForSequenceClassification``, ``num_labels=1``), then loaded to score
``(prompt, response)`` pairs by the reward engine (``reward.model``).

What a score is, in training and in scoring alike: the head applied to the last hidden state of the
response's last token, the response tokenized without special tokens after the prompt's ids (the same
ids the policy sees), its end-of-sequence token not included. In training the rows end with EOS and the
critic engine's value at the EOS position is read: that value comes from the hidden state of the token
before it, the last response token (the engine's values sit where the next token's log-prob would). A
Hugging Face sequence classifier pools at the last non-pad token, so the saved model scores an unpadded
``prompt + response`` exactly so (``config.pad_token_id`` is the tokenizer's pad token).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from relayrl.models.load import (ModelLoadError, _check_dir, inference_attention, load_pretrained, load_tokenizer,
                                 model_config, read_json, resolve_dtype)

__all__ = ["export_reward_model", "load_reward_model", "RewardModelScorer", "is_reward_model", "scored_prompts"]


def is_reward_model(path: str | Path) -> bool:
    """Whether ``path`` holds a one-label sequence classifier (what ``workflow: rm`` saves)."""
    if not (Path(path) / "config.json").is_file():
        return False
    c = read_json(Path(path), "config.json")
    archs = c.get("architectures") or []
    return any(a.endswith("ForSequenceClassification") for a in archs) and c.get("num_labels", len(c.get("id2label", {}))) == 1


def export_reward_model(model, tokenizer, path: str | Path, state_dict: dict | None = None,
                        dtype: str | None = None) -> None:
    """Save a value-head causal LM (``load_value_model(bias=False)``) as a one-label sequence classifier:
    the backbone's weights, the head's ``[1, hidden]`` weight as ``score.weight``; in ``dtype`` (None: the
    head's own, as it trained; a run passes ``model.export_dtype``)."""
    from transformers import AutoModelForSequenceClassification

    sd = dict(state_dict if state_dict is not None else model.state_dict())
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise ValueError("export_reward_model: the value head has a bias, which a Hugging Face sequence classifier "
                         "lacks; build the reward model with load_value_model(bias=False)")
    head_keys = [k for k, v in model.named_parameters() if v is head.weight] or ["lm_head.weight"]
    score = sd.pop(head_keys[0])
    cfg = model.config.__class__.from_dict(model.config.to_dict())
    cfg.num_labels = 1
    cfg.pad_token_id = tokenizer.pad_token_id
    cfg.architectures = None
    cfg.tie_word_embeddings = False
    seq = AutoModelForSequenceClassification.from_config(cfg, dtype=resolve_dtype(dtype) if dtype else score.dtype)
    sd["score.weight"] = score.reshape(1, -1)
    missing, unexpected = seq.load_state_dict(sd, strict=False)
    if missing or unexpected:
        raise ValueError(f"export_reward_model: {type(seq).__name__} does not take this model's weights: missing "
                         f"{missing[:5]}, unexpected {unexpected[:5]}")
    Path(path).mkdir(parents=True, exist_ok=True)
    seq.save_pretrained(path)
    tokenizer.save_pretrained(path)


def load_reward_model(path: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu",
                      key: str = "reward.model"):
    """The sequence classifier at ``path`` in eval mode (``key`` names the config key in errors), with the attention
    that computes it (:func:`~relayrl.models.load.inference_attention`: eager for a Gemma 2 reward model, whose
    attention cap SDPA drops)."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    try:
        _check_dir(path, ("config.json",))
        if is_reward_model(path):
            return load_pretrained(AutoModelForSequenceClassification, path, dtype=dtype,
                                   attn_implementation=inference_attention(model_config(path))).to(device).eval()
    except ModelLoadError as e:
        raise ModelLoadError(f"{key}: {e}") from None
    raise ModelLoadError(f"{key}={path} is not a reward model (a one-label *ForSequenceClassification, what "
                         f"'workflow: rm' saves); train one with recipes/arith_rm.yaml")


class RewardModelScorer:
    """Scores ``(prompt, response)`` texts with a reward model, in batches of ``batch_size`` left-padded rows
    (position ids from the attention mask, so a padded row scores as it would alone)."""

    def __init__(self, path: str | Path, *, device: str | torch.device = "cpu", dtype: str = "float32",
                 batch_size: int = 64, chat_template: bool | None = None,
                 template_kwargs: Mapping[str, Any] | None = None) -> None:
        self.path, self.batch_size, self.chat_template = Path(path), batch_size, chat_template
        self.template_kwargs = template_kwargs
        self.device = torch.device(device)
        self.model = load_reward_model(path, dtype=dtype, device=self.device)
        self.tokenizer = load_tokenizer(path)
        from relayrl.data.plain_text import EnvTextEncoder

        self._plain = EnvTextEncoder(self.tokenizer)
        """A response's ids as plain text (:mod:`relayrl.data.plain_text`): its ``<|im_end|>`` is text."""

    def to(self, device: str | torch.device) -> "RewardModelScorer":
        """Move the model (a reward worker placed on a pool's device)."""
        self.device = torch.device(device)
        self.model.to(self.device)
        return self

    def ids(self, prompt: str | list[dict], response: str) -> list[int]:
        """The ids the model scores: the prompt's (as the policy encodes it, and as workflow rm trained on it:
        chat messages through the tokenizer's template), then the response's as plain text (a special-token
        string the policy spelled in ordinary tokens stays text, so it cannot end the response's turn and write
        past it in the scorer's context)."""
        from relayrl.data.prompts import encode_prompt, render_plain
        from relayrl.data.tasks import Problem

        problem = (Problem(render_plain(prompt), "", {"messages": prompt}) if isinstance(prompt, list)
                   else Problem(prompt, ""))
        p = encode_prompt(self.tokenizer, problem, self.chat_template, self.template_kwargs)
        return list(p) + self._plain(response)

    @torch.no_grad()
    def score_ids(self, rows: Sequence[Sequence[int]]) -> list[float]:
        """One score per row of token ids."""
        out: list[float] = []
        base = getattr(self.model, self.model.base_model_prefix)
        pad = self.tokenizer.pad_token_id
        for start in range(0, len(rows), self.batch_size):
            chunk = [list(r) for r in rows[start:start + self.batch_size]]
            width = max(len(r) for r in chunk)
            ids = torch.tensor([[pad] * (width - len(r)) + r for r in chunk], device=self.device)
            mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in chunk], device=self.device)
            pos = (mask.cumsum(-1) - 1).clamp_min(0)
            hidden = base(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state[:, -1]
            out += self.model.score(hidden.to(self.model.score.weight.dtype))[:, 0].float().tolist()
        return out

    def score(self, prompts: Sequence[str | list[dict]], responses: Sequence[str]) -> list[float]:
        """One score per (prompt, response); a prompt is its text or its chat messages."""
        return self.score_ids([self.ids(p, r) for p, r in zip(prompts, responses)])


def scored_prompts(prompts: Sequence[str], columns: Sequence) -> list[str | list[dict]]:
    """Each row's prompt for :meth:`RewardModelScorer.score`: a chat row's messages (its dataset fields'
    ``prompt``, the system prompt included), which the scorer renders through its tokenizer's template as
    workflow rm trained on them; else the text (``prompts`` holds a chat row only as ``role: content`` lines)."""
    return [c["prompt"] if isinstance(c, dict) and isinstance(c.get("prompt"), list) else p
            for p, c in zip(prompts, columns)]
