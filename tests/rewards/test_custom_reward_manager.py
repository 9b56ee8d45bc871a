"""Reward managers of one's own, written for verl (reward.reward_manager.source=importlib): both
of verl's interfaces, loaded from files that import verl's modules, against the per-sample
manager's own results."""

import sys

import pytest
import torch

from hybrid_rl.rewards import RewardFunctionError, RewardManager
from hybrid_rl.rewards.custom_manager import load_reward_manager_class
from tests.rewards.test_reward_manager import make_batch

RUN_SINGLE = '''
from verl import DataProto
from verl.experimental.reward_loop.reward_manager import register
from verl.experimental.reward_loop.reward_manager.base import RewardManagerBase


@register("length_aware")
class LengthAware(RewardManagerBase):
    """compute_score, less a cost per response token, one sample at a time."""

    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)

    async def run_single(self, data: DataProto) -> dict:
        item = data[0]
        width = item.batch["responses"].shape[-1]
        length = int(item.batch["attention_mask"][-width:].sum())
        text = await self.loop.run_in_executor(
            None, lambda: self.tokenizer.decode(item.batch["responses"][:length], skip_special_tokens=True))
        if text.strip() == "boom":
            raise RuntimeError("the judge fell over")
        score = self.compute_score(data_source=item.non_tensor_batch["data_source"], solution_str=text,
                                   ground_truth=item.non_tensor_batch["reward_model"]["ground_truth"],
                                   extra_info=item.non_tensor_batch.get("extra_info"))
        return {"reward_score": score - 0.01 * length, "reward_extra_info": {"acc": score, "length": length}}
'''

WHOLE_BATCH = '''
import torch
from verl import DataProto
from verl.utils.reward_score import default_compute_score
from verl.workers.reward_manager import register
from verl.workers.reward_manager.abstract import AbstractRewardManager


@register("scaled")
class Scaled(AbstractRewardManager):
    """verl 0.3-0.8's interface: the whole batch, the score times `scale` on the last token."""

    def __init__(self, tokenizer, num_examine, compute_score=None, reward_fn_key="data_source", scale=1.0):
        self.tokenizer, self.key, self.scale = tokenizer, reward_fn_key, scale
        self.compute_score = compute_score or default_compute_score

    def __call__(self, data: DataProto, return_dict=False):
        rewards = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        width = data.batch["responses"].shape[-1]
        accs = []
        for i in range(len(data)):
            item = data[i]
            length = int(item.batch["attention_mask"][-width:].sum())
            text = self.tokenizer.decode(item.batch["responses"][:length], skip_special_tokens=True)
            acc = self.compute_score(item.non_tensor_batch[self.key], text,
                                     item.non_tensor_batch["reward_model"]["ground_truth"])
            rewards[i, length - 1] = self.scale * acc
            accs.append(acc)
        return {"reward_tensor": rewards, "reward_extra_info": {"acc": accs}} if return_dict else rewards
'''

PROMPTS, RESPONSES, TRUTHS = ["What is 1 + 2?", "What is 5 - 7?", "What is 3 + 3?"], ["3", "-2", "7"], ["3", "-2", "6"]


def _class(tmp_path, body, name):
    (tmp_path / "manager.py").write_text(body)
    cls = load_reward_manager_class(str(tmp_path / "manager.py"), name, "reward.reward_manager")
    assert "verl" not in sys.modules  # the stand-ins are gone once the file has loaded
    return cls


def test_run_single_manager_scores_each_sample(tmp_path, tiny_tokenizer):
    from hybrid_rl.rewards import default_compute_score

    cls = _class(tmp_path, RUN_SINGLE, "LengthAware")
    batch, lengths = make_batch(tiny_tokenizer, PROMPTS, RESPONSES, TRUTHS)
    manager = cls(config=None, tokenizer=tiny_tokenizer, compute_score=default_compute_score)
    reward, extra = RewardManager(tiny_tokenizer, manager=manager, timeout_s=30)(batch)
    expected = [acc - 0.01 * n for acc, n in zip([1.0, 1.0, 0.0], lengths)]
    assert extra["score"] == pytest.approx(expected) and extra["acc"] == [1.0, 1.0, 0.0] and extra["length"] == lengths
    assert reward[torch.arange(3), torch.tensor(lengths) - 1].tolist() == pytest.approx(expected)
    assert reward.sum().item() == pytest.approx(sum(expected))


def test_run_single_failures_are_per_sample(tmp_path, tiny_tokenizer):
    from hybrid_rl.rewards import default_compute_score

    manager = _class(tmp_path, RUN_SINGLE, "LengthAware")(None, tiny_tokenizer, default_compute_score)
    batch, _ = make_batch(tiny_tokenizer, PROMPTS[:2], ["boom", "-2"], TRUTHS[:2])
    scorer = RewardManager(tiny_tokenizer, manager=manager, on_error="zero")
    _, extra = scorer(batch)
    assert extra["reward_failed"] == [True, False] and extra["score"][0] == 0.0 and scorer.failures == 1
    with pytest.raises(RewardFunctionError, match="reward function LengthAware raised RuntimeError: the judge fell over"):
        RewardManager(tiny_tokenizer, manager=manager, on_error="raise")(batch)


def test_whole_batch_manager(tmp_path, tiny_tokenizer):
    cls = _class(tmp_path, WHOLE_BATCH, "Scaled")
    batch, lengths = make_batch(tiny_tokenizer, PROMPTS, RESPONSES, TRUTHS)
    manager = cls(tokenizer=tiny_tokenizer, num_examine=0, compute_score=None, reward_fn_key="data_source", scale=2.0)
    reward, extra = RewardManager(tiny_tokenizer, manager=manager, on_error="zero")(batch)
    plain, plain_extra = RewardManager(tiny_tokenizer)(batch)  # the built-in scorer, per sample
    assert torch.equal(reward, 2.0 * plain) and extra["acc"] == plain_extra["score"]
    assert extra["score"] == [2.0, 2.0, 0.0] and extra["reward_failed"] == [False] * 3


@pytest.mark.parametrize("body, name, match", [
    ("class Plain:\n    pass\n", "Plain", "must be a class derived from verl's RewardManagerBase"),
    (RUN_SINGLE, "Missing", "has no class 'Missing' \\(reward.reward_manager.name.*found there: .*LengthAware"),
    ("from verl.utils.ray_utils import get_event_loop\n", "X", "No module named 'verl.utils.ray_utils'"),
])
def test_bad_reward_manager_files(tmp_path, body, name, match):
    with pytest.raises(ValueError, match=match):
        _class(tmp_path, body, name)


def test_whole_batch_manager_must_return_the_batchs_shape(tmp_path, tiny_tokenizer):
    body = WHOLE_BATCH.replace('return {"reward_tensor": rewards,', 'return {"reward_tensor": rewards[:, :2],')
    manager = _class(tmp_path, body, "Scaled")(tokenizer=tiny_tokenizer, num_examine=0)
    batch, _ = make_batch(tiny_tokenizer, PROMPTS, RESPONSES, TRUTHS)
    with pytest.raises(TypeError, match="returned a reward tensor of \\(3, 2\\); it must be \\(batch, response length\\)"):
        RewardManager(tiny_tokenizer, manager=manager)(batch)
