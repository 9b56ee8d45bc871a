"""verl's agent-loop interface, so that agent loops written for verl run here unchanged.

A verl agent loop subclasses ``verl.experimental.agent_loop.agent_loop.AgentLoopBase`` and
implements ``async run(sampling_params, **row) -> AgentLoopOutput``; it reaches the model through
``self.server_manager.generate(request_id, prompt_ids=..., sampling_params=...)``, which returns a
``TokenOutput`` (the sampled token ids and their log-probs). ``rollout.agent.agent_loop_config_path``
lists the loops (``- name: <agent_name>``, ``_target_: <module.Class>``, more keys are passed to
the class), and each data row picks one by its ``agent_name`` column (else
``rollout.agent.default_agent_loop``). While the classes are imported, verl's modules they use
resolve to the stand-ins below (``VERL_AGENT_LOOP_API``, with the tool interface of
``verl_tools``), so verl need not be installed.

verl sends every request to an HTTP server that batches continuously. Here the engine is in this
process: all rows' loops run as coroutines on one event loop, and their requests are gathered
until every unfinished loop waits on the model, then generated as one batch (rows in order, so a
rerun samples the same tokens). A loop waiting on anything else (a tool, a thread) is waited for.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import json
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict

from hybrid_rl.agent.formats import FORMATS, get_format
from hybrid_rl.agent.tools import ToolConfigError, load_tools
from hybrid_rl.agent.verl_tools import VERL_TOOL_API, BaseTool, OpenAIFunctionToolSchema, ToolResponse, VerlTool
from hybrid_rl.user_code import verl_stand_ins

KEY = "actor_rollout_ref.rollout.agent.agent_loop_config_path"


# ------------------------------------------------- verl.workers.rollout.replica / agent_loop stand-ins
class TokenOutput(BaseModel):
    """One generation: the sampled token ids and their log-probs."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None


class AgentLoopMetrics(BaseModel):
    generate_sequences: float = 0.0
    tool_calls: float = 0.0
    num_preempted: int = -1


class AgentLoopOutput(BaseModel):
    """What a loop returns for its row: the prompt and response token ids, the response's loss mask
    (1 on the model's tokens, 0 on those a tool or user wrote) and log-probs (0 where the mask is 0)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float] | None = None
    routed_experts: Any = None
    multi_modal_data: dict[str, Any] | None = None
    reward_score: float | None = None
    num_turns: int = 0
    metrics: AgentLoopMetrics | dict = AgentLoopMetrics()
    extra_fields: dict[str, Any] = {}


class DictConfigWrap:
    """verl hands the config to the loops inside this wrapper (``.config``)."""

    def __init__(self, config):
        self.config = config


class AgentLoopBase:
    """verl's base class. ``trainer_config.config`` is the whole run config; ``tokenizer`` the
    model's; ``processor`` and ``dataset_cls`` are None (text-only rollouts)."""

    def __init__(self, trainer_config: DictConfigWrap, server_manager, tokenizer, processor=None, dataset_cls=None,
                 dataset_config: DictConfigWrap | None = None, **kwargs):
        self.config = trainer_config.config
        self.server_manager = server_manager
        self.tokenizer = tokenizer
        self.processor = processor
        self.dataset_cls = dataset_cls
        self.dataset_config = dataset_config.config if dataset_config is not None else self.config.data
        self.apply_chat_template_kwargs = dict(self.dataset_config.get("apply_chat_template_kwargs") or {})
        self.system_prompt = default_system_prompt(tokenizer, self.apply_chat_template_kwargs)
        self.loop = asyncio.get_event_loop()

    async def process_vision_info(self, messages: list[dict]) -> dict:
        return {}

    async def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None, images=None,
                                  videos=None, remove_system_prompt: bool = False) -> list[int]:
        """The token ids of ``messages`` rendered with a generation prompt (and ``tools`` shown);
        ``remove_system_prompt`` drops the template's default system prompt from the front, as
        verl does for turns appended to a conversation."""
        if images or videos:
            raise ValueError("images or videos in an agent loop's messages: rollouts here are text-only")
        ids = chat_ids(self.tokenizer, messages, tools=tools or None, add_generation_prompt=True,
                       **self.apply_chat_template_kwargs)
        return ids[len(self.system_prompt):] if remove_system_prompt else ids

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement async run(sampling_params, **kwargs)")


def chat_ids(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False, **kwargs))


def default_system_prompt(tokenizer, chat_template_kwargs: dict) -> list[int]:
    """The token ids a chat template puts before the first message when no system message is
    given (what one empty user turn adds beyond the second)."""
    one = chat_ids(tokenizer, [{"role": "user", "content": ""}], **chat_template_kwargs)
    two = chat_ids(tokenizer, [{"role": "user", "content": ""}] * 2, **chat_template_kwargs)
    return one[:len(one) - (len(two) - len(one))]


def register(agent_name: str):
    """verl's ``@register``: here the loop file's ``_target_`` entries name the loops, so the
    class is left as it is."""
    return lambda cls: cls


@contextlib.contextmanager
def simple_timer(name: str, timing: dict) -> Iterator[None]:
    """verl's timer: adds the block's seconds to ``timing[name]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        timing[name] = timing.get(name, 0.0) + time.perf_counter() - start


def marked_timer(name: str, timing: dict, *args, **kwargs):
    return simple_timer(name, timing)


def initialize_tools_from_config(tools_config_file: str) -> list:
    """verl's tool registry: the tools of a tool config file as verl tools (``create``,
    ``execute``, ``release``, ``tool_schema``); tools of ours wrapped in ``OurToolAsVerl``."""
    return [tool.impl if isinstance(tool, VerlTool) else OurToolAsVerl(tool)
            for tool in load_tools(tools_config_file).values()]


class OurToolAsVerl(BaseTool):
    """One of our tools behind verl's tool interface: ``execute`` runs it in a thread and answers
    its text and reward."""

    def __init__(self, tool):
        super().__init__(config={}, tool_schema=OpenAIFunctionToolSchema.model_validate(tool.schema))
        self.tool = tool

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple:
        output = await asyncio.to_thread(self.tool.call, parameters, kwargs.get("agent_data"))
        return ToolResponse(text=output.text), output.reward, {}


class FunctionCall(BaseModel):
    """A parsed call: the function's name and its arguments as a JSON string."""

    arguments: str
    name: str


class ToolParser:
    """verl's tool-call parsers, on this package's formats (``formats.py``: ``hermes``,
    ``gpt-oss``) and any a loop's file registers. Malformed calls are left out, as verl leaves them."""

    _registry: dict[str, type] = {}

    def __init__(self, tokenizer, call_format=None):
        self.tokenizer = tokenizer
        self.format = call_format

    @classmethod
    def get_tool_parser(cls, name: str, tokenizer):
        if name in cls._registry:
            return cls._registry[name](tokenizer)
        if name not in FORMATS:
            raise ValueError(f"Unknown tool parser: {name} (here: {', '.join([*FORMATS, *cls._registry])})")
        return cls(tokenizer, get_format(name, tokenizer))

    @classmethod
    def register(cls, name: str):
        def decorator(subclass: type) -> type:
            cls._registry[name] = subclass
            return subclass

        return decorator

    async def extract_tool_calls(self, responses_ids: list[int]) -> tuple[str, list[FunctionCall]]:
        """The text without its calls (for gpt-oss: the final channel's message), and the calls."""
        calls, _ = self.format.parse(self.tokenizer.decode(responses_ids, skip_special_tokens=False))
        return self.format.content(responses_ids), [
            FunctionCall(name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False)) for call in calls]


# ----------------------------------------------------------------------------- the loops' engine
@dataclass
class _Request:
    row: int
    prompt_ids: list[int]
    sampling_params: dict
    future: asyncio.Future


# The row whose loop a coroutine (or a task it started) belongs to.
_ROW: contextvars.ContextVar[int] = contextvars.ContextVar("agent_loop_row")

# Sampling keys a loop may set; the engine returns log-probs always.
SAMPLING_KEYS = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
                 "stop", "ignore_eos", "n"}


class BatchingServer:
    """verl's ``AsyncLLMServerManager`` for loops on one event loop: ``generate`` queues the request
    and the queue goes to the engine when every unfinished row's loop is waiting on it."""

    def __init__(self, engine, settings: dict, context_length: int, default_max_tokens):
        self.engine = engine
        self.settings = settings  # the rollout's (ignore_eos among them)
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens  # prompt -> tokens when the loop sets no max_tokens
        self.pending: list[_Request] = []
        self.running: set[int] = set()
        self.generations: dict[int, int] = {}  # row -> engine calls
        self._scheduled = False

    def start(self, row: int, task: asyncio.Task) -> None:
        self.running.add(row)
        task.add_done_callback(lambda _: self._finished(row))

    def _finished(self, row: int) -> None:
        self.running.discard(row)
        self._schedule()

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None) -> TokenOutput:
        if image_data or video_data:
            raise ValueError("an agent loop sent images or videos: rollouts here are text-only")
        unknown = set(sampling_params) - SAMPLING_KEYS
        if unknown:
            raise ValueError(f"sampling_params {sorted(unknown)} are not taken here; an agent loop may set "
                             f"{', '.join(sorted(SAMPLING_KEYS))}")
        if sampling_params.get("repetition_penalty", 1.0) != 1.0 or sampling_params.get("n", 1) != 1:
            raise ValueError("sampling_params: repetition_penalty other than 1.0 and n other than 1 are not taken "
                             "here; run a loop once per sample, with repetition_penalty=1.0")
        future = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(_ROW.get(), list(map(int, prompt_ids)), dict(sampling_params), future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._dispatch_if_all_wait)

    def _dispatch_if_all_wait(self) -> None:
        self._scheduled = False
        waiting = {request.row for request in self.pending if not request.future.cancelled()}
        if not self.pending or not self.running <= waiting:
            return
        requests, self.pending = sorted(self.pending, key=lambda r: r.row), []
        groups: dict[tuple, list[_Request]] = {}
        for request in requests:
            if not request.future.cancelled():
                groups.setdefault(self._settings_key(request.sampling_params), []).append(request)
        for key, group in groups.items():
            try:
                outputs = self._generate(dict(key[0]), key[1], group)
            except Exception as exc:  # the engine's failure is every waiting loop's
                for request in group:
                    request.future.set_exception(exc)
                continue
            for request, output in zip(group, outputs):
                self.generations[request.row] = self.generations.get(request.row, 0) + 1
                request.future.set_result(output)

    def _settings_key(self, params: dict) -> tuple:
        settings = {**self.settings, **{k: params[k] for k in ("temperature", "top_p", "top_k", "ignore_eos")
                                        if k in params}}
        if settings.get("temperature", 1.0) == 0:  # greedy: the other knobs do not matter
            settings.update(top_p=1.0, top_k=-1)
        stop = params.get("stop")
        stop = (stop,) if isinstance(stop, str) else tuple(stop or ())
        return tuple(sorted(settings.items())), stop

    def _generate(self, settings: dict, stop: tuple, group: list[_Request]) -> list[TokenOutput]:
        limits = []
        for request in group:
            room = self.context_length - len(request.prompt_ids)
            if room < 1:
                raise ValueError(f"an agent loop's prompt is {len(request.prompt_ids)} tokens, at or past the "
                                 f"engine's context of {self.context_length} (rollout.max_model_len, else "
                                 "prompt_length + response_length); end the loop before that")
            asked = request.sampling_params.get("max_tokens", request.sampling_params.get("max_new_tokens"))
            limits.append(max(1, min(room, int(asked) if asked is not None
                                     else self.default_max_tokens(len(request.prompt_ids)))))
        tokens, log_probs = self.engine.generate_ids([r.prompt_ids for r in group], settings, limits,
                                                     stop=list(stop) or None)
        return [TokenOutput(token_ids=list(t), log_probs=list(lp), stop_reason="completed")
                for t, lp in zip(tokens, log_probs)]


# The modules an agent-loop file imports, as ``user_code.verl_stand_ins`` takes them (verl's tool
# interface among them, for loops that call tools).
_LOOP_API = {"AgentLoopBase": AgentLoopBase, "AgentLoopOutput": AgentLoopOutput, "AgentLoopMetrics": AgentLoopMetrics,
             "AsyncLLMServerManager": BatchingServer, "DictConfigWrap": DictConfigWrap, "register": register}
VERL_AGENT_LOOP_API: dict[str, dict[str, object]] = {
    **VERL_TOOL_API,
    "verl.experimental.agent_loop": _LOOP_API,
    "verl.experimental.agent_loop.agent_loop": _LOOP_API,
    "verl.workers.rollout.replica": {"TokenOutput": TokenOutput},
    "verl.utils.profiler": {"simple_timer": simple_timer, "marked_timer": marked_timer},
    "verl.tools.utils.tool_registry": {"initialize_tools_from_config": initialize_tools_from_config},
    "verl.experimental.agent_loop.tool_parser": {"FunctionCall": FunctionCall, "ToolParser": ToolParser},
}


# ----------------------------------------------------------------------------- loading and running
def load_agent_loops(path: str) -> dict[str, dict]:
    """The entries of an agent loop config file, by name: ``{"cls": class, "kwargs": extra keys}``."""
    try:
        entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as exc:
        raise ToolConfigError(f"{KEY}={path} cannot be read: {exc}") from exc
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{KEY}={path} must be a YAML list of entries, each with a name and a _target_ "
                              "(the dotted path of a subclass of verl's AgentLoopBase)")
    loops = {}
    for i, entry in enumerate(entries):
        where = f"{KEY}={path}, entry {i}"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or \
                not isinstance(entry.get("_target_"), str):
            raise ToolConfigError(f"{where}: give it a name (the rows' agent_name) and a _target_ (module.Class)")
        name, target = entry.pop("name"), entry.pop("_target_")
        loops[name] = {"cls": import_agent_loop(target, where), "kwargs": entry}
    return loops


def import_agent_loop(target: str, where: str) -> type:
    module_name, _, attr = target.rpartition(".")
    if module_name.split(".")[0] == "verl":
        raise ToolConfigError(f"{where}: {target} is one of verl's own agent loops; here single_turn_agent and "
                              "tool_agent are built in: name them in the rows' agent_name instead")
    try:
        with verl_stand_ins(VERL_AGENT_LOOP_API):
            cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ToolConfigError(f"{where}: cannot import {target!r} ({type(exc).__name__}: {exc}); make its module "
                              "importable (PYTHONPATH, or the working directory)") from exc
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise ToolConfigError(f"{where}: {target!r} is not a subclass of verl's AgentLoopBase")
    return cls


@dataclass
class AgentResult:
    """One row's loop, as the batch takes it."""

    prompt_ids: list[int]
    tokens: list[int]
    log_probs: list[float]
    loss_mask: list[int]
    extra_fields: dict = field(default_factory=dict)
    num_turns: int = 0
    generations: int = 0
    reward_score: float | None = None  # the loop's own score of the row, which replaces the reward function's


class VerlAgentLoops:
    """The agent loops of ``agent_loop_config_path``, run over a batch's rows."""

    def __init__(self, cfg: Any, tokenizer, loops: dict[str, dict]):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.loops = loops

    def run(self, engine, names: list[str], rows: list[dict], settings: dict) -> list[AgentResult]:
        rollout = self.cfg.actor_rollout_ref.rollout
        from hybrid_rl.workers.rollout import context_length

        budget = int(rollout.prompt_length) + int(rollout.response_length)
        server = BatchingServer(engine, settings, context_length(rollout), lambda prompt: budget - prompt)
        sampling = {"temperature": settings["temperature"], "top_p": settings["top_p"], "top_k": settings["top_k"],
                    "repetition_penalty": 1.0, "logprobs": True}

        async def one(row: int, name: str, kwargs: dict) -> AgentLoopOutput:
            _ROW.set(row)
            loop = self.loops[name]["cls"](trainer_config=DictConfigWrap(self.cfg), server_manager=server,
                                           tokenizer=self.tokenizer, processor=None, dataset_cls=None,
                                           dataset_config=DictConfigWrap(self.cfg.data), **self.loops[name]["kwargs"])
            return await loop.run(dict(sampling), **kwargs)

        async def run_all() -> list:
            tasks = []
            for i, (name, row) in enumerate(zip(names, rows)):
                task = asyncio.create_task(one(i, name, row))
                server.start(i, task)
                tasks.append(task)
            return await asyncio.gather(*tasks, return_exceptions=True)

        outputs = asyncio.run(run_all())
        return [self._result(name, output, server.generations.get(i, 0))
                for i, (name, output) in enumerate(zip(names, outputs))]

    def _result(self, name: str, output, generations: int) -> AgentResult:
        rollout = self.cfg.actor_rollout_ref.rollout
        if isinstance(output, BaseException):
            raise RuntimeError(f"agent loop {name!r} failed: {type(output).__name__}: {output}") from output
        if not isinstance(output, AgentLoopOutput):
            raise TypeError(f"agent loop {name!r} returned {type(output).__name__}; return an AgentLoopOutput")
        n = len(output.response_ids)
        problems = []
        if n > rollout.response_length:
            problems.append(f"{n} response tokens, more than response_length={rollout.response_length}")
        if len(output.prompt_ids) > rollout.prompt_length:
            problems.append(f"{len(output.prompt_ids)} prompt tokens, more than prompt_length={rollout.prompt_length}")
        if len(output.response_mask) != n:
            problems.append(f"a response_mask of {len(output.response_mask)} for {n} response tokens")
        if output.response_logprobs is None or len(output.response_logprobs) != n:
            problems.append("no response_logprobs for each response token (the TokenOutput log_probs of the model's "
                            "tokens, 0.0 for the others): the trainer compares them with its own")
        if problems:
            raise ValueError(f"agent loop {name!r} returned " + "; ".join(problems))
        return AgentResult(list(output.prompt_ids), list(output.response_ids), list(output.response_logprobs),
                           [int(bool(m)) for m in output.response_mask], dict(output.extra_fields),
                           output.num_turns, generations, output.reward_score)


def row_kwargs(row: dict) -> dict:
    """What verl's dataset gives a loop's ``run`` of its row."""
    extra_info = row.get("extra_info") or {}
    return {**row, "tools_kwargs": extra_info.get("tools_kwargs") or {},
            "interaction_kwargs": extra_info.get("interaction_kwargs") or {}}
