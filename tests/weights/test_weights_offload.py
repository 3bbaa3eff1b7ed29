"""Optimizer state swapped to host and back leaves training bitwise identical."""
import pytest
import torch

from relayrl.weights import is_offloaded, offload_optimizer, reload_optimizer


def make(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=True)
    return model, opt


def step(model, opt, i: int):
    g = torch.Generator().manual_seed(1000 + i)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 3, generator=g)
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()


def test_offload_round_trip_keeps_training_bitwise_identical():
    ref_model, ref_opt = make()
    model, opt = make()
    for i in range(6):
        step(ref_model, ref_opt, i)
    for i in range(6):
        step(model, opt, i)
        if i in (1, 3):
            before = {(id(p), k): v.clone() for p, s in opt.state.items() for k, v in s.items()}
            m = offload_optimizer(opt)
            assert is_offloaded(opt)
            assert m["offload/tensors"] == 8  # exp_avg + exp_avg_sq of 4 parameters; scalar steps stay
            assert m["offload/bytes"] == 2 * 4 * sum(p.numel() for p in model.parameters())
            moments = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
            assert len({v.untyped_storage().data_ptr() for v in moments}) == 1  # one flat host buffer
            reload_optimizer(opt, "cpu")
            assert not is_offloaded(opt)
            after = [v for s in opt.state.values() for k, v in s.items() if k != "step"]
            assert len({v.untyped_storage().data_ptr() for v in after}) == len(after)  # fresh tensors again
            for p, s in opt.state.items():
                for k, v in s.items():
                    assert torch.equal(v, before[(id(p), k)]), k
    for a, b in zip(ref_model.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_offload_reuses_its_host_buffer_and_checks_the_order_of_calls():
    model, opt = make()
    with pytest.raises(RuntimeError, match="not offloaded"):
        reload_optimizer(opt)
    assert offload_optimizer(opt)["offload/tensors"] == 0  # no state yet: nothing to move
    reload_optimizer(opt)
    step(model, opt, 0)
    offload_optimizer(opt)
    ptr = next(iter(opt.state.values()))["exp_avg"].untyped_storage().data_ptr()
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload_optimizer(opt)
    reload_optimizer(opt)
    step(model, opt, 1)
    offload_optimizer(opt)
    assert next(iter(opt.state.values()))["exp_avg"].untyped_storage().data_ptr() == ptr
    reload_optimizer(opt)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        offload_optimizer(model)
