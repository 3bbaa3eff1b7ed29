"""The search's ranking on a toy profile, and ``relayrl plan`` end to end with stored profiles (no training)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_CONFIG, EXIT_USER
from relayrl.planner.placement import Placement
from relayrl.planner.profile import load_profile, save_profile
from relayrl.planner.search import candidates, format_plan, rank
from relayrl.planner.workload import LatencyDist, LengthDist, ModelShape

from .toy import toy_profile, toy_workload

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "recipes" / "arith_grpo.yaml")
PROFILES = ROOT / "relayrl" / "planner" / "profiles"


def test_candidates_cover_every_mode_and_split():
    c = candidates(3)
    assert Placement("sync-colocated", main=3) in c
    for gen in (1, 2):
        assert Placement("periodic", main=3 - gen, gen=gen) in c
        assert Placement("offpolicy", main=3 - gen, gen=gen, k=2, partial=True) in c
    assert len(c) == 1 + 2 * (2 + 4)



def test_candidates_keep_the_rollout_pools_a_tensor_parallel_rollout_can_be_cut_into():
    """rollout.vllm.tensor_parallel_size=2 on 4 devices: the rollout's pool (gen, or main when colocated) must be
    a multiple of 2 devices: colocated on 2 or 4, or a pool of 2 (gen=1 and gen=3 are refused by the config)."""
    c = candidates(4, cpu=True, rollout_tp=2)
    assert {(p.main, p.gen) for p in c} == {(2, 0), (4, 0), (2, 2)}
    assert all((p.gen or p.main) % 2 == 0 for p in c) and len(candidates(4, rollout_tp=2)) == 1 + 2 + 4
    assert {p.gen for p in candidates(64)} >= {0, 1, 2, 4, 8, 16, 32, 48, 56, 60, 62, 63}
    assert len(candidates(2, offpolicy=False, cpu=True)) == 2 + 2  # colocated 1 and 2 ranks, sync-split, periodic


def test_ranking_long_tail_prefers_overlap():
    """Long tails (one response in eight runs to 64 tokens) and a slow verifier: generation-bound steps, so
    the modes that overlap training with generation rank first, periodic above synchronous split."""
    prof = toy_profile(train_token_s=0.001, decode_s=0.01)
    w = toy_workload(8, 4, lengths=LengthDist(kind="mixture", short=4, p_long=0.125, long_mean=1000,
                                              max_new_tokens=64), reward_latency=LatencyDist(low_s=0.1, high_s=0.3))
    preds = rank(prof, w, candidates(2), steps=10)
    order = [p.placement.mode_name for p in preds]
    assert order[0].startswith("offpolicy")
    assert order.index("periodic") < order.index("sync-split")
    assert all(a.tpspd >= b.tpspd for a, b in zip(preds, preds[1:]))


def test_ranking_puts_infeasible_placements_last():
    """A 7B model on two 80 GiB devices: one trainer rank holds 104 GiB of state (split placements do not
    fit); two sharded ranks hold 52 GiB each, plus the rollout's bf16 weights (13 GiB) and a 2048-token
    micro-batch's activations (6.9 GiB): the colocated loop fits and ranks first although the split
    placements are predicted faster."""
    shape = ModelShape(params=7_000_000_000, layers=28, hidden=3584, kv_dim=512, vocab=152064, compute_bytes=2)
    prof = toy_profile(train_token_s=1e-6, decode_s=0.01, memory_gib=80.0)
    preds = rank(prof, toy_workload(8, 4, shape=shape, token_budget=2048), candidates(2), steps=4)
    assert preds[0].placement == Placement("sync-colocated", main=2) and preds[0].fits
    assert not any(p.fits for p in preds[1:])
    assert max(p.tpspd for p in preds[1:]) > preds[0].tpspd
    text = format_plan(preds, title="t")
    assert text.splitlines()[-1] == "best: cluster.devices=2"
    assert text.count(" NO") == len(preds) - 1


def _toy_files(tmp_path: Path) -> tuple[Path, Path]:
    prof = save_profile(toy_profile(kind="cpu", train_token_s=1e-4, decode_s=0.002), tmp_path / "toy.json")
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
                               "vocab_size": 512}))
    return prof, cfg


def test_cli_plan_with_a_stored_profile(tmp_path, capsys):
    prof, cfg = _toy_files(tmp_path)
    assert load_profile(prof).cores == 2
    code = cli.main(["plan", GRPO, "data.prompts_per_step=4", "--devices", "2", "--hardware", str(prof),
                     "--model-config", str(cfg), "--prompt-tokens", "6", "--lengths", "mixture:3,0.25,8",
                     "--reward-latency", "0.02,0.2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "PREDICTED" in out and "4 prompts x 8" in out
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) == len(candidates(2, cpu=True))
    best = out.strip().splitlines()[-1]
    assert best.startswith("best: cluster.devices=")
    tpspd = [float(r.split()[-4]) for r in rows]
    assert tpspd == sorted(tpspd, reverse=True)


@pytest.mark.parametrize("latency", ["0,inf", "inf,inf"])
def test_an_infinite_reward_latency_is_refused_naming_the_option(tmp_path, capsys, latency):
    """--reward-latency 0,inf planned every placement at "nan" seconds a step."""
    prof, cfg = _toy_files(tmp_path)
    code = cli.main(["plan", GRPO, "--devices", "2", "--hardware", str(prof), "--model-config", str(cfg),
                     "--prompt-tokens", "6", "--reward-latency", latency])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and "finite number" in err and "--reward-latency" in err, err


def test_the_plan_names_candidates_too_close_to_rank_as_near_ties():
    """A candidate predicted within NEAR_TIE of the best is named with its overrides before the best line; one
    further away, or one that does not fit, is not."""
    from relayrl.planner.placement import Prediction
    from relayrl.planner.search import NEAR_TIE

    def pred(placement, step_s, fits=True):
        return Prediction(placement, step_s, tokens=100.0, busy={"main": 1.0}, memory_gib={"main": 1.0}, fits=fits)

    k1, k1p = Placement("offpolicy", main=1, gen=1, k=1), Placement("offpolicy", main=1, gen=1, k=1, partial=True)
    split = Placement("sync-split", main=1, gen=1)
    close = 1.0 / (1 - NEAR_TIE / 2)  # TPSPD NEAR_TIE / 2 below the best
    preds = [pred(k1, 1.0), pred(k1p, close), pred(split, 1.5), pred(Placement("periodic", 1, 1), 1.0, fits=False)]
    out = format_plan(preds, title="t", base=["x=1"]).splitlines()
    assert out[-1] == "best: x=1 " + " ".join(k1.overrides())
    ties = [line for line in out if line.startswith("near-tie")]
    assert len(ties) == 1 and ties[0].startswith("near-tie: #2 (main=1 gen=1 offpolicy-k1-partial)")
    assert ties[0].endswith("x=1 " + " ".join(k1p.overrides())) and "2.5%" in ties[0]
    assert not any(line.startswith("near-tie") for line in format_plan([pred(k1, 1.0), pred(split, 1.5)], title="t")
                   .splitlines())


@pytest.mark.slow  # (about 13 s: the 64-device search)
def test_cli_plan_h100_7b_on_8_and_64_devices(capsys):
    for devices in (8, 64):
        code = cli.main(["plan", str(ROOT / "recipes" / "gpu_grpo.yaml"), "data.prompts_per_step=64", "rollout.n=8",
                         "rollout.max_new_tokens=2048", "--devices", str(devices), "--hardware", "h100_7b",
                         "--model-config", str(PROFILES / "qwen2_7b_config.json"), "--prompt-tokens", "200",
                         "--lengths", "mixture:300,0.25,800", "--top", "5"])
        out = capsys.readouterr().out
        assert code == 0
        assert "ASSUMED" in out and f"on {devices} device(s)" in out
        assert "7615.5M params" in out
        assert out.strip().splitlines()[-1].startswith("best: cluster.devices=")


def test_cli_plan_with_dynamic_sampling_says_how_many_groups_a_round_keeps(tmp_path, capsys):
    prof, cfg = _toy_files(tmp_path)
    args = ["plan", GRPO, "algorithm.dynamic_sampling=true", "algorithm.max_resample_rounds=2", "--devices", "2",
            "--hardware", str(prof), "--model-config", str(cfg), "--prompt-tokens", "6", "--lengths", "max"]
    assert cli.main([*args, "--keep-frac", "0.5"]) == 0
    half = capsys.readouterr().out
    assert "dynamic sampling keeping 50% of groups a round, up to 2 more round(s)" in half
    assert cli.main(args) == 0
    assert "keeping 100% of groups" in capsys.readouterr().out


def test_cli_plan_errors_name_the_fix(tmp_path, capsys):
    code = cli.main(["plan", GRPO, "--devices", "2", "--hardware", str(tmp_path / "none.json")])
    assert code == EXIT_CONFIG
    assert "relayrl plan --profile" in capsys.readouterr().err
    prof, cfg = _toy_files(tmp_path)
    code = cli.main(["plan", GRPO, "--hardware", str(prof)])
    assert code == EXIT_CONFIG and "--devices N" in capsys.readouterr().err
    code = cli.main(["plan", GRPO, "--devices", "2", "--hardware", str(prof), "--model-config", str(cfg),
                     "--prompt-tokens", "6", "--lengths", "mixture:3"])
    assert code == EXIT_CONFIG and "mixture:SHORT,P_LONG,LONG_MEAN" in capsys.readouterr().err
    code = cli.main(["plan", GRPO, "--devices", "2", "--hardware", str(prof), "--model-config", str(cfg),
                     "--prompt-tokens", "6", "--lengths", "max", "--keep-frac", "0.5"])
    assert code == EXIT_CONFIG and "algorithm.dynamic_sampling=true" in capsys.readouterr().err
    code = cli.main(["plan", GRPO, "algorithm.dynamic_sampling=true", "--devices", "2", "--hardware", str(prof),
                     "--model-config", str(cfg), "--prompt-tokens", "6", "--lengths", "max", "--keep-frac", "1.5"])
    assert code == EXIT_CONFIG and "keep_frac" in capsys.readouterr().err
    code = cli.main(["plan", str(ROOT / "recipes" / "arith_dpo.yaml"), "--devices", "2", "--hardware", str(prof),
                     "--model-config", str(cfg), "--prompt-tokens", "6", "--lengths", "max"])
    err = capsys.readouterr().err
    assert code == EXIT_CONFIG and "workflow dpo" in err and "workflow grpo" in err
    assert "relayrl plan: relayrl plan" not in err  # (the prefix said twice)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(prof.read_text()), "cores": 0}))
    code = cli.main(["plan", GRPO, "--devices", "2", "--hardware", str(bad), "--model-config", str(cfg),
                     "--prompt-tokens", "6", "--lengths", "max"])
    assert code in (EXIT_CONFIG, EXIT_USER) and "cores" in capsys.readouterr().err


@pytest.mark.slow
def test_calibration_measures_positive_costs(tiny_dir):
    from relayrl.planner.calibrate import calibrate

    prof = calibrate(str(tiny_dir), reps=1, overhead=False, log=lambda _: None)
    for dev in prof.devices.values():
        # >=: on the tiny model the per-row slope is at the noise level of one rep on a loaded machine, and a
        # negative fitted slope is dropped to 0 (the fit keeps coefficients non-negative)
        assert dev.decode(32, 20) >= dev.decode(1, 20) > 0
        assert dev.train(4096) > dev.train(64) > 0
        assert dev.optimizer_s > 0
    assert prof.relay.per_s > 0 and prof.collective(1e8) > 0


def test_calibration_samples_each_run_a_whole_pass_apart():
    """Both samples of a run never sit back to back (a slow patch of a shared machine would take both)."""
    from relayrl.planner.calibrate import calibration_order

    order = calibration_order(["sync", "dataflow", "offpolicy"], ["long", "short"], passes=2)
    assert len(order) == 12 and len({(p, w) for _, p, w in order}) == 6
    at = {}
    for k, (_, path, workload) in enumerate(order):
        at.setdefault((path, workload), []).append(k)
    assert all(b - a == 6 for a, b in at.values())  # one pass of all six runs between a run's two samples
    assert [i for i, _, _ in order] == [0] * 6 + [1] * 6


def test_the_reward_cost_of_a_trl_function_that_needs_a_column_is_measured(tmp_path):
    """``--reward-fn`` with a TRL reward function whose answer column has no default: calibration gives that
    field the answer (it had no dataset row to take it from)."""
    from relayrl.planner.calibrate import _reward

    (tmp_path / "trl_cost.py").write_text("def acc(completions, solution, **kw):\n"
                                          "    return [float(c == s) for c, s in zip(completions, solution)]\n")
    cost = _reward(f"{tmp_path}/trl_cost.py:acc", reps=1)
    assert cost.fn.endswith("trl_cost.py:acc") and cost.call_s >= 0 and cost.row_s >= 0


def test_sequence_parallel_spreads_activations_and_needs_a_multiple_of_its_ranks():
    """engine.sequence_parallel=2: a micro-batch's activations are counted at half per trainer rank (the
    trainer state is unchanged), and placements with an odd number of trainer ranks are not proposed."""
    from relayrl.planner.memory import memory_gib

    shape = ModelShape(params=500_000_000, layers=24, hidden=896, kv_dim=128, vocab=151936, compute_bytes=2)
    plain = toy_workload(8, 4, shape=shape, token_budget=32768)
    sp = plain.model_copy(update={"sequence_parallel": 2})
    pl = Placement("sync-colocated", main=2)
    acts = 32768 * 896 * 24 * 18 * 2 / 2**30  # the layers' activations of one micro-batch, GiB
    assert memory_gib(plain, pl, 0)["main"] - memory_gib(sp, pl, 0)["main"] == pytest.approx(acts / 2)
    kept = [p.placement for p in rank(toy_profile(), sp, candidates(3), steps=4)]
    assert kept and all(p.main % 2 == 0 for p in kept)
    assert len(kept) < len(candidates(3))


def test_a_recipe_with_expert_parallelism_plans_the_experts_out_of_fsdp2s_gathers(tmp_path):
    """engine.expert_parallel reaches the workload for a mixture of experts (its experts counted), and not for a
    dense model (no experts to keep: FSDP2 as before)."""
    from tests.models.architectures import ARCHS, COMMON

    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.planner.from_config import workload_from_config

    cfg = load_config(Config, "recipes/arith_grpo.yaml", ["engine.expert_parallel=true", "cluster.devices=2"])
    for arch, routed in (("qwen3_moe", True), ("qwen2", False)):
        (tmp_path / f"{arch}.json").write_text(json.dumps({"model_type": arch, **COMMON, **ARCHS.get(arch, {})}))
        w = workload_from_config(cfg, model_config=str(tmp_path / f"{arch}.json"), prompt_tokens=8, lengths="max")
        assert w.expert_parallel is routed and (w.model.routed > 0) is routed, arch
        gathered, reduced = w.fsdp_params
        assert gathered == w.model.params - w.model.routed * routed and reduced == gathered, arch
    assert w.expert_group == 0  # (true: one group of whatever ranks the placement gives the trainer)
    cfg = load_config(Config, "recipes/arith_grpo.yaml", ["engine.expert_parallel=2", "cluster.devices=4",
                                                           "cluster.oversubscribe=true"])
    w = workload_from_config(cfg, model_config=str(tmp_path / "qwen3_moe.json"), prompt_tokens=8, lengths="max")
    assert w.expert_parallel and w.expert_group == 2 and w.experts_over(4) == 2


def test_the_plan_measures_response_lengths_with_the_recipes_own_sampling(tiny_dir, monkeypatch):
    """``--lengths measure`` samples as the run's rollout does (``cfg.rollout.sampling()``): its stop strings (a
    tool recipe's ``</tool>`` ends a turn), top-p/k, min-p and repetition penalty move where a response ends.
    It sampled with the temperature alone, so a recipe with stop strings was planned on responses that ran on
    to ``rollout.max_new_tokens``."""
    from relayrl.config.loader import load_run_config
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.planner.from_config import workload_from_config

    cfg = load_run_config(GRPO, [f"trainer.init_from={tiny_dir}", "rollout.n=2", "rollout.max_new_tokens=6",
                                 "rollout.temperature=0.7", "rollout.top_k=5", "rollout.repetition_penalty=1.2",
                                 "rollout.stop_strings=['+', '1']"])
    seen, generate = [], NativeGenerationEngine.generate

    def spy(self, prompts, params, **kw):
        seen.append(params)
        return generate(self, prompts, params, **kw)

    monkeypatch.setattr(NativeGenerationEngine, "generate", spy)
    w = workload_from_config(cfg, lengths="measure", measure_prompts=3)
    assert seen == [cfg.rollout.sampling()]
    assert seen[0].stop_strings == ("+", "1") and seen[0].top_k == 5
    assert len(w.lengths.samples) == 3 * 2 and max(w.lengths.samples) <= 6


def test_the_plan_names_what_the_recipe_runs_that_it_does_not_simulate(tmp_path, capsys):
    """A multi-turn environment's further turns and tool steps, a reward model's and a judge's passes are not in
    the simulator; the plan says so before its table (it planned them silently as one turn and a free reward)."""
    prof, cfg = _toy_files(tmp_path)
    flags = ["--devices", "2", "--hardware", str(prof), "--model-config", str(cfg), "--prompt-tokens", "6",
             "--lengths", "max", "--top", "2"]
    assert cli.main(["plan", str(ROOT / "recipes" / "toolsum_grpo.yaml"), "env.workers=2", *flags]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("relayrl plan: not simulated:")]
    assert len(notes) == 1 and "env.name=tools" in notes[0] and "env.max_turns=3" in notes[0]
    assert "env.workers=2" in notes[0] and "lower bound" in notes[0]
    assert out.index(notes[0]) < out.index("placement")
    (tmp_path / "rm").mkdir()
    assert cli.main(["plan", GRPO, f"reward.model={tmp_path / 'rm'}", *flags]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "not simulated" in line]
    assert len(notes) == 1 and notes[0].startswith("relayrl plan: not simulated: reward.model=")
    assert "--reward-latency LOW,HIGH" in notes[0]
    assert cli.main(["plan", GRPO, *flags]) == 0
    assert "not simulated" not in capsys.readouterr().out


def test_the_plan_says_it_runs_a_role_placed_on_a_pool_of_its_own_on_main(tmp_path, capsys):
    """Every candidate runs the reference, critic and teacher on main; a recipe that places one elsewhere was
    planned as if it did not, and its 'best:' overrides kept the recipe's pool (devices beyond --devices)."""
    prof, cfg = _toy_files(tmp_path)
    flags = ["--devices", "2", "--hardware", str(prof), "--model-config", str(cfg), "--prompt-tokens", "6",
             "--lengths", "max", "--top", "1"]
    assert cli.main(["plan", GRPO, "algorithm.kl_coef=0.01", "placement.pools.ref=1", "placement.reference=ref",
                     *flags]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "not simulated" in line]
    assert len(notes) == 1 and "placement.reference=ref" in notes[0] and "pool ref's 1 device(s)" in notes[0]
    assert "placement.reference=main" in notes[0]
    assert cli.main(["plan", GRPO, "algorithm.kl_coef=0.01", "placement.pools.gen=1", "placement.rollout=gen",
                     "placement.reference=gen", *flags]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if "not simulated" in line]
    assert len(notes) == 1 and "does not try it on the rollout's pool gen" in notes[0]
    assert cli.main(["plan", GRPO, "algorithm.kl_coef=0.01", *flags]) == 0  # the reference on main: nothing to say
    assert "not simulated" not in capsys.readouterr().out
