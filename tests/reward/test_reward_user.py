"""User reward functions: loading by dotted path (with signature checks) and the per-call contract."""

import textwrap

import numpy as np
import pytest
import torch

from relayrl.engines.reward import RewardConfig, RewardEngine, RewardError, RewardFn, check_rewards, load_reward_fn
from relayrl.engines.reward.examples import LengthPenalizedExact


@pytest.fixture
def user_mod(tmp_path, monkeypatch):
    """A throwaway module ``relayrl_test_userfns`` with good and bad reward functions."""
    (tmp_path / "relayrl_test_userfns.py").write_text(textwrap.dedent('''
        import math
        CONSTANT = 3
        calls = []

        def good(prompts, responses, answers):
            calls.append(len(responses))
            return [float(len(r)) for r in responses]

        def with_kwargs(prompts, responses, answers, *, scale=2.0, **extra):
            return [scale] * len(responses)

        def too_few_args(responses):
            return [0.0] * len(responses)

        def openrlhf_reward_func(queries, prompts, labels, **kwargs):
            return {"rewards": [float(len(q)) for q in queries]}

        def too_many_args(prompts, responses, answers, tokenizer):
            return [0.0] * len(responses)

        def short(prompts, responses, answers):
            return [1.0] * (len(responses) - 1)

        def returns_str(prompts, responses, answers):
            return "1.0"

        def bad_item(prompts, responses, answers):
            return [1.0] + ["high"] * (len(responses) - 1)

        def nan(prompts, responses, answers):
            return [1.0, math.nan] + [0.0] * (len(responses) - 2)

        def huge(prompts, responses, answers):  # finite, but inf as the float32 rewards train as
            return [1.0, 1e308] + [0.0] * (len(responses) - 2)

        def numpy_out(prompts, responses, answers):
            import numpy as np
            return np.ones(len(responses), dtype=np.float32)

        def per_response(prompt, response, answer):  # verl's compute_score shape: one response, one number
            return 1.0

        def raises(prompts, responses, answers):
            return [1 / 0 for _ in responses]

        class Scorer:
            def __call__(self, prompts, responses, answers):
                return [0.5] * len(responses)

        scorer = Scorer()
    '''))
    (tmp_path / "relayrl_test_broken.py").write_text("import relayrl_dependency_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib
    import sys

    sys.modules.pop("relayrl_test_userfns", None)
    mod = importlib.import_module("relayrl_test_userfns")
    yield mod
    sys.modules.pop("relayrl_test_userfns", None)


def test_example_functions_load_by_both_path_styles():
    fn = load_reward_fn("relayrl.engines.reward.examples:length_penalized_exact")
    assert isinstance(fn, LengthPenalizedExact) and isinstance(fn, RewardFn)
    # exact hit with 4 chars beyond the 16 free ones: 1 - 0.04; a miss floors at 0
    out = fn(["p", "p"], ["12\n" + "x" * 17, "13"], ["12", "12"])
    assert out == pytest.approx([0.96, 0.0])
    fn2 = load_reward_fn("relayrl.engines.reward.examples.contains_answer")
    assert fn2(["p"] * 3, ["the answer is 42", "41", "x"], ["42", "42", None]) == [1.0, 0.0, 0.0]


def test_load_accepts_extra_keyword_parameters_and_callable_instances(user_mod):
    assert load_reward_fn("relayrl_test_userfns:with_kwargs")(["p"], ["r"], ["a"]) == [2.0]
    assert load_reward_fn("relayrl_test_userfns:scorer")(["p"], ["r"], ["a"]) == [0.5]
    with pytest.raises(RewardError, match="missing a required argument: 'answers'"):  # unbound: needs self
        load_reward_fn("relayrl_test_userfns:Scorer.__call__")


@pytest.mark.parametrize(
    "path, message",
    [
        ("relayrl_no_such_module:fn", "no module named 'relayrl_no_such_module'"),
        ("relayrl_no_such_module.sub.fn", "no module named 'relayrl_no_such_module.sub'"),
        ("relayrl_test_userfns:missing", "'relayrl_test_userfns' has no attribute 'missing'"),
        ("relayrl_test_userfns.missing", "has no attribute 'missing'"),
        ("relayrl_test_userfns:CONSTANT", "is a int, not callable"),
        ("relayrl_test_userfns:Scorer", "is a class"),
        ("relayrl_test_userfns:too_few_args", "cannot be called as fn(prompts, responses, answers)"),
        ("relayrl_test_userfns:too_many_args", "missing a required argument: 'tokenizer'"),
        ("relayrl_test_userfns:openrlhf_reward_func", "OpenRLHF's reward_func(queries, prompts, labels), which "
         "takes each prompt with its response as one text; relayrl calls fn(prompts, responses, answers)"),
        ("relayrl_test_broken:fn", "importing module 'relayrl_test_broken' failed"),
        ("nodots", "must look like 'package.module:function'"),
        ("relayrl_test_userfns:", "must look like"),
    ],
)
def test_load_rejects_bad_paths_with_reason(user_mod, path, message):
    with pytest.raises(RewardError) as e:
        load_reward_fn(path)
    assert message in str(e.value)


def test_missing_attribute_lists_callables(user_mod):
    with pytest.raises(RewardError, match=r"callables there: .*good"):
        load_reward_fn("relayrl_test_userfns:god")


def _engine(name):
    return RewardEngine(RewardConfig(verifier="user", user_fn=f"relayrl_test_userfns:{name}"))


@pytest.mark.parametrize(
    "name, message",
    [
        ("short", "relayrl_test_userfns:short returned 2 values for 3 responses; expected 3"),
        ("returns_str", "relayrl_test_userfns:returns_str returned str; expected a list of 3 floats"),
        ("bad_item", "returned str 'high' at index 1; expected a float"),
        ("nan", "returned nan at index 1; rewards must be finite"),
        ("huge", "returned 1e+308 at index 1, beyond float32's range (+-3.4e+38, as rewards train); rewards must "
                 "be finite"),
        ("raises", "relayrl_test_userfns:raises raised ZeroDivisionError"),
        ("per_response", "relayrl_test_userfns:per_response returned float; expected a list of 3 floats: it is "
                         "called once with lists (prompts, responses, answers), not once per response; wrap a "
                         "per-response function as"),
    ],
)
def test_user_fn_contract_breaches_raise_reward_error(user_mod, name, message):
    with pytest.raises(RewardError) as e:
        _engine(name).score(["p"] * 3, ["a", "bb", "ccc"], ["x", None, "z"])
    assert message in str(e.value)


def test_user_fn_gets_whole_batch_and_numpy_output_is_accepted(user_mod):
    user_mod.calls.clear()
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="relayrl_test_userfns:good", workers=3))
    rewards, metrics = eng.score(["p"] * 5, ["a", "bb", "", "dddd", "e"], [None] * 5)
    eng.close()
    assert rewards == [1.0, 2.0, 0.0, 4.0, 1.0]
    assert user_mod.calls == [5]
    assert metrics["reward/verifier_mean"] == pytest.approx(8 / 5)
    assert _engine("numpy_out").score(["p"] * 2, ["a", "b"], [None, None])[0] == [1.0, 1.0]


def test_check_rewards_shapes():
    assert check_rewards(torch.tensor([0.5, 1.0]), 2, "f") == [0.5, 1.0]
    assert check_rewards((1, 0), 2, "f") == [1.0, 0.0]
    assert check_rewards([True, False], 2, "f") == [1.0, 0.0]  # a verifier's verdicts, as Python's numbers
    with pytest.raises(RewardError, match=r"shape \(2, 1\)"):
        check_rewards(np.zeros((2, 1)), 2, "f")
    with pytest.raises(RewardError, match="returned dict"):
        check_rewards({"a": 1.0}, 1, "f")


def test_check_rewards_takes_numpy_and_torch_scalars_per_response():
    """verl's reward loop writes a compute_score's result into a tensor, so np.bool_, np.float32 and 0-d
    tensors work there: here too, as the Python numbers they hold."""
    got = check_rewards([np.bool_(True), np.float32(0.5), torch.tensor(2.0), np.array(1)], 4, "f")
    assert got == [1.0, 0.5, 2.0, 1.0] and all(type(v) is float for v in got)
    with pytest.raises(RewardError, match=r"returned ndarray .* at index 0; expected a float"):
        check_rewards([np.zeros(2)], 1, "f")  # (not one number)
    with pytest.raises(RewardError, match="returned nan at index 0"):
        check_rewards([torch.tensor(float("nan"))], 1, "f")


def _fails_on_b(prompts, responses, answers):
    if "b" in prompts:
        raise KeyError("no reference")
    return [float(len(r)) for r in responses]


def test_a_reward_function_failing_on_one_prompt_is_named_or_its_rows_dropped(monkeypatch):
    import math
    import sys
    import types

    monkeypatch.setitem(sys.modules, "flaky_rewards", types.SimpleNamespace(score=_fails_on_b))
    prompts, responses = ["a", "a", "b", "b", "c"], ["x", "xx", "y", "yy", "zzz"]
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="flaky_rewards:score"))
    with pytest.raises(RewardError) as e:
        eng.score(prompts, responses, [None] * 5)
    assert "raised KeyError: 'no reference', scoring the responses to prompt 'b'; fix the function" in str(e.value)
    eng = RewardEngine(RewardConfig(verifier="user", user_fn="flaky_rewards:score", on_error="drop_group"))
    rewards, metrics = eng.score(prompts, responses, [None] * 5)
    assert rewards[:2] == [1.0, 2.0] and math.isnan(rewards[2]) and math.isnan(rewards[3]) and rewards[4] == 3.0
    assert metrics["reward/errors"] == 2.0 and metrics["reward/mean"] == 2.0  # the mean of the rows scored
    assert eng.verify(prompts, responses, [None] * 5) == [1.0, 2.0, 0.0, 0.0, 3.0]
    with pytest.raises(ValueError, match="reward.on_error=drop_group applies to a reward function"):
        RewardConfig(verifier="exact", on_error="drop_group")


def test_a_file_path_loads_like_a_module_and_becomes_absolute_when_the_config_loads(tmp_path, monkeypatch):
    """verl's custom_reward_function.path: no package, no PYTHONPATH. The config makes the path absolute, so a
    rank process or Ray worker with another working directory opens the same file."""
    from pydantic import ValidationError

    (tmp_path / "my_rewards.py").write_text("def score(prompts, responses, answers):\n"
                                            "    return [float(r == a) for r, a in zip(responses, answers)]\n")
    (tmp_path / "broken.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.chdir(tmp_path)
    cfg = RewardConfig(verifier="user", user_fn="my_rewards.py:score")
    assert cfg.user_fn == f"{tmp_path / 'my_rewards.py'}:score"
    monkeypatch.chdir("/")
    assert load_reward_fn(cfg.user_fn)(["p", "q"], ["1", "2"], ["1", "3"]) == [1.0, 0.0]
    assert RewardEngine(cfg).score(["p"], ["7"], ["7"])[0] == [1.0]
    (tmp_path / "strs.py").write_text("def score(prompts, responses, answers):\n    return ['1']\n")
    with pytest.raises(RewardError, match=rf"reward function {tmp_path / 'strs.py'}:score returned str"):
        RewardEngine(RewardConfig(verifier="user", user_fn=f"{tmp_path / 'strs.py'}:score")).score(["p"], ["7"], ["7"])
    with pytest.raises(ValidationError, match=r"reward.user_fn='nope.py:score': no file /nope.py"):
        RewardConfig(verifier="user", user_fn="nope.py:score")
    with pytest.raises(RewardError, match=r"has no attribute 'scor' \(callables there: score\)"):
        load_reward_fn(f"{tmp_path / 'my_rewards.py'}:scor")
    with pytest.raises(RewardError, match=r"running .*broken.py raised RuntimeError: no GPU here"):
        load_reward_fn(f"{tmp_path / 'broken.py'}:score")
    with pytest.raises(RewardError, match=r"names a file but not the object in it: 'rewards.py:my_function'"):
        load_reward_fn("rewards.py")  # (it said: no module named 'rewards' ... name the file: rewards.py:py)
    with pytest.raises(RewardError, match=r"no module named 'my_rewards': install it, put its directory on "
                                          r"PYTHONPATH, or name the file: my_rewards.py:score"):
        load_reward_fn("my_rewards:score")
