"""User reward functions: found by path (``relayrl.plugins``), signature checked at load, output checked per call.

A user function follows :class:`RewardFn`: it takes the whole batch
(``prompts``, ``responses``, ``answers``, equal lengths) and returns one float
per row. A function that also takes keyword arguments gets a dataset row's other
fields by name, one list per field (:func:`column_params`: every field for
``**kwargs``, the named ones otherwise; ``None`` where a row lacks the field), as TRL passes a
dataset's extra columns. Loading rejects what cannot work before any training starts (missing
module or attribute, a non-callable, a signature that cannot take the three
lists); each call's result is checked (length, numeric, finite) and a breach
raises :class:`RewardError` naming the function. :func:`call_within` gives a call a time limit
(``reward.timeout_s``).
"""

from __future__ import annotations

import inspect
import math
import numbers
import threading
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

from relayrl.engines.reward.config import RewardError
from relayrl.plugins import resolve

__all__ = ["RewardFn", "load_reward_fn", "column_params", "column_kwargs", "check_rewards", "call_within", "Overtime"]

POSITIONAL = ("prompts", "responses", "answers")
"""What a user function takes positionally: a dataset field of one of these names is not passed by keyword."""


@runtime_checkable
class RewardFn(Protocol):
    """The contract of a user reward function (batched)."""

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        """One finite float per row: ``len(result) == len(responses)``. Keyword parameters after these (or
        ``**kwargs``) receive the rows' other dataset fields (:func:`column_params`)."""
        ...


def load_reward_fn(path: str) -> RewardFn:
    """Import the reward function at ``path`` and check it can be called as ``fn(prompts, responses, answers)``.

    ``path`` is ``"package.module:function"`` (attribute paths like
    ``module:Class.method`` allowed), ``"package.module.function"`` or ``"path/to/file.py:function"``
    (:mod:`relayrl.plugins`). Raises
    :class:`RewardError` with the reason when the module or attribute is missing,
    the object is not callable (or is a class), or its signature cannot bind
    three positional arguments.
    """
    fn = resolve(path, f"reward function {path!r}", RewardError, shape="package.module:function")
    if inspect.isclass(fn):
        raise RewardError(
            f"reward function {path!r} is a class; point at a function, or at an instance with __call__"
        )
    if not callable(fn):
        raise RewardError(f"reward function {path!r} is a {type(fn).__name__}, not callable")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return fn  # builtins without a signature: the per-call check still applies
    try:
        sig.bind([], [], [])
    except TypeError as e:
        raise RewardError(
            f"reward function {path!r} has signature {sig}, which cannot be called as "
            f"fn(prompts, responses, answers): {e}"
        ) from None
    return fn


def column_params(fn: Callable) -> frozenset[str] | None:
    """The dataset fields ``fn`` takes by keyword: ``None`` for every field (it has ``**kwargs``), else its
    parameters after the first three that can be passed by keyword (empty: it takes none)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return frozenset()  # builtins without a signature: the three lists only
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
    return frozenset(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                     and p not in positional)


def column_kwargs(takes: frozenset[str] | None, columns: Sequence[dict | None]) -> dict[str, list]:
    """The keyword arguments of one call: each field of the rows' ``columns`` (a row's other dataset fields,
    ``None`` for a row with none) that the function takes (:func:`column_params`), as one list over the rows
    (``None`` where a row lacks it). Fields named like the three positional lists are left out."""
    rows = [c or {} for c in columns]
    names = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in POSITIONAL]
    if takes is not None:
        names = [k for k in names if k in takes]
    return {k: [r.get(k) for r in rows] for k in names}


def check_rewards(result: Any, n: int, fn_name: str, what: str = "reward function") -> list[float]:
    """Validate a reward source's result: ``n`` finite real numbers; return them as floats. Errors name it as
    ``f"{what} {fn_name}"`` (``what=""``: ``fn_name`` alone, e.g. "reward model DIR").

    Accepts a list or tuple, a 1-D numpy array or a 1-D torch tensor.
    """
    fn_name = f"{what} {fn_name}".strip()
    if hasattr(result, "tolist") and hasattr(result, "ndim"):  # numpy array, torch tensor
        if result.ndim != 1:
            raise RewardError(
                f"{fn_name} returned an array of shape {tuple(result.shape)}; expected {n} values (1-D)"
            )
        result = result.tolist()
    if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
        hint = ""
        if isinstance(result, numbers.Real) and what == "reward function":  # scores one response (verl's shape)
            hint = (": it is called once with lists (prompts, responses, answers), not once per response; wrap a "
                    "per-response function as [f(p, r, a) for p, r, a in zip(prompts, responses, answers)]")
        raise RewardError(f"{fn_name} returned {type(result).__name__}; expected a list of {n} floats{hint}")
    if len(result) != n:
        raise RewardError(f"{fn_name} returned {len(result)} values for {n} responses; expected {n}")
    out = []
    for i, v in enumerate(result):
        if not isinstance(v, numbers.Real):
            raise RewardError(f"{fn_name} returned {type(v).__name__} {v!r} at index {i}; expected a float")
        v = float(v)
        if not math.isfinite(v):
            raise RewardError(f"{fn_name} returned {v} at index {i}; rewards must be finite")
        out.append(v)
    return out


class Overtime(Exception):
    """A call ran past its time limit; ``thread`` still runs it (abandoned, not stopped)."""

    def __init__(self, thread: threading.Thread) -> None:
        super().__init__(f"{thread.name} ran past its time limit")
        self.thread = thread


def call_within(limit: float, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on a daemon thread, its result (or its exception) once it returns within ``limit``
    seconds; else :class:`Overtime`. Python cannot interrupt a thread: an overtime call is abandoned and runs
    on until ``fn`` returns (its result is dropped); being a daemon, it does not keep the process alive."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def call() -> None:
        try:
            box["out"] = fn(*args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e
        finally:
            done.set()

    t = threading.Thread(target=call, name="reward-call", daemon=True)
    t.start()
    if not done.wait(limit):
        raise Overtime(t)
    if "error" in box:
        raise box["error"]
    return box["out"]
