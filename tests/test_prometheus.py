"""verl's rollout.prometheus.*: the engines serve vLLM's metrics, and the driver writes the
Prometheus configuration that scrapes them and reloads Prometheus."""

from __future__ import annotations

import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import yaml

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.controller.worker import get_free_port, get_node_ip
from hybrid_rl.prometheus import RAY_DISCOVERY_FILE, publish_targets, served_model_name
from tests.conftest import run_overrides

ON = ["actor_rollout_ref.rollout.prometheus.enable=true", "actor_rollout_ref.rollout.disable_log_stats=false"]


@pytest.mark.parametrize("overrides, message", [
    (ON[:1], "disable_log_stats=false"),
    (ON + ["actor_rollout_ref.rollout.name=hf"], "rollout.name=vllm"),
    (ON + ["actor_rollout_ref.rollout.prometheus.port=0"], "prometheus.port=0"),
    (ON + ["actor_rollout_ref.rollout.prometheus.file=null"], "prometheus.file"),
])
def test_prometheus_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate_config(compose_config(overrides))


def test_the_metrics_are_labelled_with_the_last_part_of_the_served_name():
    cfg = compose_config(ON)
    assert served_model_name(cfg.actor_rollout_ref.rollout.prometheus, "/models/SmolLM2-135M/") == "SmolLM2-135M"
    cfg = compose_config(ON + ["actor_rollout_ref.rollout.prometheus.served_model_name=org/Qwen3-235B"])
    assert served_model_name(cfg.actor_rollout_ref.rollout.prometheus, "/models/x") == "Qwen3-235B"


class Reloads(BaseHTTPRequestHandler):
    """Prometheus' lifecycle endpoint, recording the reloads it is asked for."""

    seen: list[str] = []

    def do_POST(self):
        Reloads.seen.append(self.path)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_the_targets_are_written_on_every_node_and_prometheus_reloads(ray_session, tmp_path):
    server = HTTPServer(("0.0.0.0", get_free_port()), Reloads)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    path = tmp_path / "prometheus" / "prometheus.yml"
    cfg = compose_config(ON + [f"actor_rollout_ref.rollout.prometheus.file={path}",
                               f"actor_rollout_ref.rollout.prometheus.port={server.server_port}"])
    try:
        reloaded = publish_targets(cfg.actor_rollout_ref.rollout.prometheus, ["10.0.0.2:8001", "10.0.0.1:8000"])
    finally:
        server.shutdown()
    assert reloaded == [f"http://{get_node_ip()}:{server.server_port}/-/reload"] and Reloads.seen == ["/-/reload"]
    written = yaml.safe_load(path.read_text())
    jobs = {job["job_name"]: job for job in written["scrape_configs"]}
    assert jobs["rollout"]["static_configs"] == [{"targets": ["10.0.0.1:8000", "10.0.0.2:8001"]}]
    assert jobs["ray"]["file_sd_configs"] == [{"files": [RAY_DISCOVERY_FILE]}]
    # No Prometheus listening: the file is still written, nothing is reloaded.
    assert publish_targets(cfg.actor_rollout_ref.rollout.prometheus, ["10.0.0.3:8002"]) == []
    assert "10.0.0.3:8002" in path.read_text()


def scraped(target: str) -> dict[str, float]:
    """`name{labels}` -> value of a /metrics page."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line and line[0] != "#"}


@pytest.mark.slow
@pytest.mark.parametrize("layout, per_engine", [
    (["trainer.n_gpus_per_node=2"], [4, 4]),  # colocated: each rank's engine generates half the rows
    # a rollout pool of its own (one rank beside the trainer's): its engine generates them all
    (["actor_rollout_ref.hybrid_engine=false", "trainer.cpus_per_worker=1", "rollout.n_gpus_per_node=1"], [8]),
], ids=["colocated", "rollout_pool"])
def test_each_engine_serves_vllms_metrics_of_the_step(ray_session, tmp_path, tiny_model_dir, arithmetic_files, layout,
                                                      per_engine):
    """One step through the driver: every engine serves vLLM's counters at the address the
    written configuration lists, and they count the step's requests and tokens."""
    from hybrid_rl.main import build_trainer

    path = tmp_path / "prometheus.yml"
    cfg = compose_config(run_overrides(tiny_model_dir, arithmetic_files, tmp_path / "run") + ON + [
        f"actor_rollout_ref.rollout.prometheus.file={path}", "actor_rollout_ref.rollout.prometheus.served_model_name=tiny",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=1", "data.val_files=null", "trainer.final_model_dir=null", *layout])
    trainer = build_trainer(cfg)
    try:
        trainer.fit()
        targets = yaml.safe_load(path.read_text())["scrape_configs"][1]["static_configs"][0]["targets"]
        pages = [scraped(target) for target in targets]
    finally:
        trainer.shutdown()
    assert len(set(targets)) == len(per_engine)  # one engine per rank (rollout tensor parallel 1)

    def counts(name: str) -> list[float]:
        return [sum(value for key, value in page.items() if key.startswith(name + "{") and 'model_name="tiny"' in key)
                for page in pages]

    step = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")][-1]
    assert counts("vllm:request_success_total") == per_engine  # 4 prompts x 2 responses
    assert sum(counts("vllm:generation_tokens_total")) == pytest.approx(8 * step["response_length/mean"])
