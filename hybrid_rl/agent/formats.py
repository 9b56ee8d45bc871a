"""Tool-call formats (``actor_rollout_ref.rollout.multi_turn.format``, verl's key and names): how a
model writes a tool call, how the rollout finds it in a turn, where the engine stops the turn, and
which assistant message the chat template is given so that it renders the tool answers after it.

``hermes`` (Qwen2.5, Hermes, many others): a JSON object ``{"name": ..., "arguments": {...}}``
between ``<tool_call>`` and ``</tool_call>``, possibly several in one turn.

``gpt-oss`` (OpenAI's harmony format): the turn is a sequence of messages, each
``<|start|>assistant`` (the generation prompt holds the first), a header, ``<|message|>``, the
body and an end token. A call is a message addressed to ``functions.<name>`` (the recipient
``to=functions.<name>`` stands before or after ``<|channel|>commentary``) whose body is the JSON
arguments, ended by ``<|call|>``; the engine stops on that token, so a turn makes one call. The
chat template names a tool message after the last assistant message's ``tool_calls``, so the tool
turn is rendered after an assistant message that carries the call.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: dict


def call_arguments(name: str, arguments) -> tuple[dict | None, str | None]:
    """The arguments as a dict (models also write them as a JSON string), or an error text."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            if not arguments.strip():
                return {}, None
            return None, f"Error: the arguments of the call to {name} are not valid JSON ({exc.msg} at character {exc.pos})"
    if not isinstance(arguments, dict):
        return None, f'Error: the "arguments" of the call to {name} must be a JSON object'
    return arguments, None


class Hermes:
    name = "hermes"
    call_end = "</tool_call>"
    # With one call per turn the engine stops right after it: small models often write on past it.
    stop_texts = [call_end]
    end_tokens: list[str] = []
    _CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        """The calls in a turn's text, and an error text for each malformed one."""
        calls, errors = [], []
        bodies = self._CALL.findall(text)
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
            arguments, error = call_arguments(call["name"], call.get("arguments", {}))
            if error:
                errors.append(error)
            else:
                calls.append(ToolCall(call["name"], arguments))
        return calls, errors

    def ends_with_call(self, text: str) -> bool:
        return text.rstrip().endswith(self.call_end)

    def call_message(self, text: str, calls: list[ToolCall]) -> dict | None:
        """The assistant message the template renders before the tool answers; None: the turn's
        own text stands in (the template copies an assistant's content as it is)."""
        return None

    def closing(self, after_turn: str, stop_text: str) -> str:
        """What the template puts after an assistant turn's text, less the end-of-turn token the
        model already wrote (``stop_text``)."""
        return after_turn[len(stop_text):] if stop_text and after_turn.startswith(stop_text) else after_turn

    def answer(self, ids: list[int]) -> str:
        """An assistant turn as the user (an interaction agent) reads it."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def content(self, ids: list[int]) -> str:
        """An assistant turn without its calls (what verl's tool parsers return beside them)."""
        return self._CALL.sub("", self.tokenizer.decode(ids, skip_special_tokens=False))

    def instructions(self, listing: str) -> str:
        return ("You can call the tools below. Each is described by a JSON function schema:\n"
                f"<tools>\n{listing}\n</tools>\n"
                "To call one, write a JSON object with its name and arguments between tool-call tags, then stop:\n"
                '<tool_call>\n{"name": "<tool name>", "arguments": {<arguments>}}\n</tool_call>\n'
                "Its result comes back in the next message. When you have the answer, reply without a tool call.")


class GptOss:
    name = "gpt-oss"
    call_end = "<|call|>"
    stop_texts: list[str] = []  # the engine stops on the <|call|> token itself
    end_tokens = [call_end]
    message_ends = ("<|end|>", "<|call|>", "<|return|>")
    _MESSAGE = re.compile(r"(?P<header>(?:<\|start\|>|<\|channel\|>|<\|constrain\|>|[^<])*)<\|message\|>"
                          r"(?P<body>.*?)(?P<end><\|end\|>|<\|call\|>|<\|return\|>|$)", re.S)
    _RECIPIENT = re.compile(r"(?:^|[\s>])to=(\S+?)(?=<\||\s|$)")

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def messages(self, text: str) -> list[tuple[str, str, str]]:
        """(header, body, end token) of each harmony message in a turn's text."""
        return [(m["header"], m["body"], m["end"]) for m in self._MESSAGE.finditer(text)]

    def parse(self, text: str) -> tuple[list[ToolCall], list[str]]:
        calls, errors = [], []
        for header, body, end in self.messages(text):
            if end != self.call_end:
                continue  # reasoning, a preamble or the answer
            recipient = self._RECIPIENT.search(header)
            if recipient is None:
                errors.append("Error: a message ended with <|call|> names no recipient (to=functions.<tool name>)")
                continue
            if not recipient[1].startswith("functions."):
                errors.append(f"Error: {recipient[1]} is not a function tool: address calls to functions.<tool name>")
                continue
            name = recipient[1].removeprefix("functions.")
            arguments, error = call_arguments(name, body)
            if error:
                errors.append(error)
            else:
                calls.append(ToolCall(name, arguments))
        return calls, errors

    def ends_with_call(self, text: str) -> bool:
        return text.endswith(self.call_end)

    def call_message(self, text: str, calls: list[ToolCall]) -> dict | None:
        if calls:
            name, arguments = calls[0].name, calls[0].arguments
        else:  # a malformed call: its answer (the error) goes to whatever the model addressed
            recipients = [self._RECIPIENT.search(header) for header, _, end in self.messages(text) if end == self.call_end]
            name = recipients[-1][1].removeprefix("functions.") if recipients and recipients[-1] else "unknown"
            arguments = {}
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}

    def closing(self, after_turn: str, stop_text: str) -> str:
        # The model ends its answer with <|return|> where a rendered history has <|end|>: the
        # model's own end token stays, the template's is dropped.
        if stop_text in self.message_ends:
            for end in self.message_ends:
                if after_turn.startswith(end):
                    return after_turn[len(end):]
        return after_turn

    def answer(self, ids: list[int]) -> str:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        finals = [body for header, body, _ in self.messages(text) if "<|channel|>final" in header]
        return finals[-1] if finals else self.tokenizer.decode(ids, skip_special_tokens=True)

    def content(self, ids: list[int]) -> str:
        """An assistant turn without its calls: its final message."""
        return self.answer(ids)

    def instructions(self, listing: str) -> str:
        return ("You can call the tools below. Each is described by a JSON function schema:\n"
                f"{listing}\n"
                "To call one, send a message on the commentary channel to functions.<tool name> with the JSON "
                "arguments as its body, ending it with <|call|>:\n"
                "<|start|>assistant<|channel|>commentary to=functions.<tool name> <|constrain|>json<|message|>"
                "{<arguments>}<|call|>\n"
                "Its result comes back in the next message. When you have the answer, reply on the final channel.")


FORMATS = {cls.name: cls for cls in (Hermes, GptOss)}


def get_format(name: str, tokenizer) -> Hermes | GptOss:
    if name not in FORMATS:
        raise ValueError(f"actor_rollout_ref.rollout.multi_turn.format={name}: tool calls are parsed in the formats "
                         f"{', '.join(FORMATS)}")
    return FORMATS[name](tokenizer)
