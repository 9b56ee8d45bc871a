"""verl's `rollout.use_fire_sampling` (FIRE, arXiv:2410.21236) on both rollouts: each training
response's first token is drawn at temperature 30 from the 16 likeliest tokens, the rest at the
rollout's temperature after it; the returned log-probs, checked against transformers' logits, are
those of the distributions each token was drawn from. Validation rollouts sample as before."""

from __future__ import annotations

import dataclasses
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.protocol import Sampling
from hybrid_rl.workers.rollout import FIRE_TEMPERATURE, FIRE_TOP_K
from tests.test_rollout_sampling_keys import PROMPTS, RESPONSE, STOP_IDS, TEMPERATURE, prompt_batch


def config(model_dir: str, name: str, fire: bool = True):
    return compose_config([
        f"actor_rollout_ref.model.path={model_dir}", f"actor_rollout_ref.rollout.name={name}",
        "actor_rollout_ref.rollout.dtype=float32", "actor_rollout_ref.rollout.enforce_eager=true",
        "actor_rollout_ref.rollout.prompt_length=16", f"actor_rollout_ref.rollout.response_length={RESPONSE}",
        f"actor_rollout_ref.rollout.temperature={TEMPERATURE}", "actor_rollout_ref.rollout.ignore_eos=true",
        f"actor_rollout_ref.rollout.use_fire_sampling={fire}"])


def rollouts(engine, model_dir: str, name: str) -> dict:
    """A training rollout and a validation rollout (val_kwargs: greedy) with FIRE on."""
    from hybrid_rl.workers.rollout import generate_batch

    out = {}
    for sampling in (Sampling.TRAIN, Sampling.VALIDATE):
        prompts = prompt_batch()
        prompts.meta = dataclasses.replace(prompts.meta, sampling=sampling)
        batch = generate_batch(engine, None, config(model_dir, name), prompts, 0, STOP_IDS)
        out[sampling.value] = {key: batch[key] for key in ("responses", "rollout_log_probs")}
    return out


def vllm_rollouts(model_dir: str) -> dict:
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
    cfg = config(model_dir, "vllm").actor_rollout_ref
    engine = VLLMRollout(model_dir, cfg.rollout, torch.device("cpu"), STOP_IDS, cfg.model)
    engine.load_weights(load_file(os.path.join(model_dir, "model.safetensors")).items())
    return rollouts(engine, model_dir, "vllm")


def model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["vllm", "hf"])
def fire_runs(request, tiny_model_dir) -> dict:
    if request.param == "hf":
        from hybrid_rl.workers.rollout import HFRollout

        return rollouts(HFRollout(model(tiny_model_dir), 0, STOP_IDS), tiny_model_dir, "hf")
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(vllm_rollouts, tiny_model_dir).result()


@pytest.mark.slow
def test_the_first_token_is_drawn_hot_and_the_rest_as_usual(fire_runs, tiny_model_dir):
    run = fire_runs[Sampling.TRAIN.value]
    hf = model(tiny_model_dir)
    with torch.no_grad():
        for prompt, response, log_probs in zip(PROMPTS, run["responses"].tolist(), run["rollout_log_probs"]):
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            hot = logits[0] / FIRE_TEMPERATURE
            kept = hot.topk(FIRE_TOP_K).indices
            assert response[0] in kept.tolist()
            hot_top = torch.full_like(hot, float("-inf")).scatter(0, kept, hot[kept])
            expected = torch.cat([torch.log_softmax(hot_top, -1)[response[0]].reshape(1),
                                  torch.log_softmax(logits[1:] / TEMPERATURE, -1).gather(
                                      -1, torch.tensor(response[1:]).unsqueeze(-1)).squeeze(-1)])
            torch.testing.assert_close(log_probs, expected, atol=1e-4, rtol=0)
            # Drawn nearly uniformly from 16: a probability near 1/16, not the model's own at T=0.5.
            assert abs(float(log_probs[0]) - torch.log(torch.tensor(1 / FIRE_TOP_K)).item()) < 0.5
            own = torch.log_softmax(logits[0] / TEMPERATURE, -1)[response[0]]
            assert abs(float(log_probs[0] - own)) > 1e-2


@pytest.mark.slow
def test_validation_is_not_fired(fire_runs, tiny_model_dir):
    """val_kwargs are greedy by default: every token the model's argmax, the first one too."""
    run = fire_runs[Sampling.VALIDATE.value]
    hf = model(tiny_model_dir)
    with torch.no_grad():
        for prompt, response in zip(PROMPTS, run["responses"].tolist()):
            logits = hf(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]
            assert logits.argmax(-1).tolist() == response


@pytest.mark.parametrize("overrides, fragment", [
    (["actor_rollout_ref.rollout.multi_turn.enable=true"], "with multi_turn.enable=true there is no such split"),
    (["actor_rollout_ref.rollout.beam_search=true"], "with beam_search=true"),
    (["actor_rollout_ref.rollout.do_sample=false"], "with do_sample=false"),
    (["actor_rollout_ref.actor.router_replay.mode=R3"], "with router_replay.mode=R3"),
    (["data.max_response_length=1"], "needs responses of two tokens or more (response_length=1)"),
])
def test_what_cannot_split_off_the_first_token_is_refused(overrides, fragment):
    with pytest.raises(ConfigError) as error:
        validate_config(compose_config(["actor_rollout_ref.rollout.use_fire_sampling=true", *overrides]))
    assert fragment in str(error.value)
