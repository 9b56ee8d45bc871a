"""GSM8K scorer (verl-compatible semantics).

Only the tail of the response is inspected (the last ``_TAIL_CHARS``
characters) so very long generations cannot slow the regex down and the
final answer -- which is what the prompt asks for -- is what gets graded.

* ``method="strict"``: the answer is the number after the last ``####``
  marker (the format the GSM8K preprocessing instruction requests).
* ``method="flexible"``: the answer is the last number anywhere in the tail.

Commas and ``$`` are removed from the extracted answer (and a trailing
sentence period is dropped) before comparing it *as a string* with the
ground truth.  Scores: exact match -> ``score``; an answer was found but is
wrong -> ``format_score``; no answer -> 0.0.
"""

from __future__ import annotations

import re

_TAIL_CHARS = 300
_STRICT_RE = re.compile(r"####\s*\$?\s*(-?[0-9.,]+)")
_FLEX_RE = re.compile(r"-?[0-9.,]+")
_METHODS = ("strict", "flexible")


def _clean(raw: str) -> str:
    return raw.replace(",", "").replace("$", "").rstrip(".")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """Return the graded answer string, or ``None`` if nothing was found."""
    if method not in _METHODS:
        raise ValueError(f"gsm8k method must be one of {_METHODS}, got {method!r}")
    tail = (solution_str or "")[-_TAIL_CHARS:]
    if method == "strict":
        matches = _STRICT_RE.findall(tail)
        candidates = [_clean(m) for m in matches]
    else:
        candidates = [_clean(m) for m in _FLEX_RE.findall(tail)]
    # Drop fragments that are only punctuation (e.g. a lone "," or ".").
    candidates = [c for c in candidates if c not in ("", "-") and any(ch.isdigit() for ch in c)]
    return candidates[-1] if candidates else None


def compute_score(
    solution_str: str,
    ground_truth,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    answer = extract_solution(solution_str, method=method)
    if answer is None:
        return 0.0
    return float(score) if answer == str(ground_truth).strip() else float(format_score)
