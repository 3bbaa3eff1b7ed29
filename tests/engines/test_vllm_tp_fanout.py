"""The tensor-parallel vLLM engine's plumbing without starting vLLM: how a weight update fans out to every
worker through ``collective_rpc`` (against a stand-in that pickles the arguments as the worker processes
receive them), the buckets, the devices the workers see and the environment they start with."""

from __future__ import annotations

import os
import pickle
import sys
from types import ModuleType, SimpleNamespace

import pytest
import torch

from relayrl.engines.generation import vllm_tp
from relayrl.engines.generation.vllm_engine import VLLMGenerationEngine, vllm_available
from relayrl.models.checkpoint_names import CheckpointNames
from relayrl.engines.generation.vllm_tp import buckets, tp_devices, worker_env
from relayrl.errors import UserError


class FakeModel:
    """A worker's model: what ``load_weights`` got, and the reload's events in order."""

    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}
        self.events: list[str] = []

    def modules(self):  # (no MoE layer: a reload on CPU drops no kernel)
        return iter(())

    def load_weights(self, weights) -> None:
        self.events.append("load")
        for name, t in weights:
            self.loaded[name] = t.clone()


class FakeCore:
    """vLLM's engine as the engine calls it: ``collective_rpc`` runs the function on every worker with its
    arguments pickled and unpickled (they cross to other processes), one result per worker."""

    def __init__(self, n: int) -> None:
        self.models = [FakeModel() for _ in range(n)]
        self.workers = [SimpleNamespace(model_runner=SimpleNamespace(get_model=lambda m=m: m, model_config="mc"),
                                        device=torch.device("cpu")) for m in self.models]
        self.calls: list[str] = []
        self.sizes: list[int] = []
        self.resets = 0

    def collective_rpc(self, fn, args=()):
        self.calls.append(fn.__name__)
        if args:
            self.sizes.append(sum(t.numel() * t.element_size() for _, t in args[0]))
        return [fn(w, *pickle.loads(pickle.dumps(args))) for w in self.workers]

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.fixture
def engine(tiny_model, monkeypatch):
    """A two-worker engine on a stand-in vLLM (its layerwise reload recorded on each worker's model). The
    stand-in takes the place of ``vllm.model_executor.model_loader.reload`` in ``sys.modules``: importing the
    real one costs ~4 s of vLLM here (``test_vllm_tp.py``, marked slow, reloads through the real one)."""
    reload = ModuleType("vllm.model_executor.model_loader.reload")
    reload.initialize_layerwise_reload = lambda model: model.events.append("begin")
    reload.finalize_layerwise_reload = lambda model, cfg: model.events.append(f"finish {cfg}")
    monkeypatch.setitem(sys.modules, reload.__name__, reload)
    eng = VLLMGenerationEngine.__new__(VLLMGenerationEngine)
    eng.tp, eng.apart, eng.device, eng.devices = 2, True, torch.device("cpu"), (torch.device("cpu"),) * 2
    eng.engine, eng._version, eng._sleeping, eng._threads = FakeCore(2), 0, False, torch.get_num_threads()
    eng._shapes = {n: tuple(p.shape) for n, p in tiny_model.state_dict().items()}
    eng._tied = bool(tiny_model.config.tie_word_embeddings)
    eng._head_copy = True  # (vLLM's Qwen2 has an lm_head: what the stand-in's models stand for)
    eng._names = CheckpointNames(tiny_model)
    return eng


def test_every_worker_loads_every_full_tensor_in_buckets_of_one_reload(engine, tiny_model, monkeypatch):
    monkeypatch.setattr(vllm_tp, "BUCKET_BYTES", 256 << 10)
    state = {n: p.detach() + 1.0 for n, p in tiny_model.state_dict().items()}
    engine.update_weights(state.items(), 3)
    core = engine.engine
    loads = len(core.calls) - 2
    assert loads > 1 and core.calls == ["begin_reload"] + ["load_bucket"] * loads + ["finish_reload"]
    biggest = max(t.numel() * t.element_size() for t in state.values())
    assert all(s <= max(256 << 10, biggest) for s in core.sizes) and sum(core.sizes) >= sum(
        t.numel() * t.element_size() for t in state.values())
    want = dict(state)
    if engine._tied:  # (a tied head goes as lm_head.weight too: vLLM's CPU head is a copy)
        want["lm_head.weight"] = state["model.embed_tokens.weight"]
    for model in core.models:  # every worker: every tensor, whole (its loaders keep its shard)
        assert model.events == ["begin"] + ["load"] * loads + ["finish mc"]
        assert model.loaded.keys() == want.keys()
        for n, t in want.items():
            assert torch.equal(model.loaded[n], t), n
    assert core.resets == 1 and engine.weight_version == 3


def test_a_worker_that_loads_less_than_its_bucket_fails_the_update(engine, tiny_model, monkeypatch):
    monkeypatch.setattr(vllm_tp, "load_bucket", lambda worker, bucket: len(bucket) - 1)
    with pytest.raises(RuntimeError, match="each should load all"):
        engine.update_weights(tiny_model.state_dict().items(), 1)
    assert engine.weight_version == 0


def test_buckets_keep_order_and_bound_their_bytes():
    ts = [(f"t{i}", torch.zeros(n)) for i, n in enumerate([10, 10, 30, 5, 5, 5])]  # float32: 4 bytes each
    got = list(buckets(ts, 80))
    assert [[n for n, _ in b] for b in got] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [n for b in buckets(ts, 1) for n, _ in b] == [n for n, _ in ts]  # larger than the bound: alone
    assert list(buckets([], 80)) == []


def test_the_devices_a_rank_gives_its_engine():
    cpu = torch.device("cpu")
    assert tp_devices(cpu, None, 2) == (cpu, cpu)
    assert tp_devices(torch.device("cuda:2"), None, 2) == (torch.device("cuda:2"), torch.device("cuda:3"))
    assert tp_devices(torch.device("cuda:2"), ["cuda:2", "cuda:5"], 2)[1] == torch.device("cuda:5")
    with pytest.raises(UserError, match=r"tensor_parallel_size=2, but this rollout rank owns 1 device"):
        tp_devices(cpu, ["cpu"], 2)


def test_workers_start_seeing_exactly_the_ranks_gpus_and_none_of_its_group(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")  # the rank's cuda:1 is GPU 5, cuda:2 is GPU 6
    monkeypatch.setenv("LOCAL_RANK", "1")  # (this rank's place among the rollout ranks, not a vLLM worker's)
    monkeypatch.setenv("RANK", "1")
    with worker_env((torch.device("cuda:1"), torch.device("cuda:2"))):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,6"
        assert "LOCAL_RANK" not in os.environ and "RANK" not in os.environ
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    assert os.environ["LOCAL_RANK"] == "1" and os.environ["RANK"] == "1"
    with worker_env((torch.device("cuda:1"),)):  # one device: the worker runs in this process; nothing changes
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"


def test_cpu_workers_start_with_their_share_of_the_ranks_threads_unpinned(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "9")
    with worker_env((torch.device("cpu"),) * 2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert os.environ["OMP_NUM_THREADS"] == str(max(1, torch.get_num_threads() // 2))
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and os.environ["OMP_NUM_THREADS"] == "9"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a user's own binding stays
    with worker_env((torch.device("cpu"),) * 2):
        assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"


def test_heads_that_do_not_split_evenly_are_named_before_vllm_starts(tiny_tokenizer):
    """The tiny shape with 2 heads (of 32 dimensions) over 3 workers: refused before any worker starts."""
    if not vllm_available():
        pytest.skip("needs vLLM")
    from relayrl.engines.generation.vllm_engine import VLLMSpec
    from relayrl.models.tiny import TinyModelConfig, build_tiny

    two_heads = build_tiny(TinyModelConfig(hidden_size=64, intermediate_size=256, num_heads=2), verbose=False)
    with pytest.raises(UserError, match=r"tensor_parallel_size=3: vLLM splits the model's 2 attention heads.*\[1, 2\]"):
        VLLMGenerationEngine(str(two_heads), tiny_tokenizer, spec=VLLMSpec(tensor_parallel_size=3))
