import math

import pytest
import torch

from hybrid_rl.protocol import Batch
from hybrid_rl.rewards import RewardFunctionError, RewardManager


def make_batch(tok, prompts, responses, truths, data_source="arithmetic", extra_info=True, T=12, P=16):
    """Left-padded prompts, right-padded responses ending in EOS (included in the mask)."""
    B = len(responses)
    pad, eos = tok.pad_token_id, tok.eos_token_id
    prompt_t = torch.full((B, P), pad, dtype=torch.long)
    resp_t = torch.full((B, T), pad, dtype=torch.long)
    resp_mask = torch.zeros(B, T, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    lengths = []
    for i, (p, r) in enumerate(zip(prompts, responses)):
        p_ids = tok(p, add_special_tokens=False)["input_ids"][-P:]
        prompt_t[i, P - len(p_ids):] = torch.tensor(p_ids)
        prompt_mask[i, P - len(p_ids):] = 1
        if r is None:  # zero valid tokens
            lengths.append(0)
            continue
        r_ids = (tok(r, add_special_tokens=False)["input_ids"] + [eos])[:T]
        resp_t[i, : len(r_ids)] = torch.tensor(r_ids)
        resp_mask[i, : len(r_ids)] = 1
        lengths.append(len(r_ids))
    non_tensors = {
        "data_source": [data_source] * B,
        "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
    }
    if extra_info:
        non_tensors["extra_info"] = [{"index": i} for i in range(B)]
    batch = Batch(
        {
            "prompts": prompt_t,
            "responses": resp_t,
            "response_mask": resp_mask,
            "attention_mask": torch.cat([prompt_mask, resp_mask], dim=1),
        },
        non_tensors,
    )
    return batch, lengths


def test_score_at_last_valid_token(tiny_tokenizer):
    batch, lengths = make_batch(
        tiny_tokenizer,
        ["What is 1 + 2?", "What is 5 - 7?", "What is 3 + 3?"],
        ["3", "The answer is -2", "7"],
        ["3", "-2", "6"],
    )
    reward, extra = RewardManager(tiny_tokenizer)(batch)
    assert reward.shape == batch["responses"].shape and reward.dtype == torch.float32
    expected = torch.zeros_like(reward)
    for i, (L, s) in enumerate(zip(lengths, [1.0, 1.0, 0.0])):
        expected[i, L - 1] = s
    assert torch.equal(reward, expected)
    assert extra == {"score": [1.0, 1.0, 0.0]}
    # the EOS token is counted in the mask, so the reward sits on it
    for i, L in enumerate(lengths):
        assert batch["responses"][i, L - 1].item() == tiny_tokenizer.eos_token_id


def test_decodes_only_valid_tokens_and_passes_fields(tiny_tokenizer):
    seen = []

    def fn(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return 1

    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["12", "34 + 1"], ["12", "35"], data_source="custom")
    RewardManager(tiny_tokenizer, compute_score=fn)(batch)
    assert seen == [("custom", "12", "12", {"index": 0}), ("custom", "34 + 1", "35", {"index": 1})]


def test_no_extra_info_and_zero_length_row(tiny_tokenizer):
    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], [None, "5"], ["5", "5"], extra_info=False)
    calls = []

    def fn(data_source, solution_str, ground_truth, extra_info=None):
        calls.append((solution_str, extra_info))
        return 0.5

    reward, extra = RewardManager(tiny_tokenizer, compute_score=fn)(batch)
    assert calls == [("", None), ("5", None)]
    assert reward[0, 0].item() == 0.5 and reward[0, 1:].abs().sum() == 0
    assert extra["score"] == [0.5, 0.5]


def test_dict_return_collects_extra_keys(tiny_tokenizer):
    def fn(data_source, solution_str, ground_truth, extra_info):
        ok = solution_str.strip() == ground_truth
        return {"score": 1.0 if ok else -1.0, "acc": ok, "pred": solution_str}

    batch, lengths = make_batch(tiny_tokenizer, ["q", "q"], ["4", "5"], ["4", "4"])
    reward, extra = RewardManager(tiny_tokenizer, compute_score=fn)(batch)
    assert extra == {"score": [1.0, -1.0], "acc": [True, False], "pred": ["4", "5"]}
    assert reward[1, lengths[1] - 1].item() == -1.0


def test_reward_fn_key(tiny_tokenizer):
    batch, _ = make_batch(tiny_tokenizer, ["q"], ["4"], ["4"])
    batch["source2"] = ["arithmetic"]
    batch["data_source"] = ["unknown_source"]
    _, extra = RewardManager(tiny_tokenizer, reward_fn_key="source2")(batch)
    assert extra["score"] == [1.0]


@pytest.mark.parametrize("bad", ["1.0", None, [1.0], {"acc": 1}])
def test_wrong_return_type(tiny_tokenizer, bad):
    def my_bad_fn(data_source, solution_str, ground_truth, extra_info):
        return bad

    batch, _ = make_batch(tiny_tokenizer, ["q"], ["4"], ["4"])
    with pytest.raises(TypeError) as err:
        RewardManager(tiny_tokenizer, compute_score=my_bad_fn)(batch)
    msg = str(err.value)
    assert "my_bad_fn" in msg and "score" in msg and "expected" in msg


def test_raising_reward_fn(tiny_tokenizer):
    def exploding(data_source, solution_str, ground_truth, extra_info):
        if ground_truth == "9":
            raise ZeroDivisionError("boom")
        return 0.0

    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "9"], data_source="src_x")
    with pytest.raises(RewardFunctionError) as err:
        RewardManager(tiny_tokenizer, compute_score=exploding)(batch)
    msg = str(err.value)
    for part in ("exploding", "index 1", "src_x", "'9'", "ZeroDivisionError", "boom"):
        assert part in msg
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_unknown_data_source_with_default(tiny_tokenizer):
    batch, _ = make_batch(tiny_tokenizer, ["q"], ["1"], ["1"], data_source="mystery")
    with pytest.raises(RewardFunctionError, match="custom_reward_function.path"):
        RewardManager(tiny_tokenizer)(batch)


@pytest.mark.parametrize("value", [math.nan, math.inf, {"score": -math.inf}])
def test_non_finite_score(tiny_tokenizer, value):
    batch, _ = make_batch(tiny_tokenizer, ["q", "q"], ["1", "2"], ["1", "2"], data_source="ds_nan")
    with pytest.raises(RewardFunctionError) as err:
        RewardManager(tiny_tokenizer, compute_score=lambda **kw: value)(batch)
    assert "ds_nan" in str(err.value) and "index 0" in str(err.value)


def test_num_examine_prints(tiny_tokenizer, capsys):
    batch, _ = make_batch(tiny_tokenizer, ["What is 1 + 2?", "q2"], ["3", "4"], ["3", "4"])
    RewardManager(tiny_tokenizer, num_examine=1)(batch)
    out = capsys.readouterr().out
    assert "What is 1 + 2?" in out and "[ground_truth] 3" in out and "[score] 1.0" in out
    assert "q2" not in out


def test_step_rewards_land_on_each_steps_last_token(tiny_tokenizer):
    """Process supervision: each step's reward sits on the token holding its last character."""
    text = "The answer is 46. #### 46"
    batch, lengths = make_batch(tiny_tokenizer, ["What is 12 + 34?"], [text], ["46"], T=32)
    ends = [len("The answer is 46."), len(text)]

    def steps(data_source, solution_str, ground_truth, extra_info):
        assert solution_str == text
        return {"step_rewards": [0.25, 1.0], "step_ends": ends}

    reward, extra = RewardManager(tiny_tokenizer, steps)(batch)
    mask = extra.pop("step_mask")
    ids = batch["responses"][0, : lengths[0]].tolist()
    prefix = [len(tiny_tokenizer.decode(ids[: k + 1], skip_special_tokens=True)) for k in range(len(ids))]
    expected_tokens = [min(k for k, n in enumerate(prefix) if n >= end) for end in ends]
    assert mask[0].nonzero().flatten().tolist() == expected_tokens
    assert reward[0, expected_tokens].tolist() == [0.25, 1.0]
    assert reward.sum().item() == 1.25 and extra["score"] == [1.25]


@pytest.mark.parametrize("result, fragment", [
    ({"step_rewards": [1.0], "step_ends": [1, 2]}, "equal length"),
    ({"step_rewards": [1.0], "step_ends": [999]}, "character offsets"),
])
def test_bad_step_rewards(tiny_tokenizer, result, fragment):
    batch, _ = make_batch(tiny_tokenizer, ["What is 1 + 2?"], ["3"], ["3"])
    with pytest.raises(TypeError, match=fragment):
        RewardManager(tiny_tokenizer, lambda **kw: result)(batch)


def test_batch_manager_calls_once_with_lists(tiny_tokenizer):
    """verl's batch manager: one call with the batch's lists (extra_infos copied, with verl's
    rollout_reward_scores), results placed per sample as the per-sample manager places them."""
    calls = []

    def score_batch(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
        calls.append((list(data_sources), list(solution_strs), list(ground_truths), extra_infos))
        return [{"score": float(s.strip().endswith(t)) + bonus, "acc": float(s.strip().endswith(t))}
                for s, t in zip(solution_strs, ground_truths)]

    prompts, responses, truths = ["What is 1 + 2?", "What is 5 - 7?", "What is 3 + 3?"], ["3", "-2", "7"], ["3", "-2", "6"]
    batch, lengths = make_batch(tiny_tokenizer, prompts, responses, truths)
    import functools

    reward, extra = RewardManager(tiny_tokenizer, functools.partial(score_batch, bonus=0.5), batched=True)(batch)
    assert len(calls) == 1
    sources, solutions, gts, infos = calls[0]
    assert sources == ["arithmetic"] * 3 and gts == truths and [s.strip() for s in solutions] == responses
    assert infos == [{"index": i, "rollout_reward_scores": {}} for i in range(3)]
    assert batch["extra_info"][0] == {"index": 0}  # the batch's own dicts are not changed
    per_sample, per_extra = RewardManager(tiny_tokenizer, lambda data_source, solution_str, ground_truth, extra_info: {
        "score": float(solution_str.strip().endswith(ground_truth)) + 0.5,
        "acc": float(solution_str.strip().endswith(ground_truth))})(batch)
    assert torch.equal(reward, per_sample) and extra == per_extra == {"score": [1.5, 1.5, 0.5], "acc": [1.0, 1.0, 0.0]}


@pytest.mark.parametrize("result, fragment", [
    ([1.0, 0.0], "returned list of 2 for a batch of 3 samples"),
    (1.0, "returned float for a batch of 3"),
    (torch.tensor([1.0, 0.0, 1.0]), None),
])
def test_batch_manager_checks_what_the_function_returns(tiny_tokenizer, result, fragment):
    batch, _ = make_batch(tiny_tokenizer, ["a", "b", "c"], ["1", "2", "3"], ["1", "2", "3"])
    manager = RewardManager(tiny_tokenizer, lambda data_sources, solution_strs, ground_truths, extra_infos: result,
                            batched=True)
    if fragment is None:
        assert manager(batch)[1]["score"] == [1.0, 0.0, 1.0]
        return
    with pytest.raises(TypeError, match=fragment):
        manager(batch)


def test_batch_manager_failure_fails_the_batch(tiny_tokenizer):
    def broken(data_sources, solution_strs, ground_truths, extra_infos):
        raise ConnectionError("judge unreachable")

    batch, _ = make_batch(tiny_tokenizer, ["a", "b"], ["1", "2"], ["1", "2"])
    manager = RewardManager(tiny_tokenizer, broken, on_error="zero", batched=True)
    reward, extra = manager(batch)
    assert not reward.any() and extra["reward_failed"] == [True, True] and manager.failures == 2
    with pytest.raises(RewardFunctionError, match="raised ConnectionError: judge unreachable \\(the batch of 2 samples"):
        RewardManager(tiny_tokenizer, broken, on_error="raise", batched=True)(batch)
    with pytest.raises(ValueError, match="reward_manager=batch calls one reward function of your own"):
        RewardManager(tiny_tokenizer, batched=True)
