"""Names that moved to a module of their own are still importable from where they were, as the same objects (a
user's ``from relayrl.data.datasets import encode_prompt`` keeps working, and nothing is defined twice)."""

from __future__ import annotations

import importlib

import pytest

MOVED = {
    "relayrl.data.datasets": {
        "relayrl.data.dataset_config": ("DatasetConfig", "key_options"),
        "relayrl.data.prompts": ("encode_prompt", "prompt_identity", "render_plain", "render_prompt"),
        "relayrl.data.rows": ("CHAT_ROLES",),
    },
    "relayrl.cli.main": {
        "relayrl.cli.parser": ("build_parser", "builtin_tasks", "parse_args"),
        "relayrl.cli.commands": ("DEMO_MARK", "RECIPES", "cmd_demo", "cmd_dock", "cmd_plot", "cmd_serve",
                                 "cmd_train", "resolved_config"),
        "relayrl.cli.eval_command": ("cmd_eval",),
    },
    "relayrl.config.algorithm": {
        "relayrl.config.algorithm_sections": ("CorrectionConfig", "CovConfig", "DistillConfig", "OnlineDPOConfig",
                                              "SapoConfig", "VespoConfig"),
    },
    "relayrl.config.schema": {"relayrl.config.algorithm_sections": ("CorrectionConfig", "DistillConfig")},
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_moved_name_is_the_same_object_at_its_old_path(old):
    was = importlib.import_module(old)
    for new, names in MOVED[old].items():
        home = importlib.import_module(new)
        for name in names:
            assert getattr(was, name) is getattr(home, name), f"{old}.{name} is not {new}.{name}"
    for name in getattr(was, "__all__", ()):
        assert hasattr(was, name), f"{old}.__all__ names {name}, which it lacks"
