"""verl's rollout keys `ignore_eos`, `logprobs_mode` and `scheduling_policy` on both rollouts (vLLM
and transformers' generate): with `ignore_eos` every response runs to the length limit and is
trained on whole; the returned log-probs are of the distribution sampled from
(`processed_logprobs`) or of the model's own (`raw_logprobs`), checked against transformers'
logits of the same tokens. The model's `hf_config_path` and `override_config` reach the vLLM
engine as they reach the trainer: those logits are of the model built with both."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from hybrid_rl.config_keys import compose_config
from hybrid_rl.protocol import Batch, BatchMeta, Sampling
from tests.conftest import build_tiny_model

RESPONSE, TEMPERATURE = 8, 0.5
# Stop tokens: half the tiny vocabulary, so that most responses end early unless EOS is ignored.
STOP_IDS = list(range(2, 318, 2))
PROMPTS = [[5, 9, 13, 17], [21, 25], [29, 33, 37], [41, 45, 49, 53, 57, 61]]


def config(model_dir: str, ignore_eos: bool, logprobs_mode: str, name: str = "vllm", config_dir: str | None = None):
    """The rollout's settings; with `config_dir`, verl's hf_config_path (a config of another rotary
    base) and an override_config (another norm epsilon)."""
    policy = "priority" if logprobs_mode == "raw_logprobs" else "fcfs"
    model_settings = [] if config_dir is None else [
        f"actor_rollout_ref.model.hf_config_path={config_dir}", "+actor_rollout_ref.model.override_config.rms_norm_eps=1e-3"]
    return compose_config([
        *model_settings, f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.rollout.name={name}",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.prompt_length=16", f"actor_rollout_ref.rollout.response_length={RESPONSE}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", f"actor_rollout_ref.rollout.ignore_eos={ignore_eos}",
        f"actor_rollout_ref.rollout.logprobs_mode={logprobs_mode}",
        f"actor_rollout_ref.rollout.scheduling_policy={policy}"])


def prompt_batch() -> Batch:
    width = max(map(len, PROMPTS))
    batch = Batch({"input_ids": torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS]),
                   "attention_mask": torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])})
    batch.meta = BatchMeta(step=1, temperature=TEMPERATURE, sampling=Sampling.TRAIN)
    return batch


def rollouts(engine, model_dir: str, logprobs_mode: str, name: str, config_dir: str) -> dict:
    from hybrid_rl.workers.rollout import generate_batch

    out = {}
    for ignore_eos in (False, True):
        batch = generate_batch(engine, None, config(model_dir, ignore_eos, logprobs_mode, name, config_dir),
                               prompt_batch(), 0, STOP_IDS)
        out[ignore_eos] = {key: batch[key] for key in ("responses", "response_mask", "rollout_log_probs")}
    return out


def vllm_rollouts(model_dir: str, logprobs_mode: str, config_dir: str) -> dict:
    """In a fresh process, as one worker rank: a float32 vLLM engine with the model's weights."""
    import os

    import torch.distributed as dist
    from safetensors.torch import load_file

    from hybrid_rl.controller.worker import get_free_port
    from hybrid_rl.workers.rollout import VLLMRollout

    port = get_free_port("127.0.0.1")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    cfg = config(model_dir, False, logprobs_mode, config_dir=config_dir).actor_rollout_ref
    engine = VLLMRollout(model_dir, cfg.rollout, torch.device("cpu"), STOP_IDS, cfg.model)
    engine.load_weights(load_file(os.path.join(model_dir, "model.safetensors")).items())
    return {"rollouts": rollouts(engine, model_dir, logprobs_mode, "vllm", config_dir),
            "policy": engine.llm.llm_engine.vllm_config.scheduler_config.policy}


def hf_rollouts(model_dir: str, logprobs_mode: str, config_dir: str) -> dict:
    from hybrid_rl.workers.rollout import HFRollout

    engine = HFRollout(transformers_model(model_dir, config_dir), 0, STOP_IDS,
                       raw_log_probs=logprobs_mode == "raw_logprobs")
    return {"rollouts": rollouts(engine, model_dir, logprobs_mode, "hf", config_dir)}


def transformers_model(model_dir: str, config_dir: str | None):
    """The model as the trainer builds it (`models.model_config`): the config from `config_dir`
    with the override, or the folder's own."""
    from transformers import AutoModelForCausalLM

    from hybrid_rl.models import model_config

    model_cfg = config(model_dir, False, "processed_logprobs", config_dir=config_dir).actor_rollout_ref.model
    return AutoModelForCausalLM.from_pretrained(model_dir, config=model_config(model_dir, model_cfg),
                                                dtype=torch.float32)


def expected_log_probs(model_dir: str, responses: torch.Tensor, raw: bool, config_dir: str | None) -> torch.Tensor:
    """transformers' log-probs of each response token after its prompt and the tokens before it."""
    model = transformers_model(model_dir, config_dir)
    rows = []
    with torch.no_grad():
        for prompt, response in zip(PROMPTS, responses.tolist()):
            logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            logp = torch.log_softmax(logits if raw else logits / TEMPERATURE, dim=-1)
            rows.append(logp.gather(-1, torch.tensor(response).unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def other_config_dir(tiny_tokenizer, tmp_path_factory) -> str:
    """A folder whose config.json differs from the tiny model's in its rotary base only."""
    return build_tiny_model(tmp_path_factory.mktemp("other_config"), tiny_tokenizer, rope_theta=50.0)


@pytest.fixture(scope="module", params=["vllm", "hf"])
def engine_runs(request, tiny_model_dir, other_config_dir) -> dict:
    runs = {}
    for mode in ("processed_logprobs", "raw_logprobs"):
        if request.param == "hf":
            runs[mode] = hf_rollouts(tiny_model_dir, mode, other_config_dir)
            continue
        with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
            runs[mode] = pool.submit(vllm_rollouts, tiny_model_dir, mode, other_config_dir).result()
    return runs


@pytest.mark.slow
def test_ignore_eos_runs_every_response_to_the_limit_and_trains_on_it_whole(engine_runs):
    for run in engine_runs.values():
        stopped, ignored = run["rollouts"][False], run["rollouts"][True]
        lengths = stopped["response_mask"].sum(-1)
        assert (lengths < RESPONSE).any()  # without it, responses end at their first stop token
        for row, length in zip(stopped["responses"].tolist(), lengths.tolist()):
            assert row[length - 1] in STOP_IDS or length == RESPONSE
            assert not any(token in STOP_IDS for token in row[:length - 1])
        assert bool((ignored["response_mask"] == 1).all())
        assert any(token in STOP_IDS for row in ignored["responses"].tolist() for token in row[:-1])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["processed_logprobs", "raw_logprobs"])
def test_log_probs_are_of_the_sampling_or_the_models_distribution(engine_runs, tiny_model_dir, other_config_dir,
                                                                  mode):
    run = engine_runs[mode]["rollouts"][True]  # full-length responses: every position compared
    raw = mode == "raw_logprobs"
    expected = expected_log_probs(tiny_model_dir, run["responses"], raw, other_config_dir)
    torch.testing.assert_close(run["rollout_log_probs"], expected, atol=1e-4, rtol=0)
    other_mode = expected_log_probs(tiny_model_dir, run["responses"], not raw, other_config_dir)
    assert (run["rollout_log_probs"] - other_mode).abs().max() > 0.1  # the two modes differ at T=0.5
    # ... and the model with the folder's own config (no hf_config_path, no override) differs too.
    own_config = expected_log_probs(tiny_model_dir, run["responses"], raw, None)
    assert (run["rollout_log_probs"] - own_config).abs().max() > 1e-2
    if "policy" in engine_runs[mode]:
        assert engine_runs[mode]["policy"] == ("priority" if mode == "raw_logprobs" else "fcfs")


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.logprobs_mode=raw_logits"], "vLLM would return logits"),
    (["actor_rollout_ref.rollout.scheduling_policy=lifo"], "scheduling_policy='lifo' is not valid"),
    (["actor_rollout_ref.rollout.ignore_eos=true", "actor_rollout_ref.rollout.multi_turn.enable=true"],
     "the tool loop needs it"),
])
def test_rollout_settings_that_cannot_work_are_refused_at_start(overrides, message):
    from hybrid_rl.config import ConfigError, validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(compose_config(overrides))
