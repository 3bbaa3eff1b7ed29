"""benchmarks/gpu_flex.py: the kernel-option presets resolve to the options and head layout they name (the
kernels themselves run only on a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_flex  # noqa: E402

from relayrl.engines.training import flex  # noqa: E402


def test_relayrl_preset_is_the_engine_default_and_the_others_say_their_head_layout():
    opts, expand = gpu_flex.kernel_options(gpu_flex.PRESETS["relayrl"])
    assert (opts, expand) == (flex.CUDA_KERNEL_OPTIONS, flex.EXPAND_KV)
    assert opts is not flex.CUDA_KERNEL_OPTIONS  # a copy: a variant's options never leak into the engine's
    assert gpu_flex.kernel_options({}) == ({}, False)  # torch's defaults
    old, old_expand = gpu_flex.kernel_options(gpu_flex.PRESETS["tiles-64"])
    assert old == {"BLOCK_M": 64, "BLOCK_N": 64, "IS_DIVISIBLE": False} and not old_expand
    for name, preset in gpu_flex.PRESETS.items():
        if preset:  # each names its head layout, so it means the same whatever relayrl's default is
            assert "EXPAND_KV" in preset, name
            assert "EXPAND_KV" not in gpu_flex.kernel_options(preset)[0], name


def test_presets_parse_by_name_or_json_and_unknown_names_are_refused():
    got = gpu_flex.parse_presets("relayrl,bwd-n1-32")
    assert list(got) == ["relayrl", "bwd-n1-32"]
    assert gpu_flex.parse_presets('mine={"BLOCK_M": 32}') == {"mine": {"BLOCK_M": 32}}
    with pytest.raises(SystemExit, match="flex preset 'nope'"):
        gpu_flex.parse_presets("relayrl,nope")
