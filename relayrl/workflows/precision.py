"""Each role's precision from the ``model`` and ``rollout`` sections: weight dtype, compute dtype and whether
its output head computes in float32 (``model.head_fp32``). The workers take these as constructor arguments."""

from __future__ import annotations

__all__ = ["role_precision"]


def role_precision(model, rollout=None) -> dict[str, dict]:
    """Weight and compute dtypes of each role from ``model`` (``ModelConfig``) and ``rollout`` (``RolloutConfig``),
    and ``head_fp32`` for every role (a critic's or reward model's worker takes it and leaves its value head as it
    is: that head is not an LM head).

    Trained roles (actor, critic) keep float32 weights and compute in ``model.dtype`` (mixed precision),
    unless ``model.pure_low_precision``; frozen roles (reference) and the rollout hold their weights in the
    compute dtype, since they are never updated. With LoRA the trained roles' base weights are frozen too: they
    load in the compute dtype, and peft keeps the adapters (the weights that train) in float32.
    """
    trained = model.dtype if model.pure_low_precision or model.lora.enabled else "float32"
    head = model.head_fp32
    return {
        "trained": dict(dtype=trained, compute_dtype=model.dtype, head_fp32=head),
        "frozen": dict(dtype=model.dtype, head_fp32=head),
        "rollout": dict(dtype=(rollout.dtype if rollout is not None and rollout.dtype else model.dtype),
                        head_fp32=head),
    }
