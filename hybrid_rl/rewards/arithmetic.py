"""Rule-based scorer for the synthetic arithmetic task.

The response is correct when the *last* integer it mentions equals the
ground truth.  Thousands separators (``1,234``) are accepted and a leading
minus sign is honoured, so ``"the answer is -1,024."`` yields ``-1024``.
Problems asked in the ``tags`` answer format (R1-Zero's ``<think>``/``<answer>``) are read
from the last ``<answer>`` block only.
"""

from __future__ import annotations

import re

from .think_answer import answer_text

# An optional minus sign, then digits possibly grouped with commas.  The
# look-behind stops the minus of "5-3" (a binary operator between two
# numbers) from being read as part of "-3"; a minus after a space, start of
# text or an opening bracket is treated as a sign.
_INT_RE = re.compile(r"(?<![\d.])(-?)(\d{1,3}(?:,\d{3})+|\d+)(?![\d])")


def extract_last_integer(text: str) -> int | None:
    """Return the last integer in ``text`` or ``None`` when there is none."""
    if not text:
        return None
    matches = _INT_RE.findall(text)
    if not matches:
        return None
    sign, digits = matches[-1]
    value = int(digits.replace(",", ""))
    return -value if sign else value


def compute_score(solution_str: str, ground_truth, answer_format: str = "number") -> float:
    """1.0 when the last integer in ``solution_str`` (``answer_format="tags"``: in its last
    ``<answer>`` block) equals ``int(ground_truth)``."""
    try:
        target = int(str(ground_truth).strip().replace(",", ""))
    except ValueError as exc:
        raise ValueError(
            f"arithmetic ground_truth must be an integer string, got {ground_truth!r}; "
            "check the reward_model.ground_truth column of the data file"
        ) from exc
    if answer_format == "tags":
        solution_str = answer_text(solution_str) or ""
    predicted = extract_last_integer(solution_str)
    return 1.0 if predicted is not None and predicted == target else 0.0
