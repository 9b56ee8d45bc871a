"""Multi-turn rollouts: the policy writes, calls tools, reads their answers, and writes again.

One trajectory is the prompt followed by alternating parts: an assistant turn the engine sampled
(trained on: loss mask 1, with its log-probs) and a tool turn this module inserted (the tool
outputs as the chat template renders them, then the start of the next assistant turn: loss mask
0). The trainer sees the whole trajectory as one response; the loss mask keeps tool tokens out of
every loss term, and the reward reads the whole text.

Tool calls are found in each turn as ``multi_turn.format`` says (`formats.py`: Hermes JSON in
``<tool_call>`` tags, or gpt-oss's harmony messages to ``functions.<name>``). With one call per
turn (``max_parallel_calls: 1``, verl's default) the engine stops right after the call, and the
turn's end-of-turn text is inserted with the tool turn. A turn with no call ends the
trajectory, unless the row has an interaction agent (`interactions.py`): it then answers as the
user, or ends the trajectory. So do the response budget (``rollout.response_length`` tokens for
all turns together), ``max_assistant_turns`` and ``max_user_turns`` (tool and interaction turns).
A malformed call, an unknown tool, a tool's error or one that does not answer within
``tool_timeout_s`` is answered with an error text the model reads next turn, and counted; an
interaction that fails or does not answer in that time ends its trajectory, and is counted.
"""

from __future__ import annotations

import functools
import uuid
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybrid_rl.agent import interactions as interaction_agents
from hybrid_rl.agent.formats import Hermes, ToolCall, get_format
from hybrid_rl.agent.interactions import Interaction
from hybrid_rl.agent.tools import Tool, ToolOutput
from hybrid_rl.rollout_trace import Span, now_ns

_MARK = "\x00assistant-turn\x00"  # stands for an assistant turn's text when rendering the template
_PROBE = "tool-output-probe-91c2"  # plain text: some templates JSON-encode tool outputs
TOOL_THREADS = 32  # tool calls (and interaction turns) run at once


class MultiTurnError(ValueError):
    """The model's chat template cannot render tool turns as this rollout needs them."""


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
    template: the rest of the finished assistant turn after its stop token, the tool messages (or
    the user's reply), and the header of the next assistant turn."""

    def __init__(self, tokenizer, chat_template_kwargs: dict | None = None, call_format=None):
        self.tokenizer = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.format = call_format or Hermes(tokenizer)
        self.user = {"role": "user", "content": "?"}
        probe = self.format.call_message("", [ToolCall("calculator", {})])
        try:
            rendered = self._text([{"role": "tool", "content": _PROBE}], "", probe)
        except MultiTurnError:
            raise
        except Exception as exc:  # noqa: BLE001  jinja's errors, and the template's own raise_exception
            raise MultiTurnError(f"the chat template fails to render a tool message after an assistant turn "
                                 f"({type(exc).__name__}: {exc}); set actor_rollout_ref.model.custom_chat_template "
                                 f"to a template that renders them, or multi_turn.format to the model's tool-call "
                                 f"format") from exc
        if _PROBE not in rendered:
            raise MultiTurnError(
                "the chat template does not render a tool message after an assistant turn (it leaves out "
                "messages with role 'tool'): set actor_rollout_ref.model.custom_chat_template to a template "
                "that renders them.")

    def _render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                                  **self.kwargs)

    def _text(self, messages: list[dict], stop_text: str, call_message: dict | None) -> str:
        if call_message is None:  # the turn's own text, which the template copies
            rendered = self._render([self.user, {"role": "assistant", "content": _MARK}] + messages, True)
            return self.format.closing(rendered[rendered.index(_MARK) + len(_MARK):], stop_text)
        # The template renders the call itself, ending with the token the engine stopped on.
        before = self._render([self.user, call_message])
        rendered = self._render([self.user, call_message] + messages, True)
        if not rendered.startswith(before):
            raise MultiTurnError("the chat template renders an assistant turn with a tool call differently once "
                                 "its tool answers follow: set actor_rollout_ref.model.custom_chat_template to "
                                 "one that renders earlier turns as it rendered them last")
        return rendered[len(before):]

    def inserted_turn(self, messages: list[dict], stop_text: str, call_message: dict | None = None) -> list[int]:
        """Token ids of the ``messages`` (tool outputs, or the user's reply) answering an
        assistant turn that ended with ``stop_text`` (its end-of-turn token; empty when the turn
        stopped after a tool call, which the turn's end then closes); ``call_message`` is the
        turn as the format has the template render it before tool answers."""
        return self.tokenizer.encode(self._text(messages, stop_text, call_message), add_special_tokens=False)


def format_token_ids(call_format, tokenizer) -> list[int]:
    """The ids of the special tokens that end a turn with a call in ``call_format`` (the engine
    stops on them); a tokenizer without them cannot write such calls."""
    ids = []
    for token in call_format.end_tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if token_id is None or token_id == tokenizer.unk_token_id or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise MultiTurnError(f"actor_rollout_ref.rollout.multi_turn.format={call_format.name} needs the special "
                                 f"token {token} in the model's tokenizer, which has none: set multi_turn.format to "
                                 "the model's tool-call format (hermes for ChatML models).")
        ids.append(token_id)
    return ids


class TokenEngine(Protocol):
    def generate_ids(self, prompts: list[list[int]], settings: dict, max_tokens: list[int],
                     stop: list[str] | None = None,
                     stop_token_ids: list[int] | None = None) -> tuple[list[list[int]], list[list[float]]]: ...


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
    tool_rewards: list[float] = field(default_factory=list)  # each tool call's own reward
    messages: list[dict] = field(default_factory=list)  # the conversation (given the rows), for agents and tools
    # What verl's tools read of their trajectory (``agent_data``): the row's tools_kwargs, and
    # extra_fields, where a tool keeps what the reward function should see in extra_info.
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tools_kwargs: dict = field(default_factory=dict)
    extra_fields: dict = field(default_factory=dict)
    spans: list[Span] = field(default_factory=list)  # its engine and tool calls, for rollout traces

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
        self.format = get_format(cfg.format, tokenizer)
        self.eos = set(eos_token_ids) | set(format_token_ids(self.format, tokenizer))
        self.response_length = int(response_length)
        self.chat = ChatTurns(tokenizer, chat_template_kwargs, self.format)

    def run(self, engine: TokenEngine, prompts: list[list[int]], settings: dict,
            rows: list[dict] | None = None) -> list[Trajectory]:
        """``rows``: per prompt its ``raw_prompt`` (chat messages), ``extra_info``, ``data_source``
        and ``ground_truth``, which interactions need and tools may read (verl's
        ``extra_info.tools_kwargs``)."""
        trajectories = [Trajectory() for _ in prompts]
        for trajectory, row in zip(trajectories, rows or []):
            trajectory.messages = [dict(m) for m in row.get("raw_prompt") or []]
            trajectory.tools_kwargs = dict((row.get("extra_info") or {}).get("tools_kwargs") or {})
        talks = self.start_interactions(rows, trajectories) if self.interactions else {}
        try:
            self._turns(engine, prompts, settings, trajectories, talks, conversations=rows is not None)
        finally:
            for i, (interaction, instance_id, _) in talks.items():
                try:
                    interaction_agents.call(interaction.finalize_interaction, instance_id)
                except Exception:  # noqa: BLE001  a failed clean-up must not lose the batch
                    trajectories[i].interaction_errors += 1
        return trajectories

    def _turns(self, engine: TokenEngine, prompts: list[list[int]], settings: dict,
               trajectories: list[Trajectory], talks: dict, conversations: bool) -> None:
        cfg = self.cfg
        active = list(range(len(prompts)))
        # A turn ends at the model's end-of-turn token or, when it may make one call only, right
        # after that call: small models often write on past it, and the answer should come next.
        stop = self.format.stop_texts if cfg.max_parallel_calls == 1 and self.format.stop_texts else None
        stop_token_ids = sorted(self.eos)
        while active:
            contexts = [prompts[i] + trajectories[i].tokens for i in active]
            budgets = [self.response_length - len(trajectories[i].tokens) for i in active]
            start = now_ns()
            tokens, log_probs = engine.generate_ids(contexts, settings, budgets, stop=stop, stop_token_ids=stop_token_ids)
            end = now_ns()
            pending = []  # (row, calls, errors, stop text)
            replies = []  # (row, stop text): answers the row's interaction reads
            for i, new, lps in zip(active, tokens, log_probs):
                trajectory = trajectories[i]
                trajectory.spans.append(Span("generate", start, end, tokens=(len(trajectory.tokens),
                                                                            len(trajectory.tokens) + len(new))))
                trajectory.add(new, lps, trained=True)
                trajectory.assistant_turns += 1
                text = self.tokenizer.decode(new, skip_special_tokens=False)
                if conversations:
                    trajectory.messages.append({"role": "assistant", "content": self.format.answer(new)})
                ended = bool(new) and new[-1] in self.eos
                if not (ended or self.format.ends_with_call(text)):
                    continue  # the budget ran out inside the turn
                calls, errors = self.format.parse(text)
                if (cfg.max_assistant_turns and trajectory.assistant_turns >= cfg.max_assistant_turns) or \
                        (cfg.max_user_turns and trajectory.user_turns >= cfg.max_user_turns):
                    continue
                stop_text = self.tokenizer.decode(new[-1:], skip_special_tokens=False) if ended else ""
                if calls or errors:
                    calls = calls[:cfg.max_parallel_calls]
                    pending.append((i, calls, errors, stop_text, self.format.call_message(text, calls)))
                elif i in talks:
                    replies.append((i, stop_text))
                # else an answer: the trajectory is complete
            outputs = iter(self.call_tools([(call, trajectories[i]) for i, calls, _, _, _ in pending for call in calls]))
            active = []
            for i, calls, errors, stop_text, call_message in pending:
                trajectory = trajectories[i]
                answers = [next(outputs) for _ in calls]
                trajectory.tool_calls += len(calls)
                trajectory.tool_errors += len(errors) + sum(a.error for a in answers)
                trajectory.tool_rewards += [a.reward for a in answers]
                texts = [truncate_text(a.text, cfg.max_tool_response_length, cfg.tool_response_truncate_side)
                         for a in answers] + errors
                if self._insert(trajectory, [{"role": "tool", "content": text} for text in texts], stop_text,
                                call_message):
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

    def _insert(self, trajectory: Trajectory, messages: list[dict], stop_text: str,
                call_message: dict | None = None) -> bool:
        """Append an inserted turn (loss mask 0) if it leaves room for a reply; False ends the
        trajectory where it is."""
        turn = self.chat.inserted_turn(messages, stop_text, call_message)
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

    def call_tools(self, calls: list[tuple[ToolCall, Trajectory]]) -> list[ToolOutput]:
        """Every call at once (threads; a sandboxed tool's work is another process; verl's
        coroutines on one event loop); a call that raises or has not answered ``tool_timeout_s``
        after the calls started is answered with an error."""
        timeout = float(self.cfg.tool_timeout_s)
        start = now_ns()
        results = self._concurrently([functools.partial(self._timed_call, *call) for call in calls])
        end = now_ns()
        outputs = []
        for (call, trajectory), result in zip(calls, results):
            output, call_start, call_end = result or (
                ToolOutput(f"Error: the tool did not answer within {timeout:g} s", error=True), start, end)
            trajectory.spans.append(Span(f"tool {call.name}", call_start, call_end, inputs=call.arguments, outputs={
                "text": output.text, "reward": output.reward, "error": output.error}))
            outputs.append(output)
        return outputs

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

    def _timed_call(self, call: ToolCall, trajectory: Trajectory) -> tuple[ToolOutput, int, int]:
        start = now_ns()
        return self._call(call, trajectory), start, now_ns()

    def _call(self, call: ToolCall, trajectory: Trajectory) -> ToolOutput:
        tool = self.tools.get(call.name)
        if tool is None:
            return ToolOutput(f"Error: there is no tool named {call.name!r}; the tools are: "
                              f"{', '.join(self.tools)}", error=True)
        try:
            return tool.call(call.arguments, trajectory, float(self.cfg.tool_timeout_s))
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
