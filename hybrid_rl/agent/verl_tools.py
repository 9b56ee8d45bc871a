"""verl's tool interface, so that tool classes written for verl's agent loop run here unchanged.

A verl tool subclasses ``verl.tools.base_tool.BaseTool``: it is built as ``cls(config=...,
tool_schema=...)`` and has four coroutines, ``create``, ``execute``, ``calc_reward`` and
``release``. While a tool config's classes are imported, ``verl.tools.base_tool``,
``verl.tools.schemas``, ``verl.utils.rollout_trace`` and ``verl.interactions.base`` resolve to the
stand-ins below (``VERL_TOOL_API``), so verl need not be installed.

Each call runs the lifecycle of verl 0.9's tool agent loop: ``create(create_kwargs=...)`` with
the row's ``extra_info.tools_kwargs[<tool name>].create_kwargs``, ``execute(instance_id,
arguments, agent_data=...)``, then ``release(instance_id)`` whatever happened. ``agent_data`` is
the trajectory (``loop.Trajectory``): ``messages``, ``request_id``, ``tools_kwargs``,
``extra_fields`` (what a tool stores there reaches the reward function's ``extra_info``),
``turn_scores``, ``tool_rewards``, ``assistant_turns``, ``user_turns``. The reward ``execute``
returns is appended to the trajectory's ``tool_rewards``, which the reward function receives as
``extra_info["tool_rewards"]``, as in verl. The coroutines of all tools run on one event loop
(``tools.run_coroutine``), and a call still running at ``tool_timeout_s`` is cancelled.
"""

from __future__ import annotations

import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hybrid_rl.agent.interactions import Interaction
from hybrid_rl.agent.tools import SandboxFusionTool, Tool, ToolConfigError, ToolOutput, run_coroutine
from hybrid_rl.rewards import gsm8k


# ------------------------------------------------------------------ verl.tools.schemas stand-ins
class OpenAIFunctionPropertySchema(BaseModel):
    """One parameter of a function schema (JSON Schema keywords beyond these are kept)."""

    model_config = ConfigDict(extra="allow")
    type: str | list[str]
    description: str | None = None
    enum: list[Any] | None = None


class OpenAIFunctionParametersSchema(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    properties: dict[str, OpenAIFunctionPropertySchema]
    required: list[str]


class OpenAIFunctionSchema(BaseModel):
    name: str
    description: str
    parameters: OpenAIFunctionParametersSchema = Field(
        default_factory=lambda: OpenAIFunctionParametersSchema(type="object", properties={}, required=[]))
    strict: bool = False


class OpenAIFunctionToolSchema(BaseModel):
    """A tool as the chat template shows it to the model (OpenAI's function-tool format)."""

    type: str
    function: OpenAIFunctionSchema


class ToolResponse(BaseModel):
    """What a verl tool answers. Only ``text`` is shown to the model here: the rollout is
    text-only, so a response with images or videos is an error."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None


def rollout_trace_op(fn):
    """verl's tracing decorator. The turn loop itself gives every tool call a span when
    ``rollout.trace.backend`` is set (``rollout_trace.py``), so the method is left as it is."""
    return fn


# ------------------------------------------------------------------ verl.tools.base_tool stand-in
class BaseTool:
    """verl's tool base class: subclass it and override the coroutines. ``config`` is the tool
    config entry's ``config``; ``tool_schema`` its ``tool_schema`` (None when the entry has none:
    then ``get_openai_tool_schema`` must give one)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        self.config = config
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ToolConfigError(f"{type(self).__name__}: no tool_schema in the tool config entry and none from "
                                  "get_openai_tool_schema(); give the entry a tool_schema")
        self.name = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, ToolResponse]:
        """Open the state of one call; returns its id (a new one unless given)."""
        return instance_id or str(uuid.uuid4()), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        """Run the call: (response, the call's reward, metrics)."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        return 0.0

    async def release(self, instance_id: str, **kwargs) -> None:
        """Forget the call's state."""


# The modules a verl tool or interaction file imports, as ``user_code.verl_stand_ins`` takes them.
VERL_TOOL_API: dict[str, dict[str, object]] = {
    "verl.tools.base_tool": {"BaseTool": BaseTool},
    "verl.tools.schemas": {cls.__name__: cls for cls in (
        OpenAIFunctionPropertySchema, OpenAIFunctionParametersSchema, OpenAIFunctionSchema, OpenAIFunctionToolSchema,
        ToolResponse)},
    "verl.utils.rollout_trace": {"rollout_trace_op": rollout_trace_op},
    "verl.interactions.base": {"BaseInteraction": Interaction},
}


class VerlTool(Tool):
    """A verl ``BaseTool`` as one of this rollout's tools."""

    def __init__(self, impl: BaseTool):
        super().__init__(impl.tool_schema.model_dump(exclude_unset=True, exclude_none=True))
        self.impl = impl

    def call(self, arguments: dict, trajectory: Any, timeout_s: float | None = None) -> ToolOutput:
        return run_coroutine(self._lifecycle(arguments, trajectory), timeout_s)

    async def _lifecycle(self, arguments: dict, trajectory: Any) -> ToolOutput:
        kwargs = (getattr(trajectory, "tools_kwargs", None) or {}).get(self.name) or {}
        instance_id, _ = await self.impl.create(create_kwargs=kwargs.get("create_kwargs") or {})
        try:
            response, reward, _ = await self.impl.execute(instance_id, arguments, agent_data=trajectory)
        finally:
            await self.impl.release(instance_id)
        if not isinstance(response, ToolResponse):
            raise TypeError(f"execute returned {type(response).__name__} as its response; return a ToolResponse")
        if response.image or response.video:
            raise ValueError("the tool answered with images or videos; rollouts here are text-only")
        return ToolOutput(response.text or "", reward=float(reward) if reward is not None else 0.0)


def build_verl_tool(cls: type[BaseTool], entry: dict, options: dict, where: str) -> VerlTool:
    """A tool config entry's verl tool, built as verl builds it."""
    schema = entry.get("tool_schema")
    try:
        tool_schema = OpenAIFunctionToolSchema.model_validate(schema) if schema is not None else None
    except ValueError as exc:
        raise ToolConfigError(f"{where}: tool_schema is not an OpenAI function schema: {exc}") from exc
    try:
        return VerlTool(cls(config=options, tool_schema=tool_schema))
    except TypeError as exc:
        raise ToolConfigError(f"{where}: {entry['class_name']} cannot be built from its config {options}: {exc}") from exc


class Gsm8kAnswerTool(BaseTool):
    """verl's ``verl.tools.gsm8k_tool.Gsm8kTool``, as verl's GSM8K multi-turn examples configure
    it: the model submits ``answer``; the tool scores it against the row's ground truth
    (``create_kwargs.ground_truth``) with the GSM8K rule's flexible match, and answers
    ``Current parsed answer='<answer>' reward=<score>``. The call's reward is 0 when the score
    improves on the instance's last one, else -0.05 (verl's penalty for an unimproved answer; each
    call is a fresh instance, so a call scoring 0 gets -0.05)."""

    UNIMPROVED_PENALTY = -0.05

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None):
        super().__init__(config, tool_schema)
        self.instances: dict[str, dict] = {}

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs) -> tuple[str, ToolResponse]:
        instance_id = instance_id or str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        if ground_truth is None:
            raise ValueError("no ground truth for calc_gsm8k_reward: give each row "
                             "extra_info.tools_kwargs.<tool name>.create_kwargs.ground_truth")
        self.instances[instance_id] = {"answer": "", "ground_truth": str(ground_truth), "score": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        answer = str(parameters.get("answer", ""))
        state = self.instances[instance_id]
        state["answer"] = answer if answer.startswith("#### ") else "#### " + answer
        score = await self.calc_reward(instance_id)
        reward = 0.0 if score > state["score"] else self.UNIMPROVED_PENALTY
        state["score"] = score
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={score}"), reward, {}

    async def calc_reward(self, instance_id: str, **kwargs) -> float:
        state = self.instances[instance_id]
        return gsm8k.compute_score(state["answer"], state["ground_truth"], method="flexible", format_score=0.0)

    async def release(self, instance_id: str, **kwargs) -> None:
        self.instances.pop(instance_id, None)


# verl's own tool classes that have an equivalent here, by the class_name verl's configs give.
VERL_TOOLS: dict[str, type] = {"verl.tools.sandbox_fusion_tools.SandboxFusionTool": SandboxFusionTool,
                               "verl.tools.gsm8k_tool.Gsm8kTool": Gsm8kAnswerTool}
