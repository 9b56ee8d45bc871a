"""Unit-test reward for code tasks: the response's program runs in the sandbox against the row's tests.

A row's ``reward_model.ground_truth`` holds its tests, in either of two common shapes:

* assertion tests (MBPP style): ``{"tests": ["assert add(1, 2) == 3", ...], "setup": "import math"}``
  (``setup`` optional) or a bare list of such strings: the program is defined, then each test runs
  separately, and a test passes when it raises nothing;
* input/output tests (APPS / CodeContests style): ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``:
  the program runs once per case with the input on stdin and passes when its stdout equals the
  expected output (compared line by line, trailing whitespace ignored).

The score is the fraction of tests passed, in [0, 1]. The program is the last fenced code block of
the response (```python ... ``` or ``` ... ```), else the whole response. A program that times
out, crashes, or breaks a limit passes none of the tests it was running; these samples are counted
in ``failed`` (logged as ``reward/<name>/sandbox_failures``). Malformed tests are a data error and
raise.

Limitation: assertion tests run in the program's own process, so a program written to defeat the
harness (reading the harness's constants from its stack frames) could forge a pass; input/output
tests are compared outside the sandbox and cannot be forged.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

from .sandbox import ExecResult, Sandbox

__all__ = ["CodeTestsScorer", "extract_program", "parse_tests"]

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.S)


def extract_program(response: str) -> str:
    """The last fenced block (preferring python-tagged ones), else the response itself."""
    blocks = _FENCE.findall(response)
    python_blocks = [body for tag, body in blocks if tag.lower() in ("python", "py", "python3")]
    if python_blocks:
        return python_blocks[-1]
    if blocks:
        return blocks[-1][1]
    return response


def parse_tests(ground_truth: Any) -> dict:
    """``{"kind": "assert", "tests": [...], "setup": str}`` or ``{"kind": "io", "inputs": [...], "outputs": [...]}``."""
    if isinstance(ground_truth, str):
        try:
            ground_truth = json.loads(ground_truth)
        except json.JSONDecodeError:
            raise ValueError("code tests: reward_model.ground_truth is a string that is not JSON; give a list of "
                             "assert statements, {'tests': [...]}, or {'inputs': [...], 'outputs': [...]}") from None
    if hasattr(ground_truth, "tolist"):  # numpy arrays from parquet
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, (list, tuple)):
        ground_truth = {"tests": list(ground_truth)}
    if not isinstance(ground_truth, dict):
        raise ValueError(f"code tests: reward_model.ground_truth must be a list or dict, got {type(ground_truth).__name__}")
    gt = {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in ground_truth.items()}
    if "tests" in gt:
        tests = gt["tests"]
        if not isinstance(tests, list) or not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("code tests: 'tests' must be a non-empty list of Python statements (e.g. assert ...)")
        return {"kind": "assert", "tests": tests, "setup": str(gt.get("setup") or "")}
    if "inputs" in gt and "outputs" in gt:
        inputs, outputs = gt["inputs"], gt["outputs"]
        if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
            raise ValueError("code tests: 'inputs' and 'outputs' must be non-empty lists of equal length")
        return {"kind": "io", "inputs": [str(x) for x in inputs], "outputs": [str(x) for x in outputs]}
    raise ValueError(f"code tests: reward_model.ground_truth has keys {sorted(gt)}; expected 'tests' "
                     "(assert statements) or 'inputs' and 'outputs'")


def _assert_harness(program: str, tests: list[str], setup: str, marker: str) -> str:
    """Source that defines the program, runs each test on its own, and prints the results after a
    random marker (so that the program's own output cannot be taken for them)."""
    return (f"import sys as _s\n_ns = {{'__name__': '__main__'}}\n"
            f"try:\n    exec(compile({setup!r} + '\\n' + {program!r}, 'solution.py', 'exec'), _ns)\n"
            f"except BaseException:\n    pass\n"
            f"_r = []\nfor _t in {tests!r}:\n    try:\n        exec(compile(_t, 'test.py', 'exec'), _ns)\n"
            f"        _r.append(1)\n    except BaseException:\n        _r.append(0)\n"
            f"_s.stdout.flush()\n_s.stdout.write('\\n' + {marker!r} + ''.join(map(str, _r)) + '\\n')\n")


def _same_output(got: str, expected: str) -> bool:
    lines = lambda text: [line.rstrip() for line in text.strip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


class CodeTestsScorer:
    """Scores a batch of responses against their rows' tests, all sandbox runs in parallel."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox = sandbox

    def __call__(self, responses: list[str], ground_truths: list[Any]) -> tuple[list[float], list[bool]]:
        """Per sample: the fraction of its tests passed, and whether a run timed out or crashed."""
        plans, jobs = [], []
        for response, ground_truth in zip(responses, ground_truths):
            tests = parse_tests(ground_truth)
            program = extract_program(response)
            if tests["kind"] == "assert":
                marker = "@@hybrid_rl_tests_" + secrets.token_hex(8) + "@@"
                plans.append((tests, marker, len(jobs), 1))
                jobs.append((_assert_harness(program, tests["tests"], tests["setup"], marker), ""))
            else:
                plans.append((tests, None, len(jobs), len(tests["inputs"])))
                jobs.extend((program, stdin) for stdin in tests["inputs"])
        results = self.sandbox.run_many(jobs)
        scores, failed = [], []
        for tests, marker, first, count in plans:
            runs: list[ExecResult] = results[first:first + count]
            if marker is not None:
                found = runs[0].stdout.rsplit(marker, 1)
                passed = [c == "1" for c in found[1].split()[0]] if len(found) == 2 and found[1].split() else []
                scores.append(sum(passed) / len(tests["tests"]))
                failed.append(runs[0].status != "ok" or len(passed) != len(tests["tests"]))
            else:
                passed = [r.status == "ok" and _same_output(r.stdout, out) for r, out in zip(runs, tests["outputs"])]
                scores.append(sum(passed) / count)
                # A wrong answer exits 0 or 1; a timeout, or a kill by a limit (exit 128 + signal), is a failure.
                failed.append(any(r.status == "timeout" or (r.returncode or 0) >= 128 for r in runs))
        return scores, failed
