"""Reward-function faults: on_error (zero / raise), timeout_s, and the errors that always raise."""

import asyncio
import logging
import math
import os
import pickle
import threading
import time

import pytest
import torch

from hybrid_rl.rewards import RewardFunctionError, RewardManager, UnknownDataSourceError

from tests.rewards.test_reward_manager import make_batch

LOGGER = "hybrid_rl.rewards.manager"


@pytest.fixture
def release():
    """Set at teardown so functions that 'hang' on it end and leave no thread behind."""
    event = threading.Event()
    yield event
    event.set()


def failure_records(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_raising_fn_scores_zero_counts_and_logs_once(tiny_tokenizer, caplog):
    def flaky_judge(data_source, solution_str, ground_truth, extra_info):
        if ground_truth in ("2", "4"):
            raise ConnectionError(f"judge down for {ground_truth}")
        return 1.0

    batch, lengths = make_batch(tiny_tokenizer, ["q"] * 4, ["1", "2", "3", "4"], ["1", "2", "3", "4"],
                                data_source="src_f")
    manager = RewardManager(tiny_tokenizer, flaky_judge, on_error="zero")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        reward, extra = manager(batch)
        assert extra["score"] == [1.0, 0.0, 1.0, 0.0]
        assert extra["reward_failed"] == [False, True, False, True]
        assert reward.sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
        assert reward[0, lengths[0] - 1].item() == 1.0
        assert manager.failures == 2 and manager.total_failures == 2

        (record,) = failure_records(caplog)  # one warning for two failures
        message = record.getMessage()
        for part in ("flaky_judge", "ConnectionError", "judge down for 2", "sample index 1", "src_f",
                     "ground_truth='2'", "reward_model.on_error=raise"):
            assert part in message
        assert record.exc_info and record.exc_info[0] is ConnectionError
        assert "Traceback" in caplog.text and "in flaky_judge" in caplog.text

        # later calls: per-call count resets, the total grows, nothing more is logged
        _, extra = manager(batch)
        assert manager.failures == 2 and manager.total_failures == 4
        assert len(failure_records(caplog)) == 1

        ok, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"])
        _, extra = manager(ok)
        assert extra["reward_failed"] == [False]
        assert manager.failures == 0 and manager.total_failures == 4


def test_exception_raised_inside_fn_is_a_failure_not_a_contract_error(tiny_tokenizer):
    """A TypeError *raised by* the function is a fault of that sample, unlike a wrong return type."""
    def buggy(data_source, solution_str, ground_truth, extra_info):
        return int(None)

    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"])
    manager = RewardManager(tiny_tokenizer, buggy, on_error="zero")
    _, extra = manager(batch)
    assert extra["score"] == [0.0] and manager.failures == 1


def test_dict_extras_of_failed_samples_are_none(tiny_tokenizer):
    def fn(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "2":
            raise RuntimeError("nope")
        return {"score": 1.0, "acc": True}

    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "2"])
    _, extra = RewardManager(tiny_tokenizer, fn, on_error="zero")(batch)
    assert extra == {"score": [1.0, 0.0], "acc": [True, None], "reward_failed": [False, True]}


def test_on_error_raise(tiny_tokenizer):
    def exploding(data_source, solution_str, ground_truth, extra_info):
        if extra_info["index"] == 1:
            raise KeyError("missing field")
        return 0.0

    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "9"], data_source="src_r")
    manager = RewardManager(tiny_tokenizer, exploding, on_error="raise")
    with pytest.raises(RewardFunctionError) as err:
        manager(batch)
    msg = str(err.value)
    for part in ("exploding", "KeyError", "missing field", "index 1", "src_r", "'9'"):
        assert part in msg
    assert isinstance(err.value.__cause__, KeyError)
    assert manager.total_failures == 0


def test_default_constructor_policy_is_raise(tiny_tokenizer):
    manager = RewardManager(tiny_tokenizer)
    assert manager.on_error == "raise" and manager.timeout_s is None


@pytest.mark.parametrize("bad", ["ignore", "Zero", None, ""])
def test_invalid_on_error(tiny_tokenizer, bad):
    with pytest.raises(ValueError) as err:
        RewardManager(tiny_tokenizer, on_error=bad)
    assert "'zero'" in str(err.value) and "'raise'" in str(err.value) and "on_error" in str(err.value)


@pytest.mark.parametrize("value, expected", [(None, None), (0, None), (-1, None), (math.inf, None),
                                             (2, 2.0), ("0.5", 0.5)])
def test_timeout_values(tiny_tokenizer, value, expected):
    assert RewardManager(tiny_tokenizer, timeout_s=value).timeout_s == expected


@pytest.mark.parametrize("bad", ["soon", math.nan, [1]])
def test_invalid_timeout(tiny_tokenizer, bad):
    with pytest.raises(ValueError, match="timeout_s"):
        RewardManager(tiny_tokenizer, timeout_s=bad)


def test_timeout_scores_zero_and_next_calls_are_not_blocked(tiny_tokenizer, caplog, release):
    def slow_judge(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "slow":
            release.wait(2.0)
        return 1.0

    truths = ["slow", "1", "slow", "1"]
    batch, _ = make_batch(tiny_tokenizer, ["q"] * 4, ["1"] * 4, truths, data_source="src_t")
    manager = RewardManager(tiny_tokenizer, slow_judge, on_error="zero", timeout_s=0.2)
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        _, extra = manager(batch)
    elapsed = time.monotonic() - start
    assert extra["score"] == [0.0, 1.0, 0.0, 1.0]
    assert extra["reward_failed"] == [True, False, True, False]
    assert manager.failures == 2
    assert elapsed < 10  # two 0.2 s deadlines, not two 2 s sleeps (loose bound: no timing flakes)
    (record,) = failure_records(caplog)
    message = record.getMessage()
    for part in ("slow_judge", "reward_model.timeout_s=0.2", "sample index 0", "src_t", "'slow'"):
        assert part in message
    assert "in slow_judge" in message  # the stack where the call was stuck
    manager.close()


def test_timeout_on_error_raise(tiny_tokenizer, release):
    def stuck(data_source, solution_str, ground_truth, extra_info):
        release.wait(2.0)
        return 1.0

    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["7"], data_source="src_h")
    manager = RewardManager(tiny_tokenizer, stuck, on_error="raise", timeout_s=0.2)
    with pytest.raises(RewardFunctionError) as err:
        manager(batch)
    msg = str(err.value)
    for part in ("stuck", "exceeded reward_model.timeout_s=0.2", "index 0", "src_h", "'7'",
                 "raise reward_model.timeout_s"):
        assert part in msg


def test_fast_fn_under_timeout_keeps_dict_and_step_rewards(tiny_tokenizer):
    text = "The answer is 46. #### 46"
    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], [text, "5"], ["46", "5"], T=32)

    def fn(data_source, solution_str, ground_truth, extra_info):
        if extra_info["index"] == 0:
            return {"step_rewards": [0.25, 1.0], "step_ends": [len("The answer is 46."), len(text)]}
        return {"score": 0.5, "acc": True}

    reward, extra = RewardManager(tiny_tokenizer, fn, on_error="zero", timeout_s=5)(batch)
    assert extra["score"] == [1.25, 0.5] and extra["acc"] == [None, True]
    assert extra["reward_failed"] == [False, False]
    assert extra["step_mask"][0].sum().item() == 2
    assert reward.sum(-1).tolist() == [1.25, 0.5]


@pytest.mark.parametrize("timeout_s", [None, 5])
def test_async_reward_fn(tiny_tokenizer, timeout_s):
    async def judge(data_source, solution_str, ground_truth, extra_info):
        await asyncio.sleep(0)
        return float(solution_str == ground_truth)

    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "3"])
    _, extra = RewardManager(tiny_tokenizer, judge, on_error="zero", timeout_s=timeout_s)(batch)
    assert extra["score"] == [1.0, 0.0] and extra["reward_failed"] == [False, False]


def test_async_reward_fn_is_cancelled_at_deadline(tiny_tokenizer):
    cancelled = threading.Event()

    async def slow_async(data_source, solution_str, ground_truth, extra_info):
        try:
            await asyncio.sleep(2.0)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 1.0

    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"])
    manager = RewardManager(tiny_tokenizer, slow_async, on_error="zero", timeout_s=0.2)
    start = time.monotonic()
    _, extra = manager(batch)
    assert extra["score"] == [0.0] and manager.failures == 1
    assert time.monotonic() - start < 10
    assert cancelled.wait(5)

    with pytest.raises(RewardFunctionError, match=r"reward_model\.timeout_s=0\.2"):
        RewardManager(tiny_tokenizer, slow_async, on_error="raise", timeout_s=0.2)(batch)


@pytest.mark.parametrize("timeout_s", [None, 5])
@pytest.mark.parametrize("bad", ["1.0", None, [1.0], {"acc": 1}])
def test_wrong_return_type_raises_under_zero(tiny_tokenizer, bad, timeout_s):
    def my_bad_fn(data_source, solution_str, ground_truth, extra_info):
        return bad

    batch, _ = make_batch(tiny_tokenizer, ["q"], ["4"], ["4"])
    manager = RewardManager(tiny_tokenizer, my_bad_fn, on_error="zero", timeout_s=timeout_s)
    with pytest.raises(TypeError, match="my_bad_fn"):
        manager(batch)
    assert manager.total_failures == 0


def test_bad_step_rewards_raise_under_zero(tiny_tokenizer):
    batch, _ = make_batch(tiny_tokenizer, ["q"], ["3"], ["3"])
    manager = RewardManager(tiny_tokenizer, lambda **kw: {"step_rewards": [1.0], "step_ends": [1, 2]},
                            on_error="zero")
    with pytest.raises(TypeError, match="equal length"):
        manager(batch)


@pytest.mark.parametrize("value", [math.nan, {"score": math.inf}])
def test_non_finite_score_raises_under_zero(tiny_tokenizer, value):
    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "2"], data_source="ds_nan")
    fn = lambda **kw: value if kw["extra_info"]["index"] == 1 else 1.0  # noqa: E731
    with pytest.raises(RewardFunctionError) as err:
        RewardManager(tiny_tokenizer, fn, on_error="zero")(batch)
    assert "ds_nan" in str(err.value) and "index 1" in str(err.value) and "non-finite" in str(err.value)


def test_unknown_data_source_raises_under_zero(tiny_tokenizer):
    """No scorer for the data source is a configuration error, never a 0 score."""
    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"], data_source="mystery")
    with pytest.raises(RewardFunctionError, match="custom_reward_function.path") as err:
        RewardManager(tiny_tokenizer, on_error="zero")(batch)
    assert isinstance(err.value.__cause__, UnknownDataSourceError)
    assert isinstance(err.value.__cause__, ValueError)


def test_manager_with_workers_pickles(tiny_tokenizer):
    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"])
    manager = RewardManager(tiny_tokenizer, on_error="zero", timeout_s=5)
    manager(batch)
    copy = pickle.loads(pickle.dumps(manager))
    reward, extra = copy(batch)
    assert extra["score"] == [1.0] and isinstance(reward, torch.Tensor)
    manager.close()
    copy.close()


SCORED_IN_PROCESSES = '''
import os
import time


def score(data_source, solution_str, ground_truth, extra_info=None, hang="never"):
    if solution_str.strip() == hang:
        time.sleep(120)
    if solution_str.strip() == "boom":
        raise ValueError("cannot parse")
    return {"score": float(solution_str.strip() == ground_truth), "pid": os.getpid()}
'''


def test_scoring_processes_run_a_users_function_and_stop_a_hung_call(tiny_tokenizer, tmp_path, caplog):
    """verl's prime / remote managers: the calls run in worker processes (the function of a user's
    file carried there by value); a raising call fails its sample; a hung one is stopped at the
    deadline with its process and the next batch is scored by fresh ones."""
    from hybrid_rl.rewards import load_custom_reward_fn

    (tmp_path / "score.py").write_text(SCORED_IN_PROCESSES)
    fn = load_custom_reward_fn(str(tmp_path / "score.py"), "score", {"hang": "9"})
    manager = RewardManager(tiny_tokenizer, fn, on_error="zero", timeout_s=20, processes=2)
    try:
        batch, _ = make_batch(tiny_tokenizer, ["a", "b", "c", "d"], ["1", "2", "boom", "5"], ["1", "3", "0", "5"])
        _, extra = manager(batch)
        assert extra["score"] == [1.0, 0.0, 0.0, 1.0] and extra["reward_failed"] == [False, False, True, False]
        assert os.getpid() not in extra["pid"][:2] + extra["pid"][3:] and "cannot parse" in caplog.text
        manager.timeout_s = 3
        hung, _ = make_batch(tiny_tokenizer, ["a", "b"], ["9", "2"], ["9", "2"])
        start = time.monotonic()
        _, extra = manager(hung)
        assert extra["reward_failed"] == [True, False] and time.monotonic() - start < 30
        manager.timeout_s = 20
        _, extra = manager(batch)  # fresh processes
        assert extra["score"] == [1.0, 0.0, 0.0, 1.0]
    finally:
        manager.close()
    with pytest.raises(ValueError, match="does not combine with reward.funcs, the batch manager"):
        RewardManager(tiny_tokenizer, fn, batched=True, processes=2)
