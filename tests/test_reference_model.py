"""verl 0.6's reference model of its own (`+actor_rollout_ref.ref.model.path`): the config's
refusals, the checks that it reads the actor's token ids, and a training step whose KL loss is the
one between the actor and that model, computed again here from the step's own responses."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.config import ConfigError, check_model_limits, reference_model_path, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.main import check_reference_vocabulary
from hybrid_rl.models import ModelPathError, load_tokenizer

REF = "+actor_rollout_ref.ref.model.path"


def test_the_path_is_read_and_null_means_the_actors_start():
    assert reference_model_path(compose_config([])) is None
    assert reference_model_path(compose_config([f"{REF}=/models/teacher"])) == "/models/teacher"
    assert reference_model_path(compose_config(["actor_rollout_ref.ref.model={path: /models/teacher}"])) == (
        "/models/teacher")


@pytest.mark.parametrize("overrides, fragment", [
    ([f"{REF}=/m", "actor_rollout_ref.actor.use_kl_loss=false"], "nothing uses a reference policy"),
    (["actor_rollout_ref.ref.model=/m"], "must be a section with a path"),
    ([f"{REF}=/m", "+actor_rollout_ref.ref.model.dtype=bf16"], "actor_rollout_ref.ref.model.dtype is not read"),
    ([f"{REF}=''"], "actor_rollout_ref.ref.model.path=''"),
    ([f"{REF}=/m", "trainer.iterative.enable=true"], "resetting would replace that model"),
    ([f"{REF}=/m", "actor_rollout_ref.model.hf_config_path=/c"], "describes the actor's model"),
])
def test_bad_reference_model_settings_are_refused(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(overrides))
    assert fragment in str(error.value)


def test_a_megatron_reference_takes_its_weights_from_one_place():
    cfg = compose_config([f"{REF}=/m", "actor_rollout_ref.ref.megatron.use_dist_checkpointing=true"],
                         config_name="ppo_megatron_trainer")
    with pytest.raises(ConfigError, match="both say where the reference's weights come from"):
        reference_model_path(cfg)


def llama(path, tokenizer, vocab_size: int, max_positions: int = 512, save_tokenizer: bool = True) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=max_positions)
    LlamaForCausalLM(config).save_pretrained(path)
    if save_tokenizer:
        tokenizer.save_pretrained(path)
    return str(path)


def test_the_reference_must_read_the_actors_token_ids(tiny_model_dir, make_tokenizer, tmp_path):
    cfg = compose_config([f"{REF}=/m", f"actor_rollout_ref.model.path={tiny_model_dir}"])
    tokenizer = load_tokenizer(cfg, tiny_model_dir)
    vocab = len(tokenizer)
    same = llama(tmp_path / "same", tokenizer, vocab)
    check_reference_vocabulary(cfg, tokenizer, tiny_model_dir, same)

    other_tokenizer = make_tokenizer()
    other_tokenizer.add_tokens(["<not-in-the-actors>"])
    with pytest.raises(ModelPathError, match="its tokenizer's vocabulary differs from the actor's"):
        check_reference_vocabulary(cfg, tokenizer, tiny_model_dir, llama(tmp_path / "other", other_tokenizer,
                                                                         vocab + 1))
    with pytest.raises(ModelPathError, match=f"its embedding has {vocab - 8} rows, fewer than"):
        check_reference_vocabulary(cfg, tokenizer, tiny_model_dir, llama(tmp_path / "short", tokenizer, vocab - 8,
                                                                         save_tokenizer=False))
    # A padded embedding reads the same ids; only the full KL, over whole distributions, minds the size.
    padded = llama(tmp_path / "padded", tokenizer, vocab + 8)
    check_reference_vocabulary(cfg, tokenizer, tiny_model_dir, padded)
    full = compose_config([f"{REF}=/m", "actor_rollout_ref.actor.kl_loss_type=full"])
    with pytest.raises(ConfigError, match="kl_loss_type=full compares whole next-token distributions"):
        check_reference_vocabulary(full, tokenizer, tiny_model_dir, padded)


def test_the_reference_models_context_window_is_checked(tiny_model_dir, tiny_tokenizer, tmp_path):
    short = llama(tmp_path / "short_context", tiny_tokenizer, len(tiny_tokenizer), max_positions=64)
    cfg = validate_config(compose_config([f"{REF}={short}", f"actor_rollout_ref.model.path={tiny_model_dir}",
                                          "data.max_prompt_length=48", "data.max_response_length=32"]))
    with pytest.raises(ConfigError, match=r"exceeds the reference model's \(actor_rollout_ref.ref.model.path\) "
                                          r"context window \(64 tokens"):
        check_model_limits(cfg, tiny_model_dir, None, short)


def response_log_probs(model_dir: str, tensors: dict) -> torch.Tensor:
    """Each response token's log-probability under the model in `model_dir` (float32, temperature 1)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    responses = tensors["responses"]
    with torch.no_grad():
        logits = model(input_ids=tensors["input_ids"], attention_mask=tensors["attention_mask"],
                       position_ids=tensors["position_ids"]).logits.float()
    logits = logits[:, -responses.shape[1] - 1:-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full_weights", "lora"])
def test_the_kl_loss_pulls_toward_the_reference_model(ray_session, tiny_model_dir, tiny_tokenizer, arithmetic_files,
                                                      tmp_path, lora):
    """One step with a reference of other weights: the logged KL loss is k3 between the actor and
    that model over the step's responses (which the rollout cache dumped), token mean; under LoRA
    the reference is that model too, not the actor with its adapter switched off."""
    from tests.conftest import build_tiny_model, run_overrides
    from tests.test_algorithm_catalogue_runs import ONE_STEP, train

    teacher = build_tiny_model(tmp_path / "teacher", tiny_tokenizer, seed=1)
    out, dump = tmp_path / "run", tmp_path / "dump"
    overrides = run_overrides(tiny_model_dir, arithmetic_files, out, response=12) + [
        *ONE_STEP, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        f"{REF}={teacher}", "skip.rollout.enable=true", "skip.rollout.steps=[1]", f"skip.rollout.dump_dir={dump}"]
    if lora:
        overrides += ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.target_modules=all-linear"]
    (metrics,) = train(overrides, out)

    (dumped,) = dump.glob("*/*/1/generation_0.pt")
    tensors = torch.load(dumped, weights_only=False)["generated"]["tensors"]
    mask = tensors["response_mask"].bool()
    # The actor's log-probs before its update are its starting weights' (a fresh adapter adds zero).
    log_ratio = response_log_probs(teacher, tensors) - response_log_probs(tiny_model_dir, tensors)
    k3 = (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    expected = float(k3[mask].mean())
    assert expected > 1e-3  # the two models differ: a reference of the actor's own weights gives 0
    assert metrics["actor/kl_loss"] == pytest.approx(expected, rel=1e-4)
