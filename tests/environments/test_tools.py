"""Tool-call format, the calculator, the built-in tool environment, and loading with contract checks."""

from __future__ import annotations

import json
import sys
import textwrap
import types

import pytest

from relayrl.data.tasks import Problem, make_task
from relayrl.environments.config import EnvConfig, EnvLoadError, load_env_factory, load_tool
from relayrl.environments.sandbox import SandboxConfig
from relayrl.environments.tools import Calculator, ToolEnvironment, ToolError, format_call, parse_tool_call


def test_format_round_trips_through_the_parser():
    text = "let me compute " + format_call("calculator", {"expression": "1+2"}) + " trailing"
    call = parse_tool_call(text)
    assert call.name == "calculator" and call.arguments == {"expression": "1+2"}
    assert parse_tool_call("12345") is None
    assert parse_tool_call(format_call("calculator", {"expression": "3"}, tag="tool_call"), tag="tool_call").arguments == {"expression": "3"}


@pytest.mark.parametrize("text, why", [
    ('<tool>{"name": "calculator"', "closing"),
    ("<tool>not json</tool>", "not JSON"),
    ('<tool>{"arguments": {}}</tool>', "name"),
    ('<tool>{"name": "c", "arguments": [1]}</tool>', "arguments"),
])
def test_malformed_calls_are_tool_errors(text, why):
    with pytest.raises(ToolError, match=why):
        parse_tool_call(text)


@pytest.mark.parametrize("expr, value", [("48213+99377", "147590"), ("2*(3+4)", "14"), ("-3+10", "7"),
                                         ("7/2", "3.5"), ("2**10", "1024"), ("17//5", "3"), ("10/5", "2")])
def test_calculator_values(expr, value):
    assert Calculator()({"expression": expr}) == value


@pytest.mark.parametrize("expr, why", [("__import__('os')", "unsupported"), ("1/0", "division"),
                                       ("9**9999", "exponent"), ("a+1", "unsupported"), ("1+", "parse")])
def test_calculator_refuses(expr, why):
    with pytest.raises(ToolError, match=why):
        Calculator()({"expression": expr})


def test_tool_environment_runs_tools_then_scores_the_answer():
    task = make_task("toolsum", digits=5)
    p = Problem("48213+99377=", "147590", {"expression": "48213+99377"})
    env = ToolEnvironment({"calculator": Calculator()}, score=lambda prob, text: task.verify(text, prob.answer))
    assert env.reset(p) == ""
    r = env.step(format_call("calculator", {"expression": "48213+99377"}))
    assert r.observation == "<result>147590</result>" and not r.done and r.reward == 0 and r.info["tool"] == "calculator"
    r = env.step(format_call("calc", {"expression": "1"}))
    assert r.observation.startswith("<error>unknown tool 'calc'") and not r.done
    r = env.step("147590")
    assert r.done and r.reward == 1.0
    env.reset(p)
    assert env.step("147591").reward == 0.0


def test_long_observations_are_cut():
    env = ToolEnvironment({"calculator": Calculator()}, score=lambda p, t: 0.0, max_chars=16)
    env.reset(None)
    r = env.step(format_call("calculator", {"expression": "9**60"}))
    assert r.observation.startswith("<result>") and "more characters cut" in r.observation


def test_toolsum_demonstrations_follow_the_format():
    import random

    task = make_task("toolsum", digits=4, tool_rate=0.5)
    rng = random.Random(0)
    kinds = set()
    for _ in range(40):
        p = task.sample(rng)
        segs = task.demonstration(p, rng)
        kinds.add(len(segs))
        if len(segs) == 3:
            call = parse_tool_call(segs[0][0])
            assert Calculator()(call.arguments) == p.answer and segs[1] == (f"<result>{p.answer}</result>", False)
        assert segs[-1] == (p.answer, True) and task.verify(segs[-1][0], p.answer) == 1.0
    assert kinds == {1, 3}


# ------------------------------------------------------------------------- loading and contracts
class GoodTool:
    name = "echo"
    description = "echo the text"

    def __call__(self, arguments):
        return str(arguments.get("text", ""))


class NoName:
    def __call__(self, arguments):
        return ""


class GoodEnv:
    def reset(self, problem):
        return ""

    def step(self, action):
        from relayrl.environments.base import StepResult

        return StepResult("", 1.0, True)


class NoStep:
    def reset(self, problem):
        return ""


@pytest.fixture()
def user_module():
    mod = types.ModuleType("relayrl_test_userenv")
    mod.GoodTool, mod.NoName, mod.GoodEnv, mod.NoStep = GoodTool, NoName, GoodEnv, NoStep
    mod.not_callable = 3
    sys.modules[mod.__name__] = mod
    yield mod.__name__
    del sys.modules[mod.__name__]


def test_user_tools_and_environments_load_by_dotted_path(user_module):
    assert load_tool(f"{user_module}:GoodTool", SandboxConfig())({"text": "hi"}) == "hi"
    factory = load_env_factory(EnvConfig(name=f"{user_module}:GoodEnv"), None)
    assert isinstance(factory(), GoodEnv)
    f = load_env_factory(EnvConfig(name="tools", tools=["calculator", f"{user_module}:GoodTool"]), lambda p, t: 0.0)
    assert set(f().tools) == {"calculator", "echo"}


@pytest.mark.parametrize("name, match", [
    ("{m}:NoStep", "without a step"),
    ("{m}:not_callable", "is a int"),
    ("{m}:Missing", "no attribute"),
    ("no_such_pkg_xyz.mod:Env", "no module named"),
    ("justaname", "package.module:attribute"),
])
def test_bad_environments_fail_at_load_naming_the_key(user_module, name, match):
    with pytest.raises(EnvLoadError, match=match) as e:
        load_env_factory(EnvConfig(name=name.format(m=user_module)), None)
    assert "env.name" in str(e.value)


def test_bad_tools_fail_at_load(user_module):
    with pytest.raises(EnvLoadError, match="name"):
        load_tool(f"{user_module}:NoName", SandboxConfig())
    with pytest.raises(EnvLoadError, match="not a built-in tool"):
        load_tool("abacus", SandboxConfig())


def _no_libseccomp():
    raise OSError("libseccomp.so.2: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize("why, patch, expected", [
    ("not Linux", lambda mp, sb: mp.setattr(sb.sys, "platform", "darwin"), "needs Linux namespaces; this is darwin"),
    ("no unshare", lambda mp, sb: mp.setattr(sb.shutil, "which", lambda name: None), "apt-get install util-linux"),
    ("no libseccomp", lambda mp, sb: mp.setattr(sb.sandbox_seccomp, "filter_program", _no_libseccomp),
     "libseccomp, which cannot be loaded here (libseccomp.so.2: cannot open shared object file"),
    ("neither root nor user namespaces", lambda mp, sb: (
        mp.setattr(sb.os, "geteuid", lambda: 1000),
        mp.setattr(sb, "_user_namespaces_refused", lambda: "unshare: unshare failed: Operation not permitted")),
     "refuses user namespaces to uid 1000 (unshare: unshare failed: Operation not permitted); run relayrl as root"),
])
def test_python_tool_refuses_to_load_where_the_sandbox_cannot_run(monkeypatch, why, patch, expected):
    """The sandbox checks at load, not at the first tool call: the run stops before any worker generates,
    with what is missing and the fix (or: drop the python tool)."""
    from relayrl.environments import sandbox

    patch(monkeypatch, sandbox)
    with pytest.raises(EnvLoadError, match="env.tools: the python tool cannot run here") as e:
        load_tool("python", SandboxConfig())
    assert expected in str(e.value) and "drop the python tool from env.tools" in str(e.value)
    with pytest.raises(EnvLoadError, match="the python tool cannot run here"):
        load_env_factory(EnvConfig(name="tools", tools=["calculator", "python"]), lambda p, t: 0.0)
    assert load_tool("calculator", SandboxConfig())({"expression": "1+1"}) == "2"  # other tools still load


def test_config_names_the_key_to_fix():
    from relayrl.config.schema import Config

    with pytest.raises(ValueError, match="rollout.stop_strings"):
        Config(env={"name": "tools"})
    with pytest.raises(ValueError, match="overlong_shaping"):
        Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]}, algorithm={"overlong_shaping": True})
    with pytest.raises(ValueError, match="advantage=remax"):
        Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]}, algorithm={"advantage": "remax"})
    Config(env={"name": "tools", "tool_results": "chat"})  # its turns may end at the end-of-turn token instead
    # episodes run on every GRPO mode: off-policy, periodic, split placements
    Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]}, trainer={"off_policy_steps": 1})
    with pytest.raises(ValueError, match="tool_tag"):
        EnvConfig(tool_tag="a b")


def test_a_user_environment_brings_its_rewards_so_reward_settings_that_would_be_ignored_are_refused(tmp_path):
    from relayrl.config.schema import Config

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    env = {"name": "relayrl_test_userenv:GoodEnv"}
    cfg = Config(env=env, data={"task": None, "path": str(data)})  # no reward.verifier needed: none is used
    tools = Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]})
    assert cfg.env.own_rewards and not tools.env.own_rewards
    with pytest.raises(ValueError, match="reward.verifier=task needs a built-in data.task"):
        Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]}, data={"task": None, "path": str(data)})
    with pytest.raises(ValueError, match=r"gives each episode its reward .*reward.model, reward.judge.path would "
                                         r"score nothing: unset them"):
        Config(env=env, reward={"model": str(tmp_path), "judge": {"path": str(tmp_path)}})
    with pytest.raises(ValueError, match="reward.user_fn would score nothing: unset it"):
        Config(env=env, reward={"verifier": "user", "user_fn": "m:f"})
    # (the reward engine normalises and clips; a user environment's rewards never reach it: silently unshaped)
    with pytest.raises(ValueError, match=r"reward.normalize=running, reward.clip=1.0 would leave as it is .*unset "
                                         r"them, or normalise or clip inside the environment"):
        Config(env=env, reward={"normalize": "running", "clip": 1.0})
    assert Config(env={"name": "tools"}, rollout={"stop_strings": ["</tool>"]}, reward={"clip": 1.0}).reward.clip


def test_environments_and_tools_load_from_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(textwrap.dedent("""
        from relayrl.environments.base import StepResult

        class Echo:
            name, description = "echo", "says it back"
            def __call__(self, arguments):
                return arguments["text"]

        class Env:
            def reset(self, problem):
                return ""
            def step(self, action):
                return StepResult("", 1.0, True)
        """))
    monkeypatch.chdir(tmp_path)
    cfg = EnvConfig(name="my_env.py:Env")
    assert cfg.name == f"{tmp_path / 'my_env.py'}:Env"  # absolute: other processes open the same file
    monkeypatch.chdir("/")
    assert load_env_factory(cfg, None)().step("x").done
    tools = EnvConfig(name="tools", tools=["calculator", str(tmp_path / "my_env.py") + ":Echo"]).tools
    assert load_tool(tools[1], SandboxConfig())({"text": "hi"}) == "hi"
    with pytest.raises(ValueError, match=r"env.tools='gone.py:Echo': no file /gone.py"):
        EnvConfig(name="tools", tools=["gone.py:Echo"])


def test_a_plain_function_is_a_tool_as_trl_takes_one(tmp_path):
    """Its name, its docstring's first paragraph, its arguments by keyword; arguments it cannot take are a bad
    call the model sees; a result that is not text comes back as JSON."""
    (tmp_path / "fn_tools.py").write_text(textwrap.dedent('''
        def multiply(a: int, b: int) -> int:
            """Multiply two integers.

            Args:
                a: the first
                b: the second
            """
            return a * b

        def lookup(key: str) -> dict:
            return {"key": key, "found": False}
    '''))
    tool = load_tool(f"{tmp_path}/fn_tools.py:multiply", SandboxConfig())
    assert (tool.name, tool.description) == ("multiply", "Multiply two integers.")
    assert tool({"a": 6, "b": 7}) == "42"
    with pytest.raises(ToolError, match=r"multiply\(a: int, b: int\) -> int: missing a required argument: 'b'"):
        tool({"a": 6})
    other = load_tool(f"{tmp_path}/fn_tools.py:lookup", SandboxConfig())
    assert other.description == "lookup(key: str) -> dict" and json.loads(other({"key": "x"})) == {
        "key": "x", "found": False}
    env = load_env_factory(EnvConfig(name="tools", tools=["calculator", f"{tmp_path}/fn_tools.py:multiply"]),
                           lambda p, t: float(t == "42"))()
    env.reset(Problem("6*7=", "42"))
    assert env.step('<tool>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool>').observation == \
        "<result>42</result>"
    assert env.step('<tool>{"name": "multiply", "arguments": {"c": 1}}</tool>').observation.startswith(
        "<error>multiply(a: int, b: int) -> int: ")


def test_a_tool_class_that_cannot_be_made_is_refused_naming_the_key(tmp_path):
    """A tool class whose ``__init__`` needs an argument escaped as a bare TypeError traceback from a rollout
    rank, once the model had loaded."""
    (tmp_path / "needs_args.py").write_text(textwrap.dedent('''
        class Search:
            name, description = "search", "search the index"

            def __init__(self, index_path):
                self.index_path = index_path

            def __call__(self, arguments):
                return "found"
    '''))
    with pytest.raises(EnvLoadError, match=r"env.tools: making '.*needs_args.py:Search' as Search\(\) raised "
                                           r"TypeError: .*index_path.*give its parameters defaults"):
        load_tool(f"{tmp_path}/needs_args.py:Search", SandboxConfig())


def test_async_tools_are_awaited(tmp_path):
    """An ``async def`` function or tool object (verl's tools are coroutines) returns its result: the model was
    shown ``"<coroutine object lookup at 0x...>"`` as the tool's result, and the call never ran."""
    (tmp_path / "async_tools.py").write_text(textwrap.dedent('''
        import asyncio

        from relayrl.environments.tools import ToolError

        async def lookup(key: str) -> str:
            """Look a key up."""
            await asyncio.sleep(0)
            if key == "?":
                raise ToolError("no such key")
            return {"a": "1"}.get(key, "none")

        class Search:
            name, description = "search", "search the index"

            async def __call__(self, arguments):
                await asyncio.sleep(0)
                return f"found {arguments['q']}"
    '''))
    tools = [f"{tmp_path}/async_tools.py:lookup", f"{tmp_path}/async_tools.py:Search"]
    assert load_tool(tools[0], SandboxConfig())({"key": "a"}) == "1"
    env = load_env_factory(EnvConfig(name="tools", tools=tools), lambda p, t: 0.0)()
    env.reset(Problem("q", "1"))
    assert env.step(format_call("lookup", {"key": "a"})).observation == "<result>1</result>"
    assert env.step(format_call("lookup", {"key": "?"})).observation == "<error>no such key</error>"
    assert env.step(format_call("search", {"q": "x"})).observation == "<result>found x</result>"


def test_two_tools_of_one_name_are_refused_at_load(tmp_path):
    """The model calls a tool by name: a user tool named like a built-in one (or listed twice) replaced the other
    in the environment's tools without a word, so the built-in could never be called."""
    (tmp_path / "named.py").write_text(textwrap.dedent('''
        def calculator(expression: str) -> str:
            """My own calculator."""
            return "42"
    '''))
    mine = f"{tmp_path}/named.py:calculator"
    with pytest.raises(EnvLoadError, match=r"env.tools: 'calculator' and '.*named.py:calculator' are both named "
                                           r"'calculator'.*give each tool its own"):
        load_env_factory(EnvConfig(name="tools", tools=["calculator", mine]), lambda p, t: 0.0)
    with pytest.raises(EnvLoadError, match="both named 'calculator'"):
        load_env_factory(EnvConfig(name="tools", tools=[mine, mine]), lambda p, t: 0.0)
    env = load_env_factory(EnvConfig(name="tools", tools=[mine]), lambda p, t: 0.0)()  # alone it is the calculator
    env.reset(Problem("1+1=", "2"))
    assert env.step('<tool>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool>').observation == \
        "<result>42</result>"


TOOLS_TEMPLATE = ("{% if tools %}<|im_start|>system\nTools: {{ tools | map(attribute='function') "
                  "| map(attribute='name') | join(', ') }}<|im_end|>\n{% endif %}"
                  "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_tools_are_described_to_the_model_through_the_chat_template(tmp_path, tiny_dir):
    """env.tools_in_prompt: a chat prompt is rendered with the tool environment's tools in the template's
    tools list (as TRL renders them); a template without one says so and renders the prompt as written."""
    import shutil

    from relayrl.config.schema import Config
    from relayrl.environments.tools import tool_schema
    from relayrl.workflows.session import Session

    (tmp_path / "fn_tools2.py").write_text("def multiply(a: int, b: int) -> int:\n"
                                           "    return a * b\n")
    assert tool_schema(load_tool(f"{tmp_path}/fn_tools2.py:multiply", SandboxConfig()))["function"] == {
        "name": "multiply", "description": "multiply(a: int, b: int) -> int", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    conf = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**conf, "chat_template": TOOLS_TEMPLATE}))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{i}*3="}], "answer": str(3 * i)})
                            + "\n" for i in range(6)))

    def session(path, run, *over):
        cfg = Config(run={"dir": str(tmp_path / run)}, model={"path": str(path)},
                     data={"task": None, "path": str(data)}, eval={"size": 2}, reward={"verifier": "exact"},
                     env={"name": "tools", "tools": ["calculator", f"{tmp_path}/fn_tools2.py:multiply"], **dict(over)},
                     rollout={"stop_strings": ["</tool>"]})
        lines: list[str] = []
        return Session(cfg, log=lines.append), lines

    s, _ = session(model, "a")
    text = s.tokenizer.decode(s.encode(s.eval_problems[0]))
    assert text.startswith("<|im_start|>system\nTools: calculator, multiply<|im_end|>\n<|im_start|>user\n")
    s, _ = session(model, "b", ("tools_in_prompt", False))
    assert "Tools:" not in s.tokenizer.decode(s.encode(s.eval_problems[0]))
    s, lines = session(tiny_dir, "c")  # the tiny tokenizer's template has no tools list
    assert "Tools:" not in s.tokenizer.decode(s.encode(s.eval_problems[0]))
    assert any("has no tools list, so the prompts do not describe the tools" in l for l in lines)


QWEN_TOOLS = (  # the tool-message part of Qwen2.5's template: results in a user turn, in <tool_response> tags
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _templated(tiny_tokenizer, template):
    import copy

    tok = copy.deepcopy(tiny_tokenizer)
    tok.chat_template = template
    return tok


def test_tool_results_come_back_as_the_chat_template_renders_a_tool_message(tiny_tokenizer):
    from relayrl.environments.tools import chat_tool_turn

    turn = chat_tool_turn(_templated(tiny_tokenizer, QWEN_TOOLS))
    assert turn("42") == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                          "<|im_start|>assistant\n")
    assert chat_tool_turn(tiny_tokenizer)("42") == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    env = ToolEnvironment({"calculator": Calculator()}, lambda p, t: 1.0, tag="tool_call", turn=turn)
    env.reset(Problem("6*7=", "42"))
    out = env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}</tool_call>')
    assert out.observation == turn("42") and not out.done
    assert env.step('<tool_call>{"name": "abacus", "arguments": {}}</tool_call>').observation == turn(
        "error: unknown tool 'abacus'; tools: calculator")


@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
     "{{ m.content }}{% endfor %}", "cannot render a tool message (TemplateError: no tool role)"),
    ("{% for m in messages %}{% if m.role != 'tool' %}{{ m.content }}{% endif %}{% endfor %}",
     "renders no tool message"),
])
def test_a_template_that_cannot_render_tool_results_is_refused_at_load(tiny_tokenizer, template, says):
    with pytest.raises(EnvLoadError, match="env.tool_results=chat: ") as e:
        load_env_factory(EnvConfig(name="tools", tool_results="chat"), lambda p, t: 0.0,
                         _templated(tiny_tokenizer, template))
    assert says in str(e.value) and "use env.tool_results=tags" in str(e.value)
    with pytest.raises(ValueError, match="env.tool_results=chat is how the built-in tool environment"):
        EnvConfig(name="my_envs:Env", tool_results="chat")


def test_a_tool_turn_the_model_closed_itself_is_not_closed_twice(tiny_tokenizer):
    """With env.tool_results=chat and no stop string, a model ends its tool-call turn with its end-of-turn
    token; the template's tool message opens with that token, so the observation drops it (else the context
    would read <|im_end|><|im_end|>)."""
    import torch

    from relayrl.engines.generation.base import Completion
    from relayrl.environments.episodes import after_turn

    from relayrl.data.plain_text import EnvTextEncoder
    from relayrl.environments.tools import chat_tool_turn

    end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    obs = chat_tool_turn(tiny_tokenizer)("42")  # (the template's tokens around the result are markup)
    assert obs == "<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"

    def turn(last: int, reason: str = "stop") -> Completion:
        return Completion(0, 0, torch.tensor([5, last]), torch.zeros(2), reason, 0, "x")

    assert after_turn(tiny_tokenizer, turn(end), obs) == obs[len("<|im_end|>"):]
    assert after_turn(tiny_tokenizer, turn(7), obs) == obs  # stopped at a stop string: the template closes it
    assert after_turn(tiny_tokenizer, turn(end, "length"), obs) == obs
    assert after_turn(tiny_tokenizer, turn(end), "<result>42</result>") == "<result>42</result>"
    closed = after_turn(tiny_tokenizer, turn(end), obs)
    assert [i for i in EnvTextEncoder(tiny_tokenizer)(closed) if i in (3, end)] == [3, end, 3]  # still markup
    # in plain text (a tool's output, an environment's own str) the string is text, not the model's token
    assert after_turn(tiny_tokenizer, turn(end), str(obs)) == str(obs)


def _loud(n: int) -> str:
    """A tool that prints a lot (1 MB) to both streams before answering."""
    print("debug line\n" + "x" * n)
    print("y" * n, file=sys.stderr)
    return "42"


def test_a_tool_printing_a_megabyte_leaves_the_console_at_most_one_line(capsys, caplog):
    from relayrl.environments import user_prints
    from relayrl.environments.tools import FunctionTool

    user_prints._noted.discard(("tool", "_loud"))
    env = ToolEnvironment({"_loud": FunctionTool(_loud)}, score=lambda p, t: 0.0)
    env.reset(Problem("q", "a"))
    with caplog.at_level("WARNING", logger="relayrl.environments.user_prints"):
        for _ in range(3):
            r = env.step(format_call("_loud", {"n": 1 << 20}))
            assert r.observation == "<result>42</result>"
    out, err = capsys.readouterr()
    assert len(out) + len(err) < 400 and (out + err).count("\n") <= 1
    notes = [rec.getMessage() for rec in caplog.records if "printed" in rec.getMessage()]
    assert len(notes) == 1 and "'_loud'" in notes[0] and "debug line" in notes[0]  # once per tool per run
    assert sys.stdout is not None and type(sys.stdout).__name__ != "_Router"  # the streams are put back


def test_other_threads_print_through_while_a_tool_captures(capsys):
    import threading

    from relayrl.environments.user_prints import captured_prints

    inside, done = threading.Event(), threading.Event()

    def other():
        inside.wait(5)
        print("the trainer's own line")
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with captured_prints() as cap:
        print("the tool's")
        inside.set()
        done.wait(5)
    t.join(5)
    out, _ = capsys.readouterr()
    assert out == "the trainer's own line\n" and cap.text == "the tool's\n"


def test_the_stream_a_capture_stands_for_keeps_its_attributes():
    from relayrl.environments.user_prints import captured_prints

    class Stream:
        encoding = "utf-8"

        def __init__(self):
            self.text = ""

        def write(self, t):
            self.text += t

        def flush(self):
            pass

        def fileno(self):
            return 7

    real = sys.stdout
    sys.stdout = base = Stream()
    try:
        with captured_prints():
            assert sys.stdout.fileno() == 7 and sys.stdout.encoding == "utf-8"  # (another thread's faulthandler)
            print("kept off")
        print("shown")
    finally:
        sys.stdout = real
    assert base.text == "shown\n"
