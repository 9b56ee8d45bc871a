"""The Hydra tree composes with verl's key names, and bad values fail before any worker starts
with a message naming the keys and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from hydra.errors import ConfigCompositionException

from hybrid_rl.algorithms import ADV_ESTIMATORS, KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSSES
from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.main import REPO_ROOT, compose_config

# A typical verl GRPO command line (examples/grpo_trainer), module name aside.
VERL_GRPO_LINE = [
    "algorithm.adv_estimator=grpo",
    "data.train_batch_size=32", "data.max_prompt_length=512", "data.max_response_length=1024",
    "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.tensor_model_parallel_size=1", "actor_rollout_ref.rollout.name=vllm",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "actor_rollout_ref.rollout.n=5",
    "algorithm.use_kl_in_reward=False", "trainer.val_before_train=True",
    "trainer.logger=[console,wandb]", "trainer.project_name=verl_grpo_example_gsm8k",
    "trainer.experiment_name=qwen2_5_0_5b", "trainer.n_gpus_per_node=2", "trainer.nnodes=1",
    "trainer.save_freq=20", "trainer.test_freq=5", "trainer.total_epochs=15",
]


def test_verl_grpo_command_line_composes_and_validates():
    cfg = validate_config(compose_config(VERL_GRPO_LINE))
    assert cfg.actor_rollout_ref.rollout.n == 5
    assert cfg.actor_rollout_ref.rollout.response_length == 1024  # interpolated from data.*
    assert cfg.trainer.device in ("cpu", "cuda")


@pytest.mark.parametrize("key, registry", [
    ("algorithm.adv_estimator", ADV_ESTIMATORS), ("actor_rollout_ref.actor.policy_loss.loss_mode", POLICY_LOSSES),
    ("actor_rollout_ref.actor.kl_loss_type", KL_ESTIMATORS), ("actor_rollout_ref.actor.loss_agg_mode", LOSS_AGG_MODES),
])
def test_every_registered_name_and_alias_validates(key, registry):
    for name in registry.names():
        # The optimal token baseline needs the actor's Σπ² (refused without it: below), DRO its β,
        # GDPO its reward components.
        needs = {"optimal_token": ["actor_rollout_ref.actor.calculate_sum_pi_squared=true"],
                 "dro": ["actor_rollout_ref.actor.policy_loss.dro_beta=0.1"],
                 "gdpo": ["algorithm.gdpo_reward_keys=[acc,format]"]}
        validate_config(compose_config([f"{key}={name}", *next((v for k, v in needs.items() if k in name), [])]))
    if registry is POLICY_LOSSES:
        with pytest.raises(ConfigError, match="loss_mode=dro needs policy_loss.dro_beta > 0"):
            validate_config(compose_config([f"{key}=dro"]))


def test_unknown_key_is_rejected_by_hydra():
    with pytest.raises(ConfigCompositionException):
        compose_config(["actor_rollout_ref.actor.no_such_key=1"])


@pytest.mark.parametrize("override, fragments", [
    ("algorithm.adv_estimator=grpoo", ["algorithm.adv_estimator='grpoo'", "grpo", "rloo"]),
    ("actor_rollout_ref.actor.kl_loss_type=k5", ["kl_loss_type", "low_var_kl", "k3"]),
    ("actor_rollout_ref.actor.loss_agg_mode=mean", ["loss_agg_mode", "token-mean", "seq-mean-token-sum-norm"]),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=ppo2", ["loss_mode", "vanilla"]),
    ("actor_rollout_ref.rollout.name=sglang", ["rollout.name=sglang is not supported yet (use vllm (or hf))"]),
    ("actor_rollout_ref.rollout.name=sglangx", ["rollout.name='sglangx' is not valid", "vllm", "hf"]),
    ("algorithm.adv_estimator=grpo_vectorized", ["grpo_vectorized is not supported yet", "use grpo"]),
    ("algorithm.adv_estimator=optimal_token_baseline", ["optimal_token_baseline weighs every token by Σπ²",
                                                        "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]),
    ("trainer.logger=[console,wandbx]", ["trainer.logger='wandbx'", "tensorboard", "wandb", "mlflow"]),
    ("trainer.logger=[console,clearml]", ["trainer.logger=clearml is not supported yet", "jsonl", "swanlab"]),
    ("actor_rollout_ref.actor.optim.lr=0", ["optim.lr=0", "positive"]),
    ("actor_rollout_ref.actor.optim.lr=-1e-5", ["optim.lr", "positive"]),
    ("actor_rollout_ref.actor.clip_ratio_c=0.5", ["clip_ratio_c", "> 1"]),
    ("actor_rollout_ref.rollout.top_p=0", ["top_p"]),
    ("data.train_batch_size=0", ["data.train_batch_size=0", "positive"]),
    ("reward_model.on_error=ignore", ["reward_model.on_error='ignore'", "raise", "zero"]),
    ("trainer.critic_warmup=-1", ["trainer.critic_warmup=-1", ">= 0"]),
    ("trainer.esi_redundant_time=-5", ["trainer.esi_redundant_time=-5", "seconds >= 0"]),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.mm_preprocessor_cache_size=1",
     ["engine_kwargs.vllm sets mm_preprocessor_cache_size, which vLLM", "does not take"]),
    ("actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]",
     ["save_contents='weights' is not valid", "hf_model"]),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[model,weights]", ["load_contents='weights' is not valid"]),
    ("actor_rollout_ref.actor.checkpoint.load_contents=[optimizer,extra]",
     ["load_contents=['optimizer', 'extra'] leaves out model", "trainer.resume_mode=disable"]),
    ("actor_rollout_ref.rollout.max_model_len=10", ["max_model_len (10)", "prompt_length + rollout.response_length"]),
    ("actor_rollout_ref.rollout.prompt_length=4", ["rollout.prompt_length (4)", "data.max_prompt_length"]),
    ("data.gen_batch_size=16", ["data.gen_batch_size=16 is read by dynamic sampling only",
                                "algorithm.filter_groups.enable=true", "data.train_batch_size=16"]),
])
def test_bad_choice_or_value(override, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config([override]))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_sum_pi_squared_needs_the_actors_log_prob_pass():
    """The optimal token baseline's Σπ² comes from the actor's log-prob pass, which bypass mode
    (the engine's log-probs as the old ones) skips."""
    otb = ["algorithm.adv_estimator=optimal_token_baseline", "actor_rollout_ref.actor.calculate_sum_pi_squared=true"]
    validate_config(compose_config(otb))
    with pytest.raises(ConfigError, match="calculate_sum_pi_squared=true needs the actor's own log-prob pass"):
        validate_config(compose_config([*otb, "algorithm.rollout_correction.bypass_mode=true"]))


def test_bypass_modes_loss_type_and_verl06s_policy_gradient_switch():
    bypass = ["algorithm.rollout_correction.bypass_mode=true"]
    cfg = validate_config(compose_config([*bypass, "algorithm.rollout_correction.use_policy_gradient=true",
                                          "algorithm.rollout_correction.rollout_is=token"]))
    assert cfg.algorithm.rollout_correction.loss_type == "reinforce"
    # In bypass mode the weights and masks compare the trained policy with the engine's.
    validate_config(compose_config([*bypass, "algorithm.rollout_correction.rollout_rs=token_k1",
                                    "algorithm.rollout_correction.rollout_rs_threshold=2.0"]))
    for overrides, message in [
        (["algorithm.rollout_correction.loss_type=reinforce"],
         "loss_type=reinforce is bypass mode's loss .* set algorithm.rollout_correction.bypass_mode=true"),
        ([*bypass, "algorithm.rollout_correction.loss_type=pg"], "loss_type='pg' is not valid"),
        ([*bypass, "algorithm.rollout_correction.loss_type=reinforce", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"],
         "loss_type=reinforce replaces the policy loss, but actor_rollout_ref.actor.policy_loss.loss_mode=gspo"),
    ]:
        with pytest.raises(ConfigError, match=message):
            validate_config(compose_config(overrides))


def test_vllm_engine_arguments_under_names_vllm_dropped_are_translated_as_verl_does():
    from hybrid_rl.workers.rollout import current_engine_args

    old = "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache"
    assert current_engine_args({"disable_mm_preprocessor_cache": True, "block_size": 16}) == {
        "mm_processor_cache_gb": 0, "block_size": 16}
    assert current_engine_args({"disable_mm_preprocessor_cache": False}) == {}
    validate_config(compose_config([f"{old}=true"]))  # verl's vision-language scripts set it
    with pytest.raises(ConfigError, match="sets both disable_mm_preprocessor_cache .* keep only mm_processor_cache_gb"):
        validate_config(compose_config([f"{old}=true", "+actor_rollout_ref.rollout.engine_kwargs.vllm.mm_processor_cache_gb=4"]))


@pytest.mark.parametrize("overrides, fragments", [
    (["data.train_batch_size=3", "actor_rollout_ref.rollout.n=3", "trainer.n_gpus_per_node=2",
      "actor_rollout_ref.actor.ppo_mini_batch_size=3"], ["9 sequences", "2 ranks", "multiple of 2"]),
    (["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
     ["ppo_mini_batch_size (16)", "data.train_batch_size (8)", "at most 8"]),
    (["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
     ["multiple of", "ppo_mini_batch_size (8)", "divisor of 12"]),
    (["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
      "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
      "actor_rollout_ref.actor.use_dynamic_bsz=false"],
     ["32 sequences", "ppo_micro_batch_size_per_gpu (5)", "divides 32"]),
])
def test_batch_size_arithmetic(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_grpo_with_one_sample_warns(caplog):
    validate_config(compose_config(["actor_rollout_ref.rollout.n=1"]))
    assert "no group baseline" in caplog.text and "rollout.n >= 2" in caplog.text


def test_cli_prints_config_and_reports_errors_without_traceback():
    printed = subprocess.run([sys.executable, "-m", "hybrid_rl.main", "--cfg", "job",
                              "actor_rollout_ref.rollout.n=7"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert "'n': 7" in printed.stdout and "adv_estimator: grpo" in printed.stdout

    bad = subprocess.run([sys.executable, "-m", "hybrid_rl.main", "algorithm.adv_estimator=nope"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: algorithm.adv_estimator='nope' is not valid")
    assert "Traceback" not in bad.stderr


# A config folder of a verl user's own (verl's examples/sglang_multiturn/config/gsm8k_multiturn_grpo.yaml
# has this shape): it builds on verl's trainer config, found through a folder of verl's checkout.
USER_CONFIG = """hydra:
  searchpath:
    - file://verl/trainer/config

defaults:
  - ppo_trainer
  - _self_

data:
  return_raw_chat: True
actor_rollout_ref:
  rollout:
    multi_turn:
      enable: True
      max_assistant_turns: 5
"""


def test_a_users_config_folder_builds_on_our_tree_as_on_verls(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "mine.yaml").write_text(USER_CONFIG)
    printed = subprocess.run([sys.executable, "-m", "hybrid_rl.main", f"--config-path={tmp_path / 'conf'}",
                              "--config-name=mine", "actor_rollout_ref.rollout.n=3", "--cfg", "job"],
                             cwd=tmp_path, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    cfg = yaml.safe_load(printed.stdout)
    assert cfg["actor_rollout_ref"]["rollout"]["multi_turn"]["max_assistant_turns"] == 5  # the user's file
    assert cfg["actor_rollout_ref"]["rollout"]["n"] == 3 and cfg["algorithm"]["adv_estimator"] == "grpo"  # ours


def test_misspelt_keys_fail_with_the_nearest_real_key():
    from hybrid_rl.main import unknown_override_keys

    assert unknown_override_keys(["actor_rollout_ref.actor.ppo_mini_batch_size=4", "+my.own_key=1",
                                  "trainer.final_model_dir=null"]) == []  # verl's, our own, and a new key
    errors = unknown_override_keys(["--config-name", "ppo_megatron_trainer", "trainer.totl_epochs=2",
                                    "actor_rollout_ref.actor.megatron.tensor_model_paralel_size=2"])
    assert errors == [
        "trainer.totl_epochs is not a config key; did you mean trainer.total_epochs? (A key of your own "
        "needs a leading +.)",
        "actor_rollout_ref.actor.megatron.tensor_model_paralel_size is not a config key; did you mean "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size? (A key of your own needs a leading +.)"]
    cli = subprocess.run([sys.executable, "-m", "hybrid_rl.main", "data.train_batchsize=4"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert cli.returncode == 2 and "did you mean data.train_batch_size?" in cli.stderr


def test_verl_trainer_keys_that_work_validate():
    validate_config(compose_config([
        "trainer.critic_warmup=3", "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        "actor_rollout_ref.rollout.max_model_len=4096", "actor_rollout_ref.rollout.response_length=512",
        "data.trust_remote_code=true", "ray_kwargs.ray_init.num_cpus=2"]))


def test_checkpoint_contents_without_resume_state_are_saved_anyway_and_said(caplog):
    validate_config(compose_config(["actor_rollout_ref.actor.checkpoint.save_contents=[hf_model]"]))
    assert "save_contents=['hf_model']: checkpoints hold model, optimizer, extra as well" in caplog.text


def test_a_resume_loads_what_load_contents_names_where_it_differs_from_save_contents(caplog):
    from hybrid_rl.checkpoint import parts_to_load

    def parts(*overrides):
        cfg = compose_config([f"actor_rollout_ref.actor.checkpoint.{o}" for o in overrides])
        validate_config(cfg)
        return parts_to_load(cfg.actor_rollout_ref.actor.checkpoint, "actor_rollout_ref.actor", "ckpt")

    everything = ("model", "optimizer", "extra")
    assert parts() == parts("save_contents=[model,optimizer,extra,hf_model]") == everything
    assert parts("save_contents=[hf_model]") == everything  # load_contents follows it; all is saved anyway
    assert not caplog.records[-1].message.startswith("Resuming")
    assert parts("load_contents=[extra,model]") == ("model", "extra")
    assert "with a fresh optimizer state, so this run does not go on" in caplog.records[-1].message
    assert parts("load_contents=[model]") == ("model",)
    assert "fresh optimizer state and learning-rate schedule and RNG states" in caplog.records[-1].message


def test_reward_function_from_either_of_verls_trees(tmp_path, caplog):
    """verl 0.9's reward.custom_reward_function is read when the legacy top-level section has no
    path; the legacy section wins when both have one, as in verl."""
    from hybrid_rl.config import custom_reward_function

    new = ["reward.custom_reward_function.path=/r/new.py", "reward.custom_reward_function.name=score"]
    key, section = custom_reward_function(compose_config(new))
    assert (key, section.path, section.name) == ("reward.custom_reward_function", "/r/new.py", "score")
    key, section = custom_reward_function(compose_config(new + ["custom_reward_function.path=/r/old.py"]))
    assert (key, section.path) == ("custom_reward_function", "/r/old.py") and "the first is used" in caplog.text


def test_data_trust_remote_code_reaches_the_tokenizer(tiny_model_dir, monkeypatch):
    from transformers import AutoTokenizer

    from hybrid_rl.models import load_tokenizer

    seen = []
    real = AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        lambda *a, **kw: seen.append(kw["trust_remote_code"]) or real(*a, **kw))
    for value in ("false", "true"):
        load_tokenizer(compose_config([f"data.trust_remote_code={value}"]), tiny_model_dir)
    assert seen == [False, True]


@pytest.mark.parametrize("overrides, expected", [
    # tiny model: 2 attention heads, 1 key/value head
    (["trainer.n_gpus_per_node=4", "actor_rollout_ref.rollout.tensor_model_parallel_size=4"],
     r"rollout.tensor_model_parallel_size=4 does not fit the model's 2 attention heads and 1 key/value heads "
     r".*valid here: 1, 2\."),
    (["trainer.n_gpus_per_node=3", "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=6",
      "actor_rollout_ref.rollout.tensor_model_parallel_size=2"],
     r"tensor_model_parallel_size=2 must divide the number of ranks \(3"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.name=hf"],
     r"rollout.name=hf generates with the actor's own module"),
    (["actor_rollout_ref.rollout.tensor_model_parallel_size=0"], r"tensor_model_parallel_size=0 must be a positive"),
])
def test_rollout_tensor_parallel_sizes_the_model_cannot_take_are_refused(tiny_model_dir, overrides, expected):
    from hybrid_rl.config import check_model_limits

    cfg = validate_config(compose_config(["trainer.n_gpus_per_node=2", "trainer.device=cpu", *overrides]))
    with pytest.raises(ConfigError, match=expected):
        check_model_limits(cfg, tiny_model_dir)
    fits = validate_config(compose_config(["trainer.n_gpus_per_node=2", "trainer.device=cpu",
                                           "actor_rollout_ref.rollout.tensor_model_parallel_size=2"]))
    check_model_limits(fits, tiny_model_dir)


DAPO = ["algorithm.filter_groups.enable=true", "reward_model.overlong_buffer.enable=true",
        "reward_model.overlong_buffer.len=8", "reward_model.overlong_buffer.penalty_factor=1.0"]


def test_verl_dapo_recipe_keys_validate():
    validate_config(compose_config([*DAPO, "data.gen_batch_size=24", "algorithm.filter_groups.metric=acc",
                                    "algorithm.filter_groups.max_num_gen_batches=10", "reward_model.reward_manager=dapo",
                                    "actor_rollout_ref.actor.clip_ratio_high=0.28"]))


# verl's own DAPO example scripts (examples/gmpo_trainer/test_dapo_7b_math.sh and ten more) set the
# overlong buffer as arguments of the dapo reward manager, at the default response length here.
VERL_DAPO_REWARD_KWARGS = ["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.len=8",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
                           "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
                           "+reward_model.reward_kwargs.max_resp_len=24", "data.max_response_length=24"]


@pytest.mark.parametrize("place", ["reward_model", "reward"])  # verl 0.7-0.8's and 0.9's
def test_verl_dapo_reward_kwargs_set_the_overlong_buffer_the_recipe_key_sets(place):
    overrides = [o.replace("+reward_model.reward_kwargs", f"+{place}.reward_kwargs") for o in VERL_DAPO_REWARD_KWARGS]
    from_kwargs = validate_config(compose_config(overrides)).reward_model.overlong_buffer
    from_recipe = validate_config(compose_config([*DAPO[1:], "data.max_response_length=24"])).reward_model.overlong_buffer
    assert from_kwargs == from_recipe and from_kwargs.enable and from_kwargs.len == 8


@pytest.mark.parametrize("overrides", [["reward_manager.name=dapo"], ["reward.reward_manager.name=dapo"],
                                       ["reward_model.reward_manager=naive", "reward_manager.name=dapo"]])
def test_each_releases_reward_manager_key_names_the_manager(overrides):
    assert validate_config(compose_config(overrides)).reward_model.reward_manager == "dapo"


@pytest.mark.parametrize("overrides, fragments", [
    (["reward_manager.name=prime", "reward.funcs=[rule,code_tests]"],
     ["reward_manager=prime scores one function per sample in worker processes", "reward.funcs combines"]),
    (["reward.reward_manager.name=remote", "reward.num_workers=0"], ["reward.num_workers=0", "whole number >= 1"]),
    (["reward.reward_manager.name=batch"], ["reward_manager=batch calls your reward function once per batch",
                                             "custom_reward_function.path=<file.py>", "data_sources, solution_strs"]),
    (["reward_model.reward_manager=batch", "custom_reward_function.path=f.py", "reward.funcs=[rule]"],
     ["reward.funcs combines several per sample"]),
    (["reward_model.reward_manager=batch", "custom_reward_function.path=f.py", "reward_model.enable=true"],
     ["the reward model alone scores", "reward.funcs=[reward_model,'f.py:compute_score']"]),
    (["reward.reward_manager.source=importlib"], ["reward.reward_manager.source=importlib loads the class",
                                                  "set module.path"]),
    (["reward_manager.module.path=m.py"], ["reward_manager.module.path=m.py is read with reward_manager.source="
                                           "importlib only"]),
    (["reward_manager.source=importlib", "reward_manager.module.path=m.py", "reward.reward_manager.source=importlib",
      "reward.reward_manager.module.path=m.py"], ["both load a reward manager class"]),
    (["reward.reward_manager.source=importlib", "reward.reward_manager.module.path=m.py",
      "reward.reward_manager.name=Mine", "reward.funcs=[rule]"], ["your reward manager Mine scores the responses",
                                                                  "reward.funcs combines"]),
    (["reward.reward_manager.source=plugin"], ["reward.reward_manager.source='plugin' is not valid"]),
    (["reward_model.reward_manager=naive", "+reward_model.reward_kwargs.judge=x"],
     ["reward_model.reward_kwargs sets judge, but the naive reward manager takes no keyword arguments",
      "its batch manager passes them to your function"]),
    (["reward_manager.name=dapo", "reward.reward_manager.name=prime"], ["name two reward managers", "keep one"]),
    (["+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True"],
     ["reward_kwargs sets overlong_buffer_cfg, but the naive reward manager", "reward_model.reward_manager=dapo"]),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.reward_fn_key=x"],
     ["sets reward_fn_key, which the dapo reward manager does not take", "custom_reward_function.reward_kwargs"]),
    (["reward_model.reward_manager=dapo", "+reward_model.reward_kwargs.overlong_buffer_cfg.length=3"],
     ["overlong_buffer_cfg sets length; its fields are enable, len"]),
    ([*VERL_DAPO_REWARD_KWARGS, "++reward_model.reward_kwargs.max_resp_len=20"],
     ["max_resp_len=20 differs from data.max_response_length=24"]),
    ([*VERL_DAPO_REWARD_KWARGS, "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=4"],
     ["overlong_buffer and reward_model.reward_kwargs.overlong_buffer_cfg are both set, to different values"]),
    ([*VERL_DAPO_REWARD_KWARGS, "+reward.reward_kwargs.max_resp_len=24"], ["reward_model.reward_kwargs and "
                                                                           "reward.reward_kwargs differ", "keep one"]),
    (["reward.reward_manager.name=dapo", "+reward.reward_kwargs.overlong_buffer_cfg.log=true",
      "+reward.reward_kwargs.max_resp_len=8"], ["reward.reward_kwargs.max_resp_len=8 differs"]),
    ([*VERL_DAPO_REWARD_KWARGS, "++reward_model.reward_kwargs.overlong_buffer_cfg.len=30"],
     ["overlong_buffer.len=30", "1..data.max_response_length"]),
])
def test_bad_reward_manager_settings(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides))
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("override, fragments", [
    ("reward_model.overlong_buffer.len=0", ["overlong_buffer.len=0", "1..data.max_response_length"]),
    ("reward_model.overlong_buffer.len=100000", ["overlong_buffer.len=100000", "1..data.max_response_length"]),
    ("reward_model.overlong_buffer.penalty_factor=-1", ["penalty_factor=-1", ">= 0"]),
    ("algorithm.filter_groups.metric=null", ["filter_groups.metric=None", "seq_reward", "acc"]),
    ("algorithm.filter_groups.max_num_gen_batches=-2", ["max_num_gen_batches=-2", "0: generate until"]),
    ("actor_rollout_ref.rollout.n=1", ["filter_groups.enable=true", "rollout.n >= 2 (got 1)"]),
    ("data.gen_batch_size=0", ["data.gen_batch_size=0", "positive"]),
])
def test_bad_dapo_settings(override, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config([*DAPO, override]))
    for fragment in fragments:
        assert fragment in str(err.value)


def test_gdpo_keys_in_verl_form_and_ours():
    """verl's scripts add the GDPO keys with `+` (its YAML tree lacks them); ours has them, so both
    forms set them."""
    for plus in ("+", ""):
        cfg = compose_config(["algorithm.adv_estimator=gdpo", f"{plus}algorithm.gdpo_reward_keys=[fmt,acc]",
                              f"{plus}algorithm.gdpo_reward_weights=[1.0,0.5]"])
        validate_config(cfg)
        assert list(cfg.algorithm.gdpo_reward_keys) == ["fmt", "acc"] and list(cfg.algorithm.gdpo_reward_weights) == [1.0, 0.5]
    validate_config(compose_config(["algorithm.adv_estimator=gdpo", "reward.funcs=[rule,code_tests]"]))  # keys: their scores
    validate_config(compose_config(["reward_manager.name=gdpo"]))


@pytest.mark.parametrize("overrides, fragments", [
    (["algorithm.adv_estimator=gdpo"], ["gdpo_reward_keys=[format_reward,accuracy_reward]", "two or more reward.funcs"]),
    (["algorithm.adv_estimator=gdpo", "reward.funcs=[rule]"], ["two or more reward.funcs"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=acc"], ["gdpo_reward_keys='acc' must be a list"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,acc]"], ["must be a list of different names"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]", "algorithm.gdpo_reward_weights=[1.0]"],
     ["gdpo_reward_weights=[1.0] must be 2 finite numbers"]),
    (["algorithm.adv_estimator=gdpo", "reward.funcs=[rule,code_tests]", "algorithm.gdpo_reward_weights=[1,nan]"],
     ["must be 2 finite numbers"]),
    (["algorithm.gdpo_reward_keys=[acc,fmt]"], ["gdpo_reward_keys is read by algorithm.adv_estimator=gdpo only",
                                                "(it is grpo)"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]", "algorithm.use_kl_in_reward=true",
      "algorithm.reward_clip=1.0"],
     ["use_kl_in_reward=true, algorithm.reward_clip (which act on the summed score) would have no effect",
      "use_kl_loss=true"]),
    (["algorithm.adv_estimator=gdpo", "algorithm.gdpo_reward_keys=[acc,fmt]", "algorithm.reward_norm.std=group"],
     ["algorithm.reward_norm (which act"]),
])
def test_bad_gdpo_settings(overrides, fragments):
    with pytest.raises(ConfigError) as err:
        validate_config(compose_config(overrides))
    for fragment in fragments:
        assert fragment in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.router_replay.mode=R4"], "router_replay.mode='R4' is not valid. Valid choices: R2, R3"),
    (["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.router_replay.mode=R2",
      "actor_rollout_ref.model.compile_layers=true"], "compile_layers=true compiles: set one of them"),
    (["actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
      "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.ref.router_replay.mode=R2"],
     "the actor's router_replay.mode must be set too"),
    (["actor_rollout_ref.actor.router_replay.mode=R3"], "set actor_rollout_ref.rollout.enable_rollout_routing_replay"),
    (["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"],
     "vLLM-CPU cannot return the routed experts"),
    (["actor_rollout_ref.ref.megatron.router_replay.mode=R3", "actor_rollout_ref.rollout.name=hf",
      "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"], "only vLLM returns routes"),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
      "actor_rollout_ref.rollout.agent.agent_loop_config_path=loops.yaml"], "your agent loops do not carry routes"),
    (["actor_rollout_ref.actor.megatron.router_replay.mode=R3", "actor_rollout_ref.actor.router_replay.mode=R2"],
     "verl 0.9's and 0.7-0.8's place for the same setting"),
])
def test_router_replay_settings_that_cannot_work_are_refused(overrides, message):
    cfg = compose_config(["trainer.device=cpu", *overrides], config_name="ppo_megatron_trainer")
    with pytest.raises(ConfigError, match=message):
        validate_config(cfg)


# TinyZero's GRPO script (Jiayi-Pan/TinyZero, scripts/train_tiny_zero_a100_grpo.sh), written for
# verl's early global micro-batch sizes.
TINYZERO_MICRO_BATCHES = ("actor_rollout_ref.actor.ppo_mini_batch_size=64", "actor_rollout_ref.actor.ppo_micro_batch_size=4",
                          "actor_rollout_ref.rollout.log_prob_micro_batch_size=4", "actor_rollout_ref.rollout.n=5",
                          "actor_rollout_ref.ref.log_prob_micro_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=True",
                          "actor_rollout_ref.actor.use_dynamic_bsz=false", "data.train_batch_size=128")


@pytest.mark.parametrize("ranks, extra, expected", [
    # verl: each rank's size is the global one // (ranks // Ulysses group), or // Megatron's data-parallel size.
    (2, (), (2, 2, 1)),
    (1, (), (4, 4, 2)),
    (2, ("actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "actor_rollout_ref.model.use_remove_padding=true"),
     (4, 4, 2)),
])
def test_verls_global_micro_batch_sizes_are_divided_over_the_data_parallel_replicas(ranks, extra, expected):
    cfg = compose_config([*TINYZERO_MICRO_BATCHES, f"trainer.n_gpus_per_node={ranks}", *extra])
    validate_config(cfg)
    ar = cfg.actor_rollout_ref
    assert (ar.actor.ppo_micro_batch_size_per_gpu, ar.rollout.log_prob_micro_batch_size_per_gpu,
            ar.ref.log_prob_micro_batch_size_per_gpu) == expected


def test_global_micro_batch_sizes_on_megatron_and_for_the_roles_that_follow_others():
    cfg = compose_config(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=4",
                          "actor_rollout_ref.actor.ppo_micro_batch_size=6", "algorithm.adv_estimator=gae",
                          "actor_rollout_ref.rollout.log_prob_micro_batch_size=10", "critic.ppo_micro_batch_size=8",
                          "actor_rollout_ref.actor.use_kl_loss=true"], config_name="ppo_megatron_trainer")
    validate_config(cfg)
    # Two data-parallel replicas of two TP ranks; the reference's per-rank size follows the
    # rollout's, and the critic's forward size its update size, as their defaults say.
    assert cfg.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 3
    assert cfg.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 5
    assert cfg.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 5
    assert (cfg.critic.ppo_micro_batch_size_per_gpu, cfg.critic.forward_micro_batch_size_per_gpu) == (2, 2)


def test_global_micro_batch_sizes_that_leave_a_replica_nothing_or_come_twice_are_refused():
    from hybrid_rl.config import settings_given_twice

    cfg = compose_config(["actor_rollout_ref.actor.ppo_micro_batch_size=1", "trainer.n_gpus_per_node=2"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.ppo_micro_batch_size=1 is split over the role's 2 "
                                          r"data-parallel replicas .* set it to at least 2, or set "
                                          r"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu instead"):
        validate_config(cfg)
    # A critic-free run does not read the critic's.
    validate_config(compose_config(["critic.ppo_micro_batch_size=1", "trainer.n_gpus_per_node=2"]))
    assert settings_given_twice(["critic.ppo_micro_batch_size", "critic.forward_micro_batch_size_per_gpu"]) == []
    cli = subprocess.run([sys.executable, "-m", "hybrid_rl.main", "actor_rollout_ref.ref.log_prob_micro_batch_size=4",
                          "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"], cwd=REPO_ROOT,
                         capture_output=True, text=True)
    assert cli.returncode == 2
    assert ("error: actor_rollout_ref.ref.log_prob_micro_batch_size and "
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu are both set") in cli.stderr


@pytest.fixture(scope="module")
def eight_layer_model_dir(tmp_path_factory, tiny_tokenizer) -> str:
    from tests.conftest import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("eight_layers"), tiny_tokenizer, num_layers=8)


def test_verl02s_layers_per_virtual_pipeline_stage_set_the_virtual_pipeline_size(eight_layer_model_dir):
    from hybrid_rl.config import check_model_limits

    layout = ["trainer.device=cpu", "trainer.n_gpus_per_node=2",
              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2", "actor_rollout_ref.actor.use_kl_loss=true"]
    # 8 layers over 2 pipeline stages: 4 a stage, 2 a virtual stage, so 2 virtual stages (the
    # reference follows the actor, as its virtual pipeline size does in verl's tree).
    cfg = validate_config(compose_config([*layout, "actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=2"],
                                         config_name="ppo_megatron_trainer"))
    check_model_limits(cfg, eight_layer_model_dir)
    assert cfg.actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size == 2
    assert cfg.actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size == 2
    cfg = validate_config(compose_config([*layout, "actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=1",
                                          "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=4"],
                                         config_name="ppo_megatron_trainer"))
    check_model_limits(cfg, eight_layer_model_dir)
    assert cfg.actor_rollout_ref.ref.megatron.virtual_pipeline_model_parallel_size == 4
    for extra, message in [
        (["actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=3"],
         r"num_layers_per_virtual_pipeline_stage=3 does not divide the 4 layers of each of the 2 pipeline stages "
         r"\(valid here: 1, 2, 4\)"),
        (["actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=2",
          "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=4"],
         r"num_layers_per_virtual_pipeline_stage=2 means virtual_pipeline_model_parallel_size=2 for this model .* "
         r"but virtual_pipeline_model_parallel_size=4 is set: keep one"),
        (["actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=0"],
         r"num_layers_per_virtual_pipeline_stage must be >= 1 \(got 0\)"),
        (["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1",
          "actor_rollout_ref.actor.megatron.num_layers_per_virtual_pipeline_stage=2"],
         r"num_layers_per_virtual_pipeline_stage=2 splits each pipeline stage into virtual stages, which needs "
         r"pipeline_model_parallel_size > 1 \(it is 1\)"),
    ]:
        cfg = validate_config(compose_config([*layout, *extra], config_name="ppo_megatron_trainer"))
        with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.megatron." + message):
            check_model_limits(cfg, eight_layer_model_dir)


def test_older_verl_names_set_the_keys_they_are_now():
    from hybrid_rl.config import settings_given_twice
    from hybrid_rl.config_keys import check_verl_keys

    cfg = compose_config(["trainer.val_generations_to_log_to_wandb=3", "trainer.remove_previous_ckpt_in_save=true",
                          "actor_rollout_ref.actor.checkpoint.contents=[model,optimizer,extra]", "ray_init.num_cpus=2",
                          "ray_init.timeline_json_file=/tmp/timeline.json"])
    validate_config(cfg)
    assert cfg.trainer.log_val_generations == 3
    assert (cfg.trainer.max_actor_ckpt_to_keep, cfg.trainer.max_critic_ckpt_to_keep) == (1, 1)
    checkpoint = cfg.actor_rollout_ref.actor.checkpoint
    assert list(checkpoint.save_contents) == list(checkpoint.load_contents) == ["model", "optimizer", "extra"]
    assert (cfg.ray_kwargs.ray_init.num_cpus, cfg.ray_kwargs.timeline_json_file) == (2, "/tmp/timeline.json")
    # verl 0.2-0.4's Megatron names.
    cfg = compose_config(["actor_rollout_ref.ref.param_offload=true",
                          "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_granularity=full",
                          "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_method=uniform",
                          "actor_rollout_ref.model.gradient_checkpointing_kwargs.activations_checkpoint_num_layers=2"],
                         config_name="ppo_megatron_trainer")
    assert cfg.actor_rollout_ref.ref.megatron.param_offload is True
    overrides = cfg.actor_rollout_ref.actor.megatron.override_transformer_config
    assert (overrides.recompute_granularity, overrides.recompute_method, overrides.recompute_num_layers) == (
        "full", "uniform", 2)
    # verl 0.2's gradient offload: nothing to do on CPU; the GPU engine has no switch for it alone.
    cfg = compose_config(["actor_rollout_ref.actor.fsdp_config.grad_offload=true"])
    assert check_verl_keys(cfg, "cpu") == []
    assert check_verl_keys(cfg, "cuda") == ["actor_rollout_ref.actor.fsdp_config.grad_offload=True is not supported "
                                            "yet (verl 0.2's gradient offload; on CPU the gradients are in host memory "
                                            "already (on GPU, param_offload offloads them with the weights))"]
    assert settings_given_twice(["ray_init.num_cpus", "ray_kwargs.ray_init.num_cpus"]) == [
        "ray_init.num_cpus and ray_kwargs.ray_init.num_cpus are both set: ray_init.num_cpus is older verl's name for "
        "ray_kwargs.ray_init.num_cpus; set ray_kwargs.ray_init.num_cpus only."]


def test_verls_critic_fsdp_sections_set_the_critic_engine():
    """verl 0.9's critic.fsdp.* and 0.7-0.8's critic.model.fsdp_config.* reach the critic's FSDP
    engine settings (critic.fsdp_config); its dtype follows the actor's unless one of them sets it."""
    from hybrid_rl.config import settings_given_twice

    critic = compose_config(["actor_rollout_ref.actor.fsdp_config.dtype=fp32"]).critic.fsdp_config
    assert (critic.dtype, critic.reshard_after_forward, critic.full_determinism, critic.fsdp_size) == ("fp32", True, False, -1)
    for section in ("critic.fsdp", "critic.model.fsdp_config"):
        cfg = compose_config([f"{section}.dtype=bfloat16", f"{section}.reshard_after_forward=false",
                              f"{section}.full_determinism=true", f"{section}.fsdp_size=1",
                              f"{section}.ulysses_sequence_parallel_size=2", "actor_rollout_ref.actor.fsdp_config.dtype=fp32"])
        critic = validate_config(cfg).critic.fsdp_config
        assert (critic.dtype, critic.reshard_after_forward, critic.full_determinism, critic.fsdp_size,
                critic.ulysses_sequence_parallel_size) == ("bfloat16", False, True, 1, 2), section
    assert settings_given_twice(["critic.model.fsdp_config.dtype", "critic.fsdp.dtype"]) == [
        "critic.model.fsdp_config.dtype and critic.fsdp.dtype are both set: critic.model.fsdp_config.dtype is older "
        "verl's name for critic.fsdp.dtype; set critic.fsdp.dtype only."]


def test_rollout_full_determinism_is_refused_on_cpu_and_sets_vllms_batch_invariance_elsewhere():
    from hybrid_rl.workers.rollout import engine_env

    cfg = compose_config(["actor_rollout_ref.rollout.full_determinism=true", "trainer.device=cpu"])
    with pytest.raises(ConfigError, match="rollout.full_determinism=true asks for vLLM's batch-invariant kernels"):
        validate_config(cfg)
    assert engine_env(cfg.actor_rollout_ref.rollout, "cuda")["VLLM_BATCH_INVARIANT"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in engine_env(compose_config([]).actor_rollout_ref.rollout, "cuda")


def test_adding_a_key_verl_has_since_added_sets_it():
    """Scripts for early verl add keys it lacked (TinyZero's `+trainer.val_before_train=False`);
    Hydra refuses to add a key that exists, so such an addition sets it. Keys of one's own are
    added as before."""
    cfg = compose_config(["+trainer.val_before_train=False", "+my_own.setting=3"])
    assert cfg.trainer.val_before_train is False and cfg.my_own.setting == 3
    # One of this system's own keys is no key verl added later: Hydra's rule stands.
    with pytest.raises(ConfigCompositionException, match="An item is already at 'actor_rollout_ref.rollout.kv_cache_gib'"):
        compose_config(["+actor_rollout_ref.rollout.kv_cache_gib=2"])
    printed = subprocess.run([sys.executable, "-m", "hybrid_rl.main", "--cfg", "job", "+trainer.val_before_train=False"],
                             cwd=REPO_ROOT, capture_output=True, text=True)
    assert printed.returncode == 0, printed.stderr
    assert "val_before_train: false" in printed.stdout


@pytest.mark.parametrize("overrides, message", [
    (["critic.strategy=fsdp2", "critic.load_weight=false"], "critic.load_weight=false is verl's Megatron switch"),
    (["reward_model.load_weight=false"], "reward_model.strategy=megatron"),
    (["actor_rollout_ref.actor.load_weight=no"], "actor_rollout_ref.actor.load_weight='no' is not valid"),
    (["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.load_weight=false"],
     "must equal actor_rollout_ref.actor.load_weight"),
])
def test_load_weight_false_is_checked(overrides, message):
    """verl <= 0.5's Megatron load_weight: false only where the role runs on the Megatron engine,
    and under LoRA the reference (the actor with its adapter off) follows the actor."""
    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(overrides, config_name="ppo_megatron_trainer"))


def test_load_weight_false_is_accepted_on_the_megatron_engine():
    validate_config(compose_config(["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.actor.load_weight=false",
                                    "actor_rollout_ref.ref.load_weight=false", "critic.load_weight=false",
                                    "reward_model.strategy=megatron", "reward_model.load_weight=false"],
                                   config_name="ppo_megatron_trainer"))
