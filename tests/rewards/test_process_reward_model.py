"""The process reward model: step splitting, step scores at the step-end tokens against a plain
transformers forward of the same token classifier (the policy's tokens and a re-templated reward
model), the step rewards in the reward tensor and the grpo_process advantage, and the start-up
checks."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, LlamaForTokenClassification

from hybrid_rl.algorithms.advantage import grpo_process_advantage
from hybrid_rl.config import ConfigError
from hybrid_rl.engines import Head, Output
from hybrid_rl.main import check_reward_model, compose_config, prepare
from hybrid_rl.models import ModelPathError
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards import RewardManager
from hybrid_rl.rewards.mixture import sources_from_config
from hybrid_rl.rewards.model_inputs import RewardInputs
from hybrid_rl.rewards.steps import step_ends, tag_steps
from hybrid_rl.workers.reward_model import place_step_scores, tag_token_ids_of
from tests.conftest import run_overrides
from tests.rewards.test_mixture import reward_cfg
from tests.rewards.test_reward_model import OTHER_TEMPLATE, build_reward_model
from tests.rewards.test_reward_model import engine as reward_model_engine
from tests.rewards.test_reward_model import rollouts as policy_rollouts

CHATS = [[{"role": "user", "content": "What is 12 + 34?"}],
         [{"role": "user", "content": "minus 17"}],
         [{"role": "user", "content": "3.5 dollars"}]]
ANSWERS = ["12 + 34\n= 46\n\nThe answer is 46", "minus 17", "\n3.5 $\n"]
# ANSWERS with a step tag after each step's text
TAGGED = ["12 + 34 ки\n= 46 ки\n\nThe answer is 46 ки", "minus 17 ки", "\n3.5 $ ки\n"]


def build_prm(path, tokenizer, num_labels=1, seed=0) -> str:
    return build_reward_model(path, tokenizer, num_labels, seed, model_class=LlamaForTokenClassification)


def rollouts(tokenizer) -> Batch:
    return policy_rollouts(tokenizer, CHATS, ANSWERS)


def prm_engine(path, packing="shared_prompts"):
    return reward_model_engine(path, packing=packing, head=Head.STEP_SCORE)


def plain_position_scores(path, ids: list[int]) -> torch.Tensor:
    model = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return logits.softmax(-1)[:, 1] if logits.shape[-1] == 2 else logits[:, 0]


def test_step_ends():
    assert step_ends("a = 1\nb = 2\n\nso 3", "\n") == [6, 13, 17]  # a run of separators closes one step
    assert step_ends("\n\nfirst\nlast\n\n", "\n") == [8, 14]  # leading ones open nothing; trailing ones end the last
    assert step_ends("one step", "\n") == [8]
    assert step_ends("x. y. z", ". ") == [3, 6, 7]
    assert step_ends("", "\n") == [] and step_ends(" \n \n", "\n") == []


def step_end_tokens(tokenizer, response: list[int], text: str) -> list[int]:
    """Independently: tokens that hold a newline closing a step, and the last text token."""
    pieces = [tokenizer.decode([t], skip_special_tokens=True) for t in response]
    last_text = max(k for k, piece in enumerate(pieces) if piece)
    ends = []
    for k, piece in enumerate(pieces):
        starts_after = "".join(pieces[:k])
        if "\n" in piece and starts_after.strip() and (k + 1 >= len(pieces) or "\n" not in pieces[k + 1]) \
                and "".join(pieces[k + 1:]).strip():
            ends.append(k)
    return ends + [last_text] if text.strip() else []


@pytest.mark.parametrize("packing", ["padded", "shared_prompts"])
@pytest.mark.parametrize("num_labels", [1, 2])
def test_step_scores_sit_on_the_step_ends_and_equal_a_plain_forward(tmp_path, tiny_tokenizer, num_labels, packing):
    path = build_prm(tmp_path / "prm", tiny_tokenizer, num_labels)
    batch = rollouts(tiny_tokenizer)
    rows, cut, steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, None).with_steps(batch, "\n")
    assert not cut.any() and torch.equal(rows["input_ids"], batch["input_ids"])
    token_scores = prm_engine(path, packing).infer(rows, Output.TOKEN_SCORES, 1.0, 2, None)["token_scores"]
    scores, mask = place_step_scores(token_scores, steps, batch["responses"].shape)
    prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    for i, answer in enumerate(ANSWERS):
        valid = batch["attention_mask"][i].bool()
        response = batch["responses"][i][valid[prompt_width:]].tolist()
        expected_tokens = step_end_tokens(tiny_tokenizer, response, answer)
        assert mask[i].nonzero().flatten().tolist() == expected_tokens
        ids = batch["input_ids"][i][valid].tolist()
        plain = plain_position_scores(path, ids)[len(ids) - len(response):]
        assert torch.allclose(scores[i, expected_tokens], plain[expected_tokens], atol=1e-5)
    assert mask.sum(-1).tolist() == [3, 1, 1]
    if num_labels == 2:
        assert ((scores[mask] > 0) & (scores[mask] < 1)).all()  # probabilities of a good step


def test_a_process_reward_model_with_another_template_reads_its_own_tokens(tmp_path, tiny_tokenizer, make_tokenizer):
    rm_tokenizer = make_tokenizer(OTHER_TEMPLATE)
    path = build_prm(tmp_path / "prm", rm_tokenizer, seed=1)
    batch = rollouts(tiny_tokenizer)
    ours, _, policy_steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, None).with_steps(batch, "\n")
    rows, _, steps = RewardInputs(tiny_tokenizer, rm_tokenizer, None).with_steps(batch, "\n")
    assert [[p for p, _ in row] for row in steps] == [[p for p, _ in row] for row in policy_steps]
    token_scores = prm_engine(path).infer(rows, Output.TOKEN_SCORES, 1.0, 8, None)["token_scores"]
    for i, (chat, answer) in enumerate(zip(CHATS, ANSWERS)):
        text = rm_tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": answer}], tokenize=False)
        prompt = rm_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        encoded = rm_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        split = sum(1 for start, _ in encoded["offset_mapping"] if start < len(prompt))
        plain = plain_position_scores(path, encoded["input_ids"])
        # each step is read where the reward model's text holds the step's last character
        for (_, token), end in zip(steps[i], step_ends(answer, "\n")):
            start, stop = encoded["offset_mapping"][split + token]
            assert start < len(prompt) + end <= stop
            assert token_scores[i, token] == pytest.approx(plain[split + token].item(), abs=1e-5)


def test_tag_steps():
    text = "a = 1\nb = 2\n\nso 3"
    tagged, ends = tag_steps(text, step_ends(text, "\n"), "\n", " ки")
    assert tagged == "a = 1 ки\nb = 2 ки\n\nso 3 ки"
    assert [tagged[:end] for end in ends] == ["a = 1 ки", "a = 1 ки\nb = 2 ки", tagged]


@pytest.mark.parametrize("template", ["own", "none"])
@pytest.mark.parametrize("packing", ["padded", "shared_prompts"])
def test_a_step_tag_scorer_reads_p_good_after_each_tag(tiny_model_dir, tiny_tokenizer, make_tokenizer, packing,
                                                        template, tmp_path):
    """Math-Shepherd's scheme: the tagged text through the scorer's template (or, without one, the
    question, a space and the tagged answer), P(good) from its next-token logits at each tag."""
    tag = " ки"
    path = tiny_model_dir
    scorer_tokenizer = tiny_tokenizer
    if template == "none":  # the policy's vocabulary without a chat template
        scorer_tokenizer = make_tokenizer(None)
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(tmp_path / "scorer")
        scorer_tokenizer.save_pretrained(tmp_path / "scorer")
        path = str(tmp_path / "scorer")
    good, bad = tag_token_ids_of(scorer_tokenizer, ["+", "-"])
    batch = rollouts(tiny_tokenizer)
    _, _, classifier_steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, None).with_steps(batch, "\n")
    rows, _, steps = RewardInputs(tiny_tokenizer, scorer_tokenizer, None, step_tag=tag).with_steps(batch, "\n")
    # the same policy tokens carry the steps as with a token classifier
    assert [[p for p, _ in row] for row in steps] == [[p for p, _ in row] for row in classifier_steps]
    engine = reward_model_engine(path, packing=packing, head=Head.STEP_TAG, tag_token_ids=(good, bad))
    token_scores = engine.infer(rows, Output.TOKEN_SCORES, 1.0, 2, None)["token_scores"]
    plain_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for i, (chat, answer) in enumerate(zip(CHATS, ANSWERS)):
        tagged = TAGGED[i]
        if template == "own":
            text = scorer_tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": tagged}],
                                                        tokenize=False)
        else:
            text = chat[-1]["content"] + " " + tagged
        encoded = scorer_tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        with torch.no_grad():
            logits = plain_model(input_ids=torch.tensor([encoded["input_ids"]])).logits[0]
        p_good = logits[:, [good, bad]].softmax(-1)[:, 0]
        answer_start = text.index(tagged)
        tag_ends = [answer_start + k + len(tag) for k in range(len(tagged)) if tagged.startswith(tag, k)]
        tag_tokens = [next(k for k, (start, end) in enumerate(encoded["offset_mapping"]) if start < tag_end <= end)
                      for tag_end in tag_ends]
        assert len(tag_tokens) == len(steps[i]) == len(step_ends(answer, "\n"))
        split = len(encoded["input_ids"]) - rows["attention_mask"][i, -rows["responses"].shape[1]:].sum().item()
        assert [split + r for _, r in steps[i]] == tag_tokens
        for (_, r), k in zip(steps[i], tag_tokens):
            assert token_scores[i, r].item() == pytest.approx(p_good[k].item(), abs=1e-5)


def test_max_length_drops_the_steps_it_cuts_away(tiny_tokenizer):
    batch = rollouts(tiny_tokenizer)
    prompt_width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    response_len = int(batch["attention_mask"][0, prompt_width:].sum())
    full_steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, None).with_steps(batch, "\n")[2]
    first_end = full_steps[0][0][0]
    rows, cut, steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, response_len - first_end - 1).with_steps(batch, "\n")
    assert cut[0] and [p for p, _ in steps[0]] == [p for p, _ in full_steps[0][1:]]
    shift = first_end + 1
    assert [r for _, r in steps[0]] == [p - shift for p, _ in full_steps[0][1:]]
    assert rows["responses"].shape[1] >= max(r for _, r in steps[0]) + 1


def test_step_rewards_reach_the_reward_tensor_and_the_process_advantage(tiny_tokenizer):
    batch = rollouts(tiny_tokenizer)
    batch.non_tensors["data_source"] = ["arithmetic"] * 3
    batch.non_tensors["reward_model"] = [{"ground_truth": "46"}] * 3
    _, _, steps = RewardInputs(tiny_tokenizer, tiny_tokenizer, None).with_steps(batch, "\n")
    token_scores = torch.linspace(-1, 1, batch["responses"].numel()).reshape(batch["responses"].shape)
    step_scores, step_mask = place_step_scores(token_scores, steps, batch["responses"].shape)
    batch["rm_step_scores"], batch["rm_step_mask"] = step_scores, step_mask
    batch["rm_scores"] = step_scores.sum(-1)
    sources = sources_from_config(reward_cfg([]), ConfigError, reward_model=True, process=True)
    reward, extra = RewardManager(tiny_tokenizer, sources=sources)(batch)
    assert torch.equal(reward, step_scores * step_mask) and torch.equal(extra["step_mask"], step_mask)
    assert extra["score"] == pytest.approx(step_scores.sum(-1).tolist())
    index = ["g"] * 3
    adv, _ = grpo_process_advantage(reward, batch["responses"].ne(tiny_tokenizer.pad_token_id).float(), index=index,
                                    step_mask=extra["step_mask"])
    rewards = step_scores[step_mask]
    normed = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    # a token's advantage is the sum of the normalised rewards of the steps that end at or after it
    first_row_steps = step_mask[0].nonzero().flatten().tolist()
    assert adv[0, 0].item() == pytest.approx(normed[:len(first_row_steps)].sum().item(), abs=1e-5)
    assert adv[0, first_row_steps[-1]].item() == pytest.approx(normed[len(first_row_steps) - 1].item(), abs=1e-5)


def test_process_reward_models_that_cannot_work_are_refused(tmp_path, tiny_tokenizer, tiny_model_dir,
                                                            arithmetic_files):
    def cfg(*extra):
        return compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run")
                              + ["reward_model.enable=true", *extra])

    prm = build_prm(tmp_path / "prm", tiny_tokenizer)
    outcome = build_reward_model(tmp_path / "rm", tiny_tokenizer)
    with pytest.raises(ModelPathError, match="not a token classifier"):
        prepare(cfg(f"reward_model.model.path={outcome}", "reward_model.process.enable=true"))
    with pytest.raises(ModelPathError, match="a token classifier scores steps: reward_model.process.enable=true"):
        prepare(cfg(f"reward_model.model.path={prm}"))
    three = build_prm(tmp_path / "three", tiny_tokenizer, num_labels=3)
    with pytest.raises(ModelPathError, match="has 3 labels"):
        check_reward_model(cfg(f"reward_model.model.path={three}", "reward_model.process.enable=true").reward_model,
                           "reward_model.model.path")
    with pytest.raises(ConfigError, match="cannot be mixed with other sources yet; give rule weight 0"):
        prepare(cfg(f"reward_model.model.path={prm}", "reward_model.process.enable=true",
                    "reward.funcs=[reward_model,rule]"))
    *_, reward_fn, _ = prepare(cfg(f"reward_model.model.path={prm}", "reward_model.process.enable=true",
                                   "reward.funcs=[reward_model,rule]", "reward.weights=[1.0,0.0]"))
    assert [(s.name, s.weight, s.step_keys) for s in reward_fn.sources] == [
        ("reward_model", 1.0, ("rm_step_scores", "rm_step_mask")), ("rule", 0.0, None)]  # the rule only logged
    with pytest.raises(ConfigError, match="step_separator=''"):
        prepare(cfg(f"reward_model.model.path={prm}", "reward_model.process.enable=true",
                    "reward_model.process.step_separator=''"))
    *_, reward_fn, _ = prepare(cfg(f"reward_model.model.path={prm}", "reward_model.process.enable=true"))
    assert [s.step_keys for s in reward_fn.sources] == [("rm_step_scores", "rm_step_mask")]
    # step-tag scorers
    with pytest.raises(ModelPathError, match="not a causal LM"):
        prepare(cfg(f"reward_model.model.path={prm}", "reward_model.process.enable=true",
                    "reward_model.process.step_tag=' ки'"))
    with pytest.raises(ConfigError, match="step_tag=' '"):
        prepare(cfg(f"reward_model.model.path={tiny_model_dir}", "reward_model.process.enable=true",
                    "reward_model.process.step_tag=' '"))
    with pytest.raises(ConfigError, match="two different tokens"):
        prepare(cfg(f"reward_model.model.path={tiny_model_dir}", "reward_model.process.enable=true",
                    "reward_model.process.step_tag=' ки'", "reward_model.process.step_tag_tokens=[+,+]"))
    prepare(cfg(f"reward_model.model.path={tiny_model_dir}", "reward_model.process.enable=true",
                "reward_model.process.step_tag=' ки'"))
    with pytest.raises(ValueError, match="each must be a single token"):
        tag_token_ids_of(tiny_tokenizer, ["+", "a long word that is several tokens"])
