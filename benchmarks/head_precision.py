"""The train/generation log-prob mismatch with and without ``model.head_fp32``, on the CPU, side by side.

The tiny model in bf16 (``model.dtype=bfloat16``: the generator holds bf16 weights, the trainer float32 masters
under bf16 autocast, or with ``--compute-copy`` a bf16 copy like FSDP2's) samples responses to arith prompts;
the trainer scores the same tokens. For each model (the tiny model, whose logits are near 0, and the same
model with every embedding row moved by one shared vector, which gives each position's logits a shared offset
of about 18, a trained model's magnitude, and keeps their spread) and each setting of the flag, in one process:
mean and max of
``|logp_gen - logp_train|`` over the sampled tokens (what ``rollout/logprob_error`` summarises), and the time
of one step (generate, score, one update) with the flag over without.

Run it::

    .venv/bin/python benchmarks/head_precision.py            # ~1 min here
    .venv/bin/python benchmarks/head_precision.py --compute-copy

Last line: ``head_precision: mean |diff| bf16 head A, fp32 head B (logits ~18: C, D); step time x R``.
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


def models(path, offset: float):
    """(trainer's float32 model, generator's bf16 copy); with ``offset`` > 0 every row of the tied embedding is
    moved by one shared vector ``v``, sized so that ``|hidden . v|`` averages ``offset`` on a random input (the
    logits' shared offset comes out larger: the moved inputs carry ``v`` through the residual stream)."""
    torch.manual_seed(0)
    m = load_model(path)
    if offset:
        g = torch.Generator().manual_seed(0)
        v = torch.randn(m.config.hidden_size, generator=g)
        v /= v.norm()
        with torch.no_grad():
            hidden = m.model(torch.randint(0, 300, (2, 20), generator=g)).last_hidden_state
            m.get_input_embeddings().weight.add_(offset / float((hidden @ v).abs().mean()) * v)
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
    p.add_argument("--offset", type=float, default=1.8, help="the second model's embedding shift (see models)")
    p.add_argument("--compute-copy", action="store_true", help="the trainer on a bf16 copy (engine.compute_copy)")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    path = build_tiny(TinyModelConfig(), verbose=False)
    tok = load_tokenizer(path)
    task, rng = make_task("arith"), random.Random(0)
    prompts = [tok(task.sample(rng).prompt)["input_ids"] for _ in range(a.prompts)]
    res = {}
    for off in (0.0, a.offset):
        with torch.no_grad():
            logits = models(path, off)[0](torch.tensor([prompts[0]])).logits
            mean, spread = float(logits.mean()), float((logits - logits.mean(-1, keepdim=True)).std())
        for flag in (False, True):
            r = res[off, flag] = one(path, tok, prompts, off, flag, a.compute_copy, a.steps)
            print(f"logits mean {mean:5.2f} spread {spread:.2f}, head_fp32={str(flag).lower():5}: |logp_gen - "
                  f"logp_train| mean {r['mean']:.2e} max {r['max']:.2e}; step {r['step_s']:.3f} s")
    offsets = (0.0, a.offset)
    ratio = sum(res[o, True]["step_s"] for o in offsets) / sum(res[o, False]["step_s"] for o in offsets)
    print(f"head_precision: mean |diff| bf16 head {res[0.0, False]['mean']:.2e}, fp32 head {res[0.0, True]['mean']:.2e}"
          f" (logits ~18: {res[a.offset, False]['mean']:.2e}, {res[a.offset, True]['mean']:.2e}); step time x{ratio:.2f}")


if __name__ == "__main__":
    main()
