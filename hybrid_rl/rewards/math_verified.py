"""Scorer of competition-math answers written in LaTeX (MATH, MATH-500: data sources
``DigitalLearningGmbH/MATH-lighteval``, ``lighteval/MATH``, ``HuggingFaceH4/MATH-500``).

The comparison is Hugging Face's ``math-verify``: the ground truth is read as ``\\boxed{<truth>}``,
the response's final answer is extracted from its LaTeX (a ``\\boxed{}`` first) or as a plain
expression, and the two are compared symbolically (``1/2`` equals ``\\frac{1}{2}`` and ``0.5``;
sets, intervals and matrices compare as such). Scores 1.0 for a right answer and 0.0 otherwise,
with ``acc`` and the parsed ``pred``.

math-verify bounds its own parsing time with ``signal.alarm``, which only the main thread may set;
elsewhere (the reward manager's timed calls run in worker threads) the bound is
``reward_model.timeout_s``.
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

_TIMEOUT_S = 5  # math-verify's own default per parse / comparison


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces matched."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    opening = text.index("{", start)
    depth = 0
    for position in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[opening + 1:position]
    return None


def compute_score(solution_str: str, ground_truth) -> dict:
    """1.0 when the response's final answer equals ``ground_truth`` under math-verify, else 0.0."""
    timeout = _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold = parse(f"\\boxed{{{ground_truth}}}", extraction_config=(LatexExtractionConfig(),), parsing_timeout=timeout)
    pred = parse(solution_str or "", extraction_config=(LatexExtractionConfig(), ExprExtractionConfig()),
                 parsing_timeout=timeout)
    correct = bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=timeout)
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": str(pred[-1]) if pred else None}
