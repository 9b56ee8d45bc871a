"""Scorer of DAPO's math data (data source ``math_dapo``: DAPO-Math-17k, AIME 2024 as published
by the DAPO authors), whose prompts ask for a last line ``Answer: $Answer``.

The answer after the last ``Answer:`` in the response's tail and the ground truth are both put in
the normal form of Minerva (Lewkowycz et al. 2022, appendix: the right side of an ``=``, no units
or filler words, no ``$``, ``\\text{}`` or ``\\boxed{}`` wrappers, ``\\fracab`` written
``\\frac{a}{b}``, no thousands commas) and compared as strings. Scores as DAPO trains: 1.0 for a
right answer, -1.0 otherwise; ``acc`` and the parsed ``pred`` come with it.
"""

from __future__ import annotations

import re

_TAIL_CHARS = 300  # only the end of a long response is read
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

_SUBSTITUTIONS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "ft", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
            "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
            "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"',
            "\\dots")


def normalize_final_answer(answer: str) -> str:
    """Minerva's normal form of a final answer (see the module's doc)."""
    answer = answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for expression in _REMOVED:
        answer = answer.replace(expression, "")
    # The content of the last $...$, \text{...}, \textbf{...}, \overline{...} and \boxed{...}.
    answer = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", answer)
    for wrapper in ("text", "textbf", "overline", "boxed"):
        answer = re.sub(r"(\\" + wrapper + r"\{)(.*?)(\})", "\\2", answer)
    # \fracab -> \frac{a}{b}, \frac{a}b -> \frac{a}{b}, \sqrta -> \sqrt{a}.
    answer = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", answer)
    answer = re.sub(r"(frac\{[^{}]*\})([^{])", "\\1{\\2}", answer)
    answer = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def compute_score(solution_str: str, ground_truth) -> dict:
    """1.0 when the last ``Answer:`` of the response's tail equals the ground truth in normal form,
    else -1.0 (no ``Answer:`` line included)."""
    answers = _ANSWER.findall((solution_str or "")[-_TAIL_CHARS:])
    pred = normalize_final_answer(answers[-1]) if answers else None
    correct = pred is not None and pred == normalize_final_answer(str(ground_truth))
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
