"""Multi-turn rollouts: the policy writes, calls tools, reads their answers, and writes again.

One trajectory is the prompt followed by alternating parts: an assistant turn the engine sampled
(trained on: loss mask 1, with its log-probs) and a tool turn this module inserted (the tool
outputs as the chat template renders them, then the start of the next assistant turn: loss mask
0). The trainer sees the whole trajectory as one response; the loss mask keeps tool tokens out of
every loss term, and the reward reads the whole text.

Tool calls are Hermes-style (Qwen2.5, Hermes, many others): JSON objects
``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``. With one call
per turn (``max_parallel_calls: 1``, verl's default) the engine stops right after the call, and
the turn's end-of-turn text is inserted with the tool turn. A turn with no call ends the
trajectory, unless the row has an interaction agent (`interactions.py`): it then answers as the
user, or ends the trajectory. So do the response budget (``rollout.response_length`` tokens for
all turns together), ``max_assistant_turns`` and ``max_user_turns`` (tool and interaction turns).
A malformed call, an unknown tool, a tool's error or one that does not answer within
``tool_timeout_s`` is answered with an error text the model reads next turn, and counted; an
interaction that fails or does not answer in that time ends its trajectory, and is counted.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybrid_rl.agent import interactions as interaction_agents
from hybrid_rl.agent.interactions import Interaction
from hybrid_rl.agent.tools import Tool, ToolOutput

CALL_END = "</tool_call>"
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_MARK = "\x00assistant-turn\x00"  # stands for an assistant turn's text when rendering the template
TOOL_THREADS = 32  # tool calls (and interaction turns) run at once


class MultiTurnError(ValueError):
    """The model's chat template cannot render tool turns as this rollout needs them."""


@dataclass
class ToolCall:
    name: str
    arguments: dict


def parse_tool_calls(text: str) -> tuple[list[ToolCall], list[str]]:
    """The Hermes-style tool calls in ``text``, and an error text for each malformed one."""
    calls, errors = [], []
    bodies = TOOL_CALL.findall(text)
    if text.count("<tool_call>") > len(bodies):
        errors.append("Error: a <tool_call> is not closed with </tool_call>")
    for body in bodies:
        try:
            call = json.loads(body)
        except json.JSONDecodeError as exc:
            errors.append(f"Error: the tool call is not valid JSON ({exc.msg} at character {exc.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            errors.append('Error: a tool call must be a JSON object with a "name" and "arguments"')
            continue
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        if not isinstance(arguments, dict):
            errors.append(f'Error: the "arguments" of the call to {call["name"]} must be a JSON object')
            continue
        calls.append(ToolCall(call["name"], arguments))
    return calls, errors


def truncate_text(text: str, limit: int, side: str) -> str:
    """verl's rule for long tool outputs: keep the head (``left``), the tail (``right``) or both
    halves (``middle``) of ``limit`` characters, marking the cut."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


class ChatTurns:
    """The tokens this rollout inserts between two assistant turns, from the model's own chat
    template: the rest of the finished assistant turn after its stop token, the tool messages,
    and the header of the next assistant turn."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.history = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _MARK}]
        self.before = self._render(self.history)
        self.after_assistant = self.before[self.before.rindex(_MARK) + len(_MARK):]
        probe = self._render(self.history + [{"role": "tool", "content": "\x00tool-output\x00"}], True)
        if not probe.startswith(self.before) or "\x00tool-output\x00" not in probe[len(self.before):]:
            raise MultiTurnError(
                "the chat template does not render a tool message after an assistant turn (it leaves out "
                "messages with role 'tool', or renders earlier turns differently once one follows): "
                "set actor_rollout_ref.model.custom_chat_template to a template that renders them.")

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.kwargs)

    def inserted_turn(self, messages: list[dict], stop_text: str) -> list[int]:
        """Token ids of the ``messages`` (tool outputs, or the user's reply) answering an
        assistant turn that ended with ``stop_text`` (its end-of-turn token; empty when the turn
        stopped after a tool call, which the turn's end then closes)."""
        rendered = self._render(self.history + messages, True)
        closing = self.after_assistant
        # The engine stopped on the end-of-turn token, which the trajectory already holds.
        closing = closing[len(stop_text):] if stop_text and closing.startswith(stop_text) else closing
        return self.tokenizer.encode(closing + rendered[len(self.before):], add_special_tokens=False)


class TokenEngine(Protocol):
    def generate_ids(self, prompts: list[list[int]], settings: dict, max_tokens: list[int],
                     stop: list[str] | None = None) -> tuple[list[list[int]], list[list[float]]]: ...


@dataclass
class Trajectory:
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    assistant_turns: int = 0
    tool_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    interaction_turns: int = 0
    interaction_errors: int = 0
    turn_scores: list[float] = field(default_factory=list)  # the interaction's score of each answer
    messages: list[dict] = field(default_factory=list)  # the conversation, for the interaction

    @property
    def user_turns(self) -> int:
        return self.tool_turns + self.interaction_turns

    def add(self, tokens: list[int], log_probs: list[float] | None, trained: bool) -> None:
        self.tokens += tokens
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(tokens)
        self.loss_mask += [int(trained)] * len(tokens)


class MultiTurnRollout:
    """Runs every row of a batch as a trajectory, turn by turn: all unfinished trajectories
    generate together, then all their tool calls run together."""

    def __init__(self, cfg: Any, tokenizer, tools: dict[str, Tool], eos_token_ids: list[int],
                 response_length: int, chat_template_kwargs: dict | None = None,
                 interactions: dict[str, Interaction] | None = None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.tools = tools
        self.interactions = interactions or {}
        self.eos = set(eos_token_ids)
        self.response_length = int(response_length)
        self.chat = ChatTurns(tokenizer, chat_template_kwargs)

    def run(self, engine: TokenEngine, prompts: list[list[int]], settings: dict,
            rows: list[dict] | None = None) -> list[Trajectory]:
        """``rows``: per prompt its ``raw_prompt`` (chat messages), ``extra_info``, ``data_source``
        and ``ground_truth``, which interactions need."""
        trajectories = [Trajectory() for _ in prompts]
        talks = self.start_interactions(rows, trajectories) if self.interactions else {}
        try:
            self._turns(engine, prompts, settings, trajectories, talks)
        finally:
            for i, (interaction, instance_id, _) in talks.items():
                try:
                    interaction_agents.call(interaction.finalize_interaction, instance_id)
                except Exception:  # noqa: BLE001  a failed clean-up must not lose the batch
                    trajectories[i].interaction_errors += 1
        return trajectories

    def _turns(self, engine: TokenEngine, prompts: list[list[int]], settings: dict,
               trajectories: list[Trajectory], talks: dict) -> None:
        cfg = self.cfg
        active = list(range(len(prompts)))
        # A turn ends at the model's end-of-turn token or, when it may make one call only, right
        # after that call: small models often write on past it, and the answer should come next.
        stop = [CALL_END] if cfg.max_parallel_calls == 1 else None
        while active:
            contexts = [prompts[i] + trajectories[i].tokens for i in active]
            budgets = [self.response_length - len(trajectories[i].tokens) for i in active]
            tokens, log_probs = engine.generate_ids(contexts, settings, budgets, stop=stop)
            pending = []  # (row, calls, errors, stop text)
            replies = []  # (row, stop text): answers the row's interaction reads
            for i, new, lps in zip(active, tokens, log_probs):
                trajectory = trajectories[i]
                trajectory.add(new, lps, trained=True)
                trajectory.assistant_turns += 1
                text = self.tokenizer.decode(new, skip_special_tokens=False)
                if talks:
                    trajectory.messages.append({"role": "assistant",
                                                "content": self.tokenizer.decode(new, skip_special_tokens=True)})
                ended = bool(new) and new[-1] in self.eos
                if not (ended or text.rstrip().endswith(CALL_END)):
                    continue  # the budget ran out inside the turn
                calls, errors = parse_tool_calls(text)
                if (cfg.max_assistant_turns and trajectory.assistant_turns >= cfg.max_assistant_turns) or \
                        (cfg.max_user_turns and trajectory.user_turns >= cfg.max_user_turns):
                    continue
                stop_text = self.tokenizer.decode(new[-1:], skip_special_tokens=False) if ended else ""
                if calls or errors:
                    pending.append((i, calls[:cfg.max_parallel_calls], errors, stop_text))
                elif i in talks:
                    replies.append((i, stop_text))
                # else an answer: the trajectory is complete
            outputs = iter(self.call_tools([call for _, calls, _, _ in pending for call in calls]))
            active = []
            for i, calls, errors, stop_text in pending:
                trajectory = trajectories[i]
                answers = [next(outputs) for _ in calls]
                trajectory.tool_calls += len(calls)
                trajectory.tool_errors += len(errors) + sum(a.error for a in answers)
                texts = [truncate_text(a.text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)
                         for a in answers] + errors
                if self._insert(trajectory, [{"role": "tool", "content": text} for text in texts], stop_text):
                    trajectory.tool_turns += 1
                    active.append(i)
            for (i, stop_text), reply in zip(replies, self.interact([(talks[i], trajectories[i]) for i, _ in replies])):
                trajectory = trajectories[i]
                if reply is None:
                    trajectory.interaction_errors += 1
                    continue
                end, text, score = reply
                if score is not None:
                    trajectory.turn_scores.append(float(score))
                if not end and self._insert(trajectory, [{"role": "user", "content": str(text)}], stop_text):
                    trajectory.interaction_turns += 1
                    active.append(i)
            active.sort()

    def _insert(self, trajectory: Trajectory, messages: list[dict], stop_text: str) -> bool:
        """Append an inserted turn (loss mask 0) if it leaves room for a reply; False ends the
        trajectory where it is."""
        turn = self.chat.inserted_turn(messages, stop_text)
        if len(trajectory.tokens) + len(turn) >= self.response_length:
            return False
        trajectory.add(turn, None, trained=False)
        trajectory.messages += messages
        return True

    def start_interactions(self, rows: list[dict] | None, trajectories: list[Trajectory]) -> dict:
        """Open each row's conversation with its interaction: {row: (interaction, instance id,
        kwargs)}. A row whose interaction fails to open runs without one, counted."""
        if rows is None:
            raise ValueError("an interaction needs each prompt's raw_prompt and extra_info")
        talks = {}
        for i, row in enumerate(rows):
            interaction, kwargs = interaction_agents.row_kwargs(row.get("extra_info"), self.interactions)
            opened = {"ground_truth": row.get("ground_truth"), "data_source": row.get("data_source"), **kwargs}
            opened.pop("name", None)
            try:
                instance_id = interaction_agents.call(interaction.start_interaction, uuid.uuid4().hex, **opened)
            except Exception:  # noqa: BLE001  the environment's bug costs this row its agent, not the step
                trajectories[i].interaction_errors += 1
                continue
            trajectories[i].messages = [dict(m) for m in row.get("raw_prompt") or []]
            talks[i] = (interaction, instance_id, kwargs)
        return talks

    def interact(self, turns: list[tuple[tuple, Trajectory]]) -> list[tuple[bool, str, float | None] | None]:
        """Each row's interaction answers its conversation (at once, as tool calls run); None for
        one that raised, returned something else than (end, text, score, metadata), or did not
        answer within ``tool_timeout_s``."""
        def reply(talk, trajectory):
            interaction, instance_id, kwargs = talk
            end, text, score, _ = interaction_agents.call(interaction.generate_response, instance_id,
                                                          list(trajectory.messages), **kwargs)
            return bool(end), text, score

        return self._concurrently([functools.partial(reply, talk, trajectory) for talk, trajectory in turns])

    def call_tools(self, calls: list[ToolCall]) -> list[ToolOutput]:
        """Every call at once (threads; a sandboxed tool's work is another process); a call that
        raises or has not answered ``tool_timeout_s`` after the calls started is answered with an
        error."""
        timeout = float(self.cfg.tool_timeout_s)
        return [output or ToolOutput(f"Error: the tool did not answer within {timeout:g} s", error=True)
                for output in self._concurrently([functools.partial(self._call, call) for call in calls])]

    def _concurrently(self, functions: list) -> list:
        """Run ``functions`` in threads; the result of each, or None where it raised or had not
        returned ``tool_timeout_s`` after they started."""
        if not functions:
            return []
        timeout = float(self.cfg.tool_timeout_s)
        pool = ThreadPoolExecutor(max_workers=min(len(functions), TOOL_THREADS), thread_name_prefix="tool")
        futures = [pool.submit(fn) for fn in functions]
        # Calls beyond the pool's width wait for a thread: give them their own share of the time.
        wait(futures, timeout=timeout * -(-len(functions) // TOOL_THREADS))
        pool.shutdown(wait=False, cancel_futures=True)  # a hung call keeps its thread, not the step
        return [f.result() if f.done() and f.exception() is None else None for f in futures]

    def _call(self, call: ToolCall) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutput(f"Error: there is no tool named {call.name!r}; the tools are: "
                              f"{', '.join(self.tools)}", error=True)
        try:
            return tool.execute(call.arguments)
        except Exception as exc:  # a tool's bug is the model's observation, not the run's end
            return ToolOutput(f"Error: {call.name} failed: {type(exc).__name__}: {exc}", error=True)


def trajectory_tensors(trajectories: list[Trajectory], interactions: bool = False) -> dict[str, torch.Tensor]:
    """Per-row counts for the step's metrics (``metrics.multi_turn_metrics``); the interaction
    turns and errors where rows have interactions."""
    counts = {
        "multi_turn_assistant_turns": [t.assistant_turns for t in trajectories],
        "multi_turn_tool_calls": [t.tool_calls for t in trajectories],
        "multi_turn_tool_errors": [t.tool_errors for t in trajectories],
    }
    if interactions:
        counts["multi_turn_interaction_turns"] = [t.interaction_turns for t in trajectories]
        counts["multi_turn_interaction_errors"] = [t.interaction_errors for t in trajectories]
    return {key: torch.tensor(values) for key, values in counts.items()}
