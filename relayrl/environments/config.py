"""Configuration of multi-turn episodes (the ``env`` section) and the loading of environments and tools.

User environments and tools load by dotted path (``package.module:attribute``) as user reward functions do
(:mod:`relayrl.engines.reward.user`), and their contract is checked when the run starts, before any
worker generates: an environment factory is called once and the object it makes must have ``reset(problem)``
and ``step(action)``; a tool must have a ``name``, a ``description`` and take one ``arguments`` dict.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from relayrl.data.tasks import Problem
from relayrl.engines.reward.config import RewardConfig
from relayrl.environments.base import EnvFactory, Environment
from relayrl.environments.sandbox import SandboxConfig, check_available
from relayrl.environments.tools import (BUILTIN_TOOLS, FinalScore, FunctionTool, Tool, ToolEnvironment,
                                        chat_tool_turn)
from relayrl.errors import UserError
from relayrl.plugins import absolute_file, resolve

if TYPE_CHECKING:  # torch: the episode runner; this module is read while a recipe is validated
    from relayrl.environments.episodes import EpisodeLimits

__all__ = ["EnvConfig", "EnvLoadError", "EpisodeSpec", "load_tool", "load_tools", "load_env_factory",
           "build_env_factory"]


class EnvLoadError(UserError, ValueError):
    """An environment or tool named in the config cannot be loaded or breaks its contract."""


class EnvConfig(BaseModel):
    """Multi-turn episodes: which environment, its tools and the per-episode limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str | None = Field(None, description="null: single-turn (one response per prompt, scored by reward.*); "
                             "'tools': the built-in tool environment (env.tools, final answer scored by the "
                             "reward verifier); or 'package.module:factory' (or 'path/to/file.py:factory') of a user "
                             "environment")
    tools: list[str] = Field(default_factory=lambda: ["calculator"], description="env.name=tools: built-in "
                             "tools (calculator, python) or 'package.module:attribute' (or "
                             "'path/to/file.py:attribute') of user tools")
    tools_in_prompt: bool = Field(True, description="env.name=tools: describe the tools to the model through "
                                  "the chat template's tools list (as TRL does), for prompts that are chat "
                                  "messages; false: the prompt as written")
    tool_results: Literal["tags", "chat"] = Field(
        "tags", description="env.name=tools: how a tool's result comes back. tags: <result>...</result> (or "
        "<error>) inside the model's turn; chat: as the chat template renders a tool message (the model's turn "
        "closes, a tool turn with the result, a new assistant turn opens), the form an instruct model learned "
        "with its template's tools")
    tool_tag: str = Field("tool", description="the tag of a tool call, <TAG>{json}</TAG> ('tool_call': the "
                          "Qwen2.5/Hermes form)")
    max_turns: int = Field(4, ge=1, description="model turns per episode")
    max_tokens: int = Field(256, ge=1, description="response tokens per episode (model turns + observations)")
    max_seconds: float = Field(60.0, gt=0, description="wall time per episode")
    step_timeout_s: float = Field(30.0, gt=0, description="an environment step that runs longer is an error")
    on_error: Literal["fail", "drop_group"] = Field(
        "fail", description="an episode that ends with an environment error (the environment or a tool raised, "
        "returned a malformed result or ran past step_timeout_s): fail stops the step naming the prompt and the "
        "cause; drop_group drops that prompt's group from the step (counted in env/errors). Evaluation scores "
        "such an episode 0 (counted in eval/env/errors)")
    workers: int = Field(4, ge=1, description="threads running environment steps")
    observation_chars: int = Field(512, ge=16, description="env.name=tools: longest tool result or error text "
                                   "(longer is cut); a user environment's observations are its own, cut only at "
                                   "env.max_tokens")
    sandbox: SandboxConfig = SandboxConfig()

    @field_validator("name")
    @classmethod
    def _env_file(cls, v: str | None) -> str | None:
        return v if v in (None, "tools") else absolute_file(v, "env.name")

    @field_validator("tools")
    @classmethod
    def _tool_files(cls, v: list[str]) -> list[str]:
        return [absolute_file(t, "env.tools") for t in v]

    @field_validator("tool_tag")
    @classmethod
    def _tag(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v):
            raise ValueError(f"env.tool_tag={v!r} must be a plain tag name such as 'tool' or 'tool_call'")
        return v

    @model_validator(mode="after")
    def _tools_only(self) -> "EnvConfig":
        if self.tool_results != "tags" and self.name != "tools":
            raise ValueError(f"env.tool_results={self.tool_results} is how the built-in tool environment returns "
                             f"results (env.name=tools); env.name={self.name!r} writes its own observations: drop "
                             f"env.tool_results")
        return self

    @property
    def enabled(self) -> bool:
        return self.name is not None

    @property
    def own_rewards(self) -> bool:
        """A user environment: its episodes' rewards are its own, so ``reward.*`` scores nothing (the built-in
        ``tools`` environment scores final answers with the reward engine)."""
        return self.name not in (None, "tools")

    @property
    def stop_string(self) -> str:
        """Where a model's turn that calls a tool ends."""
        return f"</{self.tool_tag}>"


def _resolve(path: str, what: str) -> Any:
    """The object at ``package.module:attribute``, ``package.module.attribute`` or ``path/to/file.py:attribute``."""
    return resolve(path, f"{what}={path!r}", EnvLoadError)


def _binds(fn: Callable, n: int) -> bool:
    try:
        inspect.signature(fn).bind(*([None] * n))
        return True
    except TypeError:
        return False
    except ValueError:  # no signature (a builtin): the call itself will tell
        return True


def load_tool(spec: str, sandbox: SandboxConfig) -> Tool:
    """A built-in tool by name, or a user tool by path: a class (made with no arguments) or an object with
    ``name``, ``description`` and ``__call__(arguments)``, or a plain function (:class:`FunctionTool`)."""
    if spec in BUILTIN_TOOLS:
        if spec == "python":
            try:
                check_available()
            except RuntimeError as e:
                raise EnvLoadError(f"env.tools: the python tool cannot run here: {e}") from None
        return BUILTIN_TOOLS[spec](sandbox)
    if ":" not in spec and "." not in spec:
        raise EnvLoadError(f"env.tools: {spec!r} is not a built-in tool ({', '.join(BUILTIN_TOOLS)}) nor a "
                           f"'package.module:attribute' path")
    obj = _resolve(spec, "env.tools")
    if inspect.isfunction(obj) and not isinstance(getattr(obj, "name", None), str):
        return FunctionTool(obj)  # a plain function, as TRL takes one
    try:
        tool = obj() if inspect.isclass(obj) else obj
    except Exception as e:  # (a class whose __init__ needs arguments, or raises)
        raise EnvLoadError(f"env.tools: making {spec!r} as {obj.__name__}() raised {type(e).__name__}: {e}; a tool "
                           f"class is made with no arguments: give its parameters defaults, or point at an instance "
                           f"made in its module") from e
    for attr in ("name", "description"):
        if not isinstance(getattr(tool, attr, None), str):
            raise EnvLoadError(f"env.tools: {spec!r} has no string attribute {attr!r} (a tool needs name, "
                               f"description and __call__(arguments: dict) -> str)")
    if not callable(tool) or not _binds(tool, 1):
        raise EnvLoadError(f"env.tools: {spec!r} cannot be called as tool(arguments: dict) -> str")
    return tool


def load_tools(specs: list[str], sandbox: SandboxConfig) -> dict[str, Tool]:
    """The tools of ``env.tools`` by name (:func:`load_tool` each). Two with one name (a user tool named
    ``calculator`` beside the built-in one, a function listed twice) are refused: the model calls a tool by
    name, so one of them could never be called."""
    tools: dict[str, Tool] = {}
    where: dict[str, str] = {}
    for spec in specs:
        tool = load_tool(spec, sandbox)
        if tool.name in tools:
            raise EnvLoadError(f"env.tools: {where[tool.name]!r} and {spec!r} are both named {tool.name!r}; the model "
                               f"calls a tool by its name, so give each tool its own (drop one, or rename it: a "
                               f"function's name, a tool object's name attribute)")
        tools[tool.name], where[tool.name] = tool, spec
    return tools


def load_env_factory(cfg: EnvConfig, score: Callable[[Problem, str], float] | None, tokenizer=None,
                     template_kwargs: dict[str, Any] | None = None) -> EnvFactory:
    """The factory of one environment per episode, its contract checked on one instance now. ``tokenizer``:
    the rollout's, whose chat template renders tool results with ``env.tool_results=chat`` (given
    ``template_kwargs``, ``data.chat_template_kwargs``)."""
    if cfg.name is None:
        raise EnvLoadError("env.name is null: single-turn runs have no environment")
    if cfg.name == "tools":
        if score is None:
            raise EnvLoadError("env.name=tools scores the final answer with the reward verifier; none was given")
        tools = load_tools(cfg.tools, cfg.sandbox)
        if not tools:
            raise EnvLoadError("env.name=tools with env.tools=[]: give at least one tool (calculator, python)")

        turn = None
        if cfg.tool_results == "chat":
            if tokenizer is None:
                raise EnvLoadError("env.tool_results=chat renders results through the model's chat template; no "
                                   "tokenizer was given")
            try:
                turn = chat_tool_turn(tokenizer, template_kwargs)
            except ValueError as e:
                raise EnvLoadError(f"env.tool_results=chat: {e}; use env.tool_results=tags") from None

        def factory() -> Environment:
            return ToolEnvironment(tools, score, tag=cfg.tool_tag, max_chars=cfg.observation_chars, turn=turn)
    else:
        factory = _resolve(cfg.name, "env.name")
        if not callable(factory):
            raise EnvLoadError(f"env.name={cfg.name!r} is a {type(factory).__name__}; point at a class or a "
                               f"function that makes an environment")
    try:
        env = factory()
    except Exception as e:
        raise EnvLoadError(f"env.name={cfg.name!r}: making an environment raised {type(e).__name__}: {e}") from e
    for method in ("reset", "step"):
        fn = getattr(env, method, None)
        if not callable(fn) or not _binds(fn, 1):
            raise EnvLoadError(f"env.name={cfg.name!r} made a {type(env).__name__} without a {method}(x) method; an "
                               f"environment has reset(problem) -> str and step(action: str) -> StepResult")
    return factory


@dataclass(frozen=True)
class EpisodeSpec:
    """What a rollout worker needs to run episodes (picklable: it travels to worker processes)."""

    env: EnvConfig
    reward: RewardConfig
    task: str | None
    task_options: dict[str, Any]
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    """``data.chat_template_kwargs``: for a tool message rendered by the chat template."""

    @property
    def limits(self) -> EpisodeLimits:
        from relayrl.environments.episodes import EpisodeLimits

        e = self.env
        return EpisodeLimits(max_turns=e.max_turns, max_tokens=e.max_tokens, max_seconds=e.max_seconds,
                             step_timeout_s=e.step_timeout_s)


def build_env_factory(spec: EpisodeSpec, tokenizer=None) -> EnvFactory:
    """The environment factory of ``spec``, contract checked; the built-in tool environment scores final
    answers with the run's reward engine (``reward.*``, the task's verifier by default) and renders results
    with ``tokenizer``'s chat template for ``env.tool_results=chat``."""
    from relayrl.data.tasks import make_task
    from relayrl.engines.reward import RewardEngine
    from relayrl.engines.reward.extra import ExtraLog

    score = None
    if spec.env.name == "tools":
        task = make_task(spec.task, **spec.task_options) if spec.task is not None else None
        engine = RewardEngine(spec.reward, task=task)

        def score(problem: Problem, text: str) -> FinalScore:  # (with what its functions logged: log_extra)
            extra = ExtraLog(1)
            rewards, _, _ = engine.score_each([problem.prompt], [text], [problem.answer],
                                              columns=[problem.meta.get("fields")], extra=extra)
            return FinalScore(rewards[0], extra.rows(1)[0])
    return load_env_factory(spec.env, score, tokenizer, spec.template_kwargs)
