"""Tools the policy may call in a multi-turn rollout, and the tool config file that names them.

A tool config is verl's YAML (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: calculator            # a name registered below, or a dotted path to a Tool subclass
        config: {}                         # keyword arguments of the class
        tool_schema:                       # OpenAI function schema: what the chat template shows the model
          type: function
          function: {name: calculator, description: ..., parameters: {...}}

A tool is called with the JSON arguments the model wrote and returns text for the next turn. It
never raises into the rollout: a failure comes back as an error text the model sees, and is counted.

Plain Python functions are tools too (verl's ``multi_turn.function_tool_path``): a file whose
functions carry ``@function_tool`` (``hybrid_rl.agent.function_tool``, or verl's
``from verl.tools.function_tool import function_tool``, which resolves to ours while the file
loads), each with type hints and a Google-style docstring from which transformers infers the schema.
So are classes written for verl's agent loop (subclasses of verl's ``BaseTool``): ``verl_tools.py``.
"""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import inspect
import json
import math
import operator
import os
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

import yaml

from hybrid_rl.user_code import verl_stand_ins


class ToolConfigError(ValueError):
    """The tool config file cannot be used; the message names the entry and the fix."""


@dataclass
class ToolOutput:
    """``text`` goes back to the model; ``error`` marks a call that failed (bad arguments, a
    crash, a timeout); ``reward`` is the call's own reward, which the reward function receives in
    ``extra_info["tool_rewards"]`` (verl's tools and function tools give one)."""

    text: str
    error: bool = False
    reward: float = 0.0


class Tool:
    """One callable tool. Subclasses set ``default_schema`` (used when the config gives none) and
    implement ``execute``; ``config`` entries arrive as keyword arguments."""

    default_schema: dict = {}

    def __init__(self, schema: dict | None = None):
        self.schema = schema or self.default_schema
        function = self.schema.get("function") if isinstance(self.schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolConfigError(f"{type(self).__name__}: tool_schema needs function.name (an OpenAI function schema)")
        self.name = function["name"]

    def execute(self, arguments: dict) -> ToolOutput:
        raise NotImplementedError

    def call(self, arguments: dict, trajectory: Any, timeout_s: float | None = None) -> ToolOutput:
        """One call in ``trajectory`` (the rollout's ``loop.Trajectory``), which tools with
        per-row state read; ``timeout_s``: when an asynchronous call is cancelled."""
        return self.execute(arguments)

    def close(self) -> None:
        """Release what the tool holds (processes, pools)."""


_event_loop: asyncio.AbstractEventLoop | None = None
_event_loop_lock = threading.Lock()


def run_coroutine(coroutine: Coroutine, timeout_s: float | None = None) -> Any:
    """Run an asynchronous tool's or interaction's coroutine to its end on the one event loop that
    all of this process's tools share (a thread of its own), as verl runs them: objects a tool
    made on that loop (locks, client sessions) stay usable from call to call. Cancelled (and
    TimeoutError raised) after ``timeout_s``."""
    global _event_loop
    with _event_loop_lock:
        if _event_loop is None or _event_loop.is_closed():
            _event_loop = asyncio.new_event_loop()
            threading.Thread(target=_event_loop.run_forever, name="tool-event-loop", daemon=True).start()
    if timeout_s is None:
        return asyncio.run_coroutine_threadsafe(coroutine, _event_loop).result()
    try:
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, timeout_s), _event_loop).result()
    except TimeoutError:
        raise TimeoutError(f"no answer within {timeout_s:g} s; the call was cancelled") from None


# --------------------------------------------------------------------------- calculator
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class Calculator(Tool):
    """Evaluates an arithmetic expression: numbers, + - * / // % **, parentheses. Nothing else
    is evaluated (no names, calls or attributes), and exponents and results are bounded, so a
    call cannot hang or exhaust memory."""

    default_schema = {"type": "function", "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return its value.",
        "parameters": {"type": "object", "required": ["expression"], "properties": {
            "expression": {"type": "string", "description": "for example (12 + 7) * 3"}}}}}

    def __init__(self, schema: dict | None = None, max_digits: int = 100):
        super().__init__(schema)
        self.max_digits = int(max_digits)

    def execute(self, arguments: dict) -> ToolOutput:
        expression = arguments.get("expression")
        if not isinstance(expression, (str, int, float)):
            return ToolOutput("Error: the calculator needs an 'expression' argument (a string)", error=True)
        try:
            value = self._evaluate(ast.parse(str(expression), mode="eval").body)
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError, TypeError) as exc:
            return ToolOutput(f"Error: {type(exc).__name__}: {exc}", error=True)
        if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
            value = int(value)
        return ToolOutput(str(value))

    def _evaluate(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._evaluate(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._evaluate(node.left), self._evaluate(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) * math.log10(max(abs(left), 2)) > self.max_digits:
                raise OverflowError(f"the result would have more than {self.max_digits} digits")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, complex):
                raise ValueError("the result is not a real number")
            if isinstance(value, int) and abs(value) >= 10 ** self.max_digits:
                raise OverflowError(f"the result has more than {self.max_digits} digits")
            return value
        raise ValueError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


# --------------------------------------------------------------------------- python
class PythonTool(Tool):
    """Runs the model's Python program in the code sandbox (``rewards/sandbox.py``: no network,
    a scratch directory, memory, CPU and process limits, a wall-clock timeout) and returns what it
    printed. Keyword arguments are the sandbox's limits."""

    default_schema = {"type": "function", "function": {
        "name": "python",
        "description": "Run a Python program and return what it prints.",
        "parameters": {"type": "object", "required": ["code"], "properties": {
            "code": {"type": "string", "description": "the program; print the values you need"}}}}}

    def __init__(self, schema: dict | None = None, **limits):
        super().__init__(schema)
        from hybrid_rl.rewards.sandbox import Sandbox, SandboxUnavailable

        try:
            self.sandbox = Sandbox(**limits).start()
        except (SandboxUnavailable, TypeError) as exc:
            raise ToolConfigError(f"python tool: {exc}") from exc

    def execute(self, arguments: dict) -> ToolOutput:
        code = arguments.get("code")
        if not isinstance(code, str):
            return ToolOutput("Error: the python tool needs a 'code' argument (a string)", error=True)
        result = self.sandbox.run(code)
        if result.status == "timeout":
            return ToolOutput(f"Error: the program ran longer than {self.sandbox.timeout_s:g} s and was stopped",
                              error=True)
        if result.status == "error":
            return ToolOutput((result.stdout + result.stderr[-1000:]).strip() or "Error: the program failed",
                              error=True)
        return ToolOutput(result.stdout.strip())

    def close(self) -> None:
        self.sandbox.close()


class SandboxFusionTool(PythonTool):
    """verl's ``verl.tools.sandbox_fusion_tools.SandboxFusionTool`` entry (a remote code service)
    run in the local sandbox instead, so verl's tool configs work unchanged: ``default_timeout``
    and ``memory_limit_mb`` become the sandbox's limits; the service's address, workers and rate
    limits are not used."""

    default_schema = {**PythonTool.default_schema,
                      "function": {**PythonTool.default_schema["function"], "name": "code_interpreter"}}

    def __init__(self, schema: dict | None = None, default_timeout: float = 30, memory_limit_mb: int = 1024,
                 default_language: str = "python", sandbox_fusion_url: str | None = None, num_workers: int = 10,
                 enable_global_rate_limit: bool = True, rate_limit: int = 10):
        if default_language != "python":
            raise ToolConfigError(f"SandboxFusionTool: default_language={default_language!r}; the local sandbox "
                                  "runs Python only")
        super().__init__(schema, timeout_s=default_timeout, memory_mb=memory_limit_mb)


TOOLS: dict[str, type[Tool]] = {"calculator": Calculator, "python": PythonTool}


# --------------------------------------------------------------------------- Python functions
# What @function_tool leaves on a function: (tool name or None for the function's, schema or None).
FUNCTION_TOOL_MARK = "__hybrid_rl_function_tool__"
FUNCTION_TOOL_KEY = "actor_rollout_ref.rollout.multi_turn.function_tool_path"


def function_tool(name: str | Callable | None = None, *, schema: dict | None = None):
    """Mark a function as a tool, in verl's forms: ``@function_tool``, ``@function_tool("name")``,
    ``@function_tool(schema={...})``. Without a schema, transformers' ``get_json_schema`` infers
    one from the type hints and the docstring's ``Args:`` block when the file is loaded."""
    def mark(fn: Callable, tool_name: str | None) -> Callable:
        setattr(fn, FUNCTION_TOOL_MARK, (tool_name, schema))
        return fn
    if callable(name) and schema is None:
        return mark(name, None)
    return lambda fn: mark(fn, name)


class FunctionTool(Tool):
    """A ``@function_tool`` function called with the model's arguments. What it returns becomes
    the tool's text as in verl: a string as it is, a dict as JSON, verl's ``ToolResponse`` by its
    text, a tuple ``(response, reward, metrics)`` by its response and its reward (0 when None or
    not given), anything else by ``str``."""

    def __init__(self, fn: Callable, name: str | None = None, schema: dict | None = None):
        name = name or fn.__name__
        if schema is None:
            from transformers.utils import get_json_schema

            try:
                schema = get_json_schema(fn)
            except Exception as exc:  # transformers' DocstringParsingException, TypeHintParsingException
                raise ToolConfigError(f"{FUNCTION_TOOL_KEY}: the schema of {fn.__module__}.{fn.__qualname__} cannot be "
                                      f"inferred ({exc}). Give every parameter a type hint and describe it in the "
                                      "docstring's Args: block, or pass @function_tool(schema={...}).") from exc
            schema["function"]["name"] = name
            schema["function"].pop("return", None)  # not part of an OpenAI function schema (verl drops it too)
        super().__init__(schema)
        self.fn = fn

    def call(self, arguments: dict, trajectory: Any, timeout_s: float | None = None) -> ToolOutput:
        result = self.fn(**arguments)
        if inspect.isawaitable(result):
            result = run_coroutine(result, timeout_s)
        return function_tool_output(result)

    def execute(self, arguments: dict) -> ToolOutput:
        return self.call(arguments, None)


def function_tool_output(result: Any) -> ToolOutput:
    reward = None
    if isinstance(result, tuple):
        if not 1 <= len(result) <= 3:
            raise TypeError(f"a function tool returned a tuple of {len(result)}; return (response,), "
                            "(response, reward) or (response, reward, metrics)")
        result, reward = result[0], (result[1] if len(result) > 1 else None)
    reward = 0.0 if reward is None else float(reward)
    if isinstance(result, str):
        return ToolOutput(result, reward=reward)
    if isinstance(result, dict):
        return ToolOutput(json.dumps(result, ensure_ascii=False), reward=reward)
    text = getattr(result, "text", None)  # verl's ToolResponse
    return ToolOutput(text if isinstance(text, str) else str(result), reward=reward)


def load_function_tools(path: str) -> dict[str, FunctionTool]:
    """The ``@function_tool`` functions of the Python file ``path``, by tool name. The file's
    ``import`` of verl's decorator gets ours while it runs, so a verl user's file loads unchanged."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isfile(path):
        raise ToolConfigError(f"{FUNCTION_TOOL_KEY}={path}: no such file. Point it at a Python file of "
                              "@function_tool functions (docs/multi_turn.md).")
    module_name = "hybrid_rl_function_tools_" + path.replace(os.sep, "_").replace(".", "_")
    try:
        with verl_stand_ins({"verl.tools.function_tool": {"function_tool": function_tool}}):
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module  # so the file can import its siblings by this name
            spec.loader.exec_module(module)
    except Exception as exc:
        raise ToolConfigError(f"{FUNCTION_TOOL_KEY}={path} failed to load: {type(exc).__name__}: {exc}") from exc
    tools: dict[str, FunctionTool] = {}
    for fn in vars(module).values():
        mark = getattr(fn, FUNCTION_TOOL_MARK, None)
        if mark is None or not callable(fn):
            continue
        tool = FunctionTool(fn, *mark)
        if tool.name in tools:
            raise ToolConfigError(f"{path}: two function tools named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    if not tools:
        raise ToolConfigError(f"{FUNCTION_TOOL_KEY}={path} defines no @function_tool function: decorate the "
                              "functions the model may call (from hybrid_rl.agent import function_tool).")
    return tools


# --------------------------------------------------------------------------- config
def config_entries(path: str, key: str, section: str) -> list[tuple[str, dict]]:
    """The entries of the ``section:`` list of the YAML file ``path`` (given by config ``key``),
    each with a ``class_name``, as (where, entry) pairs for error messages."""
    path = os.path.expanduser(str(path))
    if not os.path.isfile(path):
        raise ToolConfigError(f"{key}={path}: no such file. Point it at a YAML file with a '{section}:' list "
                              "(docs/multi_turn.md).")
    with open(path) as f:
        try:
            doc = yaml.safe_load(f)
        except yaml.YAMLError as exc:
            raise ToolConfigError(f"{key}={path} is not valid YAML: {exc}") from exc
    entries = doc.get(section) if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{key}={path}: expected a non-empty '{section}:' list of entries with a class_name")
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            raise ToolConfigError(f"{path}: {section}[{i}]: each entry needs a class_name")
    return [(f"{path}: {section}[{i}]", entry) for i, entry in enumerate(entries)]


def import_class(class_name: str, where: str, bases: tuple[type, ...], built_in: dict[str, type],
                 from_verl: dict[str, type], kind: str) -> type:
    """A config entry's class: a built-in name, one of verl's classes with a local equivalent, or
    the dotted path of a subclass of one of ``bases`` (``kind`` names it in errors: tool,
    interaction). The class's module imports verl's tool and interaction interfaces as ours
    (``verl_tools.VERL_TOOL_API``), so a file written for verl loads unchanged."""
    from hybrid_rl.agent.verl_tools import VERL_TOOL_API

    if class_name in built_in or class_name in from_verl:
        return built_in.get(class_name) or from_verl[class_name]
    module_name, _, attr = class_name.rpartition(".")
    names = " or ".join(f"{base.__module__}.{base.__name__}" for base in bases)
    hint = f"Use a built-in {kind} ({', '.join(built_in)}) or the dotted path of a subclass of {names}."
    if not module_name:
        raise ToolConfigError(f"{where}: unknown {kind} {class_name!r}. {hint}")
    if module_name.split(".")[0] == "verl":
        raise ToolConfigError(f"{where}: {class_name!r} is one of verl's own {kind} classes, which has no "
                              f"equivalent here (of verl's, {', '.join(from_verl)} run here). {hint}")
    try:
        with verl_stand_ins(VERL_TOOL_API):
            cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ToolConfigError(f"{where}: cannot import {class_name!r} ({exc}). {hint}") from exc
    if not (isinstance(cls, type) and issubclass(cls, bases)):
        raise ToolConfigError(f"{where}: {class_name!r} is not a subclass of {names}. {hint}")
    return cls


def load_tools(path: str) -> dict[str, Tool]:
    """The tools of a tool config file, by the function name the model calls them with."""
    from hybrid_rl.agent.verl_tools import VERL_TOOLS, BaseTool, build_verl_tool

    tools: dict[str, Tool] = {}
    for where, entry in config_entries(path, "actor_rollout_ref.rollout.multi_turn.tool_config_path", "tools"):
        options = dict(entry.get("config") or {})
        if options.get("type", "native") != "native":
            raise ToolConfigError(f"{where}: config.type={options['type']!r}: only native tools run here (verl's "
                                  "MCP tools need an MCP server's client, which is not built); use type: native")
        cls = import_class(entry["class_name"], where, (Tool, BaseTool), TOOLS, VERL_TOOLS, "tool")
        if issubclass(cls, BaseTool):  # verl's interface: its config entry as it is
            tool = build_verl_tool(cls, entry, options, where)
        else:
            options.pop("type", None)  # verl's "native" marker: every tool here runs in this process
            try:
                tool = cls(entry.get("tool_schema"), **options)
            except TypeError as exc:
                raise ToolConfigError(f"{where}: {entry['class_name']} does not take the config {options}: {exc}") from exc
        if tool.name in tools:
            raise ToolConfigError(f"{where}: a second tool named {tool.name!r}; function names must be unique")
        tools[tool.name] = tool
    return tools
