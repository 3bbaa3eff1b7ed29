"""End-to-end synchronous GRPO throughput: relayrl's ``GRPOPipeline`` against TRL's ``GRPOTrainer``.

Both systems train the same model directory (by default relayrl's tiny Qwen2,
fp32, CPU, same torch thread count) on the same ``arith`` prompts in the same
order, with the same group size ``n``, max new tokens, temperature 1.0, reward
(the arith task's exact-match verifier), optimizer (AdamW, constant LR, grad
clip 1.0), GRPO loss (token mean per sequence, then mean over sequences; clip
0.2; std-normalised group advantages) and one optimizer update per step with no
reference model (TRL: ``beta=0``, ``num_iterations=1``, no vLLM).

Tokens are counted the same way for both, from the samples of each step:

* generated = completion tokens (EOS included when sampled),
* trained   = prompt + completion tokens of every sample that goes through the
  update's forward/backward (padding excluded),

and throughput is ``(generated + trained) / step wall time``. Step time is the
wall time of a whole iteration: for relayrl ``wf.step(k)`` (generate, reward,
advantages, update, weight relay); for TRL the interval between consecutive
``on_step_end`` callbacks (data loading, generate, reward, advantages,
forward/backward, optimizer). Warm-up steps are excluded from both.

By default the systems are interleaved step by step in one process (TRL step
k, then relayrl step k, each timed on its own), so both see the same load on a
shared machine; ``--order trl-first|relayrl-first`` runs them one after the
other instead.

The randomly initialised tiny model answers with ``max_new_tokens`` random
tokens and never gets a reward, so every group has zero advantage; the update
is still computed by both systems. ``--sft-steps N`` first warm-starts the
model with relayrl's arith SFT recipe (cached), which gives short answers that
end in EOS, as in a real GRPO run after SFT.

Run it with::

    .venv/bin/python benchmarks/grpo_vs_trl.py                 # 5 warm-up + 30 measured steps each
    .venv/bin/python benchmarks/grpo_vs_trl.py --steps 10 --warmup 2 --threads 1 --sft-steps 150

TRL is a benchmark-only extra (``pip install trl``, the ``bench`` extra). The
last line printed is ``grpo_vs_trl: relayrl/trl throughput ratio R``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from relayrl.config.loader import load_config  # noqa: E402
from relayrl.config.schema import Config  # noqa: E402
from relayrl.data.tasks import make_task  # noqa: E402
from relayrl.models.load import load_tokenizer  # noqa: E402
from relayrl.models.tiny import TinyModelConfig, build_tiny  # noqa: E402
from relayrl.workflows.session import PromptSource  # noqa: E402

RECIPE = REPO / "recipes" / "arith_grpo.yaml"


@dataclass
class StepStats:
    """Per measured step: wall seconds, generated tokens, trained tokens (and optional phase seconds)."""

    name: str
    times: list[float] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    phases: dict[str, list[float]] = field(default_factory=dict)

    def add_phase(self, name: str, seconds: float) -> None:
        self.phases.setdefault(name, []).append(seconds)

    @property
    def tokens_per_s(self) -> float:
        return (sum(self.generated) + sum(self.trained)) / sum(self.times)


# ----------------------------------------------------------------------------- setup
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per system (not measured)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads, the same for both systems")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="a local HF model directory (default: the relayrl tiny model)")
    p.add_argument("--hidden", type=int, default=None, help="tiny model width (default: TinyModelConfig's)")
    p.add_argument("--layers", type=int, default=None, help="tiny model layers (default: TinyModelConfig's)")
    p.add_argument("--sft-steps", type=int, default=0,
                   help="warm-start the model with this many steps of relayrl's arith SFT recipe first (cached), so "
                        "answers are short and end in EOS and some GRPO groups have rewards that differ")
    p.add_argument("--order", choices=["interleaved", "trl-first", "relayrl-first"], default="interleaved",
                   help="interleaved: one relayrl step after each TRL step, so both see the same machine load")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: both systems on the GPU in bf16 mixed precision (float32 master weights; TRL "
                        "bf16=True, HF generate; relayrl model.dtype=bfloat16, its own engine)")
    p.add_argument("--shape", default=None, help="a published shape with random weights instead of the tiny model "
                   "(model.tiny.shape, e.g. qwen2-0.5b)")
    p.add_argument("--only", choices=["both", "relayrl", "trl"], default="both",
                   help="run one system only (for profiling); the ratio line needs both")
    a = p.parse_args(argv)
    for name in ("steps", "prompts", "threads", "max_new_tokens"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.sft_steps < 0:
        raise SystemExit(f"--sft-steps must be >= 0, got {a.sft_steps}")
    if a.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {a.warmup}")
    if a.n < 2:
        raise SystemExit(f"--n must be >= 2 (GRPO group advantages), got {a.n}")
    if sum(map(bool, (a.model, a.hidden or a.layers, a.shape))) > 1:
        raise SystemExit("--model, --hidden/--layers and --shape are exclusive")
    if a.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return a


def model_dir(a: argparse.Namespace) -> Path:
    if a.model:
        path = Path(a.model)
        if not (path / "config.json").is_file():
            raise SystemExit(f"--model {path}: no config.json there (expected a Hugging Face model directory)")
        return path
    if a.shape:
        return build_tiny(TinyModelConfig(shape=a.shape))
    base = TinyModelConfig()
    hidden = a.hidden or base.hidden_size
    cfg = TinyModelConfig(hidden_size=hidden, num_layers=a.layers or base.num_layers,
                          intermediate_size=4 * hidden if a.hidden else base.intermediate_size)
    return build_tiny(cfg)


def sft_warm_start(a: argparse.Namespace, base: Path) -> Path:
    """``base`` after ``a.sft_steps`` steps of ``recipes/arith_base.yaml`` (built once, cached by its inputs)."""
    import hashlib

    from relayrl.models.tiny import default_cache_dir
    from relayrl.workflows.sft import train_sft

    key = hashlib.sha256(f"{base.resolve()}|arith_base|{a.sft_steps}|{a.seed}".encode()).hexdigest()[:12]
    run_dir = default_cache_dir() / f"grpo_vs_trl-sft-{key}"
    if (run_dir / "model" / "config.json").is_file():
        return run_dir / "model"
    print(f"grpo_vs_trl: SFT warm start ({a.sft_steps} steps) into {run_dir} ...", flush=True)
    cfg = load_config(Config, REPO / "recipes" / "arith_base.yaml", [
        f"run.dir={run_dir}", f"run.seed={a.seed}", f"run.threads={a.threads}", f"model.path={base}",
        "model.device=cpu", f"trainer.steps={a.sft_steps}", "eval.every=0", "eval.size=50",
        "telemetry.sinks=[jsonl]", "telemetry.console_table_every=0",
        "run.resume=auto", "run.overwrite=true",  # a cut-off warm start goes on from its checkpoint, or starts over
    ])
    return train_sft(cfg)


def relayrl_config(a: argparse.Namespace, path: Path, run_dir: Path) -> Config:
    overrides = [
        f"run.dir={run_dir}", f"run.seed={a.seed}", f"run.threads={a.threads}",
        f"model.path={path}", f"model.device={a.device}",
        f"model.dtype={'bfloat16' if a.device == 'cuda' else 'float32'}",
        f"data.prompts_per_step={a.prompts}", f"rollout.n={a.n}", f"rollout.max_new_tokens={a.max_new_tokens}",
        "rollout.temperature=1.0", "rollout.top_p=1.0", "rollout.top_k=0",
        "algorithm.kl_coef=0.0", "algorithm.loss_agg=seq-mean-token-mean",
        f"trainer.steps={a.warmup + a.steps}", "trainer.epochs=1", "trainer.mini_batches=1",
        f"engine.optim.lr={a.lr}", "engine.optim.schedule=constant", "engine.optim.warmup_steps=0",
        "engine.optim.max_grad_norm=1.0", "engine.optim.weight_decay=0.0",
        "telemetry.sinks=[jsonl]", "telemetry.console_table_every=0",
    ]
    return load_config(Config, RECIPE, overrides)


def training_problems(cfg: Config, count: int):
    """The prompts relayrl's workflow will draw, in its order (same seed, same task options)."""
    return PromptSource(cfg.run.seed, task=make_task(cfg.data.task, **cfg.data.task_options)).take(count)


# ----------------------------------------------------------------------------- relayrl
class RelayrlRunner:
    """relayrl's synchronous GRPO workflow, stepped one iteration at a time (no eval, no checkpoints)."""

    def __init__(self, a: argparse.Namespace, cfg: Config) -> None:
        from relayrl.workflows.pipeline import KEY_METRICS, GRPOPipeline
        from relayrl.workflows.relay import relay_weights

        torch.set_num_threads(a.threads)
        torch.manual_seed(a.seed)
        self.warmup = a.warmup
        self.wf = wf = GRPOPipeline(cfg)
        wf.s.open_telemetry(cfg.trainer.steps, KEY_METRICS)  # step() records its phases on the timeline
        relay_weights(wf.actor, wf.rollout, version=0)
        self.stats = StepStats("relayrl")
        self.rows = cfg.data.prompts_per_step * cfg.rollout.n

    def step(self, step: int) -> None:
        t0 = time.perf_counter()
        m = self.wf.step(step)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if step > self.warmup:
            self.stats.times.append(dt)
            self.stats.generated.append(round(m["response/length_mean"] * self.rows))  # completions of this step
            self.stats.trained.append(int(m["perf/tokens"]))  # prompt + response tokens of the updated samples
            for k, v in self.wf.s.timeline.timing_metrics(step).items():
                self.stats.add_phase(k.removeprefix("timing/").removesuffix("_s"), v)

    def close(self) -> None:
        s = self.wf.s
        s.timeline.close()
        s.tracker.close()
        self.wf.shutdown()


def run_relayrl(a: argparse.Namespace, cfg: Config) -> StepStats:
    runner = RelayrlRunner(a, cfg)
    try:
        for step in range(1, cfg.trainer.steps + 1):
            runner.step(step)
    finally:
        runner.close()
    return runner.stats


# ----------------------------------------------------------------------------- TRL
class TrlRunner:
    """TRL's ``GRPOTrainer`` set up like relayrl's run; :meth:`train` runs warm-up + measured steps.

    Built before relayrl's workflow in interleaved mode, so accelerate's process
    state is fixed before relayrl initialises its own (single-rank) process group.
    """

    def __init__(self, a: argparse.Namespace, cfg: Config, path: Path, out_dir: Path) -> None:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        try:
            from datasets import Dataset
            from transformers import AutoModelForCausalLM, PrinterCallback, TrainerCallback
            from trl import GRPOConfig, GRPOTrainer
        except ImportError as e:
            raise SystemExit(f"TRL is a benchmark-only extra: .venv/bin/pip install trl ({e})") from None

        torch.set_num_threads(a.threads)
        torch.manual_seed(a.seed)
        self.a = a
        self.between: Callable[[int], None] | None = None
        self.stats = stats = StepStats("trl")
        task = make_task(cfg.data.task, **cfg.data.task_options)
        problems = training_problems(cfg, (a.warmup + a.steps) * a.prompts)
        data = Dataset.from_dict({"prompt": [p.prompt for p in problems], "answer": [p.answer for p in problems]})

        def exact_match(completions, answer, **_):
            return [task.verify(c, ans) for c, ans in zip(completions, answer)]

        marks: list[float] = []
        pending: dict[str, float] = {}
        runner = self

        class Timer(TrainerCallback):
            def on_train_begin(self, args, state, control, **kw):
                marks.append(time.perf_counter())

            def on_step_end(self, args, state, control, **kw):
                if a.device == "cuda":
                    torch.cuda.synchronize()
                dt = time.perf_counter() - marks[-1]
                if state.global_step > a.warmup:
                    stats.times.append(dt)
                    stats.generated.append(int(pending["generated"]))
                    stats.trained.append(int(pending["trained"]))
                    stats.add_phase("generate+score", pending["gen_s"])
                    stats.add_phase("update", dt - pending["gen_s"])
                if runner.between is not None:
                    runner.between(state.global_step)
                marks.append(time.perf_counter())  # the next TRL step starts after the other system's step

        class CountingGRPOTrainer(GRPOTrainer):
            """Counts the tokens of the batch it is about to train on (the output of generate-and-score)."""

            def _generate_and_score_completions(self, inputs):
                t0 = time.perf_counter()
                out = super()._generate_and_score_completions(inputs)
                pending["gen_s"] = time.perf_counter() - t0
                gen = int(out["completion_mask"].sum())
                pending["generated"] = gen
                pending["trained"] = gen + int(out["prompt_mask"].sum())
                return out

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = GRPOConfig(
                output_dir=str(out_dir), use_cpu=a.device == "cpu", bf16=a.device == "cuda", fp16=False,
                seed=a.seed,
                max_steps=a.warmup + a.steps, per_device_train_batch_size=a.prompts * a.n,
                gradient_accumulation_steps=1, num_generations=a.n, num_iterations=1, beta=0.0,
                max_completion_length=a.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
                loss_type="grpo", epsilon=0.2, scale_rewards="group",
                learning_rate=a.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
                max_grad_norm=1.0, optim="adamw_torch", shuffle_dataset=False,
                logging_strategy="no", save_strategy="no", eval_strategy="no", report_to=[], disable_tqdm=True,
                use_vllm=False, log_completions=False, dataloader_num_workers=0,
            )
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
            self.trainer = CountingGRPOTrainer(model=model, reward_funcs=exact_match, args=args, train_dataset=data,
                                               processing_class=load_tokenizer(path), callbacks=[Timer()])
        self.trainer.remove_callback(PrinterCallback)  # its end-of-training dict would not let the ratio be last

    def train(self, between: Callable[[int], None] | None = None) -> StepStats:
        """Train; ``between(k)`` runs after TRL's step ``k`` and is excluded from TRL's step times."""
        self.between = between
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer.train()
        if len(self.stats.times) != self.a.steps:
            raise RuntimeError(f"TRL ran {len(self.stats.times)} measured steps, expected {self.a.steps}")
        return self.stats


# ----------------------------------------------------------------------------- report
def table(results: list[StepStats]) -> str:
    rows = [
        ("steps/s", lambda r: f"{len(r.times) / sum(r.times):.2f}"),
        ("step time mean (s)", lambda r: f"{statistics.mean(r.times):.3f}"),
        ("step time median (s)", lambda r: f"{statistics.median(r.times):.3f}"),
        ("generated tokens/step", lambda r: f"{statistics.mean(r.generated):.1f}"),
        ("trained tokens/step", lambda r: f"{statistics.mean(r.trained):.1f}"),
        ("tokens/s (gen+train)", lambda r: f"{r.tokens_per_s:.0f}"),
    ]
    w = max(len(n) for n, _ in rows) + 2
    lines = [f"{'':<{w}}" + "".join(f"{r.name:>12}" for r in results)]
    lines += [f"{name:<{w}}" + "".join(f"{fmt(r):>12}" for r in results) for name, fmt in rows]
    for r in results:
        if r.phases:
            parts = ", ".join(f"{k} {statistics.mean(v) * 1e3:.1f}" for k, v in sorted(r.phases.items()))
            lines.append(f"{r.name} phases (ms/step, mean): {parts}")
    return "\n".join(lines)


def run_all(a: argparse.Namespace, path: Path, tmp: Path) -> dict[str, StepStats]:
    cfg = relayrl_config(a, path, tmp / "relayrl")
    if a.only == "relayrl":
        return {"relayrl": run_relayrl(a, cfg)}
    if a.only == "trl":
        return {"trl": TrlRunner(a, cfg, path, tmp / "trl").train()}
    if a.order == "interleaved":
        trl = TrlRunner(a, cfg, path, tmp / "trl")
        runner = RelayrlRunner(a, cfg)
        try:
            trl.train(between=runner.step)
        finally:
            runner.close()
        return {"relayrl": runner.stats, "trl": trl.stats}
    out: dict[str, StepStats] = {}
    for name in (("trl", "relayrl") if a.order == "trl-first" else ("relayrl", "trl")):
        out[name] = TrlRunner(a, cfg, path, tmp / "trl").train() if name == "trl" else run_relayrl(a, cfg)
    return out


def main(argv: list[str] | None = None) -> dict[str, StepStats]:
    from transformers import AutoConfig

    from transformers.utils import logging as hf_logging

    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    hf_logging.disable_progress_bar()
    path = model_dir(a)
    if a.sft_steps:
        path = sft_warm_start(a, path)
    mc = AutoConfig.from_pretrained(path)
    print(f"grpo_vs_trl: model {path} ({mc.model_type}, hidden {mc.hidden_size}, {mc.num_hidden_layers} layers), "
          f"{'bf16 mixed cuda' if a.device == 'cuda' else 'fp32 cpu'}, threads {a.threads}, {a.prompts} prompts x n={a.n}, max_new_tokens {a.max_new_tokens}, "
          f"{a.warmup} warm-up + {a.steps} measured steps each, {a.order if a.only == 'both' else a.only}",
          flush=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl-") as tmp:
        results = run_all(a, path, Path(tmp))
    print(f"grpo_vs_trl: ran in {time.perf_counter() - t0:.1f}s", flush=True)
    print(table([results[k] for k in ("relayrl", "trl") if k in results]))
    if len(results) == 2:
        ratio = results["relayrl"].tokens_per_s / results["trl"].tokens_per_s
        print(f"grpo_vs_trl: relayrl/trl throughput ratio {ratio:.2f}")
    return results


if __name__ == "__main__":
    main()
