"""Catalogue of bad input: every case fails on the driver, before Ray or any worker starts, with one
line that names the problem and the fix.

Cases go through `build_trainer` (config -> model -> data -> reward function -> resume point ->
Trainer), exactly as `python -m hybrid_rl.main` does, with Ray's start-up replaced by a tripwire;
a few go through the real command line to show the `error: ...` line and exit status 2.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
from omegaconf import OmegaConf

from hybrid_rl.checkpoint import POINTER, STATE, CheckpointError
from hybrid_rl.config import ConfigError
from hybrid_rl.data import make_arithmetic_rows
from hybrid_rl.main import REPO_ROOT, SetupError, build_trainer, compose_config, prepare
from hybrid_rl.models import ModelPathError
from tests.conftest import run_overrides, write_jsonl


# ----------------------------------------------------------------------------- harness
@pytest.fixture(autouse=True)
def ray_tripwire(monkeypatch):
    """Any attempt to start or join Ray fails the test; no case may get that far."""
    import ray

    import hybrid_rl.controller
    import hybrid_rl.controller.ray_utils

    def refuse(*args, **kwargs):
        raise AssertionError("Ray was started: the bad input was not caught before init_ray")

    monkeypatch.setattr(hybrid_rl.controller, "init_ray", refuse)
    monkeypatch.setattr(hybrid_rl.controller.ray_utils, "init_ray", refuse)
    monkeypatch.setattr(ray, "init", refuse)
    yield
    assert not ray.is_initialized()


@dataclass
class Ctx:
    """What a case may use to build its bad input."""
    tmp: Path
    model_dir: str
    files: tuple[str, str]
    run_dir: Path


@dataclass
class Case:
    make: Callable[[Ctx], list[str]]  # extra dotted overrides (written files go under ctx.tmp)
    cause: type  # the exception build_trainer wraps in SetupError
    fragments: list[str]  # all must appear in the message: the problem and the fix
    edits: Callable[[Ctx], dict]  # {dotted key: value} set after composing (values awkward on a command line)


def case(id_, overrides, cause, *fragments, edits=None):
    make = overrides if callable(overrides) else (lambda ctx, o=tuple(overrides): list(o))
    return pytest.param(Case(make, cause, list(fragments), edits or (lambda ctx: {})), id=id_)


@pytest.fixture
def ctx(tmp_path, tiny_model_dir, arithmetic_files) -> Ctx:
    return Ctx(tmp_path, tiny_model_dir, arithmetic_files, tmp_path / "run")


def check(ctx: Ctx, c: Case) -> str:
    overrides = run_overrides(ctx.model_dir, ctx.files, ctx.run_dir) + c.make(ctx)
    cfg = compose_config(overrides)
    for key, value in c.edits(ctx).items():
        OmegaConf.update(cfg, key, value, force_add=True)
    with pytest.raises(SetupError, match=re.escape(c.fragments[0])) as err:
        build_trainer(cfg)
    message = str(err.value)
    assert isinstance(err.value.__cause__, c.cause), (type(err.value.__cause__), message)
    assert "\n" not in message, message
    missing = [f for f in c.fragments if f not in message]
    assert not missing, f"{missing} not in: {message}"
    return message


# ----------------------------------------------------------------------------- config
CONFIG_CASES = [
    case("unknown-adv-estimator", ["algorithm.adv_estimator=grpoo"], ConfigError,
         "algorithm.adv_estimator='grpoo' is not valid", "Valid choices:", "grpo", "rloo"),
    case("unknown-policy-loss", ["actor_rollout_ref.actor.policy_loss.loss_mode=ppo2"], ConfigError,
         "policy_loss.loss_mode='ppo2' is not valid", "vanilla"),
    case("unknown-kl-loss-type", ["actor_rollout_ref.actor.kl_loss_type=k5"], ConfigError,
         "kl_loss_type='k5' is not valid", "low_var_kl"),
    case("unknown-kl-penalty", ["algorithm.kl_penalty=k9"], ConfigError,
         "algorithm.kl_penalty='k9' is not valid", "low_var_kl"),
    case("unknown-loss-agg-mode", ["actor_rollout_ref.actor.loss_agg_mode=mean"], ConfigError,
         "loss_agg_mode='mean' is not valid", "token-mean", "seq-mean-token-sum-norm"),
    case("unknown-rollout-rs-mode", ["algorithm.rollout_correction.rollout_rs='token_k1,seq_bogus'"], ConfigError,
         "rollout_correction.rollout_rs='seq_bogus' is not valid", "token_k1"),
    case("bad-truncation-value", ["data.truncation=bogus"], ConfigError,
         "data.truncation='bogus' is not valid", "error, left, middle, right"),
    case("batch-not-split-over-ranks", ["data.train_batch_size=3", "actor_rollout_ref.rollout.n=3",
                                        "trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_mini_batch_size=3"],
         ConfigError, "9 sequences cannot be split evenly over 2 ranks", "multiple of 2"),
    case("mini-batch-larger-than-batch", ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=16"],
         ConfigError, "ppo_mini_batch_size (16) is larger than data.train_batch_size (8)", "at most 8"),
    case("batch-not-multiple-of-mini", ["data.train_batch_size=12", "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
         ConfigError, "data.train_batch_size (12) must be a multiple of", "divisor of 12"),
    case("micro-batch-not-dividing", ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8",
                                      "actor_rollout_ref.rollout.n=4",
                                      "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5",
                                      "actor_rollout_ref.actor.use_dynamic_bsz=false"],
         ConfigError, "ppo_micro_batch_size_per_gpu (5)", "32 sequences", "divides 32"),
    case("unknown-optimizer-override", ["+actor_rollout_ref.actor.optim.override_optimizer_config.epsilon=1e-6"],
         ConfigError, "torch.optim.AdamW does not take epsilon (from actor_rollout_ref.actor.optim.override_"
         "optimizer_config)", "eps"),
    case("train-dtype-typo", ["actor_rollout_ref.actor.fsdp_config.dtype=bf32"],
         ConfigError, "actor_rollout_ref.actor.fsdp_config.dtype", "bf32"),
    case("engine-dtype-typo", ["actor_rollout_ref.rollout.dtype=half"],
         ConfigError, "actor_rollout_ref.rollout.dtype", "half"),
    case("token-budget-zero", ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0"],
         ConfigError, "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0", "positive"),
    case("head-chunk-negative", ["actor_rollout_ref.model.head_chunk_size=-1"],
         ConfigError, "actor_rollout_ref.model.head_chunk_size=-1", "positive"),
    case("compile-layers-on-megatron", ["actor_rollout_ref.model.compile_layers=true",
                                        "actor_rollout_ref.actor.strategy=megatron"],
         ConfigError, "compile_layers=true compiles the FSDP engine's decoder layers", "set it to false"),
    case("lr-zero", ["actor_rollout_ref.actor.optim.lr=0"], ConfigError,
         "actor_rollout_ref.actor.optim.lr=0 must be positive", "1e-6 to 1e-5"),
    case("lr-negative", ["actor_rollout_ref.actor.optim.lr=-1e-5"], ConfigError,
         "actor_rollout_ref.actor.optim.lr=-1e-05 must be positive", "1e-6 to 1e-5"),
    case("temperature-zero-with-sampling", ["actor_rollout_ref.rollout.temperature=0",
                                            "actor_rollout_ref.rollout.do_sample=true"], ConfigError,
         "rollout.temperature must be > 0 when do_sample=true", "do_sample=false"),
    case("top-p-zero", ["actor_rollout_ref.rollout.top_p=0"], ConfigError,
         "rollout.top_p=0 must be in (0, 1]", "1.0"),
    case("top-p-above-one", ["actor_rollout_ref.rollout.top_p=1.5"], ConfigError,
         "rollout.top_p=1.5 must be in (0, 1]", "1.0"),
    case("clip-ratio-c-not-above-one", ["actor_rollout_ref.actor.clip_ratio_c=1.0"], ConfigError,
         "clip_ratio_c=1.0 must be > 1", "3.0"),
    case("gae-without-critic", ["algorithm.adv_estimator=gae", "critic.enable=false"], ConfigError,
         "adv_estimator=gae needs a critic", "critic.enable=true", "grpo"),
    case("kl-penalty-full-in-reward", ["algorithm.kl_penalty=full", "algorithm.use_kl_in_reward=true"],
         ConfigError, "algorithm.kl_penalty=full is not available", "use_kl_loss=true", "kl_loss_type=full"),
    case("nnodes-zero", ["trainer.nnodes=0"], ConfigError,
         "trainer.nnodes=0", "must be a positive integer"),
    case("train-batch-size-zero", ["data.train_batch_size=0"], ConfigError,
         "data.train_batch_size=0 must be a positive integer"),
    case("total-training-steps-zero", ["trainer.total_training_steps=0"], ConfigError,
         "trainer.total_training_steps must be positive or null", "trainer.total_epochs"),
]


@pytest.mark.parametrize("c", CONFIG_CASES)
def test_bad_config(ctx, c):
    check(ctx, c)


def test_grpo_with_one_response_per_prompt_warns(ctx, caplog):
    """Not an error (REINFORCE without a baseline is legal) but a warning that names n and the fix."""
    cfg = compose_config(run_overrides(ctx.model_dir, ctx.files, ctx.run_dir) + ["actor_rollout_ref.rollout.n=1"])
    with caplog.at_level("WARNING", logger="hybrid_rl"):
        prepare(cfg)
    warning = " ".join(r.getMessage() for r in caplog.records if r.levelname == "WARNING")
    assert "algorithm.adv_estimator=grpo with actor_rollout_ref.rollout.n=1" in warning
    assert "no group baseline" in warning and "Set actor_rollout_ref.rollout.n >= 2" in warning


# ----------------------------------------------------------------------------- model
@pytest.fixture(scope="module")
def model_without_chat_template(tmp_path_factory, make_tokenizer, tiny_model_dir) -> str:
    """config.json of the tiny model, a tokenizer that has no chat template (no weights needed:
    the error comes before they are read)."""
    folder = tmp_path_factory.mktemp("no_template_model")
    shutil.copy(Path(tiny_model_dir) / "config.json", folder / "config.json")
    tokenizer = make_tokenizer(chat_template=None)
    assert tokenizer.chat_template is None
    tokenizer.save_pretrained(folder)
    return str(folder)


def _folder(ctx, name, files=()):
    folder = ctx.tmp / name
    folder.mkdir()
    for f in files:
        shutil.copy(Path(ctx.model_dir) / f, folder / f)
    return folder


def _config_folder(ctx, name, text):
    folder = _folder(ctx, name)
    (folder / "config.json").write_text(text)
    return folder


def _broken_tokenizer(ctx):
    folder = ctx.tmp / "broken_tokenizer"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{ this is not json")
    (folder / "tokenizer_config.json").write_text("{}")
    return folder


def _other_vocabulary_model(ctx):
    from transformers import AutoTokenizer

    from tests.test_reference_model import llama

    tokenizer = AutoTokenizer.from_pretrained(ctx.model_dir)
    tokenizer.add_tokens(["<not-in-the-actors>"])
    return llama(ctx.tmp / "other_vocabulary", tokenizer, len(tokenizer))


MODEL_CASES = [
    case("model-path-missing", lambda ctx: [f"actor_rollout_ref.model.path={ctx.tmp}/no_such_model"],
         ModelPathError, "actor_rollout_ref.model.path=", "is neither a model folder nor a .gguf file",
         "Give a local Hugging Face folder"),
    case("gguf-file-missing", lambda ctx: [f"actor_rollout_ref.model.path={ctx.tmp}/absent.gguf"],
         ModelPathError, "absent.gguf does not exist", "fix actor_rollout_ref.model.path"),
    case("model-folder-without-config-json",
         lambda ctx: [f"actor_rollout_ref.model.path={_folder(ctx, 'weights_only', ['model.safetensors'])}"],
         ModelPathError, "has no config.json", "point actor_rollout_ref.model.path at a Hugging Face model folder"),
    case("config-json-not-json",
         lambda ctx: [f"actor_rollout_ref.model.path={_config_folder(ctx, 'bad_json', '{not json')}"],
         ModelPathError, "Cannot read the model config", "not a valid JSON file",
         "with a valid config.json"),
    case("config-json-without-model-type",
         lambda ctx: [f"actor_rollout_ref.model.path={_config_folder(ctx, 'no_type', '{}')}"],
         ModelPathError, "Cannot read the model config", "model_type", "with a valid config.json"),
    case("model-folder-without-tokenizer",
         lambda ctx: [f"actor_rollout_ref.model.path={_folder(ctx, 'no_tokenizer', ['config.json'])}"],
         ModelPathError, "has no tokenizer files (tokenizer.json", "actor_rollout_ref.model.path=",
         "Copy the model's tokenizer into that folder"),
    case("tokenizer-path-missing", lambda ctx: [f"actor_rollout_ref.model.tokenizer_path={ctx.tmp}/no_tok"],
         ModelPathError, "no_tok' does not exist", "actor_rollout_ref.model.tokenizer_path=",
         "point it at the model's tokenizer folder"),
    case("tokenizer-files-unreadable",
         lambda ctx: [f"actor_rollout_ref.model.tokenizer_path={_broken_tokenizer(ctx)}"],
         ModelPathError, "Cannot load a tokenizer from actor_rollout_ref.model.tokenizer_path=",
         "Point actor_rollout_ref.model.tokenizer_path at a folder with the tokenizer files"),
    case("critic-model-path-missing", lambda ctx: ["algorithm.adv_estimator=gae",
                                                   f"critic.model.path={ctx.tmp}/no_critic"],
         ModelPathError, "critic.model.path=", "is neither a model folder nor a .gguf file"),
    case("distillation-teacher-path-missing",
         lambda ctx: ["distillation.enabled=true",
                      f"distillation.teacher_models.teacher_model.model_path={ctx.tmp}/no_teacher"],
         ModelPathError, "distillation.teacher_models.teacher_model.model_path=",
         "is neither a model folder nor a .gguf file"),
    case("distillation-teacher-of-another-tokenizer",
         lambda ctx: ["distillation.enabled=true",
                      f"distillation.teacher_models.teacher_model.model_path={_other_vocabulary_model(ctx)}"],
         ModelPathError, "distillation.teacher_models.teacher_model.model_path=",
         "its tokenizer's vocabulary differs from the actor's"),
    case("response-beyond-context-window", ["data.max_prompt_length=400", "data.max_response_length=200"],
         ConfigError, "= 600 exceeds the model's context window (512 tokens", "max_position_embeddings",
         "Shorten data.max_prompt_length or data.max_response_length"),
    case("chat-template-broken", [], ValueError, "chat template failed", "TemplateSyntaxError",
         "actor_rollout_ref.model.custom_chat_template",
         edits=lambda ctx: {"actor_rollout_ref.model.custom_chat_template": "{% for m in messages %}{{ m }"}),
]


@pytest.mark.parametrize("c", MODEL_CASES)
def test_bad_model(ctx, c):
    check(ctx, c)


def test_tokenizer_without_chat_template(ctx, model_without_chat_template):
    c = Case(lambda ctx: [f"actor_rollout_ref.model.path={model_without_chat_template}"], ValueError,
             ["has no chat template", "Use an instruct/chat model",
              "actor_rollout_ref.model.custom_chat_template"], lambda ctx: {})
    check(ctx, c)


# ----------------------------------------------------------------------------- data
def _jsonl(ctx, name, rows):
    return write_jsonl(ctx.tmp / name, rows)


def _write(ctx, name, data: bytes):
    (ctx.tmp / name).write_bytes(data)
    return str(ctx.tmp / name)


def _rows(n=8, **change):
    return [{**row, **change} for row in make_arithmetic_rows(n, seed=3)]


DATA_CASES = [
    case("train-file-missing", lambda ctx: [f"data.train_files={ctx.tmp}/missing.jsonl"], FileNotFoundError,
         "data file not found:", "missing.jsonl", "Check data.train_files / data.val_files"),
    case("val-file-missing", lambda ctx: [f"data.val_files={ctx.tmp}/missing_val.parquet"], FileNotFoundError,
         "data file not found:", "missing_val.parquet", "Check data.train_files / data.val_files"),
    case("corrupt-parquet",
         lambda ctx: [f"data.train_files={_write(ctx, 'bad.parquet', b'PAR1 this is not parquet at all')}"],
         ValueError, "cannot read parquet file", "bad.parquet", "corrupt or not parquet", "regenerate it"),
    case("unsupported-extension", lambda ctx: [f"data.train_files={_write(ctx, 'data.csv', b'prompt,answer')}"],
         ValueError, "unsupported data file extension", "data.csv", "Supported: .parquet, .jsonl, .json"),
    case("malformed-jsonl-line",
         lambda ctx: ["data.train_files=" + _write(ctx, "broken.jsonl", b'{}\n{oops')],
         ValueError, "cannot parse JSON Lines file", "line 2", "Each line must be one JSON object"),
    case("missing-prompt-key",
         lambda ctx: [f"data.train_files={_jsonl(ctx, 'q.jsonl', [{'question': 'What is 1 + 1?', 'answer': '2'}])}"],
         ValueError, "prompt key 'prompt' not found in 1 row(s)", "Columns present: ['answer', 'question']",
         "Set data.prompt_key to the column holding the prompt"),
    case("prompt-wrong-type",
         lambda ctx: [f"data.train_files={_jsonl(ctx, 'int.jsonl', _rows(prompt=12))}"],
         ValueError, "column 'prompt': row 0: prompt must be a string or a non-empty list", "got int",
         "set data.prompt_key to the column holding the chat messages"),
    case("prompt-message-without-role",
         lambda ctx: [f"data.train_files={_jsonl(ctx, 'norole.jsonl', _rows(prompt=[{'text': 'hi'}]))}"],
         ValueError, "every prompt message needs 'role' and 'content'", "Fix those rows"),
    case("empty-dataset", lambda ctx: [f"data.train_files={_write(ctx, 'empty.jsonl', b'')}"],
         ValueError, "dataset is empty: no rows in", "empty.jsonl", "non-empty parquet or JSON Lines"),
    case("all-prompts-filtered-out", ["data.filter_overlong_prompts=true", "data.max_prompt_length=4"],
         ValueError, "dataset is empty after filtering: all 64 prompts exceed data.max_prompt_length=4",
         "Raise data.max_prompt_length", "data.truncation=left|right|middle"),
    case("prompt-over-limit-truncation-error", ["data.max_prompt_length=8", "data.truncation=error"],
         ValueError, "longer than data.max_prompt_length=8", "raise data.max_prompt_length",
         "data.truncation=left|right|middle", "data.filter_overlong_prompts=True"),
    case("fewer-prompts-than-batch",
         lambda ctx: [f"data.train_files={_jsonl(ctx, 'four.jsonl', _rows(4))}", "data.train_batch_size=8",
                      "actor_rollout_ref.actor.ppo_mini_batch_size=8"],
         ConfigError, "data.train_files has 4 usable prompts, fewer than data.train_batch_size=8",
         "Lower data.train_batch_size to at most 4"),
    case("unknown-data-source-without-custom-reward",
         lambda ctx: [f"data.train_files={_jsonl(ctx, 'mystery.jsonl', _rows(data_source='mystery'))}"],
         ConfigError, "data.train_files has rows whose data_source no built-in reward function scores",
         "'mystery' (8 rows)", "arithmetic", "Set custom_reward_function.path="),
]


@pytest.mark.parametrize("c", DATA_CASES)
def test_bad_data(ctx, c):
    check(ctx, c)


# ----------------------------------------------------------------------------- reward function
def _reward_file(ctx, source):
    path = ctx.tmp / "my_reward.py"
    path.write_text(source)
    return [f"custom_reward_function.path={path}"]


REWARD_CASES = [
    case("reward-file-missing", lambda ctx: [f"custom_reward_function.path={ctx.tmp}/nope.py"], FileNotFoundError,
         "custom_reward_function.path: file not found", "nope.py", "Point it at an existing .py file"),
    case("reward-not-callable", lambda ctx: _reward_file(ctx, "compute_score = 3\n"), ValueError,
         "'compute_score' in custom reward file", "is of type int, not a function",
         "Set custom_reward_function.name to a function with signature fn(data_source, solution_str"),
    case("reward-wrong-signature", lambda ctx: _reward_file(ctx, "def compute_score(text):\n    return 0.0\n"),
         ValueError, "has signature compute_score(text)", "cannot be called as fn(data_source=",
         "Change it to fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs)"),
    case("reward-import-fails", lambda ctx: _reward_file(ctx, "import no_such_module_xyz\n"), ValueError,
         "my_reward.py (custom_reward_function.path) failed with ModuleNotFoundError", "no_such_module_xyz",
         "Fix the error in that file"),
    case("reward-name-missing",
         lambda ctx: _reward_file(ctx, "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                       "    return 1.0\n"),
         ValueError, "has no attribute 'compute_score'", "Functions and classes found there: ['score']",
         "Set custom_reward_function.name to one of them"),
    case("reward-kwargs-clash",
         lambda ctx: _reward_file(ctx, "def compute_score(data_source, solution_str, ground_truth, "
                                       "extra_info=None, **kw):\n    return 1.0\n"),
         ValueError, "reward_kwargs sets ['ground_truth']", "remove them from reward_kwargs",
         edits=lambda ctx: {"custom_reward_function.reward_kwargs": {"ground_truth": "7"}}),
]


@pytest.mark.parametrize("c", REWARD_CASES)
def test_bad_reward_function(ctx, c):
    check(ctx, c)


# ----------------------------------------------------------------------------- resume
def _checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    folder = run_dir / f"global_step_{step}"
    (folder / "actor").mkdir(parents=True)
    if complete:
        (folder / STATE).write_text(json.dumps({"global_step": step}))
    return folder


def _missing_resume_path(ctx):
    _checkpoint(ctx.run_dir, 2)
    return ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={ctx.run_dir}/global_step_99"]


def _corrupt_pointer(ctx):
    _checkpoint(ctx.run_dir, 3)
    (ctx.run_dir / POINTER).write_text("7")
    return ["trainer.resume_mode=auto"]


RESUME_CASES = [
    case("bad-resume-mode", ["trainer.resume_mode=latest"], ConfigError,
         "trainer.resume_mode='latest' is not valid", "auto, disable, resume_path"),
    case("resume-path-not-given", ["trainer.resume_mode=resume_path"], ConfigError,
         "trainer.resume_mode=resume_path needs trainer.resume_from_path=", "trainer.resume_mode=auto"),
    case("resume-path-missing", _missing_resume_path,
         CheckpointError, "global_step_99 does not exist", "global_step_2",
         "Point it at a global_step_<N> folder", "trainer.resume_mode=auto"),
    case("resume-path-incomplete",
         lambda ctx: ["trainer.resume_mode=resume_path",
                      f"trainer.resume_from_path={_checkpoint(ctx.run_dir, 5, complete=False)}"],
         CheckpointError, "is not a complete checkpoint (no trainer_state.json)",
         "point it at a global_step_<N> folder written by hybrid-rl"),
    case("latest-pointer-to-missing-step", _corrupt_pointer, CheckpointError,
         "latest_checkpointed_iteration.txt points to", "global_step_7, which is missing or incomplete",
         "Delete the pointer", "trainer.resume_mode=resume_path", "global_step_3"),
]


@pytest.mark.parametrize("c", RESUME_CASES)
def test_bad_resume(ctx, c):
    check(ctx, c)


# ----------------------------------------------------------------------------- command line
CLI_CASES = {
    "cli-top-p": (["actor_rollout_ref.rollout.top_p=1.5"],
                  "error: actor_rollout_ref.rollout.top_p=1.5 must be in (0, 1]"),
    "cli-train-file-missing": (["data.train_files=/no/such/train.parquet"],
                               "error: data file not found: /no/such/train.parquet"),
}


@pytest.fixture(scope="module", autouse=True)
def cli_runs(request, tmp_path_factory, tiny_model_dir, arithmetic_files):
    """The command lines start with the module's first test and run alongside the in-process cases
    (each pays Python + torch start-up); the CLI tests at the end collect them."""
    if not any(item.name.startswith("test_cli_") for item in request.session.items):
        yield {}
        return
    run_dir = tmp_path_factory.mktemp("cli_run")
    env = {**os.environ, "PYTHONPATH": REPO_ROOT, "HYBRID_RL_CACHE": str(run_dir / "cache")}
    procs = {}
    for name, (extra, _) in CLI_CASES.items():
        args = run_overrides(tiny_model_dir, arithmetic_files, run_dir) + extra
        procs[name] = subprocess.Popen([sys.executable, "-m", "hybrid_rl.main", *args], cwd=REPO_ROOT, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def cli_results(cli_runs):
    results = {}
    for name, proc in cli_runs.items():
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        results[name] = (proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", list(CLI_CASES))
def test_cli_prints_one_error_line_and_exits_2(cli_results, name):
    returncode, out, err = cli_results[name]
    assert returncode == 2, (out, err)
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(CLI_CASES[name][1]), err
    assert "Started a local Ray instance" not in out + err


def test_catalogue_size():
    cases = CONFIG_CASES + MODEL_CASES + DATA_CASES + REWARD_CASES + RESUME_CASES
    assert len(cases) + 1 + 1 >= 25  # + chat-template-less tokenizer + n=1 warning
    assert len({p.id for p in cases}) == len(cases)
