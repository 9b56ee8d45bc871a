"""Interaction agents: the user's side of a multi-turn rollout. After each assistant turn that
calls no tool, the row's interaction reads the conversation and answers as the user (feedback,
a follow-up question) or ends the trajectory; its turns are inserted like tool turns (loss mask 0).

The config file is verl's (``actor_rollout_ref.rollout.multi_turn.interaction_config_path``)::

    interaction:
      - name: checker                 # rows choose it by extra_info.interaction_kwargs.name
        class_name: answer_check      # a name registered below, or a dotted path to an Interaction subclass
        config: {}                    # keyword arguments of the class

An interaction has verl's four methods, which may be plain or ``async`` (verl's are): a class
written for verl's agent loop runs here unchanged, its ``from verl.interactions.base import
BaseInteraction`` giving ``Interaction`` while the file loads.
"""

from __future__ import annotations

import inspect
from typing import Any

from hybrid_rl.agent.tools import ToolConfigError, config_entries, import_class, run_coroutine

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"


class Interaction:
    """One interaction agent. ``start_interaction`` opens a conversation for a row (its
    ``interaction_kwargs`` as keyword arguments, plus the row's ``ground_truth`` and
    ``data_source`` unless those kwargs give them), ``generate_response`` returns
    ``(end, text, score, metadata)`` for the messages so far, ``finalize_interaction`` closes it.
    The scores of a trajectory's turns reach the reward function as ``extra_info["turn_scores"]``."""

    def __init__(self, config: dict | None = None):
        self.config = dict(config or {})
        self.name = self.config.get("name", type(self).__name__)

    def start_interaction(self, instance_id: str, **kwargs) -> str:
        return instance_id

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        raise NotImplementedError

    def calculate_score(self, instance_id: str, **kwargs) -> float:
        return 0.0

    def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        """Forget the conversation."""


def call(method, *args, **kwargs):
    """Call an interaction's method, plain or ``async`` (run to completion on the tools' event loop)."""
    result = method(*args, **kwargs)
    return run_coroutine(result) if inspect.iscoroutine(result) else result


def last_assistant_text(messages: list[dict]) -> str:
    return next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "assistant"), "")


class AnswerCheck(Interaction):
    """Scores the last answer with the row's built-in reward function (its ``data_source``; see
    ``hybrid_rl.rewards``): a right answer ends the conversation with score 1; otherwise the user
    says it is wrong and asks for another try (score 0). ``correct_text`` and ``retry_text`` set
    what the user says."""

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self.correct_text = self.config.get("correct_text", "That is correct.")
        self.retry_text = self.config.get("retry_text", "That answer is not correct. Check your work and answer again.")
        self._open: dict[str, dict] = {}

    def start_interaction(self, instance_id: str, ground_truth=None, data_source=None, **kwargs) -> str:
        self._open[instance_id] = {"ground_truth": ground_truth, "data_source": data_source}
        return instance_id

    def generate_response(self, instance_id: str, messages: list[dict], **kwargs) -> tuple[bool, str, float, dict]:
        from hybrid_rl.rewards import default_compute_score

        row = self._open[instance_id]
        score = default_compute_score(row["data_source"], last_assistant_text(messages), row["ground_truth"])
        score = float(score["score"] if isinstance(score, dict) else score)
        if score >= 1.0:
            return True, self.correct_text, score, {}
        return False, self.retry_text, score, {}

    def finalize_interaction(self, instance_id: str, **kwargs) -> None:
        self._open.pop(instance_id, None)


INTERACTIONS: dict[str, type[Interaction]] = {"answer_check": AnswerCheck}
# verl's interaction classes that have a local equivalent here: its GSM8K checker is AnswerCheck
# on the row's data source (openai/gsm8k rows are scored by the GSM8K rule).
VERL_INTERACTIONS: dict[str, type[Interaction]] = {"verl.interactions.gsm8k_interaction.Gsm8kInteraction": AnswerCheck}


def default_name(class_name: str) -> str:
    """verl's rule for an entry without a name: the class name, less a trailing 'Interaction',
    lower-cased (``...Gsm8kInteraction`` -> ``gsm8k``)."""
    name = class_name.rpartition(".")[2]
    return (name[:-len("Interaction")] if name.endswith("Interaction") else name).lower()


def load_interactions(path: str) -> dict[str, Interaction]:
    """The interactions of an interaction config file, by name."""
    interactions: dict[str, Interaction] = {}
    for where, entry in config_entries(path, KEY, "interaction"):
        name = entry.get("name") or default_name(entry["class_name"])
        if name in interactions:
            raise ToolConfigError(f"{where}: a second interaction named {name!r}; names must be unique")
        cls = import_class(entry["class_name"], where, (Interaction,), INTERACTIONS, VERL_INTERACTIONS, "interaction")
        interactions[name] = cls({**(entry.get("config") or {}), "name": name})
    return interactions


def check_interaction_rows(extra_infos: list, interactions: dict[str, Interaction], files) -> None:
    """Every row of a data file can be given its interaction (``row_kwargs``)."""
    for i, extra_info in enumerate(extra_infos):
        try:
            row_kwargs(extra_info, interactions)
        except ToolConfigError as exc:
            raise ToolConfigError(f"{files}, row {i}: {exc}") from None


def row_kwargs(extra_info: Any, interactions: dict[str, Interaction]) -> tuple[Interaction, dict]:
    """The row's interaction and its kwargs (``extra_info.interaction_kwargs``); a row that names
    none gets the only interaction there is."""
    kwargs = dict((extra_info or {}).get("interaction_kwargs") or {}) if isinstance(extra_info, dict) else {}
    name = kwargs.get("name")
    if name is None and len(interactions) == 1:
        name = next(iter(interactions))
    if name not in interactions:
        raise ToolConfigError(
            f"a prompt's extra_info.interaction_kwargs names the interaction {name!r}, but {KEY} defines "
            f"{', '.join(interactions)}: give each row an interaction_kwargs.name from that list.")
    return interactions[name], kwargs
