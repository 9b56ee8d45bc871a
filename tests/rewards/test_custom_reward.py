import textwrap

import pytest

from hybrid_rl.rewards import load_custom_reward_fn


def _write(tmp_path, body, name="reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_empty_path_returns_none():
    assert load_custom_reward_fn(None) is None
    assert load_custom_reward_fn("") is None


def test_loads_and_binds_kwargs(tmp_path):
    path = _write(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            return float(solution_str == ground_truth) + bonus

        def other(data_source, solution_str, ground_truth, extra_info):
            return {"score": 1.0, "acc": True}
        """,
    )
    fn = load_custom_reward_fn(path)
    assert fn(data_source="d", solution_str="1", ground_truth="1", extra_info=None) == 1.0
    fn = load_custom_reward_fn(path, reward_kwargs={"bonus": 0.5})
    assert fn(data_source="d", solution_str="1", ground_truth="2", extra_info=None) == 0.5
    assert load_custom_reward_fn(path, name="other")("d", "x", "y", None)["acc"] is True


def test_loads_from_a_module_and_verls_file_form(tmp_path, monkeypatch):
    """verl's `pkg://package.module` and `file://path` forms of the path."""
    path = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                            "    return 2.0\n", name="module_reward.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    for ref in ("pkg://module_reward", f"file://{path}"):
        assert load_custom_reward_fn(ref)(data_source="d", solution_str="1", ground_truth="1") == 2.0
    with pytest.raises(ValueError, match="pkg://no_such_module_xyz: importing the module no_such_module_xyz failed"):
        load_custom_reward_fn("pkg://no_such_module_xyz")


def test_kwargs_only_function_is_accepted(tmp_path):
    path = _write(tmp_path, "def compute_score(**kwargs):\n    return 1.0\n")
    assert load_custom_reward_fn(path)(data_source="a", solution_str="b", ground_truth="c", extra_info=None) == 1.0


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(FileNotFoundError) as err:
        load_custom_reward_fn(missing)
    assert "nope.py" in str(err.value) and "custom_reward_function.path" in str(err.value)


def test_import_failure_includes_original_exception(tmp_path):
    path = _write(tmp_path, "import definitely_not_a_module_xyz\n")
    with pytest.raises(ValueError) as err:
        load_custom_reward_fn(path)
    msg = str(err.value)
    assert "ModuleNotFoundError" in msg and "definitely_not_a_module_xyz" in msg and path in msg
    assert isinstance(err.value.__cause__, ModuleNotFoundError)

    path = _write(tmp_path, "def broken(:\n", name="syntax.py")
    with pytest.raises(ValueError, match="SyntaxError"):
        load_custom_reward_fn(path)


def test_missing_attribute_lists_callables(tmp_path):
    path = _write(
        tmp_path,
        """
        import os
        THRESHOLD = 3
        def my_score(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
        def _private():
            pass
        """,
    )
    with pytest.raises(ValueError) as err:
        load_custom_reward_fn(path, name="compute_score")
    msg = str(err.value)
    assert "'compute_score'" in msg and "my_score" in msg and "custom_reward_function.name" in msg
    assert "_private" not in msg and "'os'" not in msg


def test_not_callable(tmp_path):
    path = _write(tmp_path, "compute_score = 3\n")
    with pytest.raises(ValueError) as err:
        load_custom_reward_fn(path)
    assert "not a function" in str(err.value) and "custom_reward_function.name" in str(err.value)


def test_bad_signature(tmp_path):
    path = _write(tmp_path, "def compute_score(text, answer):\n    return 0.0\n")
    with pytest.raises(ValueError) as err:
        load_custom_reward_fn(path)
    msg = str(err.value)
    assert "signature" in msg and "(text, answer)" in msg
    assert "data_source, solution_str, ground_truth, extra_info" in msg


def test_bad_reward_kwargs(tmp_path):
    path = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ValueError, match="reward_kwargs"):
        load_custom_reward_fn(path, reward_kwargs={"unknown_kw": 1})


def test_batch_signature(tmp_path):
    """The batch manager's function takes the lists; a per-sample one is refused for it, and the
    other way round, naming the form wanted."""
    batch_fn = _write(tmp_path, "def score(data_sources, solution_strs, ground_truths, extra_infos, judge='x'):\n"
                                "    return [0.0] * len(solution_strs)\n")
    fn = load_custom_reward_fn(batch_fn, "score", reward_kwargs={"judge": "y"}, batched=True)
    assert fn(data_sources=["a"], solution_strs=["s"], ground_truths=["1"], extra_infos=[{}]) == [0.0]
    with pytest.raises(ValueError, match="cannot be called as fn\\(data_source=..., solution_str=..."):
        load_custom_reward_fn(batch_fn, "score")
    per_sample = _write(tmp_path, "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                  "    return 0.0\n", name="per_sample.py")
    with pytest.raises(ValueError, match="Change it to fn\\(data_sources, solution_strs, ground_truths, extra_infos"):
        load_custom_reward_fn(per_sample, batched=True)
    with pytest.raises(ValueError, match="sets \\['solution_strs'\\], which the reward manager passes"):
        load_custom_reward_fn(batch_fn, "score", reward_kwargs={"solution_strs": []}, batched=True)
