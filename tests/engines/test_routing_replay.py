"""MoE routing replay end to end in the engines: the native engine records each token's experts, the training
engine replays them in every layout, and the config refuses what cannot record them."""

from __future__ import annotations

import copy

import pytest
import torch

from relayrl.config.schema import Config
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.routing import Routing
from relayrl.workflows.losses import PolicyLoss
from tests.models.architectures import build


def _own_routes(model, seq: list[int]) -> torch.Tensor:
    """The model's own routing of every token of ``seq`` but the last (the generator never runs it)."""
    routing = Routing(model)
    try:
        with routing.record() as rec, torch.no_grad():
            model(torch.tensor(seq)[None])
        return rec.routes()[:-1]
    finally:
        routing.remove()


def _same_experts(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(-1).values, b.long().sort(-1).values)


@pytest.fixture()
def moe(tiny_tokenizer):
    return build("qwen3_moe", vocab=len(tiny_tokenizer))


PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16]]


def test_the_native_engine_records_the_routing_of_every_token_it_runs(moe, tiny_tokenizer):
    """Continuous batching (two of three prompts' rows at a time, joined and cropped) keeps each row's routes:
    they are the model's own routing of prompt + response but the last token."""
    eng = NativeGenerationEngine(moe, tiny_tokenizer, max_batch=4, decode="dynamic", record_routing=True)
    comps = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, temperature=1.0),
                         generator=torch.Generator().manual_seed(0))
    assert len(comps) == 6
    for c in comps:
        seq = PROMPTS[c.prompt_index] + c.token_ids.tolist()
        assert c.routed_experts.dtype == torch.int16
        assert c.routed_experts.shape == (len(seq) - 1, 2, 2)
        assert _same_experts(c.routed_experts, _own_routes(moe, seq))
    plain = NativeGenerationEngine(copy.deepcopy(moe), tiny_tokenizer, max_batch=4, decode="dynamic")
    again = plain.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, temperature=1.0),
                           generator=torch.Generator().manual_seed(0))
    assert [c.token_ids.tolist() for c in again] == [c.token_ids.tolist() for c in comps]  # (recording is passive)
    assert all(c.routed_experts is None for c in again)


def test_a_partial_rollout_records_the_context_again_under_the_new_weights(moe, tiny_tokenizer):
    new = copy.deepcopy(moe)
    with torch.no_grad():
        for name, p in new.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn_like(p) * 3)  # other routers: other experts for the same tokens
    eng = NativeGenerationEngine(copy.deepcopy(moe), tiny_tokenizer, max_batch=6, decode="dynamic", record_routing=True)
    calls = {"n": 0}

    def between() -> bool:
        calls["n"] += 1
        if calls["n"] == 3:
            eng.update_weights(list(new.named_parameters()), version=1)
            return True
        return False

    comps = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=6, temperature=1.0, ignore_eos=True),
                         generator=torch.Generator().manual_seed(0), between=between)
    for c in comps:
        assert c.token_versions.tolist() == [0, 0, 1, 1, 1, 1]
        seq = PROMPTS[c.prompt_index] + c.token_ids.tolist()
        assert _same_experts(c.routed_experts, _own_routes(new, seq))
        assert not _same_experts(c.routed_experts, _own_routes(moe, seq))


def _batch(tiny_tokenizer, shift: bool, moe) -> SequenceBatch:
    """Two groups of two rows, their routes the model's own or moved to other experts (``shift``)."""
    g = torch.Generator().manual_seed(3)
    prompts, responses, routes, groups = [], [], [], []
    for gi, p in enumerate(([5, 6, 7, 8, 9], [10, 11, 12])):
        for _ in range(2):
            r = torch.randint(3, 90, (int(torch.randint(2, 7, (1,), generator=g)),), generator=g)
            seq = p + r.tolist()
            own = _own_routes(moe, seq)
            prompts.append(torch.tensor(p))
            responses.append(r)
            routes.append(((own + 1) % 4 if shift else own).to(torch.int16))
            groups.append(gi)
    return SequenceBatch(prompts, responses, {}, groups, routes)


@pytest.mark.parametrize("packing", ["shared_prompt", "sequences", "none"])
def test_the_trainer_replays_the_routes_in_every_layout(packing, moe, tiny_tokenizer):
    eng = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(packing=packing), total_steps=1,
                              trainable=False, routing_replay=True)
    free = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(packing=packing), total_steps=1, trainable=False)
    own, shifted = _batch(tiny_tokenizer, False, moe), _batch(tiny_tokenizer, True, moe)
    want, _ = free.logprobs(own)
    got, _ = eng.logprobs(own)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    moved, _ = eng.logprobs(shifted)
    assert max(float((a - b).abs().max()) for a, b in zip(moved, want)) > 1e-2
    # the same replay as the model's own forward with the routes replayed on one unpacked row
    routing = Routing(moe)
    for i, lp in enumerate(moved):
        p, r = shifted.prompt_ids[i], shifted.response_ids[i]
        full = torch.cat([shifted.routes[i], torch.full((1, 2, 2), -1, dtype=torch.int16)])
        routing.replay(full)
        with torch.no_grad():
            logits = moe(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1).gather(-1, r[:, None])[:, 0]
        torch.testing.assert_close(lp, ref, rtol=0, atol=1e-5)


def test_the_update_reports_how_often_the_trainer_would_route_alike(moe, tiny_tokenizer):
    loss = PolicyLoss(clip_low=0.2, clip_high=0.2)
    for shift, check in ((False, lambda a: a == 1.0), (True, lambda a: a < 0.5)):
        batch = _batch(tiny_tokenizer, shift, moe)
        batch.fields["advantages"] = [torch.ones(len(r)) for r in batch.response_ids]
        eng = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(), total_steps=1, routing_replay=True)
        m = eng.train_step(batch, loss)
        assert check(m["actor/routing_agreement"]), m["actor/routing_agreement"]
        assert m["actor/grad_norm"] > 0


def test_a_batch_without_routes_is_refused_by_a_replaying_engine(moe, tiny_tokenizer):
    eng = TorchTrainingEngine(moe, TrainEngineConfig(), total_steps=1, trainable=False, routing_replay=True)
    batch = _batch(tiny_tokenizer, False, moe)
    with pytest.raises(ValueError, match="the batch carries no routes: the rollout must record them"):
        eng.logprobs(SequenceBatch(batch.prompt_ids, batch.response_ids, {}, batch.groups))
    long = [torch.cat([r, r]) if i == 2 else r for i, r in enumerate(batch.routes)]  # (another sequence's routes)
    with pytest.raises(ValueError, match="row 2: .* routed tokens for a sequence of .* does not belong"):
        eng.logprobs(SequenceBatch(batch.prompt_ids, batch.response_ids, {}, batch.groups, long))


@pytest.mark.parametrize("override, message", [
    ({"rollout": {"engine": "vllm"}}, "vLLM 0.32 returns routed experts .* from its GPU model runner only"),
    ({"rollout": {"engine": "openai", "base_url": "http://127.0.0.1:1/v1"}}, "returns no routing"),
    ({"rollout": {"decode": "static"}}, "rollout.decode=static decodes Llama-shaped"),
    ({"workflow": "sft"}, r"algorithm.routing_replay is read by workflow grpo only \(this run is workflow sft"),
])
def test_the_config_refuses_what_cannot_record_routing(override, message):
    with pytest.raises(ValueError, match=message):
        Config.model_validate({"algorithm": {"routing_replay": "rollout"}, **override})
    assert Config.model_validate({"algorithm": {"routing_replay": "rollout"}}).algorithm.routing_replay == "rollout"


@pytest.mark.parametrize("packing", ["shared_prompt", "sequences", "none"])
def test_the_old_pass_records_the_trainers_own_routing_of_every_token(packing, moe, tiny_tokenizer):
    """R2: ``logprobs_with_routes`` gives each row's routing of prompt + response (all of it: the trainer runs the
    last token too), a shared prompt's copied to every row of its group; replayed, the update starts from it."""
    eng = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(packing=packing), total_steps=1,
                              routing_replay=True)
    batch = _batch(tiny_tokenizer, False, moe)
    lp, routes, sq = eng.logprobs_with_routes(batch)
    assert sq is None
    free, _ = eng.logprobs(batch)
    for i, (a, b) in enumerate(zip(lp, free)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        seq = batch.prompt_ids[i].tolist() + batch.response_ids[i].tolist()
        assert routes[i].dtype == torch.int16 and routes[i].shape == (len(seq), 2, 2)
        assert _same_experts(routes[i][:-1], _own_routes(moe, seq))
    batch = SequenceBatch(batch.prompt_ids, batch.response_ids,
                          {"advantages": [torch.ones(len(r)) for r in batch.response_ids]}, batch.groups, routes)
    m = eng.train_step(batch, PolicyLoss(), mini_batches=2)  # the second mini-batch after an update (lr 1e-5)
    assert m["actor/routing_agreement"] == pytest.approx(1.0, abs=1e-3)


def test_recording_needs_an_engine_that_hooks_the_routers(moe, tiny_tokenizer):
    eng = TorchTrainingEngine(moe, TrainEngineConfig(), total_steps=1, trainable=False)
    with pytest.raises(ValueError, match="needs an engine built with routing_replay"):
        eng.logprobs_with_routes(_batch(tiny_tokenizer, False, moe))


def test_r2_needs_the_old_pass_and_takes_any_rollout_engine():
    with pytest.raises(ValueError, match="replays the routing of the pi_old pass, which this step does not run "
                                         "\\(algorithm.old_logprobs=auto with one optimizer step per batch"):
        Config.model_validate({"algorithm": {"routing_replay": "old"}})
    with pytest.raises(ValueError, match="algorithm.old_logprobs=rollout\\)"):
        Config.model_validate({"algorithm": {"routing_replay": "old", "old_logprobs": "rollout"}})
    for ok in ({"algorithm": {"routing_replay": "old", "old_logprobs": "recompute"}},
               {"algorithm": {"routing_replay": "old"}, "trainer": {"mini_batches": 2}, "rollout": {"engine": "vllm"}}):
        assert Config.model_validate(ok).algorithm.routing_replay == "old"


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")  # (the test's)
@pytest.mark.parametrize("packing", ["shared_prompt", "none"])
def test_the_load_balancing_loss_is_the_models_own_and_moves_the_routers(packing, moe, tiny_tokenizer):
    """engine.router_aux_loss_coef: on one row the reported term is the model's own aux_loss of that sequence
    (transformers' forward with output_router_logits); the routers' gradient then differs from the policy
    loss's alone by coef x the aux loss's."""
    prompt, response = torch.tensor([5, 6, 7, 8]), torch.tensor([9, 10, 11])
    batch = SequenceBatch([prompt], [response], {"advantages": [torch.ones(3)]}, [0])
    with torch.no_grad():
        want = float(moe(torch.cat([prompt, response])[None], output_router_logits=True).aux_loss)
    grads = {}
    for coef in (0.0, 0.5):
        cfg = TrainEngineConfig(packing=packing, router_aux_loss_coef=coef, optim=OptimConfig(max_grad_norm=None))
        eng = TorchTrainingEngine(copy.deepcopy(moe), cfg, total_steps=1)  # (unclipped: the gradients compare)
        gate = eng.model.model.layers[0].mlp.gate.weight
        eng.optimizer.step = lambda gate=gate, coef=coef: grads.__setitem__(coef, gate.grad.clone())  # (no step)
        m = eng.train_step(batch, PolicyLoss(agg="token-mean"))
        if coef:
            assert m["actor/router_aux_loss"] == pytest.approx(want, rel=1e-5)
        else:
            assert "actor/router_aux_loss" not in m
    aux_model = copy.deepcopy(moe)
    aux_model(torch.cat([prompt, response])[None], output_router_logits=True).aux_loss.backward()
    torch.testing.assert_close(grads[0.5] - grads[0.0], 0.5 * aux_model.model.layers[0].mlp.gate.weight.grad,
                               rtol=1e-4, atol=1e-6)


def test_a_load_balancing_loss_for_a_dense_model_is_refused(tiny_model):
    with pytest.raises(ValueError, match="Qwen2ForCausalLM computes none .*set engine.router_aux_loss_coef=0"):
        TorchTrainingEngine(tiny_model, TrainEngineConfig(router_aux_loss_coef=0.001), total_steps=1)


def test_cuda_graphs_are_refused_with_routing_replay():
    with pytest.raises(ValueError, match="engine.cuda_graphs=true replays recorded graphs"):
        Config.model_validate({"algorithm": {"routing_replay": "rollout"},
                               "engine": {"compile": True, "cuda_graphs": True}})


def test_an_episodes_routes_cover_every_turn_and_observation_before_its_last_turn(moe, tiny_tokenizer):
    """Multi-turn episodes (relayrl.environments.episodes): each turn prefills prompt + episode so far again, so
    the last turn's routes are the whole episode's up to that turn's last token; the observation after it was
    never run (its rows are missing: the trainer's routers choose there)."""
    from relayrl.data.tasks import Problem
    from relayrl.environments.base import StepResult
    from relayrl.environments.episodes import EpisodeLimits, run_episodes

    class Turns:
        def reset(self, problem):
            self.t = 0
            return ""

        def step(self, action):
            self.t += 1
            return StepResult(f"<obs{self.t}>", reward=0.0, done=self.t == 3)

    eng = NativeGenerationEngine(moe, tiny_tokenizer, max_batch=4, decode="dynamic", record_routing=True)
    probs = [Problem(f"{i}+{i}=", str(2 * i)) for i in range(2)]
    prompts = [tiny_tokenizer(p.prompt)["input_ids"] for p in probs]
    eps = run_episodes(eng, tiny_tokenizer, probs, prompts, Turns,
                       SamplingParams(n=2, max_new_tokens=4, temperature=1.0, ignore_eos=True),
                       EpisodeLimits(max_turns=5, max_tokens=100), generator=torch.Generator().manual_seed(0))
    last_obs = len(tiny_tokenizer("<obs3>", add_special_tokens=False)["input_ids"])
    for e in eps:
        assert e.turns == 3
        seq = e.prompt_ids + e.token_ids[:len(e.token_ids) - last_obs]  # up to the last turn's last token
        routes = e.completion(tiny_tokenizer).routed_experts
        assert routes.shape[0] == len(seq) - 1
        assert _same_experts(routes, _own_routes(moe, seq))


def test_a_response_cut_at_its_thinking_budget_keeps_the_routes_of_all_of_it(moe, tiny_tokenizer):
    """rollout.interrupt: the answer's row prefills prompt + thinking + the phrase, so its routes cover them."""
    from relayrl.engines.generation.interrupt import Interrupt, generate_interrupted

    eng = NativeGenerationEngine(moe, tiny_tokenizer, max_batch=4, decode="dynamic", record_routing=True)
    cut = Interrupt(after_tokens=3, forced_ids=(7, 8), answer_tokens=3)
    comps = generate_interrupted(eng, PROMPTS[:2], SamplingParams(n=2, max_new_tokens=8, temperature=1.0,
                                                                  ignore_eos=True), cut,
                                 generator=torch.Generator().manual_seed(0))
    assert any(c.interrupted for c in comps)
    for c in comps:
        seq = PROMPTS[c.prompt_index] + c.token_ids.tolist()
        assert c.routed_experts.shape[0] == len(seq) - 1
        assert _same_experts(c.routed_experts, _own_routes(moe, seq))



def test_the_step_plan_says_who_records_and_who_replays():
    from relayrl.config.plan import step_plan

    r3 = step_plan(Config.model_validate({"algorithm": {"routing_replay": "rollout"}})).notes
    r2 = step_plan(Config.model_validate({"algorithm": {"routing_replay": "old", "old_logprobs": "recompute"}})).notes
    assert any("the rollout records each token's experts" in n and "pi_old and update passes" in n for n in r3)
    assert any("the pi_old pass records its routers' choice" in n for n in r2)


def test_measure_compares_the_routes_and_replays_none(moe, tiny_tokenizer):
    """routing_compare (algorithm.routing_replay=measure): the log-probs are the model's own routing's, and the
    agreement says how often it chose the given experts."""
    free = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(), total_steps=1, trainable=False)
    loss = PolicyLoss()
    for shift, check in ((False, lambda a: a == 1.0), (True, lambda a: a < 0.5)):
        batch = _batch(tiny_tokenizer, shift, moe)
        eng = TorchTrainingEngine(copy.deepcopy(moe), TrainEngineConfig(), total_steps=1, routing_compare=True)
        assert eng._feed_last and not free._feed_last  # routes are laid out over whole sequences
        for a, b in zip(eng.logprobs(batch)[0], free.logprobs(batch)[0]):  # (the free engine leaves each
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # response's last token out: float32 rounding)
        batch.fields["advantages"] = [torch.ones(len(r)) for r in batch.response_ids]
        m = eng.train_step(batch, loss)
        assert check(m["actor/routing_agreement"]), m["actor/routing_agreement"]
    with pytest.raises(ValueError, match="vLLM 0.32 returns routed experts"):
        Config.model_validate({"algorithm": {"routing_replay": "measure"}, "rollout": {"engine": "vllm"}})
    from relayrl.config.plan import step_plan

    notes = step_plan(Config.model_validate({"algorithm": {"routing_replay": "measure"}})).notes
    assert any("compare their own choice with them" in n and "replay nothing" in n for n in notes)
