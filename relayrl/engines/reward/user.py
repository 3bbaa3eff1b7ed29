"""User reward functions: found by path (``relayrl.plugins``), signature checked at load, output checked per call.

A user function follows :class:`RewardFn`: it takes the whole batch
(``prompts``, ``responses``, ``answers``, equal lengths) and returns one float
per row. A function that also takes keyword arguments gets the rows' dataset
fields by name, one list per field (every field but the prompt for ``**kwargs``, the
named ones otherwise; ``None`` where a row lacks the field). A function written for TRL's
``GRPOTrainer`` (a parameter named ``completions``) is called as TRL calls it, every argument by keyword:
``prompts`` and ``completions`` (chat messages where the dataset's prompt was chat) and the fields
(:class:`CallShape`). Loading rejects what cannot work before any training starts (missing
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
from typing import Any, Callable, NamedTuple, Protocol, Sequence, runtime_checkable

from relayrl.engines.reward.config import RewardError
from relayrl.plugins import resolve

__all__ = ["RewardFn", "load_reward_fn", "UserFn", "load_user_fns", "CallShape", "call_shape", "check_rewards",
           "call_within", "Overtime"]

NOT_FIELDS = frozenset({"prompt", "prompts", "responses", "answers", "completions", "completion", "completion_ids"})
"""Names that are never passed as a dataset field: the prompt comes as ``prompts``, and the others name the
call's own lists (TRL leaves out ``prompt``, ``completion`` and ``completion_ids`` likewise)."""


@runtime_checkable
class RewardFn(Protocol):
    """The contract of a user reward function (batched)."""

    def __call__(self, prompts: list[str], responses: list[str], answers: list[str | None]) -> list[float]:
        """One finite float per row: ``len(result) == len(responses)``. Keyword parameters after these (or
        ``**kwargs``) receive the rows' dataset fields (:class:`CallShape`)."""
        ...


def load_reward_fn(path: str) -> RewardFn:
    """Import the reward function at ``path`` and check it can be called as ``fn(prompts, responses, answers)``.

    ``path`` is ``"package.module:function"`` (attribute paths like
    ``module:Class.method`` allowed), ``"package.module.function"`` or ``"path/to/file.py:function"``
    (:mod:`relayrl.plugins`). Raises
    :class:`RewardError` with the reason when the module or attribute is missing,
    the object is not callable (or is a class), or its signature cannot bind
    three positional arguments (TRL's shape, :class:`CallShape`: ``prompts`` and ``completions`` by keyword).
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
    shape = call_shape(fn)
    try:
        if shape.trl:
            sig.bind(prompts=[], completions=[], **{k: [] for k in shape.required})
        else:
            sig.bind([], [], [])
    except TypeError as e:
        called = ("fn(prompts=..., completions=..., **fields) as TRL calls it (it has a parameter named "
                  "completions)" if shape.trl else "fn(prompts, responses, answers)")
        raise RewardError(f"reward function {path!r} has signature {sig}, which cannot be called as {called}: "
                          f"{e}") from None
    return fn


class UserFn(NamedTuple):
    """One user reward function of a run (``reward.user_fn``, or one of its list)."""

    path: str
    """As configured (a file path made absolute): what errors name."""
    fn: RewardFn
    shape: "CallShape"
    weight: float
    """Its weight in the verifier's score (``reward.user_weights``)."""
    name: str
    """Its name in ``reward/fn/NAME_mean``: the function's own, numbered when two share one."""


def load_user_fns(paths: Sequence[str], weights: Sequence[float] | None = None) -> list[UserFn]:
    """Load each function (:func:`load_reward_fn`) with its weight (1 each without ``weights``)."""
    fns = [load_reward_fn(p) for p in paths]
    names = [getattr(f, "__name__", None) or p.rsplit(":", 1)[-1].rsplit(".", 1)[-1] for f, p in zip(fns, paths)]
    names = [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]
    weights = [1.0] * len(fns) if weights is None else [float(w) for w in weights]
    return [UserFn(p, f, call_shape(f), w, n) for p, f, w, n in zip(paths, fns, weights, names)]


class CallShape(NamedTuple):
    """How a user function is called (:func:`call_shape`)."""

    trl: bool
    """TRL's shape (a parameter named ``completions``): every argument by keyword, ``prompts`` as the dataset
    had them (chat messages or text) and ``completions`` likewise (``[{"role": "assistant", "content": ...}]``
    for a chat prompt); else relayrl's: ``(prompts, responses, answers)`` by position, texts."""
    takes: frozenset[str] | None
    """The dataset fields it takes by keyword; ``None``: every field (it has ``**kwargs``)."""
    required: frozenset[str]
    """Of those, the ones without a default (TRL's shape only: relayrl's loads only with defaults)."""

    def arguments(self, prompts: list[str], responses: list[str], answers: list,
                  fields: Sequence[dict | None]) -> tuple[tuple, dict[str, list]]:
        """``(args, kwargs)`` of one call on the rows; ``fields``: each row's dataset fields (``None``: the row
        has none, as a built-in task's), its prompt under ``"prompt"``."""
        rows = [f or {} for f in fields]
        names = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in NOT_FIELDS]
        if self.takes is not None:
            names = [k for k in names if k in self.takes]
        kwargs = {k: [r.get(k) for r in rows] for k in names}
        if not self.trl:
            return (prompts, responses, answers), kwargs
        asked = [r.get("prompt", p) for r, p in zip(rows, prompts)]
        done = [[{"role": "assistant", "content": t}] if isinstance(a, list) else t for a, t in zip(asked, responses)]
        return (), {"prompts": asked, "completions": done, **kwargs}


def call_shape(fn: Callable) -> CallShape:
    """How ``fn`` is called, read from its signature (a builtin without one: relayrl's three lists only)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return CallShape(False, frozenset(), frozenset())
    trl = any(p.name == "completions" for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not trl:  # the first three are the lists, by position
        skip = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
        named = [p for p in named if p not in skip]
    named = [p for p in named if p.name not in NOT_FIELDS]
    takes = None if any(p.kind is p.VAR_KEYWORD for p in params) else frozenset(p.name for p in named)
    required = frozenset(p.name for p in named if trl and p.default is p.empty)
    return CallShape(trl, takes, required)


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
