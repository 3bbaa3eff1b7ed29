"""A user's advantage estimator and policy loss named by path (``algorithm.advantage=file.py:NAME``,
``algorithm.policy_loss=file.py:fn``, :mod:`relayrl.algorithms.plugins`): the config loads them and asks the
record what it needs, the step computes them, and a plugin that breaks its contract is refused naming the key."""

from __future__ import annotations

import pickle
import textwrap
from dataclasses import fields

import pytest
import torch

from relayrl.plugins import PluginError

PLUGINS = textwrap.dedent('''
    from relayrl.algorithms.estimators.base import Advantages, Estimator, EstimatorInputs, broadcast


    def _half(x: EstimatorInputs) -> Advantages:
        from relayrl.algorithms.advantages import grpo

        adv = grpo(x.rewards, x.group_ids, normalize_std=False) * 0.5
        return Advantages(broadcast(adv, x.mask), metrics={"mine/scale": 0.5})


    HALF = Estimator("half", _half, paper="test", min_group=2)
    CRITIC = Estimator("critic", lambda x: Advantages(x.values * x.mask, returns=x.values), paper="test",
                       values=True)


    def centred(x):
        return Advantages(broadcast(x.rewards - x.rewards.mean(), x.mask))


    def per_response(x):
        return Advantages(x.rewards)


    def two_args(x, y):
        return None


    def token_loss(logprobs, old_logprobs, advantages, mask, **common):
        return -advantages * logprobs, {"mine/calls": 1.0}


    def scaled_loss(logprobs, old_logprobs, advantages, mask, *, beta=1.0, mode="hard", **common):
        return -beta * advantages * logprobs, {"mine/beta": float(beta), "mine/soft": float(mode == "soft")}


    def plain_pg(logprobs, old_logprobs, advantages, mask, **common):
        return -advantages * logprobs, {}


    plain_pg.uses_ratio = False


    def wrong_flag(logprobs, old_logprobs, advantages, mask, **common):
        return -advantages * logprobs, {}


    wrong_flag.uses_ratio = "no"


    def no_common(logprobs, old_logprobs, advantages, mask):
        return (-advantages * logprobs).sum(), {}


    NOT_A_FUNCTION = 3
''')


@pytest.fixture()
def plugins(tmp_path):
    """The path of a user file holding estimators and losses (good and broken)."""
    path = tmp_path / "mine.py"
    path.write_text(PLUGINS)
    return path


def _cfg(**algorithm):
    from relayrl.config.schema import Config

    return Config.model_validate({"algorithm": algorithm})


def test_an_estimator_record_from_a_file_is_asked_as_a_registered_one_and_computed(plugins, monkeypatch):
    from relayrl.config.plan import step_plan
    from relayrl.workflows.estimate import advantage_rows

    monkeypatch.chdir(plugins.parent)
    cfg = _cfg(advantage="mine.py:HALF")  # (relative: made absolute when the config loads)
    assert cfg.algorithm.advantage == f"{plugins}:HALF"
    plan = step_plan(cfg)
    assert plan.estimator.plugin and plan.estimator.min_group == 2 and plan.roles == ("actor", "rollout")
    out, metrics = advantage_rows(cfg.algorithm, torch.tensor([1.0, 0.0]), [2, 3], torch.tensor([0, 0]))
    torch.testing.assert_close(out["advantages"][0], torch.tensor([0.25, 0.25]))
    torch.testing.assert_close(out["advantages"][1], torch.tensor([-0.25, -0.25, -0.25]))
    assert metrics["mine/scale"] == 0.5
    from relayrl.config.schema import Config

    with pytest.raises(ValueError, match="rollout.n >= 2"):  # min_group from the record
        Config.model_validate({"algorithm": {"advantage": f"{plugins}:HALF"}, "rollout": {"n": 1, "temperature": 1}})
    with pytest.raises(ValueError, match="ignores it"):  # gamma is not one of its params
        _cfg(advantage=f"{plugins}:HALF", gamma=0.9)
    critic = step_plan(_cfg(advantage=f"{plugins}:CRITIC"))
    assert "critic" in critic.roles  # values=True: the plan builds a critic


def test_a_plain_function_is_an_estimator_that_sees_the_whole_batch(plugins):
    from relayrl.algorithms.estimators import estimator

    est = estimator(f"{plugins}:centred")
    assert est.plugin and not est.group_relative and est.min_group == 1 and not est.values
    from relayrl.algorithms.estimators.base import EstimatorInputs

    out = est(EstimatorInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), torch.ones(2, 2)))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.5, 0.5], [-0.5, -0.5]]))


@pytest.mark.parametrize("name,match", [
    ("NOPE", r"algorithm.advantage=.*mine.py:NOPE: 'mine.py' has no attribute 'NOPE' \(callables there: .*HALF"),
    ("two_args", r"algorithm.advantage=.*two_args: 'two_args' has signature \(x, y\), which cannot be called as "
                 r"fn\(x: EstimatorInputs\) -> Advantages"),
    ("NOT_A_FUNCTION", r"algorithm.advantage=.*NOT_A_FUNCTION is a int; point at an Estimator record"),
])
def test_a_broken_estimator_is_refused_when_the_config_loads_naming_the_key(plugins, name, match):
    with pytest.raises(ValueError, match=match):
        _cfg(advantage=f"{plugins}:{name}")


def test_an_estimator_file_or_module_that_is_not_there_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"algorithm.advantage='nothere.py:X': no file .*nothere.py"):
        _cfg(advantage="nothere.py:X")
    with pytest.raises(ValueError, match=r"algorithm.advantage=no_such_pkg.mod:X: no module named 'no_such_pkg.mod'"):
        _cfg(advantage="no_such_pkg.mod:X")
    with pytest.raises(ValueError, match=r"not one of grpo, .* \(or your own by path"):
        _cfg(advantage="grpoo")


def test_a_user_estimator_breaking_its_return_contract_is_the_users_error(plugins):
    from relayrl.algorithms.estimators import estimator
    from relayrl.algorithms.estimators.base import EstimatorInputs
    from relayrl.errors import is_user_error

    est = estimator(f"{plugins}:per_response")
    shape = r"algorithm.advantage=.*per_response returned advantages of shape \(2,\)"
    with pytest.raises(PluginError, match=shape) as e:
        est(EstimatorInputs(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 3)))
    assert is_user_error(e.value)


def test_a_module_path_names_an_estimator_too(plugins, monkeypatch):
    monkeypatch.syspath_prepend(str(plugins.parent))
    assert _cfg(advantage="mine:HALF").algorithm.advantage == "mine:HALF"  # (a module path is left as written)
    from relayrl.algorithms.estimators import estimator

    assert estimator("mine.HALF").min_group == 2


def test_the_loss_contract_names_the_keywords_every_loss_takes():
    from relayrl.algorithms.plugins import COMMON_LOSS_ARGS
    from relayrl.algorithms.ratio import LossArgs

    assert COMMON_LOSS_ARGS == tuple(f.name for f in fields(LossArgs))


def test_a_user_token_loss_is_aggregated_as_the_registered_ones_and_has_their_gradient(plugins):
    """``-A log pi`` per token from the user is GPG's loss: the same value and gradient under every aggregation,
    with the global counts and the is_weights of a correction or a token selection."""
    from relayrl.algorithms.gpg import gpg_loss
    from relayrl.algorithms.losses import policy_loss_fn

    user = policy_loss_fn(f"{plugins}:token_loss")
    lp0 = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    adv, mask = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, 0.0]]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 1.0]])
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        common = dict(agg=agg, is_weights=w, global_tokens=10, global_seqs=4)
        lp_user, lp_gpg = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
        loss, metrics = user(lp_user, lp0, adv, mask, **common)
        ref, _ = gpg_loss(lp_gpg, lp0, adv, mask, **common)
        loss.backward()
        ref.backward()
        torch.testing.assert_close(loss, ref)
        torch.testing.assert_close(lp_user.grad, lp_gpg.grad)
        assert metrics == {"mine/calls": 1.0}


def test_a_policy_loss_from_a_file_runs_inside_the_step_loss_and_travels_as_its_path(plugins):
    from relayrl.engines.training.base import MicroBatch
    from relayrl.workflows.losses import PolicyLoss

    cfg = _cfg(policy_loss=str(plugins) + ":token_loss")
    loss_fn = PolicyLoss(kind=cfg.algorithm.policy_loss, agg="token-mean")
    assert pickle.loads(pickle.dumps(loss_fn)) == loss_fn  # (a rank gets the path and loads the function itself)
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mb = MicroBatch(lp, torch.ones(2, 2), {"advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]])}, 4, 2, None)
    loss, metrics = loss_fn(mb)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.25, -0.25], [0.25, 0.25]]))
    assert metrics["mine/calls"] == 1.0 and "actor/loss" in metrics


@pytest.mark.parametrize("name,match", [
    ("no_common", r"algorithm.policy_loss=.*no_common: 'no_common' has signature \(logprobs, old_logprobs, "
                  r"advantages, mask\), which cannot be called as fn\(logprobs, old_logprobs, advantages, mask, "
                  r"\*\*common\)"),
    ("NOPE", r"algorithm.policy_loss=.*mine.py:NOPE: 'mine.py' has no attribute 'NOPE'"),
    ("NOT_A_FUNCTION", r"algorithm.policy_loss=.*NOT_A_FUNCTION: int is not a function"),
])
def test_a_broken_policy_loss_is_refused_when_the_config_loads_naming_the_key(plugins, name, match):
    with pytest.raises(ValueError, match=match):
        _cfg(policy_loss=f"{plugins}:{name}")
    with pytest.raises(ValueError, match=r"algorithm.policy_loss='ppoo' is not one of ppo, cispo, .* \(or your own"):
        _cfg(policy_loss="ppoo")


def test_a_user_loss_gets_its_own_options_from_the_config(plugins):
    from relayrl.engines.training.base import MicroBatch
    from relayrl.workflows.losses import PolicyLoss

    cfg = _cfg(policy_loss=f"{plugins}:scaled_loss", policy_loss_options={"beta": 0.5, "mode": "soft"})
    assert cfg.algorithm.loss_options() == (("beta", 0.5), ("mode", "soft"))
    loss_fn = PolicyLoss(kind=cfg.algorithm.policy_loss, agg="token-mean", options=cfg.algorithm.loss_options())
    assert pickle.loads(pickle.dumps(loss_fn)) == loss_fn
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    mb = MicroBatch(lp, torch.ones(2, 2), {"advantages": torch.tensor([[1.0, 1.0], [-1.0, -1.0]])}, 4, 2, None)
    loss, metrics = loss_fn(mb)
    loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([[-0.125, -0.125], [0.125, 0.125]]))  # beta halves it
    assert metrics["mine/beta"] == 0.5 and metrics["mine/soft"] == 1.0
    assert _cfg(policy_loss=f"{plugins}:scaled_loss").algorithm.loss_options() == ()  # (its defaults)


@pytest.mark.parametrize("loss,options,match", [
    ("scaled_loss", {"betta": 0.5}, r"algorithm.policy_loss_options.betta: 'scaled_loss' \(.*mine.py:scaled_loss\) "
                                    r"has no keyword parameter 'betta' \(its own: beta, mode\)"),
    ("token_loss", {"beta": 0.5}, r"'token_loss' .* has no keyword parameter 'beta' \(its own: none\)"),
    ("scaled_loss", {"clip_low": 0.1}, r"algorithm.policy_loss_options.clip_low: relayrl passes clip_low to every "
                                       r"policy loss itself"),
    ("ppo", {"beta": 0.5}, r"algorithm.policy_loss_options.beta is an option of your own loss .* "
                           r"algorithm.policy_loss=ppo is built in: it takes no options of its own"),
    ("sapo", {"tau_pos": 1.0}, r"algorithm.policy_loss=sapo is built in: its options are algorithm.sapo"),
])
def test_options_a_loss_does_not_name_are_refused_when_the_config_loads(plugins, loss, options, match):
    with pytest.raises(ValueError, match=match):
        _cfg(policy_loss=loss if loss in ("ppo", "sapo") else f"{plugins}:{loss}", policy_loss_options=options)


def test_a_user_loss_that_declares_no_ratio_skips_the_pi_old_pass(plugins):
    """With several optimizer steps per batch a loss is taken to read pi_old (the pi_old pass runs), unless the
    function says ``uses_ratio = False``; a rollout correction still needs pi_old."""
    from relayrl.config.plan import step_plan
    from relayrl.config.schema import Config

    def plan(loss, **algorithm):
        return step_plan(Config.model_validate({"algorithm": {"policy_loss": f"{plugins}:{loss}", **algorithm},
                                                "trainer": {"mini_batches": 2}}))

    assert plan("token_loss").recompute_old and not plan("plain_pg").recompute_old
    assert plan("plain_pg", correction={"level": "token"}).recompute_old
    with pytest.raises(ValueError, match=r"wrong_flag: its uses_ratio attribute is 'no'; set fn.uses_ratio = False"):
        _cfg(policy_loss=f"{plugins}:wrong_flag")


@pytest.mark.parametrize("body,match", [
    ("return -advantages * logprobs", r"returned Tensor; return \(loss, metrics\)"),
    ("return 1.0, {}", r"returned a loss of type float; return a torch tensor"),
    ("return (-advantages * logprobs).sum(-1), {}", r"returned a loss of shape \(2,\); return a 0-dim tensor or "
                                                    r"token losses shaped like the mask \(2, 2\)"),
    ("return (logprobs * float('nan')).sum(), {}", r"returned a loss of nan at its first call; it must be finite"),
    ("return (-advantages * logprobs).sum().detach(), {}", r"returned a loss with no gradient"),
    ("return (-advantages * logprobs).sum(), {'mine/x': 'high'}", r"returned metrics \{'mine/x': 'high'\}; return "
                                                                  r"a dict of floats"),
])
def test_a_policy_loss_breaking_its_return_contract_is_refused_at_its_call(tmp_path, body, match):
    from relayrl.algorithms.losses import policy_loss_fn
    from relayrl.errors import is_user_error

    path = tmp_path / "bad_loss.py"
    path.write_text(f"def bad(logprobs, old_logprobs, advantages, mask, **common):\n    {body}\n")
    fn = policy_loss_fn(f"{path}:bad")
    lp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    with pytest.raises(PluginError, match=r"algorithm.policy_loss=.*bad_loss.py:bad " + match) as e:
        fn(lp, lp.detach(), torch.ones(2, 2), torch.ones(2, 2), agg="token-mean")
    assert is_user_error(e.value)


def test_the_registered_names_still_name_the_registered_losses():
    from relayrl.algorithms.losses import POLICY_LOSSES, policy_loss_fn
    from relayrl.algorithms.names import POLICY_LOSS_NAMES

    for name in POLICY_LOSS_NAMES:
        assert _cfg(policy_loss=name, **({"advantage": "gpg"} if name == "gpg" else {})).algorithm.policy_loss == name
        assert policy_loss_fn(name) is POLICY_LOSSES[name]


def test_the_examples_of_the_algorithms_page_load_and_compute(tmp_path):
    """docs/algorithms.md's two example files, as written there: the config takes them, the estimator is RLOO
    halved, and the loss is PPO's clipped surrogate (its value and gradient those of the built-in ppo)."""
    import re
    from pathlib import Path

    from relayrl.algorithms.estimators import estimator
    from relayrl.algorithms.estimators.base import EstimatorInputs
    from relayrl.algorithms.losses import policy_loss, policy_loss_fn

    page = (Path(__file__).resolve().parents[2] / "docs" / "algorithms.md").read_text()
    section = page.split("## Your own estimator or loss", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(# (\S+\.py): (algorithm\.\S+)=\S+:(\w+)\n.*?)```", section, re.S)
    assert [b[2] for b in blocks] == ["algorithm.advantage", "algorithm.policy_loss"]
    for code, name, _, _ in blocks:
        (tmp_path / name).write_text(code)
    (_, est_file, _, est_name), (_, loss_file, _, loss_name) = blocks
    cfg = _cfg(advantage=f"{tmp_path / est_file}:{est_name}", policy_loss=f"{tmp_path / loss_file}:{loss_name}")
    r, g = torch.tensor([1.0, 0.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 0, 5, 5])
    out = estimator(cfg.algorithm.advantage)(EstimatorInputs(r, g, torch.ones(5, 2)))
    torch.testing.assert_close(out.advantages[:, 0], torch.tensor([0.5, -0.25, -0.25, 0.0, 0.0]))
    assert set(out.metrics) == {"mine/adv_abs_mean"}
    lp0 = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.2]])
    old, adv, mask = lp0 - torch.tensor([[0.5, 0.0, -0.5], [0.1, 0.0, 0.0]]), torch.ones(2, 3), torch.ones(2, 3)
    adv[1] = -1.0
    lp_user, lp_ppo = lp0.clone().requires_grad_(), lp0.clone().requires_grad_()
    loss, metrics = policy_loss_fn(cfg.algorithm.policy_loss)(lp_user, old, adv, mask, agg="token-mean")
    ref, _ = policy_loss(lp_ppo, old, adv, mask, agg="token-mean")
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lp_user.grad, lp_ppo.grad)
    assert set(metrics) == {"mine/clip_frac"}
