import pytest

from hybrid_rl.rewards import KNOWN_DATA_SOURCES, default_compute_score
from hybrid_rl.rewards import arithmetic, gsm8k


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("42", "42", 1.0),
        ("The answer is 42.", "42", 1.0),
        ("-17", "-17", 1.0),
        ("it is -17", "17", 0.0),
        ("The result: -1,024", "-1024", 1.0),
        ("1,234,567", "1234567", 1.0),
        ("12 + 30 = 42", "42", 1.0),
        ("42, no wait, 41", "42", 0.0),  # the LAST number counts
        ("73 - 75 = -2", "-2", 1.0),
        ("5-3", "3", 1.0),  # binary minus is not a sign
        ("I do not know", "42", 0.0),
        ("", "42", 0.0),
        ("42", " 42 ", 1.0),
        ("x = 0", "0", 1.0),
    ],
)
def test_arithmetic(response, truth, expected):
    assert arithmetic.compute_score(response, truth) == expected


def test_arithmetic_bad_ground_truth():
    with pytest.raises(ValueError, match="ground_truth"):
        arithmetic.compute_score("1", "abc")


@pytest.mark.parametrize(
    "response, method, expected",
    [
        ("so 3 + 4 = 7\n#### 72", "strict", 1.0),
        ("#### 1 then #### 72", "strict", 1.0),  # last marker wins
        ("#### $1,072", "strict", 0.0),  # extracted 1072 != 72 -> format_score 0
        ("The answer is 72", "strict", 0.0),  # no marker in strict mode
        ("The answer is 72", "flexible", 1.0),
        ("72 apples, then 9 more", "flexible", 0.0),  # last number is 9
        ("no numbers at all", "flexible", 0.0),
        ("#### 72.", "strict", 1.0),  # trailing sentence period dropped
        ("#### -72", "strict", 0.0),
    ],
)
def test_gsm8k(response, method, expected):
    assert gsm8k.compute_score(response, "72", method=method) == expected


def test_gsm8k_commas_dollars_and_scores():
    assert gsm8k.compute_score("#### $1,072", "1072") == 1.0
    # found but wrong -> format_score; nothing found -> 0
    assert gsm8k.compute_score("#### 5", "1072", format_score=0.1) == 0.1
    assert gsm8k.compute_score("nothing", "1072", format_score=0.1) == 0.0
    assert gsm8k.compute_score("#### 1072", "1072", score=2.0) == 2.0
    assert gsm8k.compute_score("answer: 1,072", "1072", method="flexible") == 1.0


def test_gsm8k_only_last_300_chars():
    text = "#### 72" + " filler" * 100
    assert gsm8k.compute_score(text, "72") == 0.0
    assert gsm8k.compute_score(text + " #### 72", "72") == 1.0


def test_gsm8k_bad_method():
    with pytest.raises(ValueError, match="method"):
        gsm8k.compute_score("#### 1", "1", method="fuzzy")


def test_default_compute_score_dispatch():
    assert default_compute_score("arithmetic", "= 5", "5") == 1.0
    assert default_compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    assert default_compute_score("gsm8k", "#### 5", "5", extra_info={"x": 1}) == 1.0


def test_default_compute_score_unknown_source():
    with pytest.raises(ValueError) as err:
        default_compute_score("my/dataset", "1", "1")
    msg = str(err.value)
    assert "my/dataset" in msg
    for known in KNOWN_DATA_SOURCES:
        assert known in msg
    assert "custom_reward_function.path=" in msg and "custom_reward_function.name=" in msg


@pytest.mark.parametrize("answer, truth, correct", [
    ("so x is 12.\nAnswer: 12", "12", True),
    ("Answer: $\\frac{1}{2}$", "\\frac12", True),
    ("Answer: \\boxed{1,000}", "1000", True),
    ("Answer: 10 degrees", "10", True),
    ("Answer: x = 5", "5", True),
    ("Answer: 13", "12", False),
    ("the answer is 12", "12", False),  # no Answer: line
    ("Answer: 7\nlater: Answer: 12", "12", True),  # the last one counts
])
def test_dapo_math_scorer_compares_minerva_normal_forms(answer, truth, correct):
    result = default_compute_score("math_dapo", answer, truth)
    assert result["acc"] is correct and result["score"] == (1.0 if correct else -1.0)


@pytest.mark.parametrize("response, truth, correct", [
    ("so the answer is $\\boxed{\\frac{1}{2}}$", "0.5", True),  # equal values in other forms
    ("The answer is 1/2.", "\\frac12", True),  # a plain expression when there is no \boxed{}
    ("first $\\boxed{3}$, then on reflection $\\boxed{4}$", "4", True),  # the last answer counts
    ("x = \\boxed{3}", "4", False),
    ("\\boxed{[1, 2)}", "(1, 2]", False),  # intervals compare with their ends' kinds
    ("\\boxed{\\begin{pmatrix}1\\\\2\\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", True),
    ("I cannot tell", "4", False),
    ("", "4", False),
])
def test_latex_math_scorer_compares_values_with_math_verify(response, truth, correct):
    result = default_compute_score("HuggingFaceH4/MATH-500", response, truth)
    assert (result["score"], result["acc"]) == (1.0 if correct else 0.0, correct)


def test_latex_math_scorer_works_off_the_main_thread():
    """math-verify's own time limit needs the main thread; the reward manager's timed calls run elsewhere."""
    from concurrent.futures import ThreadPoolExecutor

    from hybrid_rl.rewards.math_verified import compute_score, last_boxed
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(compute_score, "$\\boxed{2^{10}}$", "1024").result()["acc"]
    assert last_boxed("a \\boxed{x^{2}} b \\fbox{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert last_boxed("no box") is None and last_boxed("\\boxed{unclosed") is None
