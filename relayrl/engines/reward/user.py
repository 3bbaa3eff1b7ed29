"""User reward functions: found by path (``relayrl.plugins``), signature checked at load, output checked per call.

A user function follows :class:`RewardFn`: it takes the whole batch
(``prompts``, ``responses``, ``answers``, equal lengths) and returns one float
per row. A function that also takes keyword arguments gets the rows' dataset
fields by name, one list per field (every field but the prompt for ``**kwargs``, the
named ones otherwise; ``None`` where a row lacks the field). A function written for TRL's
``GRPOTrainer`` (a parameter named ``completions`` or ``completion_ids``) is called as TRL calls it, every
argument by keyword: ``prompts`` and ``completions`` (chat messages where the dataset's prompt was chat),
``completion_ids`` where the caller has them, and the fields; a ``compute_score`` written for verl (a
parameter named ``solution_str``) as verl calls it, once per response (:class:`CallShape`). ``None`` for a
row is TRL's "not this function's row". Loading rejects what cannot work before any training starts (missing
module or attribute, a non-callable, a signature that cannot take the three
lists); each call's result is checked (length, numeric, finite) and a breach
raises :class:`RewardError` naming the function. :func:`call_within` gives a call a time limit
(``reward.timeout_s``).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import numbers
import statistics
import threading
from typing import Any, Callable, Literal, NamedTuple, Protocol, Sequence, runtime_checkable

import numpy as np

from relayrl.data.truth import truth_value
from relayrl.engines.reward.config import RewardError
from relayrl.engines.reward.extra import ExtraError, json_value
from relayrl.plugins import resolve

log = logging.getLogger(__name__)

FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: rewards train as float32 tensors, so a larger one becomes inf there (and its square
overflows the float metrics)."""

__all__ = ["RewardFn", "load_reward_fn", "UserFn", "load_user_fns", "CallShape", "call_shape", "with_ids",
           "with_progress", "trainer_state", "standalone_refusal", "fn_metrics", "fn_rows", "check_rewards",
           "call_within", "Overtime"]

NOT_FIELDS = frozenset({"prompt", "prompts", "responses", "answers", "completions", "completion", "completion_ids",
                        "trainer_state", "log_metric", "log_extra"})
"""Names that are never passed as a dataset field: the prompt comes as ``prompts``, and the others name the
call's own lists (TRL leaves out ``prompt``, ``completion`` and ``completion_ids`` likewise). A row's
``completion_ids`` (its response's token ids, where the caller has them) and the training's progress
(``trainer_state``, :func:`with_progress`) go to a TRL-shaped function that takes them, as TRL passes them;
``log_metric`` is the call's metric logger and ``log_extra`` its logger of per-row columns
(:meth:`CallShape.call`)."""

CALL_ARGS = frozenset({"completion_ids", "trainer_state", "log_metric", "log_extra"})
"""What TRL passes a reward function besides the prompts, the completions and the dataset's fields."""


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
    first = [q.name for q in sig.parameters.values() if q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD)]
    if shape.style == "relayrl" and first[:1] == ["queries"]:
        # (called as fn(prompts, responses, answers) it would read each prompt as its query and each response as
        # its prompt, silently)
        raise RewardError(f"reward function {path!r} has signature {sig}: OpenRLHF's reward_func(queries, prompts, "
                          f"labels), which takes each prompt with its response as one text; relayrl calls "
                          f"fn(prompts, responses, answers) with the response apart and wants one float per row "
                          f"(not OpenRLHF's dict): wrap it, e.g. def score(prompts, responses, answers): "
                          f"return [float(x) for x in reward_func([p + r for p, r in zip(prompts, responses)], "
                          f"prompts, answers)['rewards']] (docs/migrating.md)")
    calls = {"relayrl": (([], [], []), {}, "fn(prompts, responses, answers)"),
             "trl": ((), {"prompts": [], "completions": [], **{k: [] for k in shape.required},
                          **{k: None for k in CALL_ARGS if k in sig.parameters}},
                     "fn(prompts=..., completions=..., **fields) as TRL calls it (it has a parameter completions)"),
             "verl": ((), {k: None for k in shape.takes or VERL},
                      "fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) as verl calls "
                      "compute_score (it has a parameter solution_str)"),
             "verl_batch": ((), {f"{k}s": [] for k in shape.takes or VERL},
                            "fn(data_sources=..., solution_strs=..., ground_truths=..., extra_infos=...) as verl "
                            "calls a batched compute_score (it has a parameter solution_strs)")}
    args, kwargs, called = calls[shape.style]
    try:
        sig.bind(*args, **kwargs)
    except TypeError as e:
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


VERL = ("data_source", "solution_str", "ground_truth", "extra_info")
"""What verl passes a ``compute_score`` function, per response (its batched form: the plurals, lists)."""


class CallShape(NamedTuple):
    """How a user function is called (:func:`call_shape`), by its parameters' names:

    * ``relayrl``: ``(prompts, responses, answers)`` by position, texts, and the fields it takes by keyword;
    * ``trl`` (a parameter ``completions``): TRL's ``GRPOTrainer`` reward function, every argument by keyword,
      ``prompts`` as the dataset had them (chat messages or text), ``completions`` likewise
      (``[{"role": "assistant", "content": ...}]`` for a chat prompt) and the fields;
    * ``verl`` (a parameter ``solution_str``): verl's ``compute_score``, once per response, by keyword:
      ``data_source`` and ``extra_info`` (those fields of the row, else None), ``solution_str`` (the
      response) and ``ground_truth`` (the answer as the file has it: a
      :class:`~relayrl.data.truth.GroundTruth`'s value, an int or a dict, else the text); a float, or a dict whose
      ``"score"`` is the reward;
    * ``verl_batch`` (``solution_strs``): its batched form, the same as lists under the plural names.
    """

    style: Literal["relayrl", "trl", "verl", "verl_batch"]
    takes: frozenset[str] | None
    """The names it takes by keyword (dataset fields; verl's: of :data:`VERL`); ``None``: every one
    (``**kwargs``)."""
    required: frozenset[str]
    """The dataset fields it needs (TRL's shape: parameters without a default; relayrl's loads only with
    defaults, verl's names no field)."""

    def arguments(self, prompts: list[str], responses: list[str], answers: list,
                  fields: Sequence[dict | None]) -> tuple[tuple, dict[str, list]]:
        """``(args, kwargs)`` of one call on the rows (verl's shape: every keyword a list over the rows);
        ``fields``: each row's dataset fields (``None``: the row has none, as a built-in task's), its prompt
        under ``"prompt"``."""
        rows = [f or {} for f in fields]
        if self.style.startswith("verl"):
            truths = [truth_value(a) for a in answers]  # (the ground truth as the file has it)
            values = dict(zip(VERL, ([r.get("data_source") for r in rows], responses, truths,
                                     [r.get("extra_info") for r in rows])))
            return (), {k: v for k, v in values.items() if self.takes is None or k in self.takes}
        names = [k for k in dict.fromkeys(k for r in rows for k in r) if k not in NOT_FIELDS]
        if self.takes is not None:
            names = [k for k in names if k in self.takes]
        kwargs = {k: [r.get(k) for r in rows] for k in names}
        if self.style == "relayrl":
            return (prompts, responses, answers), kwargs
        asked = [r.get("prompt", p) for r, p in zip(rows, prompts)]
        done = [[{"role": "assistant", "content": t}] if isinstance(a, list) else t for a, t in zip(asked, responses)]
        if self.takes_name("completion_ids") and any("completion_ids" in r for r in rows):
            kwargs["completion_ids"] = [r.get("completion_ids") for r in rows]  # (the response's token ids)
        if self.takes_name("trainer_state") and rows and "trainer_state" in rows[0]:
            kwargs["trainer_state"] = rows[0]["trainer_state"]  # (one object for the call, as TRL's)
        return (), {"prompts": asked, "completions": done, **kwargs}

    def takes_name(self, name: str) -> bool:
        """Whether a TRL-shaped function takes ``name`` (by name, or with ``**kwargs``)."""
        return self.style == "trl" and (self.takes is None or name in self.takes)

    def call(self, fn: Callable, args: tuple, kwargs: dict[str, list],
             log_metric: Callable[[str, float], None] | None = None,
             log_extra: Callable[[str, list], None] | None = None) -> Any:
        """``fn``'s scores of the rows (:meth:`arguments`): one call, or one per row for verl's shape; a verl
        result's dicts become their ``"score"``. An ``async def`` function runs on an event loop of its own,
        verl's per-response calls all at once (a function that awaits a server or a sandbox).

        ``log_metric(name, value)`` collects what the function reports: a TRL-shaped function that takes
        ``log_metric`` gets it (TRL's metric logger), and a verl result's other numeric keys are reported
        through it, row by row (verl's ``reward_extra_info``). ``log_extra(column, values)`` likewise goes to a
        TRL-shaped function that takes it (TRL's per-completion columns: :mod:`relayrl.engines.reward.extra`)."""
        if self.style == "verl":
            out = [fn(**{k: v[i] for k, v in kwargs.items()}) for i in range(len(kwargs["solution_str"]))]
            if out and inspect.isawaitable(out[0]):
                out = asyncio.run(_gathered(out))
            return _verl_scores(fn, out, log_metric, log_extra)
        if self.style == "verl_batch":
            args, kwargs = (), {f"{k}s": v for k, v in kwargs.items()}
        else:
            given = {"log_metric": log_metric, "log_extra": log_extra}
            kwargs = {**kwargs, **{k: f for k, f in given.items() if f is not None and self.takes_name(k)}}
        out = fn(*args, **kwargs)
        if inspect.isawaitable(out):
            out = asyncio.run(_gathered([out]))[0]
        if self.style == "verl_batch" and isinstance(out, (list, tuple)):
            return _verl_scores(fn, out, log_metric, log_extra)
        return out


async def _gathered(awaitables: list) -> list:
    """The awaitables' results, awaited together (the scoring threads run no event loop: a new one runs them)."""
    return list(await asyncio.gather(*awaitables))


def _verl_scores(fn: Callable, out: Sequence, log_metric: Callable[[str, float], None] | None,
                 log_extra: Callable[[str, list], None] | None) -> list:
    """The rewards of verl results ``out`` (a float, or a dict whose ``"score"`` is the reward) and what the
    dicts hold beside it, verl's ``reward_extra_info``: each number or flag goes to ``log_metric`` (a flag as 0/1,
    whose mean is a rate: verl's DAPO scorer returns ``acc`` as a bool), and every key to ``log_extra`` as a
    column of the samples (``None`` in a row without it), as verl dumps them with its generations: the
    extracted answer, ``"pred"``, beside the response. A key with a value JSON cannot hold (an object) is no
    column: it is dropped, said once per key and function."""
    scores, extras = [], {}
    for i, x in enumerate(out):
        if not isinstance(x, dict):
            scores.append(x)
            continue
        if "score" not in x:
            raise RewardError(f"returned a dict without a 'score' key at index {i} ({sorted(map(str, x))}); verl's "
                              f"compute_score returns a float or a dict with the reward under 'score'")
        scores.append(x["score"])
        for k, v in x.items():
            if k == "score":
                continue
            if log_metric is not None and isinstance(v, (numbers.Real, np.bool_)):
                log_metric(k, float(v))
            extras.setdefault(str(k), {})[i] = v
    if log_extra is None:
        return scores
    for key, by_row in extras.items():
        try:
            values = [json_value(by_row[i], key, i) if i in by_row else None for i in range(len(out))]
        except ExtraError as e:
            _say_dropped(fn, key, e)
            continue
        log_extra(key, values)
    return scores


_dropped: set[tuple[str, str]] = set()
_dropped_lock = threading.Lock()


def _say_dropped(fn: Callable, key: str, why: ExtraError) -> None:
    """Say once per run (process) that ``fn``'s verl key ``key`` is not kept, and why."""
    name = getattr(fn, "__qualname__", type(fn).__name__)
    try:
        name = f"{inspect.getfile(fn)}:{name}"  # (as reward.user_fn names it)
    except TypeError:  # (a callable instance, a builtin)
        name = f"{getattr(fn, '__module__', '?')}.{name}"
    with _dropped_lock:
        if (name, key) in _dropped:
            return
        _dropped.add((name, key))
    log.warning("reward function %s returned %r beside 'score' with a value JSON cannot hold (%s); the key is "
                "dropped from the samples (said once per key): return it as str(value) to keep it", name, key,
                str(why).split(": ", 1)[-1].split("; expected")[0])


def call_shape(fn: Callable) -> CallShape:
    """How ``fn`` is called, read from its parameters' names (a builtin without a signature: relayrl's three
    lists only)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return CallShape("relayrl", frozenset(), frozenset())
    names = {p.name for p in params}
    every = any(p.kind is p.VAR_KEYWORD for p in params)
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if "solution_str" in names or "solution_strs" in names:
        batch = "solution_strs" in names
        takes = frozenset(k for k in VERL if (f"{k}s" if batch else k) in names)
        return CallShape("verl_batch" if batch else "verl", None if every else takes, frozenset())
    style = "trl" if names & {"completions", "completion_ids"} else "relayrl"
    if style == "relayrl":  # the first three are the lists, by position
        skip = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:3]
        named = [p for p in named if p not in skip]
    passed = NOT_FIELDS - CALL_ARGS if style == "trl" else NOT_FIELDS  # (TRL passes the token ids and more)
    named = [p for p in named if p.name not in passed]
    takes = None if every else frozenset(p.name for p in named)
    # (completion_ids come from the caller, not the dataset: a call without them fails as the function says)
    required = frozenset(p.name for p in named if style == "trl" and p.default is p.empty and p.name not in NOT_FIELDS)
    return CallShape(style, takes, required)


def fn_metrics(each: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, float]:
    """``reward/fn/NAME_mean`` and ``_std`` of several user functions from each row's score by each (``[N][K]``,
    NaN: the function returned ``None`` for the row, or the row failed): each one's over the rows it scored
    (TRL's ``rewards/NAME/mean``, a nanmean), 0 where it scored none (:func:`fn_rows` counts them)."""
    out: dict[str, float] = {}
    for k, name in enumerate(names):
        xs = [x[k] for x in each if x[k] == x[k]]
        out[f"reward/fn/{name}_mean"] = statistics.fmean(xs) if xs else 0.0
        out[f"reward/fn/{name}_std"] = statistics.pstdev(xs) if xs else 0.0
    return out


def fn_rows(each: Sequence[Sequence[float]], names: Sequence[str]) -> dict[str, int]:
    """The rows each of :func:`fn_metrics`' means and stds is over: what a step weighs a call's value by."""
    counts = [sum(x[k] == x[k] for x in each) for k in range(len(names))]
    return {f"reward/fn/{name}_{s}": c for name, c in zip(names, counts) for s in ("mean", "std")}


def trainer_state(done: int, total: int):
    """TRL's view of the training's progress, as its reward functions read it: a ``transformers.TrainerState``
    with ``global_step`` the RL steps done (``done``) and ``max_steps`` the run's (``total``)."""
    from transformers import TrainerState

    return TrainerState(global_step=done, max_steps=total)


def with_progress(fields: Sequence[dict | None], state: Any) -> list[dict]:
    """Each row's dataset fields with the training's progress under ``trainer_state`` (:func:`trainer_state`;
    passed once to a TRL-shaped function that takes it)."""
    return [{**(f or {}), "trainer_state": state} for f in fields]


def with_ids(fields: Sequence[dict | None], token_ids: Sequence) -> list[dict]:
    """Each row's dataset fields (``None``: none) with its response's token ids under ``completion_ids``, which
    a TRL-shaped function may take (:meth:`CallShape.arguments`)."""
    return [{**(f or {}), "completion_ids": ids.tolist() if hasattr(ids, "tolist") else list(ids)}
            for f, ids in zip(fields, token_ids)]


def check_rewards(result: Any, n: int, fn_name: str, what: str = "reward function",
                  none_ok: bool = False) -> list:
    """Validate a reward source's result: ``n`` finite real numbers within float32's range; return them as
    floats. Errors name it as ``f"{what} {fn_name}"`` (``what=""``: ``fn_name`` alone, e.g. "reward model
    DIR"). ``none_ok``: ``None`` is kept (a user function's "this row is not mine", as TRL's reward functions
    say it).

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
        if v is None and none_ok:
            out.append(None)
            continue
        v = _scalar(v)
        if not isinstance(v, numbers.Real):
            raise RewardError(f"{fn_name} returned {type(v).__name__} {v!r} at index {i}; expected a float")
        v = float(v)
        if not math.isfinite(v) or abs(v) > FLOAT32_MAX:
            beyond = f", beyond float32's range (+-{FLOAT32_MAX:.1e}, as rewards train)" if math.isfinite(v) else ""
            raise RewardError(f"{fn_name} returned {v} at index {i}{beyond}; rewards must be finite")
        out.append(v)
    return out


def _scalar(v: Any) -> Any:
    """A numpy scalar or a 0-d array or tensor as the Python number it holds (``np.bool_``: a bool), else ``v``."""
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        return v.item()
    return v


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


def standalone_refusal(fns: Sequence[UserFn]) -> str | None:
    """Why ``fns`` cannot score outside a training run (``relayrl eval``): the first whose ``trainer_state`` has no
    default, refused before the model loads (it raised a ``TypeError`` part-way through); None when none."""
    for u in fns:
        try:
            p = inspect.signature(u.fn).parameters.get("trainer_state")
        except (TypeError, ValueError):  # (a builtin without a signature)
            continue
        if p is not None and p.default is inspect.Parameter.empty:
            return (f"reward function {u.path} needs trainer_state, which relayrl eval cannot give: no training run "
                    f"is in progress; give the parameter a default (trainer_state=None) and score without it then")
    return None
