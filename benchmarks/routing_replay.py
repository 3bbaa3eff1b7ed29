"""Routing replay (R3) on a mixture-of-experts model: how much of the train/generation mismatch is routing, and
what replaying the rollout's experts costs the trainer.

Workload: a Qwen3-MoE-shaped model built locally with random weights (4 layers, 16 experts, 4 per token, the
output head scaled so logits spread as a trained model's do); its routers at initialisation score experts
close together, so near-ties, where precision decides the expert, are common. The rollout is the native
engine in bfloat16 recording each token's experts (``record_routing``); the trainer is the training engine in
float32, as with ``model.dtype=float32`` and ``rollout.dtype=bfloat16``. On the same responses the trainer
computes the sampled tokens' log-probs twice, routing on its own and replaying the rollout's experts
(``routing_replay``), timed in alternation; the rollout is timed with and without recording too.

Figures: the share of the rollout's expert picks the float32 trainer makes itself (``routing agreement``), and
``rollout/logprob_error`` (mean over tokens of ``exp(|logp_gen - logp_train|)``, 1.0 a perfect match) without
and with replay; the pass time with replay over without, and the rollout's time recording over not. Printed, not
asserted. Last line::

    routing_replay: agreement A%; logprob_error free E_f, replayed E_r (excess x R smaller); pass time x T;
        recording the rollout x G

Run it with ``.venv/bin/python benchmarks/routing_replay.py`` (about 30 s on 2 cores); on a GPU, both engines there
and the trainer in bf16 mixed precision, as a GPU run trains: ``--device cuda --train-compute bfloat16``.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relayrl.algorithms.mismatch import logprob_error
from relayrl.engines.generation.base import SamplingParams
from relayrl.engines.generation.native import NativeGenerationEngine
from relayrl.engines.training.base import SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig
from relayrl.models.load import load_tokenizer
from relayrl.models.routing import Routing
from relayrl.models.tiny import TinyModelConfig, build_tiny


def moe_model(vocab: int, seed: int) -> torch.nn.Module:
    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=vocab, hidden_size=128, intermediate_size=256,
                               num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                               num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                               max_position_embeddings=512, norm_topk_prob=True)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        std = float(model(torch.arange(3, 35)[None] % vocab).logits.std())
        model.get_output_embeddings().weight.mul_(4.0 / std)
    return model


def padded(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    out, mask = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, r in enumerate(rows):
        out[i, :len(r)], mask[i, :len(r)] = r, 1.0
    return out, mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3, help="timed trainer passes of each kind, alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (both engines on the GPU)")
    ap.add_argument("--train-compute", choices=("float32", "bfloat16"), default="float32",
                    help="the trainer's compute dtype: float32, or bfloat16 (float32 weights under autocast, as "
                         "model.dtype=bfloat16 trains on a GPU)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    dev, compute = torch.device(args.device), getattr(torch, args.train_compute)

    tok = load_tokenizer(build_tiny(TinyModelConfig(), verbose=False))
    model = moe_model(len(tok), args.seed)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(10, len(tok) - 1, (int(torch.randint(8, 24, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]

    params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, ignore_eos=True)
    engines = {rec: NativeGenerationEngine(copy.deepcopy(model).to(torch.bfloat16), tok, decode="dynamic", device=dev,
                                           max_batch=args.prompts * args.n, record_routing=rec)
               for rec in (False, True)}
    gen_times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(args.repeats):  # the rollout with and without recording, in alternation
        for rec, eng in engines.items():
            t0 = time.perf_counter()
            out = eng.generate(prompts, params, generator=torch.Generator().manual_seed(1))
            gen_times[rec].append(time.perf_counter() - t0)
            if rec:
                comps = out
    print(f"rollout (bf16): {len(comps)} responses, {sum(len(c.token_ids) for c in comps)} tokens in "
          f"{min(gen_times[False]):.2f} s, recording routing {min(gen_times[True]):.2f} s")
    batch = SequenceBatch([torch.tensor(prompts[c.prompt_index]) for c in comps], [c.token_ids for c in comps], {},
                          [c.prompt_index for c in comps], [c.routed_experts for c in comps])

    # the trainer's own choices against the rollout's (in its compute dtype)
    model = model.to(dev)
    routing, matched, picks = Routing(model), 0, 0
    for c in comps:
        ids = torch.cat([torch.tensor(prompts[c.prompt_index]), c.token_ids])[None].to(dev)
        mixed = torch.autocast(dev.type, compute, enabled=compute != torch.float32)
        with routing.record() as rec, torch.no_grad(), mixed:
            model(ids)
        own, theirs = rec.routes()[:-1].cpu(), c.routed_experts.long()
        matched += int((own[..., :, None] == theirs[..., None, :]).any(-1).sum())
        picks += theirs.numel()
    routing.remove()

    cfg = TrainEngineConfig()
    free = TorchTrainingEngine(copy.deepcopy(model), cfg, total_steps=1, trainable=False, device=dev,
                               compute_dtype=compute)
    replayed = TorchTrainingEngine(copy.deepcopy(model), cfg, total_steps=1, trainable=False, routing_replay=True,
                                   device=dev, compute_dtype=compute)
    times: dict[str, list[float]] = {"free": [], "replayed": []}
    out: dict[str, list[torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name, eng in (("free", free), ("replayed", replayed)):
            t = time.perf_counter()
            out[name], _ = eng.logprobs(batch)
            times[name].append(time.perf_counter() - t)
    gen_lp, mask = padded([c.logprobs for c in comps])
    err = {k: logprob_error(gen_lp, padded(v)[0], mask) for k, v in out.items()}
    for k in ("free", "replayed"):
        e = err[k]
        print(f"trainer ({args.train_compute}, {k:8s}): rollout/logprob_error {e['rollout/logprob_error']:.5f}, "
              f"max {e['rollout/logprob_error_max']:.4f}, pass {min(times[k]):.3f} s")
    agree = matched / picks
    e_f, e_r = err["free"]["rollout/logprob_error"], err["replayed"]["rollout/logprob_error"]
    print(f"routing_replay: agreement {100 * agree:.2f}%; logprob_error free {e_f:.5f}, replayed {e_r:.5f} "
          f"(excess x {(e_f - 1) / max(e_r - 1, 1e-12):.2f} smaller); pass time x "
          f"{min(times['replayed']) / min(times['free']):.2f}; recording the rollout x "
          f"{min(gen_times[True]) / min(gen_times[False]):.2f}")


if __name__ == "__main__":
    main()
