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


def test_module_offload_round_trip_and_buffers_survive_a_reload_without_restore(monkeypatch):
    from torch import nn

    from relayrl.weights.offload import is_offloaded, offload_module, reload_module

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)
            self.register_buffer("freq", torch.arange(5.0))

    net = Net()
    before = {n: t.clone() for n, t in [*net.named_parameters(), *net.named_buffers()]}
    offload_module(net)
    assert is_offloaded(net)
    with pytest.raises(RuntimeError, match="already offloaded"):
        offload_module(net)
    reload_module(net)
    for n, t in [*net.named_parameters(), *net.named_buffers()]:
        assert torch.equal(t, before[n]), n
    offload_module(net)
    empty = torch.empty

    def nan_empty(*args, **kw):  # fresh tensors hold NaN (empty memory is undefined: it may hold old values)
        return empty(*args, **kw).fill_(float("nan")) if kw.get("dtype", torch.float32).is_floating_point \
            else empty(*args, **kw)

    monkeypatch.setattr(torch, "empty", nan_empty)
    reload_module(net, restore=False)
    assert torch.isnan(net.lin.weight).all()  # parameters are not copied back: new weights come next
    assert torch.equal(net.freq, before["freq"])  # buffers (which no relay sends) are always restored
