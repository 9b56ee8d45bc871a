"""The reward model: its scores against a plain transformers forward of the same model on the same
text, re-templating for a reward model with another chat template, truncation, the mixture source
and the start-up checks of a bad reward model."""

import pytest
import torch
from omegaconf import OmegaConf
from transformers import AutoModelForSequenceClassification, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

from hybrid_rl.config import ConfigError
from hybrid_rl.engines import Head, ModelSpec, Output, build_engine
from hybrid_rl.main import check_reward_model, compose_config, prepare
from hybrid_rl.models import ModelPathError
from hybrid_rl.protocol import Batch
from hybrid_rl.rewards import RewardManager
from hybrid_rl.rewards.mixture import sources_from_config
from hybrid_rl.rewards.model_inputs import RewardInputs
from tests.conftest import CHAT_TEMPLATE, run_overrides
from tests.rewards.test_mixture import FUNCS, reward_cfg

OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}" \
                 "{% if add_generation_prompt %}[assistant] {% endif %}"
CHATS = [[{"role": "user", "content": "What is 12 + 34?"}],
         [{"role": "system", "content": "Answer with just the number."}, {"role": "user", "content": "12 + 3?"}],
         [{"role": "user", "content": "minus 17"}]]
ANSWERS = ["The answer is 46. #### 46", "15", "-17 and 1,024 dollars"]


def build_reward_model(path, tokenizer, num_labels=1, seed=0, model_class=LlamaForSequenceClassification,
                       num_layers: int = 2) -> str:
    """A small random reward model (`model_class`: a token classifier for a process reward model)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         num_labels=num_labels)
    model_class(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_tokenizer):
    return build_reward_model(tmp_path_factory.mktemp("rm"), tiny_tokenizer)


def rollouts(tokenizer, chats=CHATS, answers=ANSWERS) -> Batch:
    """[left-padded prompt | right-padded response] rows of the policy's tokens, as the rollout
    gives them (responses end with EOS)."""
    prompts = [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True) for chat in chats]
    prompts = [p["input_ids"] if hasattr(p, "keys") else p for p in prompts]
    responses = [tokenizer(a, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for a in answers]
    pw, rw = max(map(len, prompts)), max(map(len, responses)) + 2
    ids = torch.full((len(chats), pw + rw), tokenizer.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, pw - len(p):pw + len(r)] = torch.tensor(p + r)
        mask[i, pw - len(p):pw + len(r)] = 1
    return Batch(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
                          "responses": ids[:, pw:]},
                 non_tensors={"raw_prompt": chats})


PACKING = {"padded": {"use_remove_padding": False}, "packed": {"use_remove_padding": True},
           "shared_prompts": {"use_remove_padding": True, "share_prompt_prefix": True}}


def engine(path, dtype="fp32", packing="shared_prompts", head=Head.SCORE, tag_token_ids=None):
    """The reward model on the FSDP engine; `packing` as `reward_model.model` sets it (default: ours)."""
    model_cfg = OmegaConf.create({"trust_remote_code": False, "override_config": {}, **PACKING[packing]})
    role_cfg = OmegaConf.create({"strategy": "fsdp", "fsdp_config": {"dtype": dtype, "reshard_after_forward": True}})
    return build_engine(ModelSpec("reward_model", path, model_cfg, head=head, tag_token_ids=tag_token_ids), role_cfg,
                        torch.device("cpu"))


def plain_scores(path, texts_ids) -> list[float]:
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(input_ids=torch.tensor([ids])).logits[0, 0].item() for ids in texts_ids]


@pytest.mark.parametrize("packing", PACKING)
@pytest.mark.parametrize("micro_rows,max_tokens", [(8, None), (1, None), (2, 40)])
def test_scores_equal_a_plain_transformers_forward(reward_model_dir, tiny_tokenizer, micro_rows, max_tokens, packing):
    # Two responses to one prompt (one prompt copy when shared) and one to another.
    batch = rollouts(tiny_tokenizer, CHATS[:1] + CHATS[:2], ANSWERS[1:] + ANSWERS[:1])
    rows, cut = RewardInputs(tiny_tokenizer, tiny_tokenizer, None)(batch)
    assert not cut.any() and torch.equal(rows["input_ids"], batch["input_ids"])  # the rollout's own tokens
    scores = engine(reward_model_dir, packing=packing).infer(rows, Output.SCORES, 1.0, micro_rows,
                                                             max_tokens)["scores"]
    texts = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    expected = plain_scores(reward_model_dir, texts)
    assert scores.shape == (3,)
    assert torch.allclose(scores, torch.tensor(expected), atol=1e-5), (scores, expected)


def test_an_empty_response_is_scored_at_the_prompts_last_token(reward_model_dir, tiny_tokenizer):
    batch = rollouts(tiny_tokenizer)
    response_width = batch["responses"].shape[1]
    batch["attention_mask"][1, -response_width:] = 0  # row 1 has no response; packing cannot score it
    rows, _ = RewardInputs(tiny_tokenizer, tiny_tokenizer, None)(batch)
    scores = engine(reward_model_dir).infer(rows, Output.SCORES, 1.0, 8, None)["scores"]
    texts = [ids[m.bool()].tolist() for ids, m in zip(batch["input_ids"], batch["attention_mask"])]
    assert torch.allclose(scores, torch.tensor(plain_scores(reward_model_dir, texts)), atol=1e-5)


def test_a_reward_model_with_another_chat_template_scores_its_own_template(tmp_path, tiny_tokenizer, make_tokenizer):
    rm_tokenizer = make_tokenizer(OTHER_TEMPLATE)
    path = build_reward_model(tmp_path / "rm", rm_tokenizer, seed=1)
    inputs = RewardInputs(tiny_tokenizer, rm_tokenizer, None)
    assert inputs.retemplate
    rows, _ = inputs(rollouts(tiny_tokenizer))
    texts = [rm_tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": answer}], tokenize=False)
             for chat, answer in zip(CHATS, ANSWERS)]
    assert texts[0] == "[user] What is 12 + 34?\n[assistant] The answer is 46. #### 46\n"
    text_ids = [rm_tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    # each row holds exactly the template's tokens (the prompt part and the answer part split the text)
    assert [ids[m.bool()].tolist() for ids, m in zip(rows["input_ids"], rows["attention_mask"])] == text_ids
    scores = engine(path).infer(rows, Output.SCORES, 1.0, 8, None)["scores"]
    assert torch.allclose(scores, torch.tensor(plain_scores(path, text_ids)), atol=1e-5)


def test_max_length_keeps_the_last_tokens(reward_model_dir, tiny_tokenizer):
    batch = rollouts(tiny_tokenizer)
    lengths = batch["attention_mask"].sum(-1).tolist()
    limit = sorted(lengths)[1]  # the longest row is cut, the others are not
    rows, cut = RewardInputs(tiny_tokenizer, tiny_tokenizer, limit)(batch)
    assert cut.tolist() == [n > limit for n in lengths]
    for i, n in enumerate(lengths):
        full = batch["input_ids"][i][batch["attention_mask"][i].bool()].tolist()
        assert rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist() == full[-limit:]


def test_a_reward_model_without_chat_template_but_another_tokenizer_is_refused(tiny_tokenizer, make_tokenizer):
    with pytest.raises(ValueError, match="has no chat template"):
        RewardInputs(tiny_tokenizer, make_tokenizer(None), None)


def test_the_reward_model_as_a_weighted_source(tiny_tokenizer, tmp_path):
    from tests.rewards.test_reward_manager import make_batch

    (tmp_path / "funcs.py").write_text(FUNCS)
    sources = sources_from_config(reward_cfg(["reward_model", f"{tmp_path}/funcs.py:even_rows_only"], [1.0, 0.5]),
                                  ConfigError, reward_model=True)
    batch, lengths = make_batch(tiny_tokenizer, ["q"] * 3, ["3", "4", "12"], ["3", "3", "2"])
    batch["rm_scores"] = torch.tensor([0.25, -1.5, 2.0])
    reward, extra = RewardManager(tiny_tokenizer, sources=sources)(batch)
    expected = [0.25 + 0.5 * 2.0, -1.5, 2.0 + 0.5 * 2.0]  # even_rows_only: 2 on even rows, abstains on odd
    assert [reward[i, lengths[i] - 1].item() for i in range(3)] == expected
    assert extra["reward/reward_model"] == [0.25, -1.5, 2.0]
    # enabled without reward.funcs: the reward model alone, as in verl
    alone = sources_from_config(reward_cfg([]), ConfigError, reward_model=True)
    reward, _ = RewardManager(tiny_tokenizer, sources=alone)(batch)
    assert [reward[i, lengths[i] - 1].item() for i in range(3)] == [0.25, -1.5, 2.0]


def test_reward_model_sources_that_cannot_work_are_refused():
    with pytest.raises(ConfigError, match="needs reward_model.enable=true"):
        sources_from_config(reward_cfg(["reward_model", "rule"]), ConfigError, reward_model=False)
    with pytest.raises(ConfigError, match="does not list reward_model"):
        sources_from_config(reward_cfg(["rule"]), ConfigError, reward_model=True)
    with pytest.raises(ConfigError, match="more than once"):
        sources_from_config(reward_cfg(["reward_model", "reward_model"]), ConfigError, reward_model=True)


def test_bad_reward_models_are_refused_at_start(tmp_path, tiny_tokenizer, tiny_model_dir, reward_model_dir,
                                                arithmetic_files):
    def cfg(*extra):
        return compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run")
                              + ["reward_model.enable=true", *extra])

    with pytest.raises(ConfigError, match="needs reward_model.model.path"):
        prepare(cfg())
    with pytest.raises(ModelPathError, match="holds LlamaForCausalLM .* not a sequence classifier"):
        prepare(cfg(f"reward_model.model.path={tiny_model_dir}"))
    two = build_reward_model(tmp_path / "two", tiny_tokenizer, num_labels=2)
    with pytest.raises(ModelPathError, match="has 2 labels"):
        check_reward_model(cfg(f"reward_model.model.path={two}").reward_model, "reward_model.model.path")
    with pytest.raises(ModelPathError, match="neither a model folder"):
        prepare(cfg(f"reward_model.model.path={tmp_path}/missing"))
    with pytest.raises(ConfigError, match="reward_model.nnodes=None: set it to a positive integer"):
        prepare(cfg(f"reward_model.model.path={reward_model_dir}", "reward_model.enable_resource_pool=true",
                    "reward_model.n_gpus_per_node=1"))
    with pytest.raises(ConfigError, match="reads the reward_model.megatron section of --config-name=ppo_megatron_trainer"):
        prepare(cfg(f"reward_model.model.path={reward_model_dir}", "reward_model.strategy=megatron"))

    def megatron_cfg(*extra):
        return compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run")
                              + ["reward_model.enable=true", f"reward_model.model.path={reward_model_dir}",
                                 "reward_model.strategy=megatron", *extra], config_name="ppo_megatron_trainer")

    with pytest.raises(ConfigError, match="a process reward model .* runs on the FSDP engine"):
        prepare(megatron_cfg("reward_model.process.enable=true"))
    # Iterative RL trains it on Megatron too (tests/test_megatron_engine.py); the reference reset does not.
    prepare(megatron_cfg("trainer.iterative.enable=true", "trainer.iterative.reset_reference=false"))
    # Its layout is checked against the reward model's own heads and the ranks, before any worker starts.
    with pytest.raises(ConfigError, match=r"reward_model.megatron.tensor_model_parallel_size \(2\) x "):
        prepare(megatron_cfg("reward_model.megatron.tensor_model_parallel_size=2"))
    # In processes of its own its layout is checked against its own ranks, and need not match the actor's.
    own_pool = ("reward_model.enable_resource_pool=true", "reward_model.nnodes=1", "reward_model.megatron.tensor_model_parallel_size=2")
    with pytest.raises(ConfigError, match=r"the number of ranks \(1, reward_model.nnodes x reward_model.n_gpus_per_node\)"):
        prepare(megatron_cfg(*own_pool, "reward_model.n_gpus_per_node=1"))
    prepare(megatron_cfg(*own_pool, "reward_model.n_gpus_per_node=2"))
    *_, reward_fn, _ = prepare(cfg(f"reward_model.model.path={reward_model_dir}"))
    assert [s.name for s in reward_fn.sources] == ["reward_model"]


def test_a_causal_lm_folder_becomes_a_fresh_score_head(tiny_model_dir):
    """Training a reward model from a policy: the backbone is the policy's, the head is new."""
    rm = engine(tiny_model_dir)
    policy = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(rm.module.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    assert rm.module.score.weight.shape == (1, policy.config.hidden_size)
