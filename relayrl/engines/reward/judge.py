"""An LLM judge: a generative reward that asks a model a templated question and parses a score from its
answer (LLM-as-a-judge, Zheng et al. 2023).

The judge model is a local Hugging Face causal LM (``reward.judge.path``) decoded greedily by relayrl's
native generation engine. Its answer is searched with ``reward.judge.score_regex``; the first capture
group (or the whole match) must be a number in ``[min_score, max_score]``, and the reward is that number
rescaled to ``[0, 1]``.

Malformed output -- no match, a match that is not a number, or a number outside the range -- is an
error by default (:class:`JudgeError`; ``malformed_score: null``), which ``reward.on_error`` handles as any
failure of a reward source (the step fails naming the prompt, or the group is dropped). With a number set, such a verdict scores it instead, is counted in
``reward/judge_malformed`` and the first one of a batch is logged: model output is untrusted text, and
that score is then the user's choice. A judge that raises or answers a different number of questions is
always an error.

Departure: no OpenAI-compatible judge server (relayrl's serving client is the rollout's); a judge runs
in-process on the reward engine's device.
"""

from __future__ import annotations

import logging
import math
import re
import string
from typing import Callable, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relayrl.config.paths import LocalPath

__all__ = ["JudgeConfig", "JudgeError", "LLMJudge", "parse_judge_score", "template_text"]

log = logging.getLogger(__name__)

class JudgeError(ValueError):
    """The judge's answers cannot be scores: a count that differs from the questions', or a malformed verdict
    with ``reward.judge.malformed_score: null``."""


DEFAULT_TEMPLATE = ("Question: {prompt}\nProposed answer: {response}\nRate the proposed answer from "
                    "{min_score} (wrong) to {max_score} (right). Score:")


class JudgeConfig(BaseModel):
    """``reward.judge``: a generative reward (off while ``path`` is null)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: LocalPath | None = Field(None, description="local directory of the judge's causal LM; null: no judge")
    weight: float = Field(1.0, description="weight of the judge's score (in [0, 1]) in the reward")
    template: str = Field(DEFAULT_TEMPLATE, description="question asked per response; fields {prompt}, {response}, "
                          "{answer} (the ground truth, empty when there is none), {min_score}, {max_score}, all text (10, 0.5)")
    score_regex: str = Field(r"-?\d+(?:\.\d+)?", description="searched in the judge's answer; the first group (or the "
                             "match) is the score")
    min_score: float = Field(0.0, description="lowest valid score (rescaled to reward 0)")
    max_score: float = Field(10.0, description="highest valid score (rescaled to reward 1)")
    malformed_score: float | None = Field(None, description="null (default): a malformed verdict (no valid score "
                                          "found) is an error under reward.on_error (the step fails naming the prompt, "
                                          "or its group is dropped); a number: the reward such a verdict gets, counted "
                                          "in reward/judge_malformed")
    max_new_tokens: int = Field(8, ge=1, description="tokens the judge may write")
    batch_size: int = Field(64, ge=1, description="questions per generation call")

    @model_validator(mode="after")
    def _check(self) -> "JudgeConfig":
        try:  # (with the fields as the questions fill them: text, the scores too)
            self.template.format(prompt="", response="", answer="", min_score=_num(self.min_score),
                                 max_score=_num(self.max_score))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"reward.judge.template has a field other than {{prompt}}, {{response}}, {{answer}}, "
                             f"{{min_score}}, {{max_score}}, a stray brace, or a number's format spec "
                             f"({type(e).__name__}: {e}); write literal braces as {{{{ and }}}}, and the scores as "
                             f"{{min_score}} and {{max_score}}: the fields are text (10, 0.5)") from None
        try:
            re.compile(self.score_regex)
        except re.error as e:
            raise ValueError(f"reward.judge.score_regex {self.score_regex!r} is not a valid regex: {e}") from None
        if not self.max_score > self.min_score:
            raise ValueError(f"reward.judge.max_score={self.max_score} must be > reward.judge.min_score={self.min_score}")
        return self


def parse_judge_score(text: str, pattern: re.Pattern, min_score: float, max_score: float) -> float | None:
    """The verdict in ``text`` rescaled to ``[0, 1]``, or None when malformed (no match, not a finite
    number, or outside ``[min_score, max_score]``)."""
    m = pattern.search(text)
    if m is None:
        return None
    raw = m.group(1) if m.groups() else m.group(0)
    try:
        v = float(raw)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(v) or not min_score <= v <= max_score:
        return None
    return (v - min_score) / (max_score - min_score)


def template_text(template: str, fields: dict, plain: tuple[str, ...] = ("response",)) -> str:
    """``template.format(**fields)`` as :mod:`relayrl.data.plain_text` text: the template and its other fields
    are markup (a judge template may be written in its model's chat format, ``<|im_start|>user ...``), the
    ``plain`` fields are plain text, whose special-token strings are text (a response cannot close the judge's
    turn and write the verdict itself)."""
    from relayrl.data.plain_text import EnvText, markup

    fmt, out = string.Formatter(), EnvText()
    for literal, name, spec, conversion in fmt.parse(template):
        out = out + markup(literal)
        if name is not None:
            value = fmt.convert_field(fmt.get_field(name, (), fields)[0], conversion)
            text = fmt.format_field(value, fmt.vformat(spec or "", (), fields))
            out = out + (text if name in plain else markup(text))
    return out


class LLMJudge:
    """Asks the judge per response and parses its verdicts.

    ``ask`` (tests, other back ends): a function from questions to answers; by default the model at
    ``cfg.path`` on ``device``, greedy, through :class:`NativeGenerationEngine`, loaded on first use.
    """

    def __init__(self, cfg: JudgeConfig, *, device: str = "cpu",
                 ask: Callable[[list[str]], list[str]] | None = None) -> None:
        self.cfg, self.device, self._ask = cfg, device, ask
        self._pattern = re.compile(cfg.score_regex)
        self._engine = None
        self._encode, self._affixes = None, ([], [])  # (the engine tokenizer's plain-text encoder, added ids)

    def to(self, device) -> "LLMJudge":
        self.device = str(device)
        if self._engine is not None:
            self._engine.model.to(device)
            self._engine.device = self._engine.model.device
        return self

    def questions(self, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str | None]) -> list[str]:
        """The judge's questions: the template with each row's fields; the response (the policy's text) is plain
        text in it (:func:`template_text`), the rest is the user's own."""
        c = self.cfg
        return [template_text(c.template, {"prompt": p, "response": r, "answer": a or "",
                                           "min_score": _num(c.min_score), "max_score": _num(c.max_score)})
                for p, r, a in zip(prompts, responses, answers)]

    def ask(self, questions: list[str]) -> list[str]:
        if self._ask is not None:
            return list(self._ask(questions))
        from relayrl.engines.generation.base import SamplingParams

        if self._engine is None:
            from relayrl.engines.generation.native import NativeGenerationEngine
            from relayrl.models.load import load_model, load_tokenizer

            tok = load_tokenizer(self.cfg.path)
            model = load_model(self.cfg.path, device=self.device, attn_implementation="auto").eval()
            self._engine = NativeGenerationEngine(model, tok, max_batch=self.cfg.batch_size, device=self.device)
            from relayrl.data.plain_text import EnvTextEncoder, special_affixes

            self._encode, self._affixes = EnvTextEncoder(tok), special_affixes(tok)  # (once, with the engine)
        encode, (head, tail) = self._encode, self._affixes
        out: list[str] = []
        params = SamplingParams(n=1, temperature=0.0, max_new_tokens=self.cfg.max_new_tokens)
        for s in range(0, len(questions), self.cfg.batch_size):
            ids = [head + encode(q) + tail for q in questions[s:s + self.cfg.batch_size]]
            comps = sorted(self._engine.generate(ids, params), key=lambda c: c.prompt_index)
            out += [c.text for c in comps]
        return out

    def score(self, prompts: Sequence[str], responses: Sequence[str],
              answers: Sequence[str | None]) -> tuple[list[float], int]:
        """Rewards ``[N]`` in ``[0, 1]`` (malformed verdicts: ``malformed_score``) and the malformed count;
        :class:`JudgeError` for a wrong count of verdicts, or a malformed one when ``malformed_score`` is None."""
        verdicts = self.ask(self.questions(prompts, responses, answers))
        if len(verdicts) != len(prompts):
            raise JudgeError(f"{len(verdicts)} verdicts for {len(prompts)} questions")
        scores, bad = [], []
        for i, v in enumerate(verdicts):
            s = parse_judge_score(str(v), self._pattern, self.cfg.min_score, self.cfg.max_score)
            if s is None:
                if self.cfg.malformed_score is None:
                    raise JudgeError(f"malformed verdict {str(v)[:200]!r} (no score in [{_num(self.cfg.min_score)}, "
                                     f"{_num(self.cfg.max_score)}] matching reward.judge.score_regex; "
                                     f"reward.judge.malformed_score is null)")
                bad.append(i)
                s = self.cfg.malformed_score
            scores.append(s)
        if bad:
            log.warning("reward: %d of %d judge verdicts malformed, scored %s (first: %r)", len(bad), len(verdicts),
                        self.cfg.malformed_score, str(verdicts[bad[0]])[:200])
        return scores, len(bad)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
