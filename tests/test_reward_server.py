"""The served reward model (reward.reward_model.*, verl 0.9's keys): vLLM's OpenAI-compatible server
for a generative judge that a custom reward function calls, as verl's GenRM functions do."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from hybrid_rl.config_keys import compose_config
from tests.conftest import run_overrides
from tests.test_rollout_quantization import write_int8_config

# A verl-style generative-reward-model function: async, takes reward_router_address and
# reward_model_tokenizer, posts a chat completion and scores the judge's reply. It logs what it
# sent and got, and how many of its requests were in flight at once.
JUDGE = '''
import json

import aiohttp

IN_FLIGHT = {"now": 0, "max": 0}


async def judge(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                reward_model_tokenizer, log_path):
    messages = [{"role": "user", "content": f"Is {solution_str!r} the answer {ground_truth}?"}]
    request = {"messages": messages, "temperature": 0, "max_tokens": 4, "ignore_eos": True}
    IN_FLIGHT["now"] += 1
    IN_FLIGHT["max"] = max(IN_FLIGHT["max"], IN_FLIGHT["now"])
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(f"http://{reward_router_address}/v1/chat/completions", json=request) as reply:
                body = await reply.json()
    finally:
        IN_FLIGHT["now"] -= 1
    text = body["choices"][0]["message"]["content"]
    with open(log_path, "a") as log:
        log.write(json.dumps({"messages": messages, "reply": text, "in_flight": IN_FLIGHT["max"],
                              "vocab": len(reward_model_tokenizer)}) + "\\n")
    return {"score": float(len(reward_model_tokenizer.encode(text, add_special_tokens=False)))}
'''


def served_overrides(judge_file, log_path, model_dir) -> list[str]:
    return ["reward.reward_model.enable=true", f"reward.reward_model.model_path={model_dir}",
            "reward.reward_model.rollout.dtype=float32", "reward.reward_model.rollout.max_model_len=256",
            f"custom_reward_function.path={judge_file}", "custom_reward_function.name=judge",
            f"+custom_reward_function.reward_kwargs.log_path={log_path}"]


def test_server_command_carries_verls_keys():
    from hybrid_rl.config import validate_config
    from hybrid_rl.workers.reward_server import server_command

    cfg = validate_config(compose_config([
        "reward.reward_model.enable=true", "reward.reward_model.model_path=/models/judge",
        "reward.reward_model.rollout.dtype=float32", "reward.reward_model.rollout.max_model_len=512",
        "reward.reward_model.rollout.enforce_eager=false", "+reward.reward_model.rollout.engine_kwargs.vllm.swap_space=2"]))
    command = server_command(cfg.reward.reward_model, "/abs/models/judge", 8123, "cpu", 7)
    text = " ".join(command)
    for part in ["vllm.entrypoints.openai.api_server --model /abs/models/judge",
                 "--served-model-name /models/judge /abs/models/judge", "--port 8123", "--dtype float32",
                 "--tensor-parallel-size 1", "--max-model-len 512", "--seed 7", "--no-enforce-eager", "--swap-space 2"]:
        assert part in text, (part, text)
    assert "--gpu-memory-utilization" not in text  # on CPU the KV cache is kv_cache_gib


QUANTIZED = ["reward.reward_model.rollout.quantization=torchao"]


def test_a_quantized_server_gets_vllms_torchao_flags_and_bad_settings_stop_at_start(tmp_path):
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.workers.reward_server import server_command

    served = ["reward.reward_model.enable=true", "reward.reward_model.model_path=/models/judge", *QUANTIZED]
    config_file = str(write_int8_config(tmp_path))
    cfg = validate_config(compose_config(served + [f"reward.reward_model.rollout.quantization_config_file={config_file}"]))
    command = server_command(cfg.reward.reward_model, "/abs/models/judge", 8123, "cpu", 7)
    flags = {command[i]: command[i + 1] for i in range(len(command) - 1) if command[i].startswith("--")}
    assert flags["--quantization"] == "torchao"
    assert json.loads(flags["--hf-overrides"]) == {"quantization_config_file": config_file}
    for extra, message in [([], "quantization_config_file, which is not set"),
                           (["reward.reward_model.rollout.quantization=fp8"], "quantization=fp8 is not supported yet"),
                           ([f"reward.reward_model.rollout.quantization_config_file={config_file}",
                             "+reward.reward_model.rollout.engine_kwargs.vllm.quantization=fp8"],
                            "reward.reward_model.rollout.engine_kwargs.vllm sets too")]:
        with pytest.raises(ConfigError, match=message):
            validate_config(compose_config(served + extra))


@pytest.mark.slow
def test_a_quantized_server_loads_the_judge_through_torchao_and_answers(tmp_path, tiny_model_dir):
    """rollout.quantization=torchao for the served reward model: vLLM's server quantizes the
    judge's linear layers with the config file's int8 weight-only scheme as it loads them, and
    answers chat completions."""
    from hybrid_rl.config import validate_config
    from hybrid_rl.workers.reward_server import ServerProcess, server_env

    cfg = validate_config(compose_config(served_overrides(tmp_path / "judge.py", tmp_path / "log.jsonl", tiny_model_dir)
                                         + QUANTIZED + [f"reward.reward_model.rollout.quantization_config_file="
                                                        f"{write_int8_config(tmp_path)}"]))
    rm = OmegaConf.to_container(cfg.reward.reward_model)
    log = tmp_path / "server.log"
    # The engine's start-up line is INFO (a trainer run earlier in this process may have set ERROR).
    server = ServerProcess(tiny_model_dir, rm, "cpu", 0, str(log), {**server_env(cfg), "VLLM_LOGGING_LEVEL": "INFO"})
    try:
        server.wait_ready(timeout_s=600)
        body = chat(server.port, tiny_model_dir, [{"role": "user", "content": "Is 2 + 2 = 4?"}])
    finally:
        server.stop()
    assert body["usage"]["completion_tokens"] == 4
    assert "quantization=torchao" in log.read_text()


@pytest.mark.parametrize("workers, cpus, expected", [
    (2, [0, 1], "0|1"), (2, [4, 5, 6, 7], "4,5|6,7"), (3, list(range(7)), "0,1|2,3|4,5"), (4, [0, 1], "nobind")])
def test_a_cpu_servers_workers_share_the_cores(workers, cpus, expected):
    from hybrid_rl.workers.reward_server import cpu_thread_binding

    assert cpu_thread_binding(workers, cpus) == expected


def greedy_replies(model_dir: str, chats: list[list]) -> list[str]:
    """transformers' greedy decoding of 4 tokens after each chat (messages), float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    replies = []
    for messages in chats:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                            return_dict=True)["input_ids"]
        out = model.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False)
        replies.append(tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    return replies


def chat(port: int, model: str, messages: list) -> dict:
    """The server's answer to a greedy chat completion of 4 tokens."""
    import urllib.request

    request = {"model": model, "messages": messages, "temperature": 0, "max_tokens": 4, "ignore_eos": True}
    with urllib.request.urlopen(urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions", data=json.dumps(request).encode(),
            headers={"Content-Type": "application/json"}), timeout=120) as reply:
        return json.load(reply)


@pytest.mark.slow
def test_a_server_of_two_cpu_workers_answers_as_transformers(tmp_path, tiny_model_dir):
    """Tensor parallel size 2 on a one-NUMA-node CPU (where vLLM's own thread binding refuses a
    second worker): each worker gets its share of the cores, and the judge's greedy reply is
    transformers' greedy decoding of the same chat. (Data parallel workers are bound the same
    way.)"""
    from hybrid_rl.config import validate_config
    from hybrid_rl.workers.reward_server import ServerProcess, server_env

    cfg = validate_config(compose_config(served_overrides(tmp_path / "judge.py", tmp_path / "log.jsonl", tiny_model_dir)
                                         + ["reward.reward_model.rollout.tensor_model_parallel_size=2"]))
    messages = [{"role": "user", "content": "Is 2 + 2 = 4?"}]
    log = tmp_path / "server.log"
    server = ServerProcess(tiny_model_dir, OmegaConf.to_container(cfg.reward.reward_model), "cpu", 0, str(log),
                           server_env(cfg))
    try:
        server.wait_ready(timeout_s=600)
        reply = chat(server.port, tiny_model_dir, messages)["choices"][0]["message"]["content"]
    finally:
        server.stop()
    assert [reply] == greedy_replies(tiny_model_dir, [messages])


def test_full_determinism_asks_the_server_for_batch_invariant_kernels_and_is_refused_on_cpu():
    """verl's reward.reward_model.rollout.full_determinism: VLLM_BATCH_INVARIANT=1 in the server's
    environment, as for the policy's engine; vLLM-CPU has no such kernels, so CPU runs refuse it."""
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.workers.reward_server import server_env

    served = ["reward.reward_model.enable=true", "reward.reward_model.model_path=/models/judge"]
    on = compose_config([*served, "reward.reward_model.rollout.full_determinism=true", "trainer.device=cuda"])
    assert server_env(on)["VLLM_BATCH_INVARIANT"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in server_env(on)
    off = compose_config(served)
    assert "VLLM_BATCH_INVARIANT" not in server_env(off) and "VLLM_CPU_KVCACHE_SPACE" in server_env(off)
    with pytest.raises(ConfigError, match=r"reward\.reward_model\.rollout\.full_determinism=true asks for"):
        validate_config(compose_config([*served, "reward.reward_model.rollout.full_determinism=true",
                                        "trainer.device=cpu"]))


def test_served_reward_model_configs_are_checked(tmp_path, tiny_model_dir, arithmetic_files):
    from hybrid_rl.main import SetupError, checked_trainer

    judge = tmp_path / "judge.py"
    judge.write_text(JUDGE)
    base = run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run")
    served = served_overrides(judge, tmp_path / "log.jsonl", tiny_model_dir)
    for extra, message in [
        (served[:2], "no function is set"),
        (served + ["reward.reward_model.rollout.name=sglang"], "rollout.name=vllm"),
        (served + ["reward_model.enable=true", f"reward_model.model.path={tiny_model_dir}"], "keep one"),
        (served + ["reward.reward_model.rollout.pipeline_model_parallel_size=2"], "not supported yet"),
        # A judge function without the server names the keys that start one.
        (served[2:], "reward.reward_model.enable=true"),
    ]:
        with pytest.raises(SetupError, match=message):
            checked_trainer(compose_config(base + extra))
    # verl 0.7-0.8 wrote it under the legacy keys, with a function that takes reward_router_address.
    legacy = [f"custom_reward_function.path={judge}", "custom_reward_function.name=judge",
              f"+custom_reward_function.reward_kwargs.log_path={tmp_path / 'log.jsonl'}", "reward_model.enable=true",
              f"reward_model.model.path={tiny_model_dir}", "reward_model.rollout.name=vllm",
              "reward_model.rollout.max_model_len=256", "reward_model.rollout.tensor_model_parallel_size=1"]
    cfg = checked_trainer(compose_config(base + legacy)).cfg
    assert not cfg.reward_model.enable and cfg.reward.reward_model.enable
    assert cfg.reward.reward_model.model_path == tiny_model_dir and cfg.reward.reward_model.rollout.max_model_len == 256
    with pytest.raises(SetupError, match="expert_parallel_size=2 is not supported yet"):
        checked_trainer(compose_config(base + legacy + ["reward_model.rollout.expert_parallel_size=2"]))


@pytest.mark.slow
def test_a_generative_judge_scores_every_sample_through_the_server(ray_session, tmp_path, tiny_model_dir,
                                                                  arithmetic_files):
    """One step of the tiny policy judged by the tiny model served in vLLM: every sample is scored
    through the server, all of a batch's requests are in flight together, and the judge's replies
    are what transformers' greedy decoding of the same chat gives."""
    from transformers import AutoTokenizer

    from hybrid_rl.main import build_trainer

    judge, log_path = tmp_path / "judge.py", tmp_path / "judge.jsonl"
    judge.write_text(JUDGE)
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run") + served_overrides(
        judge, log_path, tiny_model_dir) + [
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1", "data.val_files=null", "trainer.final_model_dir=null"])
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        address = trainer.reward_server.address
    finally:
        trainer.shutdown()
    calls = [json.loads(line) for line in open(log_path)]
    assert len(calls) == 8  # 4 prompts x 2 responses
    assert max(call["in_flight"] for call in calls) == 8
    step = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert step["reward/failed_samples"] == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert all(call["vocab"] == len(tokenizer) for call in calls)
    assert greedy_replies(tiny_model_dir, [call["messages"] for call in calls[:3]]) == [
        call["reply"] for call in calls[:3]]
    # The server is gone with the trainer.
    import urllib.error
    import urllib.request

    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://{address}/health", timeout=5)


# A stand-in for the server's command line: an HTTP server on the given port whose /health answers 200,
# failing as vLLM's does when the port is taken.
HEALTH_SERVER = '''
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
'''


def test_a_server_that_loses_its_port_to_another_process_starts_again_on_another(tmp_path, monkeypatch):
    """The port is picked before the server binds it; when another process takes it meanwhile, the
    server exits with EADDRINUSE and is started again on a new port instead of failing the run."""
    import socket
    import sys

    from hybrid_rl.controller.worker import get_free_port
    from hybrid_rl.workers import reward_server

    script = tmp_path / "health.py"
    script.write_text(HEALTH_SERVER)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    taken_port = taken.getsockname()[1]
    picks = iter([taken_port, get_free_port()])
    monkeypatch.setattr(reward_server, "get_free_port", lambda: next(picks))
    monkeypatch.setattr(reward_server, "server_command",
                        lambda rm, model, port, device, seed: [sys.executable, str(script), str(port)])
    log = tmp_path / "server.log"
    one_process = {"rollout": {"tensor_model_parallel_size": 1, "data_parallel_size": 1}}
    server = reward_server.ServerProcess("model", one_process, "cpu", 0, str(log), {})
    try:
        address = server.wait_ready(timeout_s=60)
    finally:
        server.stop()
        taken.close()
    assert server.port != taken_port and address.endswith(f":{server.port}")
    assert "Address already in use" in log.read_text()
