"""eval.top_p / eval.top_k / eval.min_p: the eval.k samples' filters (verl's val_kwargs.top_p / top_k).

Config checks (refused with eval.k=1, the bounds, verl's -1), the SamplingParams the runner gives its
``generate`` (the greedy pass unfiltered, both with ``logprobs=False``), the native engine applying each filter
on the tiny model, the vLLM refusals that still apply to evaluation (a pure function: no vLLM needed), and
``relayrl eval``'s flags."""

from __future__ import annotations

import json

import pytest
import torch

from relayrl.config.loader import ConfigError, load_config
from relayrl.config.schema import Config, EvalConfig
from relayrl.data.tasks import ArithmeticTask, Problem
from relayrl.engines.generation.base import Completion, SamplingParams
from relayrl.engines.generation.config import vllm_available
from relayrl.engines.generation.vllm_sampling import PROCESSED, RAW, sampling_refusal
from relayrl.evaluation.runner import eval_params, evaluate, write_report

FILTERS = [("top_p", 0.7), ("top_k", 20), ("min_p", 0.05)]


def _errors(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config(Config, "arith_grpo", list(overrides))
    return str(e.value)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("key,value", FILTERS)
def test_a_filter_with_greedy_only_evaluation_is_refused_naming_the_key_and_the_fix(key, value):
    msg = _errors(f"eval.{key}={value}")
    assert (f"eval.{key}={value} samples the eval.k answers, and eval.k=1 (greedy only): set eval.k > 1 (e.g. 8) "
            f"or set eval.{key}=") in msg
    assert getattr(load_config(Config, "arith_grpo", [f"eval.{key}={value}", "eval.k=4"]).eval, key) == value
    # (its off value with eval.k=1 is no setting at all)
    assert EvalConfig(**{key: {"top_p": 1.0, "top_k": 0, "min_p": 0.0}[key]}).k == 1


def test_eval_temperature_with_greedy_only_evaluation_keeps_its_message():
    assert "eval.temperature=0.7 samples the eval.k answers, and eval.k=1 (greedy only): set eval.k > 1 (e.g. 8) " \
           "or drop eval.temperature" in _errors("eval.temperature=0.7")


@pytest.mark.parametrize("override,says", [("eval.top_p=0", "eval.top_p: Input should be greater than 0"),
                                           ("eval.top_p=1.5", "eval.top_p: Input should be less than or equal to 1"),
                                           ("eval.min_p=-0.1", "eval.min_p: Input should be greater than or equal"),
                                           ("eval.min_p=1.5", "eval.min_p: Input should be less than or equal to 1"),
                                           ("eval.top_k=-2", "eval.top_k: Input should be greater than or equal to 0"),
                                           ("eval.top_k=-1", "eval.top_k: -1 is how verl and vLLM turn top-k off; "
                                                             "relayrl's off is eval.top_k=0")])
def test_the_bounds_are_the_sampling_params(override, says):
    assert says in _errors(override, "eval.k=4")


def test_verl_s_val_kwargs_name_the_eval_keys():
    msg = _errors("actor_rollout_ref.rollout.val_kwargs.top_p=0.7", "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
                  "actor_rollout_ref.rollout.val_kwargs.n=8", "actor_rollout_ref.rollout.val_kwargs.temperature=1.0",
                  "actor_rollout_ref.rollout.val_kwargs.do_sample=true")
    arr = "actor_rollout_ref.rollout.val_kwargs"
    assert f"{arr}.top_p: unknown key; verl's {arr}.top_p is eval.top_p here" in msg
    assert f"{arr}.top_k: unknown key; verl's {arr}.top_k is eval.top_k here (verl's -1 is 0)" in msg
    assert f"{arr}.n: unknown key; verl's {arr}.n is eval.k here" in msg  # (as before)
    assert f"{arr}.temperature: unknown key; verl's {arr}.temperature is eval.temperature here" in msg
    assert f"{arr}.do_sample: unknown key; verl's {arr}.do_sample is eval.k here (the greedy answer is always " \
           f"evaluated" in msg


# ---------------------------------------------------------------- the runner's SamplingParams
PROBLEMS = [Problem("1+1=", "2"), Problem("2+2=", "4")]


def score(prompts, responses, answers, columns, extra):
    return [ArithmeticTask().verify(r, a) for r, a in zip(responses, answers)]


def test_the_runner_filters_the_k_samples_and_never_the_greedy_answer():
    asked: list[SamplingParams] = []

    def generate(prompts, params):
        asked.append(params)
        return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, "2")
                for i in range(len(prompts)) for s in range(params.n)]

    evaluate(generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=4, k=3, temperature=0.9, top_p=0.7,
             top_k=20, min_p=0.05, stop_strings=("\n",))
    greedy, sampled = asked
    assert (greedy.n, greedy.temperature, greedy.top_p, greedy.top_k, greedy.min_p) == (1, 0.0, 1.0, 0, 0.0)
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.top_k, sampled.min_p) == (3, 0.9, 0.7, 20, 0.05)
    assert greedy.logprobs is False and sampled.logprobs is False  # (evaluation never reads them)
    assert greedy.stop_strings == sampled.stop_strings == ("\n",) and sampled.max_new_tokens == 4
    assert eval_params(max_new_tokens=4, top_p=0.7) == (greedy.model_copy(update={"stop_strings": ()}), None)


def test_the_report_says_how_the_k_samples_were_drawn(tmp_path):
    def generate(prompts, params):
        return [Completion(i, s, torch.tensor([0]), torch.tensor([0.0]), "stop", 0, "2")
                for i in range(len(prompts)) for s in range(params.n)]

    res = evaluate(generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=4, k=3, temperature=0.9, top_p=0.7,
                   top_k=20, min_p=0.05)
    report, _ = write_report(res, tmp_path, extra={"model": "m"})
    body = json.loads(report.read_text())
    assert body["sampling"] == {"max_new_tokens": 4, "k": 3, "temperature": 0.9, "top_p": 0.7, "top_k": 20,
                                "min_p": 0.05}
    assert body["model"] == "m" and body["metrics"]["eval/pass@3"] == 0.5  # (every answer says 2)
    greedy_only = evaluate(generate, lambda p: [1, 2], PROBLEMS, score, max_new_tokens=6)
    assert greedy_only.sampling == {"max_new_tokens": 6, "k": 1}  # (the greedy answer is never filtered)


@pytest.mark.parametrize("key,value", [("top_k", 1), ("top_p", 1e-6), ("min_p", 1.0)])
def test_the_native_engine_applies_each_filter_to_the_k_samples(tiny_model, tiny_tokenizer, one_torch_thread, key,
                                                                value):
    """Each filter at its narrowest keeps only the most likely token: every sample at temperature 1 is then the
    greedy answer, which unfiltered samples are not."""
    from relayrl.engines.generation.native import NativeGenerationEngine

    eng = NativeGenerationEngine(tiny_model, tiny_tokenizer)
    problems = [Problem(f"{a}+{a}=", str(2 * a)) for a in (12, 305, 7)]
    gen = torch.Generator().manual_seed(0)

    def run(**filters) -> tuple[list[str], list[list[str]]]:
        res = evaluate(lambda p, sp: eng.generate(p, sp, generator=gen),
                       lambda p: tiny_tokenizer(p.prompt)["input_ids"], problems, score, max_new_tokens=8, k=4,
                       temperature=1.0, **filters)
        greedy = [s["response"] for s in res.samples if s["mode"] == "greedy"]
        sampled = [[s["response"] for s in res.samples if s["mode"] == "sample@4" and s["prompt"] == p.prompt]
                   for p in problems]
        return greedy, sampled

    greedy, plain = run()
    assert any(s != g for g, row in zip(greedy, plain) for s in row)  # (the test can fail: samples vary)
    greedy_again, narrowed = run(**{key: value})
    assert greedy_again == greedy and narrowed == [[g] * 4 for g in greedy]


# ---------------------------------------------------------------- vLLM's refusals (pure functions)
@pytest.mark.parametrize("key,value", [("top_p", 0.9), ("top_k", 5), ("min_p", 0.1), ("repetition_penalty", 1.2)])
def test_logprobs_false_lifts_the_log_prob_refusals_only(key, value):
    # an engine started for plain sampling (processed log-probs): a filter's log-probs would not be relayrl's
    assert "processed_logprobs" in sampling_refusal(SamplingParams(**{key: value}), mode=PROCESSED)
    assert sampling_refusal(SamplingParams(**{key: value}, logprobs=False), mode=PROCESSED) is None
    # one started with raw log-probs (a rollout filter on): relayrl's at temperature 1 only
    assert "raw log-probs" in sampling_refusal(SamplingParams(**{key: value}, temperature=0.6), mode=RAW)
    assert sampling_refusal(SamplingParams(**{key: value}, temperature=0.6, logprobs=False), mode=RAW) is None


@pytest.mark.parametrize("mode", [PROCESSED, RAW])
def test_the_sampling_refusals_stay_without_log_probs(mode):
    for params, says in ((SamplingParams(temperature=2.5, logprobs=False), "temperatures up to 2"),
                         (SamplingParams(temperature=0.005, logprobs=False), "raises a temperature below 0.01"),
                         (SamplingParams(min_p=0.1, top_p=0.9, logprobs=False), "vLLM applies min_p before")):
        assert says in sampling_refusal(params, mode=mode)


vllm_config = pytest.mark.skipif(not vllm_available(), reason="rollout.engine=vllm is validated against an install")


def _vllm(rollout: dict, ev: dict) -> Config:
    return Config.model_validate({"model": {"device": "cpu"}, "rollout": {"engine": "vllm", **rollout}, "eval": ev})


@vllm_config
def test_vllm_evaluation_takes_filters_and_temperatures_its_rollout_could_not_record():
    """Old behaviour: eval.temperature=0.6 with a rollout filter on (raw log-probs) was refused, for log-probs
    evaluation never reads; filters on a plain rollout's engine (processed log-probs) could not be asked at all."""
    assert _vllm({"top_p": 0.9}, {"k": 4, "temperature": 0.6}).eval.temperature == 0.6
    assert _vllm({}, {"k": 4, "temperature": 0.6, "top_p": 0.7, "top_k": 20}).eval.top_p == 0.7
    with pytest.raises(ValueError, match=r"eval.k answers are sampled on the rollout's vLLM engine: eval.min_p=0.1 "
                                         r"with eval.top_p=0.9: vLLM applies min_p before"):
        _vllm({}, {"k": 4, "min_p": 0.1, "top_p": 0.9})
    with pytest.raises(ValueError, match=r"eval.temperature=2.5: vLLM samples at temperatures up to 2"):
        _vllm({}, {"k": 4, "temperature": 2.5})
    with pytest.raises(ValueError) as low:
        _vllm({}, {"k": 4, "temperature": 0.005})
    assert ("eval.temperature=0.005: vLLM raises a temperature below 0.01 to 0.01, so it would sample at another "
            "temperature than eval.temperature says; set eval.temperature >= 0.01") in str(low.value)
    assert "log-probs" not in str(low.value)  # (evaluation records none)


# ---------------------------------------------------------------- relayrl eval's flags
def test_relayrl_eval_s_filter_flags(capsys, tmp_path):
    from relayrl.cli import main as cli
    from relayrl.cli.boundary import EXIT_CONFIG

    missing = str(tmp_path / "no-model")  # (never loaded: the arguments are checked first)
    assert cli.main(["eval", "--model", missing, "--task", "arith", "--top-p", "0.7"]) == EXIT_CONFIG
    assert "--top-p 0.7 filters the --k samples, and --k 1 evaluates the greedy answer only: give --k > 1 (e.g. 8) " \
           "or drop --top-p" in capsys.readouterr().err
    assert cli.main(["eval", "--model", missing, "--recipe", "arith_grpo", "--top-k", "5"]) == EXIT_CONFIG
    assert "--top-k does not go with --recipe, whose run config sets eval.top_k; override eval.top_k=..." in \
        capsys.readouterr().err
    for flag, value, says in (("--top-k", "-1", "argument --top-k: -1 is how verl and vLLM turn top-k off; relayrl's "
                                                "off is 0"),
                              ("--top-p", "0", "argument --top-p: 0.0 is not in (0, 1]"),
                              ("--min-p", "1.5", "argument --min-p: 1.5 is not in [0, 1]")):
        with pytest.raises(SystemExit):
            cli.main(["eval", "--model", missing, "--task", "arith", "--k", "4", flag, value])
        assert says in capsys.readouterr().err
