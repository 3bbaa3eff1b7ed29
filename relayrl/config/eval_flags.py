"""``relayrl eval``'s options that a run config also holds, by the config key that sets each: the CLI refuses
such an option beside ``--recipe`` (the config's key decides), and an error about a config key names the flag
that sets it for ``relayrl eval`` (:func:`eval_flag`). One table for both (the data layer cannot import the
CLI)."""

from __future__ import annotations

__all__ = ["EVAL_FLAGS", "eval_flag"]

EVAL_FLAGS = {  # dest: (its value without --recipe when not given, the run config key that sets it with --recipe)
    "task": (None, "data.task"), "task_options": (None, "data.task_options"), "data": (None, "data.eval_path"),
    "format": (None, "data.format"), "prompt_key": ("prompt", "data.prompt_key"),
    "answer_key": ("answer", "data.answer_key"), "verifier": ("math", "reward.verifier"),
    "user_fn": (None, "reward.user_fn"), "user_weights": (None, "reward.user_weights"), "size": (200, "eval.size"),
    "k": (1, "eval.k"), "temperature": (1.0, "eval.temperature"),
    "top_p": (1.0, "eval.top_p"), "top_k": (0, "eval.top_k"), "min_p": (0.0, "eval.min_p"),
    "max_new_tokens": (16, "eval.max_new_tokens"),
    "dtype": ("float32", "model.dtype"), "device": ("auto", "model.device"), "seed": (0, "run.seed"),
    "chat_template": (None, "model.chat_template"), "chat_template_kwargs": (None, "data.chat_template_kwargs"),
    "think_budget": (None, "rollout.interrupt.after_tokens"), "long_prompts": ("fail", "data.long_prompts"),
}
"""The ``relayrl eval`` options that a run config holds: with ``--recipe`` the config's key decides (given as an
override), so the option is refused rather than one of the two silently ignored."""


def eval_flag(key: str) -> str | None:
    """The ``relayrl eval`` flag that sets the config key ``key`` (``data.answer_key``: ``--answer-key``), or None."""
    return next(("--" + dest.replace("_", "-") for dest, (_, k) in EVAL_FLAGS.items() if k == key), None)
