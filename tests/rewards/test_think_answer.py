"""R1-Zero's <think>/<answer> format: the format reward, the answer read from the tags, the
arithmetic task asked in that format, and the per-data-set validation means of such scores."""

import pytest
from omegaconf import OmegaConf

from hybrid_rl.config import ConfigError
from hybrid_rl.data.arithmetic import ANSWER_FORMATS, PHRASINGS, TAGS_INSTRUCTION, make_arithmetic_rows
from hybrid_rl.metrics import per_source_means
from hybrid_rl.rewards import RewardManager, default_compute_score
from hybrid_rl.rewards.mixture import sources_from_config
from hybrid_rl.rewards.think_answer import answer_text, format_score, tag_count_score, well_formed
from tests.rewards.test_reward_manager import make_batch

WELL_FORMED = ["<think>3 plus 4 is 7</think><answer>7</answer>",
               "  <think>\n3 + 4 = 7\n</think>\n\n<answer> 7 </answer>\n"]
MALFORMED = ["7", "<answer>7</answer>", "<think>7</think>", "<think>x</think><answer>7</answer> so 7",
             "<think>a<think>b</think><answer>7</answer>", "<think>x</think><answer>7</answer><answer>8</answer>",
             "<think>x</think>\n<answer>7", "<answer>7</answer><think>x</think>", ""]


@pytest.mark.parametrize("text", WELL_FORMED)
def test_well_formed_responses(text):
    assert well_formed(text) and format_score("any", text, "7") == 1.0


@pytest.mark.parametrize("text", MALFORMED)
def test_malformed_responses(text):
    assert not well_formed(text) and format_score("any", text, "7") == 0.0


def test_the_soft_format_reward_counts_tags_written_once():
    assert tag_count_score("any", WELL_FORMED[0], "7") == 1.0
    assert tag_count_score("any", "<answer>7</answer>", "7") == 0.5
    assert tag_count_score("any", "<think><think>x</think> <answer>7", "7") == 0.5  # <think> twice
    assert tag_count_score("any", "7", "7") == 0.0


def test_the_answer_is_the_last_complete_answer_block():
    assert answer_text("<think>x</think> <answer> 12 </answer>") == "12"
    assert answer_text("<answer>1</answer> then <answer>2</answer> <answer>3") == "2"
    assert answer_text("the answer is 12") is None


def test_arithmetic_in_the_tags_format_is_read_from_the_answer_block():
    tags = {"answer_format": "tags"}
    assert default_compute_score("arithmetic", "<think>4 + 3 = 7</think><answer>7</answer>", "7", tags) == 1.0
    # The last integer is 7, but it is outside the answer block.
    assert default_compute_score("arithmetic", "<think>x</think><answer>8</answer> no, 7", "7", tags) == 0.0
    assert default_compute_score("arithmetic/words", "7", "7", tags) == 0.0
    # The number format (and rows without the key) read the last integer, as before.
    assert default_compute_score("arithmetic", "<answer>8</answer> no, 7", "7", {"answer_format": "number"}) == 1.0
    assert default_compute_score("arithmetic", "so 7", "7", None) == 1.0


def test_every_phrasing_asks_for_the_tags():
    for phrasing in PHRASINGS:
        rows = make_arithmetic_rows(12, seed=1, lo=1, hi=30, ops="+-*", phrasing=phrasing, answer_format="tags")
        for row in rows:
            assert row["prompt"][0]["content"].endswith(" " + TAGS_INSTRUCTION)
            assert "Reply with only" not in row["prompt"][0]["content"]
            assert row["extra_info"]["answer_format"] == "tags"
        number = make_arithmetic_rows(12, seed=1, lo=1, hi=30, ops="+-*", phrasing=phrasing)
        # The same problems either way; only how the answer is asked for differs.
        assert [r["reward_model"] for r in rows] == [r["reward_model"] for r in number]
    with pytest.raises(ValueError, match="answer format must be one of number, tags"):
        make_arithmetic_rows(3, answer_format="boxed")
    assert ANSWER_FORMATS == ("number", "tags")


def test_format_and_answer_as_two_weighted_sources(tiny_tokenizer):
    cfg = OmegaConf.create({"funcs": ["rule", "think_format"], "weights": [1.0, 0.5], "sandbox": {}})
    sources = sources_from_config(cfg, ConfigError)
    assert [s.name for s in sources] == ["rule", "think_format"]
    responses = ["<think>1+2</think><answer>3</answer>", "<answer>3</answer>", "<think>x</think><answer>4</answer>",
                 "3"]
    batch, _ = make_batch(tiny_tokenizer, ["q"] * 4, responses, ["3"] * 4, T=48)
    batch["extra_info"] = [{"index": i, "answer_format": "tags"} for i in range(4)]
    decoded = [tiny_tokenizer.decode(tiny_tokenizer(r, add_special_tokens=False)["input_ids"]) for r in responses]
    formats = [float(well_formed(d)) for d in decoded]
    answers = [float(answer_text(d) == "3") for d in decoded]
    reward, extra = RewardManager(tiny_tokenizer, sources=sources)(batch)
    assert extra["reward/think_format"] == formats and extra["reward/rule"] == answers
    assert reward.sum(-1).tolist() == pytest.approx([a + 0.5 * f for a, f in zip(answers, formats)])
    assert formats[0] == 1.0 and answers[:2] == [1.0, 1.0] and answers[2:] == [0.0, 0.0]


def test_validation_reports_accuracy_and_sources_per_data_set():
    extra = {"acc": [1.0, 0.0, True, None], "reward/rule": [1.0, 1.0, 0.0, 0.0], "pred": ["7", "8", "9", "1"],
             "short": [1.0]}
    got = per_source_means(["a", "a", "b", "b"], extra, n=1)
    assert got == {"val-core/a/acc/mean@1": 0.5, "val-core/b/acc/mean@1": 1.0,
                   "val-core/a/reward/rule/mean@1": 1.0, "val-core/b/reward/rule/mean@1": 0.0}
