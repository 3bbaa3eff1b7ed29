"""recipes/gsm8k_grpo.yaml and recipes/math_grpo.yaml: what they make of rows in GSM8K's and MATH's formats
(system prompt through the chat template, the ground truth the math verifier compares), and two training
steps of each from the CLI on a Qwen2-shaped tiny model whose tokenizer has a chat template, their GPU
settings overridden to CPU sizes. The rows are written here; nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e_cli import records, relayrl

datasets = pytest.importorskip("datasets")

GSM8K = {"question": [f"Tom has {a} apples and buys {b} more. How many apples does he have?" for a, b in
                      [(3, 4), (10, 5), (7, 8), (20, 22), (1, 1), (6, 9)]],
         "answer": [f"He has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}" for a, b in
                    [(3, 4), (10, 5), (7, 8), (20, 22), (1, 1), (6, 9)]]}
MATH = {"problem": ["What is $\\frac{1}{2} + \\frac{1}{4}$?", "Solve for $x$: $2x + 1 = 7$.", "Compute $3^2$.",
                    "What is $\\sqrt{16}$?", "Simplify $\\frac{6}{8}$.", "What is $5!$?"],
        "solution": ["We add: $\\frac{2}{4} + \\frac{1}{4} = \\boxed{\\frac{3}{4}}$.",
                     "Subtract 1 and halve: $x = \\boxed{3}$.", "$3^2 = \\boxed{9}$.", "$\\sqrt{16} = \\boxed{4}$.",
                     "Divide by 2: $\\boxed{\\frac{3}{4}}$.", "$5! = \\boxed{120}$."]}
SYSTEM = "Please reason step by step, and put your final answer within \\boxed{}."
# the recipes' GPU and model-size settings, down to a CPU and a tiny model
CPU = ["model.device=cpu", "model.dtype=float32", "trainer.offload=false", "engine.gradient_checkpointing=false",
       "rollout.max_new_tokens=12", "data.prompts_per_step=2", "rollout.n=4", "trainer.steps=2", "eval.size=4",
       "eval.every=0", "run.threads=1", "telemetry.sinks=[jsonl]", "run.save_every=0",
       "engine.optim={lr: 1.0e-4, warmup_steps: 0}"]


def _splits(rows: dict, out: Path) -> Path:
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({k: v[:2] for k, v in rows.items()})}).save_to_disk(out)
    return out


@pytest.fixture()
def gsm8k_dir(tmp_path) -> Path:
    return _splits(GSM8K, tmp_path / "gsm8k")


@pytest.fixture()
def math_files(tmp_path) -> Path:
    """MATH rows as a directory of Parquet files, read by name (data.hf_name=<dir>; splits from the file names)."""
    d = tmp_path / "math"
    d.mkdir()
    datasets.Dataset.from_dict(MATH).to_parquet(d / "train.parquet")
    datasets.Dataset.from_dict({k: v[:2] for k, v in MATH.items()}).to_parquet(d / "test.parquet")
    return d


def _problems(recipe: str, *overrides: str):
    from relayrl.config.loader import load_run_config
    from relayrl.data.datasets import load_problems

    cfg = load_run_config(f"recipes/{recipe}", [*overrides, *CPU])
    return cfg, load_problems(cfg.data.dataset()), load_problems(cfg.data.dataset(held_out=True))


def test_gsm8k_recipe_prompts_and_answers(gsm8k_dir, tiny_tokenizer):
    from relayrl.data.datasets import encode_prompt
    from relayrl.engines.reward.verifiers import math_reward

    cfg, train, held = _problems("gsm8k_grpo.yaml", "data.hf_name=null", f"data.path={gsm8k_dir}")
    assert cfg.reward.verifier == "math" and cfg.data.system_prompt == SYSTEM
    assert [p.answer for p in train] == ["7", "15", "15", "42", "2", "15"] and len(held) == 2
    text = tiny_tokenizer.decode(encode_prompt(tiny_tokenizer, train[3]))
    assert text.startswith("<|im_start|>system\n" + SYSTEM) and GSM8K["question"][3] in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert math_reward("20 + 22 = 42, so the answer is \\boxed{42}.", train[3].answer) == 1.0
    assert math_reward("\\boxed{41}", train[3].answer) == 0.0


def test_math_recipe_prompts_and_answers(math_files):
    from relayrl.engines.reward.verifiers import math_reward

    cfg, train, held = _problems("math_grpo.yaml", f"data.hf_name={math_files}")
    assert cfg.data.answer_regex is None and cfg.rollout.max_new_tokens == 12
    assert len(train) == 6 and len(held) == 2 and train[0].meta["messages"][0]["content"] == SYSTEM
    assert math_reward("so the sum is \\boxed{0.75}", train[0].answer) == 1.0  # gold: the solution's last \boxed{}
    assert math_reward("\\boxed{\\frac{1}{2}}", train[0].answer) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["gsm8k_grpo.yaml", "math_grpo.yaml"])
def test_recipe_trains_two_steps(recipe, gsm8k_dir, math_files, tiny_dir, tmp_path):
    data = ["data.hf_name=null", f"data.path={gsm8k_dir}"] if recipe.startswith("gsm8k") else [f"data.hf_name={math_files}"]
    run = tmp_path / "run"
    r = relayrl("train", f"recipes/{recipe}", f"model.path={tiny_dir}", f"run.dir={run}", *data, *CPU)
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(run)
    assert [x["step"] for x in recs] == [0, 1, 2]
    assert "eval/accuracy" in recs[0] and "eval/accuracy" in recs[-1]
    for key in ("reward/mean", "actor/kl", "actor/kl_coef", "actor/grad_norm", "response/length_mean"):
        assert key in recs[-1], key
    assert recs[-1]["actor/kl_coef"] == pytest.approx(0.001)
    assert (run / "model" / "config.json").exists()
