"""Multi-turn rollouts (``actor_rollout_ref.rollout.multi_turn``): the tools (`tools.py`), the
interaction agents that reply as the user (`interactions.py`) and the turn loop (`loop.py`).
`setup` is what the driver and every worker run at start: the tools and interactions, and how the
prompts tell the model about the tools."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from hybrid_rl.agent.formats import FORMATS, GptOss, Hermes, ToolCall, get_format
from hybrid_rl.agent.interactions import Interaction, check_interaction_rows, load_interactions
from hybrid_rl.agent.loop import MultiTurnError, MultiTurnRollout, trajectory_tensors
from hybrid_rl.agent.tools import (TOOLS, Calculator, FunctionTool, PythonTool, Tool, ToolConfigError, ToolOutput,
                                   function_tool, load_function_tools, load_tools)

__all__ = ["FORMATS", "TOOLS", "Calculator", "FunctionTool", "GptOss", "Hermes", "Interaction", "MultiTurnError",
           "MultiTurnRollout", "PythonTool", "Tool", "ToolCall", "ToolConfigError", "ToolOutput", "ToolSetup",
           "check_interaction_rows", "function_tool", "get_format", "load_function_tools", "load_interactions",
           "load_tools", "setup", "trajectory_tensors", "AGENT_LOOPS", "SINGLE_TURN_AGENT", "TOOL_AGENT",
           "check_agent_names", "row_agent_names"]

# verl's agent loops, by the name a row's ``agent_name`` column (else
# ``rollout.agent.default_agent_loop``) gives: one generation, or the tool loop of ``multi_turn``.
SINGLE_TURN_AGENT, TOOL_AGENT = "single_turn_agent", "tool_agent"
AGENT_LOOPS = (SINGLE_TURN_AGENT, TOOL_AGENT)
AGENT_KEY = "actor_rollout_ref.rollout.agent.default_agent_loop"


def row_agent_names(agent_names, rollout_cfg: Any) -> list[str]:
    """Each row's agent loop: its ``agent_name``, else ``agent.default_agent_loop``, which
    ``multi_turn.enable=true`` makes the tool loop (verl 0.4-0.7's meaning of that key)."""
    default = rollout_cfg.agent.default_agent_loop
    if default == SINGLE_TURN_AGENT and rollout_cfg.multi_turn.enable:
        default = TOOL_AGENT
    return [name or default for name in agent_names]


def check_agent_names(agent_names: list, rollout_cfg: Any, custom: tuple | list, files) -> None:
    """Every row's agent loop is built in or one of the user's (``custom``: the names in
    agent_loop_config_path), and a row asking for the tool loop gets it."""
    known = (*AGENT_LOOPS, *custom)
    for i, name in enumerate(row_agent_names(agent_names, rollout_cfg)):
        if name not in known:
            raise ToolConfigError(f"{files}, row {i}: agent_name={name!r} is not an agent loop here; the agent loops "
                                  f"are {', '.join(known)} (yours from actor_rollout_ref.rollout.agent."
                                  "agent_loop_config_path). Fix the data's agent_name column or that file.")
        if name == TOOL_AGENT and not rollout_cfg.multi_turn.enable:
            raise ToolConfigError(
                f"{files}, row {i}: agent_name=tool_agent, but the tool loop is off. Set {AGENT_KEY}=tool_agent "
                "or actor_rollout_ref.rollout.multi_turn.enable=true, with the tools in "
                "actor_rollout_ref.rollout.multi_turn.tool_config_path.")

DESCRIBE_TOOLS = ("template", "system", "none")


@dataclass
class ToolSetup:
    tools: dict[str, Tool]
    chat_template_kwargs: dict  # what every prompt and tool turn is rendered with
    system_prompt: str | None  # added to every prompt (describe_tools=system)
    interactions: dict[str, Interaction]

    def close(self) -> None:
        for tool in self.tools.values():
            tool.close()


def setup(rollout_cfg: Any, tokenizer, chat_template_kwargs: dict | None) -> ToolSetup:
    """The tools of ``multi_turn.tool_config_path``, the prompt options that describe them, and
    the interactions of ``multi_turn.interaction_config_path``; raises ToolConfigError /
    MultiTurnError naming the problem and the fix."""
    cfg = rollout_cfg.multi_turn
    key = "actor_rollout_ref.rollout.multi_turn"
    if not cfg.tool_config_path and not cfg.get("function_tool_path") and not cfg.interaction_config_path:
        raise ToolConfigError(f"{key}.enable=true needs {key}.tool_config_path (a YAML file listing the tools), "
                              f"{key}.function_tool_path (a Python file of @function_tool functions) or "
                              f"{key}.interaction_config_path (one listing interaction agents); docs/multi_turn.md")
    if cfg.describe_tools not in DESCRIBE_TOOLS:
        raise ToolConfigError(f"{key}.describe_tools={cfg.describe_tools}: must be one of {', '.join(DESCRIBE_TOOLS)}")
    interactions = load_interactions(cfg.interaction_config_path) if cfg.interaction_config_path else {}
    tools = load_tools(cfg.tool_config_path) if cfg.tool_config_path else {}
    if cfg.get("function_tool_path"):
        functions = load_function_tools(cfg.function_tool_path)
        if clash := sorted(set(functions) & set(tools)):
            raise ToolConfigError(f"{key}.function_tool_path and {key}.tool_config_path both define {', '.join(clash)}; "
                                  "tool names must be unique.")
        tools.update(functions)
    schemas = [tool.schema for tool in tools.values()]
    kwargs = dict(chat_template_kwargs or {})
    system_prompt = None
    if tools and cfg.describe_tools == "template":
        kwargs["tools"] = schemas
        shown = tokenizer.apply_chat_template([{"role": "user", "content": "?"}], tools=schemas, tokenize=False,
                                              add_generation_prompt=True, **chat_template_kwargs or {})
        missing = [name for name in tools if name not in shown]
        if missing:
            raise MultiTurnError(
                f"the model's chat template does not show the tools to the model (it ignores the 'tools' "
                f"argument; {', '.join(missing)} never appear in a rendered prompt). Set {key}.describe_tools=system "
                "to list them in a system message of ours, or describe_tools=none if your prompts describe them.")
    elif tools and cfg.describe_tools == "system":
        listing = "\n".join(json.dumps(schema, ensure_ascii=False) for schema in schemas)
        system_prompt = get_format(cfg.format, tokenizer).instructions(listing)
    return ToolSetup(tools, kwargs, system_prompt, interactions)
