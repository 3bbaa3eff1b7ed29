"""The train/generation log-prob mismatch with and without ``model.head_fp32``, on the CPU, side by side.

The tiny model in bf16 (``model.dtype=bfloat16``: the generator holds bf16 weights, the trainer float32 masters
under bf16 autocast, or with ``--compute-copy`` a bf16 copy like FSDP2's) samples responses to arith prompts;
the trainer scores the same tokens. For each logit scale (the tiny model's own, and its embedding scaled up to
a trained model's spread) and each setting of the flag, in one process and interleaved: mean and max of
``|logp_gen - logp_train|`` over the sampled tokens (what ``rollout/logprob_error`` summarises), and the time
of one step (generate, score, one update) with the flag over without.

Run it::

    .venv/bin/python benchmarks/head_precision.py            # ~1 min here
    .venv/bin/python benchmarks/head_precision.py --compute-copy

Last line: ``head_precision: mean |diff| bf16 head A, fp32 head B (scaled logits: C, D); step time x R``.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from relayrl.data.tasks import make_task
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import load_model, load_tokenizer
from relayrl.models.tiny import TinyModelConfig, build_tiny
from relayrl.workflows.losses import PolicyLoss


def models(path, scale: float):
    """(trainer's float32 model, generator's bf16 copy), the tied embedding multiplied by ``scale``."""
    torch.manual_seed(0)
    m = load_model(path)
    with torch.no_grad():
        m.get_input_embeddings().weight.mul_(scale)
    gen = load_model(path)
    gen.load_state_dict(m.state_dict())
    return m, gen.to(torch.bfloat16)


def one(path, tok, prompts, scale: float, head_fp32: bool, compute_copy: bool, steps: int) -> dict:
    train, gen = models(path, scale)
    eng = TorchTrainingEngine(train, TrainEngineConfig(compute_copy=compute_copy, optim=OptimConfig(lr=1e-5)),
                              total_steps=steps, compute_dtype=torch.bfloat16, head_fp32=head_fp32)
    rollout = NativeGenerationEngine(gen, tok, max_batch=64, decode="dynamic", head_fp32=head_fp32)
    diffs, times = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        outs = rollout.generate(prompts, SamplingParams(n=8, temperature=1.0, max_new_tokens=8),
                                generator=torch.Generator().manual_seed(step))
        outs = [o for o in outs if len(o.token_ids)]
        batch = SequenceBatch([torch.tensor(prompts[o.prompt_index]) for o in outs], [o.token_ids for o in outs],
                              {"advantages": [torch.full((len(o.token_ids),), (-1.0) ** o.sample_index)
                                              for o in outs]}, [o.prompt_index for o in outs])
        lp = eng.logprobs(batch)[0]
        diffs += [(a - o.logprobs).abs() for a, o in zip(lp, outs)]
        eng.train_step(batch, PolicyLoss(agg="token-mean"))
        rollout.update_weights(((n, p.detach().to(torch.bfloat16)) for n, p in eng.model.named_parameters()), step + 1)
        times.append(time.perf_counter() - t0)
    d = torch.cat(diffs)
    return {"mean": float(d.mean()), "max": float(d.max()), "step_s": sorted(times)[len(times) // 2]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--scale", type=float, default=4.0, help="embedding scale of the second model (logit spread)")
    p.add_argument("--compute-copy", action="store_true", help="the trainer on a bf16 copy (engine.compute_copy)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = build_tiny(TinyModelConfig(), verbose=False)
    tok = load_tokenizer(path)
    task, rng = make_task("arith"), random.Random(0)
    prompts = [tok(task.sample(rng).prompt)["input_ids"] for _ in range(a.prompts)]
    res = {}
    for scale in (1.0, a.scale):
        with torch.no_grad():
            t, _ = models(path, scale)
            std = float(t(torch.tensor([prompts[0]])).logits.std())
        for flag in (False, True):
            r = res[scale, flag] = one(path, tok, prompts, scale, flag, a.compute_copy, a.steps)
            print(f"embedding x{scale:g} (logit std {std:.2f}), head_fp32={str(flag).lower():5}: |logp_gen - "
                  f"logp_train| mean {r['mean']:.2e} max {r['max']:.2e}; step {r['step_s']:.3f} s")
    ratio = sum(res[s, True]["step_s"] for s in (1.0, a.scale)) / sum(res[s, False]["step_s"] for s in (1.0, a.scale))
    print(f"head_precision: mean |diff| bf16 head {res[1.0, False]['mean']:.2e}, fp32 head {res[1.0, True]['mean']:.2e} "
          f"(scaled logits: {res[a.scale, False]['mean']:.2e}, {res[a.scale, True]['mean']:.2e}); "
          f"step time x{ratio:.2f}")


if __name__ == "__main__":
    main()
