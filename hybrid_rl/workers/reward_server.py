"""The served reward model of verl 0.9 (``reward.reward_model.*``): the reward model runs in vLLM's
OpenAI-compatible server, and a custom reward function calls it. verl's generative reward models
(an LLM that judges a response and writes its verdict, e.g. FAPO's GenRM) work this way: the
function gets ``reward_router_address`` ("host:port"; it POSTs to ``/v1/chat/completions``) and
``reward_model_tokenizer``, writes the judge's prompt, and parses the reply into a score.

The server is a child process of a Ray actor, so Ray places it: on GPU it needs GPUs of its own
(``reward.reward_model.enable_resource_pool``, ``n_gpus_per_node`` on one node: tensor x data
parallel replicas inside the one server), as colocation would need vLLM's sleep mode between
scorings; on CPU it runs beside the workers. Its log goes to ``<trainer.default_local_dir>/reward_server.log``.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from omegaconf import DictConfig, OmegaConf

from hybrid_rl.controller.worker import get_free_port, get_node_ip

START_TIMEOUT_S = 900  # a large model on CPU loads and warms up for minutes
SERVED_KWARGS = ("reward_router_address", "reward_model_tokenizer")


def served_reward_model(cfg: DictConfig) -> DictConfig | None:
    """``reward.reward_model`` when it is enabled, else None."""
    rm = OmegaConf.select(cfg, "reward.reward_model")
    return rm if rm is not None and rm.enable else None


def server_command(rm: DictConfig, model_path: str, port: int, device: str, seed: int) -> list[str]:
    """The vLLM server's command line from ``reward.reward_model.rollout`` (verl's keys)."""
    from hybrid_rl.workers.rollout import quantized

    rollout = rm.rollout
    tp, dp = int(rollout.tensor_model_parallel_size), int(rollout.data_parallel_size)
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path,
            # Requests may name the model as the config does or by its resolved folder.
            "--served-model-name", *dict.fromkeys([str(rm.model_path), model_path]),
            "--host", "0.0.0.0", "--port", str(port), "--dtype", str(rollout.dtype),
            "--tensor-parallel-size", str(tp), "--data-parallel-size", str(dp),
            "--max-num-seqs", str(rollout.max_num_seqs), "--seed", str(seed),
            "--uvicorn-log-level", "warning"]
    if rollout.max_model_len:
        args += ["--max-model-len", str(rollout.max_model_len)]
    if rollout.max_num_batched_tokens:
        args += ["--max-num-batched-tokens", str(rollout.max_num_batched_tokens)]
    args.append("--enforce-eager" if rollout.enforce_eager else "--no-enforce-eager")
    args.append("--enable-prefix-caching" if rollout.enable_prefix_caching else "--no-enable-prefix-caching")
    args.append("--enable-chunked-prefill" if rollout.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if device == "cuda":
        args += ["--gpu-memory-utilization", str(rollout.gpu_memory_utilization)]
    vllm_kwargs = rollout.engine_kwargs.get("vllm")
    for key, value in {**(OmegaConf.to_container(vllm_kwargs) if vllm_kwargs else {}),
                       **quantized(rollout, {})}.items():
        flag = "--" + str(key).replace("_", "-")
        args += [flag] if value is True else [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return args


def server_env(cfg: DictConfig) -> dict[str, str]:
    """What the server's processes read from the environment, beside the worker's own."""
    env = {"TOKENIZERS_PARALLELISM": "false", "VLLM_USE_AOT_COMPILE": "0"}
    if cfg.reward.reward_model.rollout.get("full_determinism", False):  # verl's switch, as for the policy's engine
        env["VLLM_BATCH_INVARIANT"] = "1"
    if cfg.trainer.device != "cuda":
        # vLLM-CPU would reserve a fraction of all RAM; it gets the policy engine's cache size.
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.actor_rollout_ref.rollout.kv_cache_gib)
    return env


def cpu_thread_binding(workers: int, cpus: list[int]) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for a CPU server of `workers` worker processes (data x tensor
    parallel, in vLLM's rank order) on `cpus`: an equal share of them each, or no binding where
    there are fewer cores than workers. vLLM's own `auto` gives each worker a NUMA node of its own
    and refuses to start more workers than the machine has nodes (one, on most machines)."""
    if len(cpus) < workers:
        return "nobind"
    share = len(cpus) // workers
    return "|".join(",".join(map(str, cpus[rank * share:(rank + 1) * share])) for rank in range(workers))


# Another process can take the picked port before the server binds it; the server is then
# started again on a new port, this many times in all.
PORT_ATTEMPTS = 3


class ServerProcess:
    """Runs as a Ray actor: starts the server, answers with its address once it serves, stops it."""

    def __init__(self, model_path: str, rm_cfg: dict, device: str, seed: int, log_path: str, env: dict[str, str]):
        self.log_path = log_path
        os.makedirs(os.path.dirname(log_path) or ".", exist_ok=True)
        self._command = functools.partial(server_command, OmegaConf.create(rm_cfg), model_path, device=device,
                                          seed=seed)
        self._env = {**os.environ, **env}
        workers = int(rm_cfg["rollout"]["tensor_model_parallel_size"]) * int(rm_cfg["rollout"]["data_parallel_size"])
        if device != "cuda" and workers > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in self._env:
            self._env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(workers, sorted(os.sched_getaffinity(0)))
        self._launch()

    def _launch(self) -> None:
        self.port = get_free_port()
        self.address = f"{get_node_ip()}:{self.port}"
        with open(self.log_path, "ab") as log:
            self._log_start = log.tell()
            self.process = subprocess.Popen(self._command(port=self.port), stdout=log,
                                            stderr=subprocess.STDOUT, env=self._env, start_new_session=True)

    def _lost_port_race(self) -> bool:
        with open(self.log_path, "rb") as f:
            f.seek(self._log_start)
            return b"Address already in use" in f.read()

    def wait_ready(self, timeout_s: float) -> str:
        """The server's "host:port" once /health answers; raises with the log's end if it exits or
        does not answer in time."""
        deadline = time.monotonic() + timeout_s
        attempts = 1
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if attempts < PORT_ATTEMPTS and self._lost_port_race():
                    attempts += 1
                    self._launch()
                    continue
                raise RuntimeError(f"the reward model's vLLM server exited with code {self.process.returncode} "
                                   f"while starting; the end of {self.log_path}:\n{self._log_tail()}")
            url = f"http://127.0.0.1:{self.port}/health"
            try:
                with urllib.request.urlopen(url, timeout=5) as reply:
                    if reply.status == 200:
                        return self.address
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the reward model's vLLM server did not answer at http://127.0.0.1:{self.port}/health "
                           f"within {timeout_s:g} s; the end of {self.log_path}:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@dataclass
class RewardServer:
    """The running server: its actor, its address and the reward model's tokenizer, which reward
    functions get as ``reward_router_address`` and ``reward_model_tokenizer``."""

    actor: object
    address: str
    tokenizer: object

    @classmethod
    def start(cls, cfg: DictConfig, model_path: str) -> RewardServer:
        import ray
        from transformers import AutoTokenizer

        rm = cfg.reward.reward_model
        device = cfg.trainer.device
        options: dict = {"num_cpus": 0}
        if device == "cuda":
            options["num_gpus"] = int(rm.n_gpus_per_node) * int(rm.nnodes)
        env = server_env(cfg)
        log_path = os.path.join(os.path.abspath(cfg.trainer.default_local_dir), "reward_server.log")
        actor = ray.remote(ServerProcess).options(**options).remote(
            model_path, OmegaConf.to_container(rm, resolve=True), device, int(rm.rollout.seed), log_path, env)
        try:
            address = ray.get(actor.wait_ready.remote(START_TIMEOUT_S))
        except Exception:
            ray.get(actor.stop.remote())
            ray.kill(actor)
            raise
        return cls(actor, address, AutoTokenizer.from_pretrained(model_path))

    def call_kwargs(self) -> dict:
        return {"reward_router_address": self.address, "reward_model_tokenizer": self.tokenizer}

    def stop(self) -> None:
        import ray

        ray.get(self.actor.stop.remote())
        ray.kill(self.actor)
