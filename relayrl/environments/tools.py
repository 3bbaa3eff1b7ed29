"""Tools, the tool-call format, and the built-in environment that runs them.

**The format.** A model calls a tool by writing, anywhere in its turn, one tag whose body is JSON::

    <tool>{"name": "calculator", "arguments": {"expression": "48213+99377"}}</tool>

The turn stops at ``</tool>`` (a stop string of the rollout), the tool runs, and its result comes back as
context in the next tag, which the model never writes and is never trained on::

    <result>147590</result>          (success)
    <error>unknown tool 'calc'; tools: calculator, python</error>        (a failed call)

A turn without a tool call is the final answer; the task's verifier scores it. The tag is configurable
(``env.tool_tag``): ``tool_call`` gives the ``<tool_call>{...}</tool_call>`` form that Qwen2.5/Hermes chat
templates document for tool calls, with the same JSON body. Results are the plain ``<result>`` text above by
default; ``env.tool_results=chat`` renders each one through the chat template's ``tool`` role instead (the
template's own tokens around it stay special, the result is plain text: :mod:`relayrl.data.plain_text`).

**Built-in tools.** ``calculator`` (``{"expression": str}``: + - * / // % ** and parentheses over integers
and decimals, evaluated from the syntax tree with size limits, no ``eval``) and ``python`` (``{"code":
str}``: the sandbox of :mod:`relayrl.environments.sandbox`; what it prints is the result). A tool raises
:class:`ToolError` for a bad call by the model (that becomes an ``<error>`` observation); any other
exception is the tool's own failure and ends the episode as an environment error. A plain function serves as
a tool too (:class:`FunctionTool`, TRL's form: its name, its docstring, its arguments by keyword). What a
tool prints is kept off the console and said once per tool (:mod:`relayrl.environments.user_prints`).
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
from dataclasses import dataclass
from typing import Any, Callable, Mapping, NamedTuple, Protocol, runtime_checkable

from relayrl.data.tasks import Problem
from relayrl.environments.base import EnvError, StepResult, awaited
from relayrl.environments.sandbox import SandboxConfig, run_python
from relayrl.environments.user_prints import captured_prints, note_tool_prints
from relayrl.data.plain_text import markup

__all__ = ["Tool", "ToolError", "ToolCall", "parse_tool_call", "format_call", "Calculator", "PythonTool",
           "FunctionTool", "tool_schema", "chat_tool_turn", "ToolEnvironment", "BUILTIN_TOOLS"]


class ToolError(Exception):
    """The model called a tool wrongly (bad arguments, an expression that does not evaluate): the
    message goes back to the model as an ``<error>`` observation."""


@runtime_checkable
class Tool(Protocol):
    """A named function of JSON arguments returning text. An optional ``parameters`` attribute (a JSON schema
    of the arguments object) is what a chat template's tool list shows (:func:`tool_schema`)."""

    name: str
    description: str

    def __call__(self, arguments: dict[str, Any]) -> str:
        ...


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


def format_call(name: str, arguments: dict[str, Any], tag: str = "tool") -> str:
    """The text of a tool call in the documented format (demonstrations and tests write it this way)."""
    return f"<{tag}>" + json.dumps({"name": name, "arguments": arguments}) + f"</{tag}>"


def parse_tool_call(text: str, tag: str = "tool") -> ToolCall | None:
    """The first tool call in ``text``; None when there is none (the turn is a final answer). A tag that
    is opened but malformed (no closing tag, bad JSON, missing fields) raises :class:`ToolError`."""
    start = text.find(f"<{tag}>")
    if start < 0:
        return None
    end = text.find(f"</{tag}>", start)
    if end < 0:
        raise ToolError(f"tool call without a closing </{tag}>")
    body = text[start + len(tag) + 2:end].strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolError(f"tool call is not JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolError('tool call must be {"name": str, "arguments": {...}}')
    args = obj.get("arguments", {})
    if not isinstance(args, dict):
        raise ToolError("tool call arguments must be a JSON object")
    return ToolCall(obj["name"], args)


_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


class Calculator:
    """Arithmetic on the syntax tree: numbers, + - * / // % **, unary minus, parentheses."""

    name = "calculator"
    description = 'evaluate an arithmetic expression: {"expression": "12*(3+4)"}'
    parameters = {"type": "object", "properties": {"expression": {"type": "string", "description": "arithmetic: "
                  "numbers, + - * / // % **, parentheses"}}, "required": ["expression"]}
    max_chars = 200
    max_digits = 64

    def __call__(self, arguments: dict[str, Any]) -> str:
        expr = arguments.get("expression")
        if not isinstance(expr, str) or not expr.strip():
            raise ToolError('calculator needs {"expression": "<arithmetic>"}')
        if len(expr) > self.max_chars:
            raise ToolError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expr.strip(), mode="eval")
        except SyntaxError:
            raise ToolError(f"cannot parse {expr!r}") from None
        value = self._eval(tree.body)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        return str(value)

    def _eval(self, node: ast.AST):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = self._eval(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            a, b = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and (abs(b) > 64 or abs(a) > 10**6):
                raise ToolError("exponent too large")
            try:
                v = _BINOPS[type(node.op)](a, b)
            except ZeroDivisionError:
                raise ToolError("division by zero") from None
            if isinstance(v, int) and len(str(abs(v))) > self.max_digits:
                raise ToolError(f"result has more than {self.max_digits} digits")
            return v
        raise ToolError(f"unsupported syntax: {type(node).__name__}")


class PythonTool:
    """Runs model-written code in the sandbox; the result is what it printed (or the error)."""

    name = "python"
    description = 'run Python code in a sandbox and return what it prints: {"code": "print(2**10)"}'
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                  "required": ["code"]}

    def __init__(self, sandbox: SandboxConfig | None = None) -> None:
        self.sandbox = sandbox or SandboxConfig()

    def __call__(self, arguments: dict[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            raise ToolError('python needs {"code": "<source>"}')
        result = run_python(code, self.sandbox)
        if not result.ok:
            raise ToolError(f"{result.error}" + (f"; output: {result.stdout[-200:]}" if result.stdout else ""))
        return result.stdout


class FunctionTool:
    """A plain Python function as a tool, as TRL's ``GRPOTrainer(tools=[...])`` takes one: its name is the
    function's, its description the docstring's first paragraph, and a call passes the JSON arguments by
    keyword. Arguments the signature cannot take are a bad call (:class:`ToolError`); the result is the
    returned string, or the JSON of anything else. What the function raises is its own failure (an
    environment error), but :class:`ToolError`, as for any tool. An ``async def`` function is awaited."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.name = fn.__name__
        doc = inspect.getdoc(fn) or ""
        self.description = doc.split("\n\n", 1)[0].strip() or f"{self.name}{inspect.signature(fn)}"
        self._signature = inspect.signature(fn)
        self.parameters = _parameters(fn, self._signature)

    def __call__(self, arguments: dict[str, Any]) -> str:
        try:
            self._signature.bind(**arguments)
        except TypeError as e:
            raise ToolError(f"{self.name}{self._signature}: {e}") from None
        out = awaited(self.fn(**arguments))
        return out if isinstance(out, str) else json.dumps(out, default=str)


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


def _parameters(fn: Callable[..., Any], sig: inspect.Signature) -> dict[str, Any]:
    """The JSON schema of ``fn``'s arguments: transformers' ``get_json_schema`` (types, and descriptions from a
    docstring's ``Args:``) where it can read the function, else the types of the signature alone."""
    try:
        from transformers.utils import get_json_schema

        return get_json_schema(fn)["function"]["parameters"]
    except Exception:  # (a docstring without Args for every argument, a type it cannot map)
        props = {n: ({"type": _JSON_TYPES[p.annotation]} if p.annotation in _JSON_TYPES else {})
                 for n, p in sig.parameters.items()}
        required = [n for n, p in sig.parameters.items() if p.default is p.empty]
        return {"type": "object", "properties": props, "required": required}


def tool_schema(tool: Tool) -> dict[str, Any]:
    """``tool`` in the form chat templates take in their ``tools`` list (OpenAI's function schema)."""
    params = getattr(tool, "parameters", None) or {"type": "object", "properties": {}}
    return {"type": "function", "function": {"name": tool.name, "description": tool.description,
                                             "parameters": params}}


BUILTIN_TOOLS: dict[str, Callable[[SandboxConfig], Tool]] = {
    "calculator": lambda sandbox: Calculator(),
    "python": lambda sandbox: PythonTool(sandbox),
}


class FinalScore(NamedTuple):
    """What a tool environment's ``score`` may return for a final answer: its reward and the sample columns the
    reward functions logged for it (``log_extra``, a verl dict's extras), which reach the episode's record
    (:mod:`relayrl.environments.extras`)."""

    reward: float
    extras: dict[str, Any]


class ToolEnvironment:
    """The built-in environment: tool calls get results; a turn without one is the final answer, scored by
    ``score(problem, answer_text)`` (the task's verifier: a float, or a :class:`FinalScore` with the columns
    its reward functions logged). Observations are capped at ``max_chars``."""

    def __init__(self, tools: dict[str, Tool], score: Callable[[Problem, str], float | FinalScore], *,
                 tag: str = "tool",
                 max_chars: int = 512, turn: Callable[[str], str] | None = None) -> None:
        self.tools, self.score, self.tag, self.max_chars, self.turn = tools, score, tag, max_chars, turn
        self.problem: Problem | None = None

    def reset(self, problem: Problem) -> str:
        self.problem = problem
        return ""

    def step(self, action: str) -> StepResult:
        try:
            call = parse_tool_call(action, self.tag)
        except ToolError as e:
            return StepResult(self._wrap("error", str(e)), info={"tool": "?", "tool_error": True})
        if call is None:
            got = self.score(self.problem, action)
            if isinstance(got, FinalScore):
                return StepResult("", reward=float(got.reward), done=True,
                                  info={"log_extra": dict(got.extras)} if got.extras else {})
            return StepResult("", reward=float(got), done=True)
        tool = self.tools.get(call.name)
        if tool is None:
            return StepResult(self._wrap("error", f"unknown tool {call.name!r}; tools: {', '.join(self.tools)}"),
                              info={"tool": call.name, "tool_error": True})
        printed = None
        try:
            with captured_prints() as printed:  # (its prints are not the console's: user_prints)
                out = awaited(tool(call.arguments))
        except ToolError as e:
            return StepResult(self._wrap("error", str(e)), info={"tool": call.name, "tool_error": True})
        except Exception as e:  # the tool's own crash: the episode's error names the tool
            raise EnvError(f"tool {call.name!r} raised {type(e).__name__}: {e}") from e
        finally:
            if printed is not None:
                note_tool_prints(call.name, printed)
        if not isinstance(out, str):
            raise EnvError(f"tool {call.name!r} returned {type(out).__name__}; a tool returns str")
        return StepResult(self._wrap("result", out), info={"tool": call.name})

    def _wrap(self, kind: str, text: str) -> str:
        text = text.strip()
        if len(text) > self.max_chars:
            text = text[:self.max_chars] + f"... [{len(text) - self.max_chars} more characters cut]"
        if self.turn is not None:  # env.tool_results=chat: a tool message as the chat template renders it
            return self.turn(text if kind == "result" else f"error: {text}")
        return f"<{kind}>{text}</{kind}>"


def chat_tool_turn(tokenizer, template_kwargs: Mapping[str, Any] | None = None) -> Callable[[str], str]:
    """The text that follows a model's turn ending in a tool call, as ``tokenizer``'s chat template renders
    a tool message with ``result`` and opens the next assistant turn (Qwen2.5's: ``<|im_end|>`` and a user
    turn holding ``<tool_response>...</tool_response>``), as a function of the result text. Read off the
    template by rendering a conversation with and without a tool message; :class:`ValueError` when the
    template has none, or renders the turns before it differently. The template's text around the result is
    :func:`~relayrl.data.plain_text.markup` (its special tokens are tokens); the result is plain text.
    ``template_kwargs``: more variables for the template (``data.chat_template_kwargs``)."""
    kw = dict(template_kwargs or {})
    call, result = "RELAYRL_TOOL_CALL_7F3A", "RELAYRL_TOOL_RESULT_7F3A"
    msgs = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": call}]
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    try:
        before = tokenizer.apply_chat_template(msgs, tokenize=False, **kw)
        after = tokenizer.apply_chat_template([*msgs, {"role": "tool", "content": result}], tokenize=False,
                                              add_generation_prompt=True, **kw)
    except Exception as e:  # (a template that raises on a tool message)
        raise ValueError(f"the chat template cannot render a tool message ({type(e).__name__}: {e})") from None
    if result not in after or call not in before:
        raise ValueError("the chat template renders no tool message (its tools' results are dropped)")
    cut = before.index(call) + len(call)
    if after[:cut] != before[:cut]:
        raise ValueError("the chat template renders the turns before a tool message differently once one follows")
    head, tail = after[cut:].split(result, 1)
    return lambda text: markup(head) + text + markup(tail)  # (the template's tokens; the result is plain text)

