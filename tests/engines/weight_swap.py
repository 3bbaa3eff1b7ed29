"""A partial-rollout weight swap for the decode tests: new weights land between two decode steps."""
from __future__ import annotations

from typing import Callable


def swap_at(eng, weights: list, step: int | None, version: int = 1) -> Callable[[], bool]:
    """A ``between`` hook for ``eng.generate``: loads ``weights`` (as ``version``) before decode step ``step``
    (None: never) and reports that it did."""
    calls = [0]

    def between() -> bool:
        calls[0] += 1
        if step is not None and calls[0] == step:
            eng.update_weights(weights, version=version)
            return True
        return False
    return between
