"""R1-Zero's response format: the reasoning inside ``<think> </think>``, then the answer inside
``<answer> </answer>`` (DeepSeek-R1, arXiv 2501.12948, table 1).

Two rule rewards come from it: the *format* reward (``format_score``; the built-in reward
source ``think_format``), and the *answer* reward, which a task's scorer computes from
``answer_text`` alone, so that an answer written outside the tags does not count. Small models
rarely write the whole format unprompted, so a strict format reward is then zero for every
sample and teaches nothing; ``tag_count_score`` (source ``think_tags``) gives partial credit
per tag, as small-scale GRPO reproductions commonly do.
"""

from __future__ import annotations

import re

# The whole response: one think block, then one answer block, nothing else but white space.
_WELL_FORMED = re.compile(r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*"
                          r"<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def well_formed(text: str) -> bool:
    """True when ``text`` is exactly ``<think>...</think> <answer>...</answer>`` (white space
    around the blocks allowed, no tag nested or repeated)."""
    return _WELL_FORMED.fullmatch(text or "") is not None


def answer_text(text: str) -> str | None:
    """The content of the last complete ``<answer>...</answer>`` block, stripped; None without one."""
    found = _ANSWER.findall(text or "")
    return found[-1].strip() if found else None


def format_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """The format reward, a reward function like ``custom_reward_function``'s: 1.0 for a
    well-formed response, else 0.0."""
    return 1.0 if well_formed(solution_str) else 0.0


def tag_count_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A soft format reward: 0.25 for each of the four tags that the response writes exactly once."""
    return sum((solution_str or "").count(tag) == 1 for tag in TAGS) / len(TAGS)
