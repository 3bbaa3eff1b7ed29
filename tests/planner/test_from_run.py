"""``relayrl plan --from-run``: the run's placement from the step plan, lengths and their trend from the run's
metrics, the profile fitted to its spans, and the report end to end on a real run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from relayrl.cli import main as cli
from relayrl.cli.boundary import EXIT_CONFIG
from relayrl.config.loader import load_run_config
from relayrl.planner.from_run import _measured, fit_profile, length_trend, placement_of, read_run, run_lengths
from relayrl.planner.placement import Placement
from relayrl.planner.profile import save_profile
from relayrl.planner.simulate import simulate

from .toy import toy_profile, toy_workload

ROOT = Path(__file__).resolve().parents[2]
GRPO = str(ROOT / "recipes" / "arith_grpo.yaml")
SPLIT = ["placement.pools.gen=1", "placement.rollout=gen"]


@pytest.mark.parametrize("overrides,want", [
    ([], Placement("sync-colocated", main=1)),
    (["cluster.devices=2", "cluster.oversubscribe=true"], Placement("sync-colocated", main=2)),
    ([*SPLIT], Placement("sync-split", main=1, gen=1)),
    ([*SPLIT, "trainer.mode=periodic"], Placement("periodic", main=1, gen=1)),
    ([*SPLIT, "trainer.mode=periodic", "trainer.mini_batches=2"], Placement("sync-split", main=1, gen=1)),
    ([*SPLIT, "trainer.off_policy_steps=2", "rollout.partial=true"],
     Placement("offpolicy", main=1, gen=1, k=2, partial=True)),
    (["trainer.off_policy_steps=1"], Placement("offpolicy", main=1, gen=1, k=1)),
])
def test_the_runs_placement_comes_from_the_step_plan(overrides, want):
    """Periodic with two mini-batches trains on the whole batch (the plan says so), so it is simulated as the
    synchronous split step; off-policy without a pool gets the plan's own one-device rollout pool."""
    assert placement_of(load_run_config(GRPO, overrides)) == want


def _fake_run(tmp_path: Path, lengths: list[float], *, quantiles: bool = True, steps: int = 10,
              overrides: tuple[str, ...] = ()) -> Path:
    """A run directory with a config, metrics (step time, lengths) and spans written by hand."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_run_config(GRPO, [f"trainer.steps={steps}", *overrides])
    (run / "config.json").write_text(json.dumps(cfg.model_dump(mode="json")))
    metrics, spans, t = [], [], 0.0
    for step, mean in enumerate(lengths, 1):
        row = {"step": step, "perf/step_time_s": 0.5, "response/length_mean": mean, "response/length_max": 2 * mean,
               "response/clip_ratio": 0.0}
        if quantiles:
            row.update({"response/length_p10": 0.5 * mean, "response/length_p50": mean, "response/length_p90": 1.5 * mean})
        metrics.append(row)
        for name, group, secs in (("generate", "rollout", 0.2), ("reward", "reward", 0.05), ("update", "actor", 0.2)):
            spans.append({"name": name, "group": group, "step": step, "start": t, "end": t + secs, "wall_start": t,
                          "pid": 1, "tid": 1, "attrs": {}})
            t += secs
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "spans.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return run


def test_lengths_and_their_trend_come_from_the_runs_metrics(tmp_path):
    rec = read_run(_fake_run(tmp_path, [10.0 + 2 * i for i in range(6)]))
    assert rec.steps == [1, 2, 3, 4, 5, 6]
    slope, now = length_trend(rec)
    assert slope == pytest.approx(2.0) and now == pytest.approx(20.0)
    dist = run_lengths(rec, cap=64, window=1)  # the last step: p10 10, p50 20, p90 30, max 40
    s = sorted(dist.samples)
    assert s[50] == pytest.approx(20, abs=1) and s[10] == pytest.approx(10, abs=1) and s[90] == pytest.approx(30, abs=1)
    assert max(s) <= 40
    grown = run_lengths(rec, cap=64, window=1, factor=1.5)
    assert sorted(grown.samples)[50] == pytest.approx(30, abs=1)
    assert max(run_lengths(rec, cap=25, window=1).samples) == 25  # capped at max_new_tokens


def test_the_share_of_groups_dynamic_sampling_kept_comes_from_the_runs_metrics(tmp_path):
    """The last five steps sampled 5 x 12 groups and dropped 5 x 3 (the first step's 12 of 12 is left out of
    the window): 75% kept. A run without the counts keeps everything."""
    from relayrl.planner.from_run import keep_frac

    run = _fake_run(tmp_path, [10.0] * 6, overrides=("algorithm.dynamic_sampling=true",))
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.update({"dapo/sampled_groups": 12.0, "dapo/dropped_groups": 12.0 if r["step"] == 1 else 3.0})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert keep_frac(read_run(run)) == pytest.approx(0.75)
    (tmp_path / "plain").mkdir()
    assert keep_frac(read_run(_fake_run(tmp_path / "plain", [10.0] * 6))) == 1.0


def test_the_fit_makes_the_runs_own_placement_match_its_spans():
    """A profile twice too slow for generation and half as fast for training: the fit finds the factors and the
    run's own prediction equals its step time."""
    prof = toy_profile(decode_s=0.01, train_token_s=1e-3, reward_row_s=1e-3)
    w = toy_workload(prompts=4, n=2)
    p = Placement("sync-colocated", main=1)
    base = simulate(prof, w, p, steps=8, warmup=2)
    measured = {"generate": base.phases["generate"] / 2, "update": base.phases["update"] * 2,
                "reward": base.phases["reward"], "step": base.step_s + 0.1}
    fitted, factors, before = fit_profile(prof, w, p, measured)
    assert factors["generate"] == pytest.approx(0.5) and factors["train"] == pytest.approx(2.0)
    assert factors["step_s"] == pytest.approx(measured["step"] - measured["generate"] - measured["update"]
                                              - measured["reward"], rel=1e-6)
    assert simulate(fitted, w, p, steps=8, warmup=2).step_s == pytest.approx(measured["step"], rel=1e-6)
    assert before.step_s == pytest.approx(base.step_s)


def test_from_run_reports_and_plans_with_the_lengths_ahead(tmp_path, capsys):
    run = _fake_run(tmp_path, [10.0 + 2 * i for i in range(6)], steps=20)
    prof = save_profile(toy_profile(kind="cpu", train_token_s=1e-4, decode_s=0.002), tmp_path / "toy.json")
    assert cli.main(["plan", "--from-run", str(run), "--hardware", str(prof), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    assert "took 0.500 s/step over steps 2-6" in out
    assert "trend +2.00 tokens/step" in out and "predicted over steps 7-20" in out
    assert "(+0%)" in out  # the fit reproduces the run's own step
    rows = [line for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert len(rows) >= 8 and "best: cluster.devices=" in out
    assert cli.main(["plan", "--from-run", str(run), "--hardware", str(prof), "--lengths-at", "now"]) == 0
    out = capsys.readouterr().out
    assert "(the last steps')" in out
    # without --devices: the run's one rank used both of the CPU profile's cores, so it plans for both
    assert "this run (main=1, sync-colocated)" in out and "PREDICTED for 2 device(s)" in out


def test_from_run_errors_name_what_is_missing(tmp_path, capsys):
    prof = save_profile(toy_profile(kind="cpu"), tmp_path / "toy.json")
    assert cli.main(["plan", "--from-run", str(tmp_path), "--hardware", str(prof)]) == EXIT_CONFIG
    assert "no config.json" in capsys.readouterr().err
    old = _fake_run(tmp_path, [10.0] * 4, quantiles=False)
    assert cli.main(["plan", "--from-run", str(old), "--hardware", str(prof)]) == EXIT_CONFIG
    assert "logged no response/length_p10/p50/p90" in capsys.readouterr().err
    assert cli.main(["plan", GRPO, "--from-run", str(old), "--hardware", str(prof)]) == EXIT_CONFIG
    assert "give no recipe" in capsys.readouterr().err


def test_a_damaged_line_inside_the_runs_files_is_named_and_a_torn_last_line_skipped(tmp_path, capsys):
    """A metrics.jsonl line damaged in the middle of the file was skipped without a word: the plan was fitted
    to the other steps as if the run had no more (spans.jsonl's reader already named such a line)."""
    run = _fake_run(tmp_path, [10.0] * 6)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:30])  # torn while written
    assert read_run(run).steps == [1, 2, 3, 4, 5]
    lines[2] = lines[2][:30]
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    prof = save_profile(toy_profile(kind="cpu"), tmp_path / "toy.json")
    assert cli.main(["plan", "--from-run", str(run), "--hardware", str(prof)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "metrics.jsonl:3: not valid JSON" in err and "fix or delete that line" in err, err


def test_from_run_on_a_run_of_episodes_says_it_reads_single_turn_runs(tmp_path, capsys):
    """An episode run logs env/model_tokens_mean, no response/length_*: the error said only that metrics.jsonl had
    no response/length_mean, as if the run were broken; and a run whose metrics had them was planned as one turn a
    response without a word."""
    prof = save_profile(toy_profile(kind="cpu"), tmp_path / "toy.json")
    episodes = ("data.task=toolsum", "data.task_options={}", "data.eval_task_options={}",
                "rollout.stop_strings=['</tool>']", "env.name=tools", "env.tools=[calculator]")
    run = _fake_run(tmp_path, [10.0] * 4, overrides=episodes)  # (its lengths written as a single-turn run's)
    assert cli.main(["plan", "--from-run", str(run), "--hardware", str(prof)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "env.name=tools" in err and "single-turn runs only" in err and "relayrl plan RECIPE --devices N" in err


@pytest.mark.slow  # (two short GRPO runs, about 20 s)
@pytest.mark.parametrize("mode", [[], [*SPLIT, "trainer.mode=periodic"]])
def test_from_run_on_a_real_run(tmp_path, capsys, mode):
    """A colocated and a periodic run of 4 steps: the report reads their spans and metrics and the fitted
    model predicts each run's own step time within 30%."""
    run = tmp_path / "run"
    assert cli.main(["train", GRPO, "trainer.steps=4", f"run.dir={run}", "eval.every=0", *mode]) == 0
    prof = ROOT / "docs" / "planner_profile_cpu2.json"
    capsys.readouterr()
    assert cli.main(["plan", "--from-run", str(run), "--hardware", str(prof), "--devices", "2"]) == 0
    out = capsys.readouterr().out
    want = placement_of(read_run(run).cfg)
    assert f"this run ({want.pools}, {want.mode_name})" in out
    err = float(out.split("predicts ")[1].split("(")[1].split("%")[0])
    assert abs(err) <= 30
    assert "best: cluster.devices=" in out
    assert _measured(read_run(run), [2, 3, 4])["generate"] > 0


def test_a_stated_length_growth_plans_with_the_mean_over_the_run(tmp_path, capsys):
    """``--length-growth G``: lengths grow by G tokens a step from the given ones; the plan uses their mean
    over trainer.steps (here 3 + 0.5 x 20 / 2 = 8 tokens, from a mixture whose responses all stop at 3)."""
    from tests.planner.test_search import _toy_files

    prof, cfg = _toy_files(tmp_path)
    args = ["plan", GRPO, "trainer.steps=20", "--devices", "2", "--hardware", str(prof), "--model-config",
            str(cfg), "--prompt-tokens", "6", "--lengths", "mixture:3,0,8"]
    assert cli.main(args) == 0
    flat = capsys.readouterr().out
    assert cli.main([*args, "--length-growth", "0.5"]) == 0
    grown = capsys.readouterr().out
    assert "mean 8 over the run with +0.5 tokens/step" in grown
    def step(out: str) -> float:  # the first-ranked row's step seconds (the first number with 3 decimals)
        import re

        row = next(line for line in out.splitlines() if line.strip().startswith("1 "))
        return float(re.findall(r"\s(\d+\.\d{3})\s", row)[0])

    assert step(grown) > step(flat)


def _rows_file(tmp_path: Path, rows: int, long: int = 0) -> Path:
    """``rows`` sums ``"i+i="`` and ``long`` sums of 40 ones."""
    path = tmp_path / "train.jsonl"
    sums = [(f"{i}+{i}=", str(2 * i)) for i in range(rows)] + [("+".join("1" * 40) + "=", "40")] * long
    path.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n" for p, a in sums))
    return path


@pytest.mark.parametrize("over,file_rows,long,rows,steps", [
    ([], 12, 0, 12, 6),
    (["data.max_rows=10"], 12, 0, 10, 5),
    (["eval.size=4"], 18, 0, 14, 7),
    (["data.long_prompts=drop", "data.max_prompt_tokens=16"], 12, 3, 12, 6),
], ids=["rows", "max_rows", "held_out", "long_prompts"])
def test_length_growth_counts_a_total_epochs_recipes_steps_from_its_rows_as_the_run_does(tmp_path, capsys, over,
                                                                                         file_rows, long, rows, steps):
    """``trainer.total_epochs=2`` at 4 prompts a step: the planner loads the rows as the run does (all 12;
    data.max_rows=10 keeps 10; eval.size=4 with no data.eval_path holds 4 of 18 out, 18 being at least twice 4;
    data.long_prompts=drop leaves out the 3 prompts over 16 tokens) and grows the lengths over the steps that
    gives: the same plan as the recipe with those steps."""
    from tests.planner.test_search import _toy_files

    prof, model = _toy_files(tmp_path)
    data = _rows_file(tmp_path, file_rows, long)
    common = [GRPO, "data.task=null", f"data.path={data}", "reward.verifier=exact", "data.prompts_per_step=4",
              "eval.size=200", *over, "--devices", "2", "--hardware", str(prof), "--model-config", str(model),
              "--prompt-tokens", "6", "--lengths", "mixture:3,0,8", "--length-growth", "0.5"]
    assert cli.main(["plan", *common, "trainer.steps=null", "trainer.total_epochs=2"]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"relayrl plan: trainer.total_epochs=2 over {rows} rows at 4 a step (data.prompts_per_step): {steps} " \
           f"steps" in out, out
    assert cli.main(["plan", *common, f"trainer.steps={steps}"]) == 0
    fixed = capsys.readouterr().out
    assert f"mean {3 + 0.5 * steps / 2:.0f} over the run with +0.5 tokens/step" in fixed
    assert out.split("relayrl plan: PREDICTED", 1)[1] == fixed.split("relayrl plan: PREDICTED", 1)[1]


def test_length_growth_on_a_total_epochs_recipe_whose_rows_cannot_be_read_names_the_key(tmp_path, capsys):
    from tests.planner.test_search import _toy_files

    prof, model = _toy_files(tmp_path)
    gone = tmp_path / "missing.jsonl"
    args = ["plan", GRPO, "trainer.steps=null", "trainer.total_epochs=2", "data.task=null", f"data.path={gone}",
            "reward.verifier=exact", "--devices", "2", "--hardware", str(prof), "--model-config", str(model),
            "--prompt-tokens", "6", "--lengths", "mixture:3,0,8", "--length-growth", "0.5"]
    assert cli.main(args) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"trainer.total_epochs=2 counts from the training rows of data.path={gone}" in err, err
    assert f"dataset file {gone} does not exist" in err and "trainer.steps=N with trainer.total_epochs=null" in err
    assert "drop --length-growth" in err
    assert cli.main(args[:-2]) == 0  # without --length-growth the steps are not needed and no row is read


def test_every_candidate_runs_as_the_placement_it_was_simulated_as():
    """The search's overrides, read by the pipeline's step plan, give back the placement that was simulated:
    a change to how the plan reads a config breaks this before it breaks a prediction."""
    from relayrl.planner.search import candidates

    for p in candidates(4, cpu=True):
        cfg = load_run_config(GRPO, [*p.overrides(), "cluster.oversubscribe=true"])
        assert placement_of(cfg) == p, p.overrides()


@pytest.mark.parametrize("overrides,forward,ref_in_update,critic", [
    ([], (), False, False),
    (["algorithm.kl_coef=0.01"], ("reference",), False, False),
    (["algorithm.kl_coef=0.01", "trainer.tri_model=true"], (), True, False),
    (["algorithm.advantage=gae"], ("values",), False, True),
    (["trainer.epochs=2"], ("old",), False, False),
])
def test_the_workloads_passes_come_from_the_step_plan(overrides, forward, ref_in_update, critic):
    from relayrl.planner.from_config import plan_passes

    got = plan_passes(load_run_config(GRPO, overrides))
    assert (got["forward"], got["ref_in_update"], got["critic"]) == (forward, ref_in_update, critic)
    assert got["accumulate"] == (not critic and "trainer.epochs=2" not in overrides)


@pytest.mark.parametrize("extra", [[], ["algorithm.kl_coef=0.01"], ["algorithm.kl_coef=0.01", "algorithm.kl_in_reward=true",
                                                                  "algorithm.advantage=reinforce++"],
                                   ["algorithm.advantage=gae"], ["trainer.epochs=2"], ["algorithm.dynamic_sampling=true"],
                                   ["algorithm.advantage=remax"]])
def test_the_simulator_schedules_the_pipelines_own_stage_graph(extra):
    """For every search candidate, the stage graph the simulator schedules (built from the workload and the
    placement) is the one the pipeline runs by (the step plan of the candidate's overrides): the same stages,
    reads, pools, chunking and gates. A change to the pipeline's graph changes the prediction, or fails here."""
    from relayrl.planner.from_config import workload_from_config
    from relayrl.planner.search import candidates
    from relayrl.planner.simulate import step_graph
    from relayrl.config.plan import step_plan

    w = workload_from_config(load_run_config(GRPO, extra), lengths="max")
    for p in candidates(4, cpu=True):
        cfg = load_run_config(GRPO, [*extra, *p.overrides(), "cluster.oversubscribe=true"])
        plan = step_plan(cfg)
        assert step_graph(w, p) == plan.stages, p.overrides()


def test_the_pipeline_runs_the_stages_of_its_graph():
    """The pipeline's stage threads are the graph's, producing and consuming, in its order."""
    from relayrl.config.plan import step_plan
    from relayrl.workflows.consume import Consume
    from relayrl.workflows.produce import Produce

    class Parts:
        def __init__(self, plan):
            self.plan = plan

    for extra in ([], ["algorithm.kl_coef=0.01", "trainer.epochs=2"], ["algorithm.advantage=gae", *SPLIT]):
        plan = step_plan(load_run_config(GRPO, extra))
        names = [*Produce(Parts(plan)).stages(), *Consume(Parts(plan)).stages()]
        assert names == [st.name for st in plan.stages]


def test_flex_attention_on_a_gpu_plans_the_repeated_keys_and_values():
    """model.attn_implementation=flex_attention: the workload says the keys and values are repeated to the
    query heads (flex.EXPAND_KV, the default), which the memory model counts on a GPU; sdpa says not."""
    from relayrl.engines.training import flex
    from relayrl.planner.from_config import workload_from_config

    gpu = ["model.device=cuda", "model.dtype=bfloat16"]
    w = workload_from_config(load_run_config(GRPO, [*gpu, "model.attn_implementation=flex_attention"]), lengths="max")
    assert w.expand_kv is flex.EXPAND_KV is True
    assert not workload_from_config(load_run_config(GRPO, gpu), lengths="max").expand_kv


def test_stored_head_logits_are_planned():
    from relayrl.planner.from_config import workload_from_config

    assert workload_from_config(load_run_config(GRPO, ["engine.head_grad=stored"]), lengths="max").head_stored
    assert not workload_from_config(load_run_config(GRPO, ["engine.head_grad=vocab"]), lengths="max").head_stored
    assert not workload_from_config(load_run_config(GRPO, ["engine.head_grad=stored", "engine.logprob_chunk=0"]),
                                    lengths="max").head_stored  # unchunked: the plain full-logits path


def test_a_datasets_prompt_length_is_measured_from_its_rows_as_the_run_encodes_them(tmp_path, capsys, tiny_dir):
    """A recipe on a dataset (data.path) whose model is on this machine: the plan measures the prompt length from
    the rows the run trains on (12 short sums and 4 of 40 ones; eval.size=4 holds 4 out), encoded by the model's
    tokenizer, instead of asking for --prompt-tokens."""
    from relayrl.data.datasets import encode_prompt
    from relayrl.models.load import load_tokenizer
    from relayrl.workflows.problems import RunProblems
    from tests.planner.test_search import _toy_files

    prof, _ = _toy_files(tmp_path)
    data = _rows_file(tmp_path, 12, long=4)
    over = [GRPO, "data.task=null", f"data.path={data}", "reward.verifier=exact", "data.prompts_per_step=4",
            "eval.size=4", f"trainer.init_from={tiny_dir}"]
    cfg = load_run_config(over[0], over[1:])
    rows = RunProblems(cfg, training=True, log=lambda _: None).train_problems
    tok = load_tokenizer(tiny_dir)
    want = round(sum(len(encode_prompt(tok, p)) for p in rows) / len(rows))
    assert cli.main(["plan", *over, "--devices", "2", "--hardware", str(prof), "--lengths", "mixture:3,0,8"]) == 0, \
        capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"(4 prompts x 8, {want} prompt tokens," in out, out
    assert want > 10  # (the long rows count: the short sums alone are about 6 tokens)


def test_a_dataset_that_cannot_be_read_says_how_to_plan_without_it(tmp_path, capsys, tiny_dir):
    from tests.planner.test_search import _toy_files

    prof, _ = _toy_files(tmp_path)
    gone = tmp_path / "missing.jsonl"
    args = ["plan", GRPO, "data.task=null", f"data.path={gone}", "reward.verifier=exact",
            f"trainer.init_from={tiny_dir}", "--devices", "2", "--hardware", str(prof)]
    assert cli.main(args) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"dataset file {gone} does not exist" in err and "--prompt-tokens N with --lengths max" in err, err
    assert cli.main([*args, "--prompt-tokens", "6", "--lengths", "mixture:3,0,8"]) == 0  # no row read


def test_a_linear_attention_model_is_planned_on_padded_rows(tmp_path):
    """The training engine does not pack Qwen3.5's rows (its Gated DeltaNet layers carry state along a row): the
    planner plans its micro-batches padded, as the engine lays them out, and the recipe's packing otherwise."""
    from relayrl.planner.from_config import workload_from_config

    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512}
    packing = {}
    for kind in ("qwen2", "qwen3_5_text"):
        path = tmp_path / f"{kind}.json"
        path.write_text(json.dumps({"model_type": kind, **base}))
        cfg = load_run_config(GRPO, [])
        packing[kind] = workload_from_config(cfg, model_config=str(path), prompt_tokens=6, lengths="max").packing
    assert packing == {"qwen2": "shared_prompt", "qwen3_5_text": "none"}
