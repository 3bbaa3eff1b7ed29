import math
import warnings

import pytest
import torch

from relayrl.engines.training.base import OptimConfig, SequenceBatch
from relayrl.engines.training.torch_engine import TorchTrainingEngine, TrainEngineConfig, make_scheduler, plan_microbatches
from relayrl.workflows.losses import PolicyLoss, SFTLoss



def _batch(tok, n=6):
    prompts = ["1+2=", "123+456=", "sort 5 12 9 =", "77+1=", "9+9=", "countdown 3 7 5 -> 9 :"][:n]
    answers = ["3", "579", "5 9 12", "78", "18", "7+5-3"][:n]
    eos = torch.tensor([tok.eos_token_id])
    return SequenceBatch([torch.tensor(tok(p)["input_ids"]) for p in prompts],
                         [torch.cat([torch.tensor(tok(a, add_special_tokens=False)["input_ids"]), eos]) for a in answers])


def test_plan_microbatches_respects_budget_and_covers_rows():
    lengths = [5, 30, 7, 12, 30, 3, 9]
    plans = plan_microbatches(lengths, token_budget=40)
    assert sorted(i for p in plans for i in p) == list(range(len(lengths)))
    for p in plans:
        assert len(p) == 1 or max(lengths[i] for i in p) * len(p) <= 40
    assert plan_microbatches([100], 10) == [[0]]  # a row over budget gets its own micro-batch


@pytest.mark.parametrize("packing", ["none", "sequences", "shared_prompt"])
def test_logprobs_match_a_plain_forward(tiny_model, tiny_tokenizer, packing):
    batch = _batch(tiny_tokenizer)
    batch.groups = [0, 1, 2, 3, 4, 5]
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(token_budget=24, packing=packing), total_steps=1,
                              trainable=False)
    lps, ents = eng.logprobs(batch, temperature=0.8, with_entropy=True)
    for p, r, lp, e in zip(batch.prompt_ids, batch.response_ids, lps, ents):
        with torch.no_grad():
            logits = tiny_model(torch.cat([p, r])[None]).logits[0, len(p) - 1:-1].float() / 0.8
        logp = torch.log_softmax(logits, -1)
        torch.testing.assert_close(lp, logp.gather(-1, r[:, None]).squeeze(-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(e, -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=1e-4)


def test_micro_batching_does_not_change_the_update(tiny_dir, tiny_tokenizer):
    """Token-budget micro-batches with global normalisation give the full-batch gradient (Periodic Asynchrony §3)."""
    from relayrl.models.load import load_model

    batch = _batch(tiny_tokenizer)
    batch.fields["advantages"] = [torch.randn(len(r), generator=torch.Generator().manual_seed(i))
                                  for i, r in enumerate(batch.response_ids)]
    results = []
    for budget in (10_000, 16):
        torch.manual_seed(0)
        eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(token_budget=budget,
                                  optim=OptimConfig(lr=1e-2, max_grad_norm=None)), total_steps=1)
        grads = []
        eng.optimizer.step = lambda: grads.extend(p.grad.clone() for p in eng.model.parameters() if p.grad is not None)
        m = eng.train_step(batch, PolicyLoss(agg="token-mean"))
        results.append((m["actor/grad_norm"], grads))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-4)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-4)


@pytest.mark.slow  # (about 1 s: make test runs it, the fast set does not)
def test_sft_steps_reduce_the_loss(tiny_dir, tiny_tokenizer):
    from relayrl.models.load import load_model

    batch = _batch(tiny_tokenizer)
    eng = TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(optim=OptimConfig(lr=3e-3)), total_steps=20)
    first = eng.train_step(batch, SFTLoss())["sft/loss"]
    for _ in range(15):
        last = eng.train_step(batch, SFTLoss())["sft/loss"]
    assert last < first * 0.7


def test_nonfinite_gradient_skips_the_step(tiny_model, tiny_tokenizer):
    batch = _batch(tiny_tokenizer, 2)
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(), total_steps=2)
    before = [p.detach().clone() for _, p in eng.named_weights()]
    with warnings.catch_warnings():  # (torch warned that the schedule advanced before any optimizer step)
        warnings.simplefilter("error")
        m = eng.train_step(batch, lambda mb: ((mb.logprobs * float("nan")).sum(), {}))
    assert m["actor/nonfinite_grad"] == 1.0 and not math.isfinite(m["actor/grad_norm"])
    assert all(torch.equal(a, b) for a, (_, b) in zip(before, eng.named_weights()))


def test_mini_batches_and_errors(tiny_model, tiny_tokenizer):
    batch = _batch(tiny_tokenizer, 4)
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(), total_steps=10)
    m = eng.train_step(batch, SFTLoss(), mini_batches=2, epochs=2)
    assert eng.scheduler.last_epoch == 4 and "sft/loss" in m
    with pytest.raises(ValueError, match="mini_batches=5"):
        eng.train_step(batch, SFTLoss(), mini_batches=5)
    with pytest.raises(ValueError, match="empty"):
        eng.train_step(batch.select([]), SFTLoss())


def test_scheduler_warmup_then_cosine():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = make_scheduler(opt, OptimConfig(lr=1.0, warmup_steps=2, schedule="cosine", min_lr_ratio=0.1), total_steps=12)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0) and lrs[2] == pytest.approx(1.0)
    assert lrs[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 9 / 10)))


def test_sequence_batch_checks_rows():
    with pytest.raises(ValueError, match="field 'x' has 1 rows, expected 2"):
        SequenceBatch([torch.ones(1)] * 2, [torch.ones(1)] * 2, {"x": [1]})


def test_minibatch_slices_are_exactly_mini_batches_nonempty_slices():
    from relayrl.engines.training.torch_engine import minibatch_slices

    for rows, mb in [(6, 4), (9, 4), (16, 7), (4, 4), (5, 1)]:
        slices = minibatch_slices(rows, mb)
        assert len(slices) == mb and all(len(s) > 0 for s in slices)
        assert [i for s in slices for i in s] == list(range(rows))
        assert max(map(len, slices)) - min(map(len, slices)) <= 1
    with pytest.raises(ValueError, match="mini_batches=5"):
        minibatch_slices(4, 5)


def test_minibatch_rows_cut_every_ranks_rows_as_one_rank_cuts_the_batch():
    """Ranks holding rows 0-3 and 4-9 of a batch take, in each mini-batch, the rows one rank takes there: a
    global permutation, each rank keeping its own rows (before, each rank cut its own rows into slices, and
    two ranks' mini-batches were not one rank's)."""
    from relayrl.engines.training.steps import minibatch_rows, minibatch_slices

    perm = torch.randperm(10, generator=torch.Generator().manual_seed(0)).tolist()
    for rows in minibatch_slices(10, 3):
        want = sorted(perm[rows.start:rows.stop])
        got = sorted(minibatch_rows(perm, rows, 0, 4) + [4 + i for i in minibatch_rows(perm, rows, 4, 6)])
        assert got == want
        assert minibatch_rows(perm, rows, 0, 10) == perm[rows.start:rows.stop]  # one rank: the slice itself
    assert minibatch_rows([5, 6, 0], range(0, 2), 0, 4) == []  # a rank may hold none of a mini-batch


@pytest.mark.parametrize("loss", [lambda: PolicyLoss(agg="seq-mean-token-sum-norm"),
                                  lambda: SFTLoss(agg="seq-mean-token-sum-norm")])
def test_token_sum_norm_without_its_constant_is_refused(loss):
    """Left to the micro-batch's padded width, Dr.GRPO's constant depended on how the rows were cut: on one
    rank and on two the same batch gave losses of 0.075 and 0.188 (tests/engines/test_data_parallel_losses.py
    runs the constant given)."""
    with pytest.raises(ValueError, match="divides each response's token sum by a constant"):
        loss()
    assert PolicyLoss(agg="seq-mean-token-sum-norm", agg_constant=8.0).normalized_by == "seqs"


@pytest.mark.parametrize("rows,mb", [(6, 4), (5, 4), (6, 5)])
def test_train_step_takes_exactly_mini_batches_optimizer_steps(tiny_model, tiny_tokenizer, rows, mb):
    """Issue 11 item 3: ceil(rows / mb)-row slices took 3 steps for 6 rows in 4 mini-batches (fails before)."""
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(), total_steps=100)
    m = eng.train_step(_batch(tiny_tokenizer, rows), SFTLoss(), mini_batches=mb, epochs=2)
    assert eng.scheduler.last_epoch == 2 * mb and "sft/loss" in m


def test_logprobs_divide_logits_by_the_sampling_temperature(tiny_model, tiny_tokenizer):
    """The engine's log-probs at temperature T are those of softmax(logits / T), the generator's convention."""
    from relayrl.engines.generation.base import SamplingParams
    from relayrl.engines.generation.native import sample_next

    batch = _batch(tiny_tokenizer, 3)
    eng = TorchTrainingEngine(tiny_model, TrainEngineConfig(packing="none"), total_steps=1)
    at_1, at_07 = eng.logprobs(batch)[0], eng.logprobs(batch, temperature=0.7)[0]
    assert not torch.allclose(at_1[0], at_07[0])
    row = 1
    ids = torch.cat([batch.prompt_ids[row], batch.response_ids[row]])[None]
    with torch.no_grad():
        logits = tiny_model(ids).logits[0, batch.prompt_ids[row].numel() - 1: -1].float()  # [T, V]
    want = torch.log_softmax(logits / 0.7, -1).gather(-1, batch.response_ids[row][:, None]).squeeze(-1)
    torch.testing.assert_close(at_07[row], want, atol=1e-5, rtol=1e-5)
    gen = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, SamplingParams(temperature=0.7), gen)
    torch.testing.assert_close(lp, torch.log_softmax(logits / 0.7, -1).gather(-1, tok[:, None]).squeeze(-1))
    with pytest.raises(ValueError, match="temperature"):
        eng.logprobs(batch, temperature=0.0)


def test_cuda_graphs_are_refused_where_they_cannot_run(tiny_dir):
    """engine.cuda_graphs needs compiled layers on one CUDA device: elsewhere the engine says which and stops."""
    from relayrl.models.load import load_model

    with pytest.raises(ValueError, match="engine.cuda_graphs=true needs .* engine.compile=false"):
        TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(cuda_graphs=True), total_steps=1)
    with pytest.raises(ValueError, match="engine.cuda_graphs=true needs .* runs on cpu"):
        TorchTrainingEngine(load_model(tiny_dir), TrainEngineConfig(compile=True, cuda_graphs=True), total_steps=1)
