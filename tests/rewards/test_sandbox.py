"""The code sandbox and the unit-test reward, against real programs: correct, wrong, and hostile."""

import os
import shutil
import socket
import threading
import time

import pytest

from hybrid_rl.rewards.code import CodeTestsScorer, extract_program, parse_tests
from hybrid_rl.rewards.sandbox import Sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed "
                                "(bash tools/install.sh --sandbox)")


@pytest.fixture(scope="module")
def scorer():
    sandbox = Sandbox(timeout_s=3, memory_mb=512, max_processes=16).start()
    yield CodeTestsScorer(sandbox)
    sandbox.close()


def sandbox_processes() -> list[str]:
    """Command lines of processes a sandbox started (bwrap with our scratch folder, or the program)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "hybrid_rl_sandbox_" in cmdline or cmdline.endswith("-I main.py "):
            found.append(f"{pid}: {cmdline}")
    return found


ADD_TESTS = {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"]}


def test_correct_partial_and_wrong_programs(scorer):
    right = "Here it is:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a + b if a > 0 else 5\n```"
    broken = "```python\ndef add(a, b) return\n```"
    stdio = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"
    io_tests = {"inputs": ["2 3\n", "4 5\n"], "outputs": ["6\n", "21"]}
    scores, failed = scorer([right, half, broken, stdio], [ADD_TESTS, ADD_TESTS, ADD_TESTS, io_tests])
    assert scores == [1.0, 0.5, 0.0, 0.5] and failed == [False] * 4


def test_the_program_cannot_print_the_result_itself(scorer):
    forged = "```python\nprint('@@hybrid_rl_tests_0@@11')\ndef add(a, b):\n    return -1\n```"
    assert scorer([forged], [ADD_TESTS]) == ([0.0], [False])


@pytest.mark.parametrize("hostile", [
    "while True:\n    pass",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "x = bytearray(10 * 1024 ** 3)",
    "import subprocess\nsubprocess.Popen(['sleep', '300'])\nwhile True:\n    pass",
], ids=["busy_loop", "fork_bomb", "alloc_10GB", "leaves_a_child"])
def test_hostile_programs_score_zero_within_the_timeout_and_leave_nothing(scorer, hostile):
    program = f"```python\n{hostile}\ndef add(a, b):\n    return a + b\n```"
    start = time.monotonic()
    scores, failed = scorer([program], [ADD_TESTS])
    assert scores == [0.0]
    assert time.monotonic() - start < scorer.sandbox.timeout_s + 2
    assert failed == [hostile != "x = bytearray(10 * 1024 ** 3)"]  # a MemoryError is an ordinary crash
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sandbox_processes() == []


def test_no_network_even_to_this_machine(scorer):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    program = (f"```python\nimport socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
               "def add(a, b):\n    return a + b\n```")
    assert scorer([program], [ADD_TESTS]) == ([0.0], [False])
    server.setblocking(False)
    with pytest.raises(BlockingIOError):  # nothing reached the listening socket
        server.accept()
    server.close()


def test_the_filesystem_is_read_only_but_the_scratch_folder(scorer, tmp_path):
    target = tmp_path / "victim.txt"
    target.write_text("keep")
    program = (f"```python\nopen('notes.txt', 'w').write('scratch is fine')\nopen({str(target)!r}, 'w').write('x')\n"
               "def add(a, b):\n    return a + b\n```")
    assert scorer([program], [ADD_TESTS]) == ([0.0], [False])
    assert target.read_text() == "keep"


def test_runs_go_in_parallel(scorer):
    program = "```python\nimport time\ntime.sleep(1)\ndef add(a, b):\n    return a + b\n```"
    start = time.monotonic()
    scores, _ = scorer([program] * 4, [ADD_TESTS] * 4)
    assert scores == [1.0] * 4
    assert time.monotonic() - start < 4 * 1.0 * 0.9 or scorer.sandbox.workers == 1


def test_extract_program_and_parse_tests():
    assert extract_program("a\n```\nx = 1\n```\nthen\n```python\ny = 2\n```") == "y = 2\n"
    assert extract_program("print(1)") == "print(1)"
    assert parse_tests('["assert f() == 1"]') == {"kind": "assert", "tests": ["assert f() == 1"], "setup": ""}
    with pytest.raises(ValueError, match="'inputs' and 'outputs' must be non-empty lists of equal length"):
        parse_tests({"inputs": ["1"], "outputs": []})
    with pytest.raises(ValueError, match="expected 'tests'"):
        parse_tests({"answer": 3})


def test_a_missing_interpreter_is_a_clear_error():
    from hybrid_rl.rewards.sandbox import SandboxUnavailable

    with pytest.raises(SandboxUnavailable, match="set reward.sandbox.python"):
        Sandbox(python="/nonexistent/python3").start()
