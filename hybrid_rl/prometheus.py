"""The rollout engines' metrics for Prometheus (verl's ``actor_rollout_ref.rollout.prometheus.*``).

With ``prometheus.enable=true`` (and ``rollout.disable_log_stats=false``, without which vLLM
records nothing) each engine's output rank serves vLLM's metrics (``vllm:*``: tokens, requests,
KV-cache use, latencies; labelled with ``served_model_name``) at ``http://<node>:<port>/metrics``.
The driver then writes ``prometheus.file``, a Prometheus configuration that scrapes those
addresses (job ``rollout``) and Ray's own metrics (job ``ray``), on every Ray node, and asks a
Prometheus on each node at ``prometheus.port`` to reload it; one started later reads the file
when it starts (``prometheus --config.file=<file> --web.enable-lifecycle``, as in verl's guide).
"""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request

from hybrid_rl.controller.worker import get_free_port, get_node_ip

logger = logging.getLogger(__name__)

# Where Ray lists the exporters of its own metrics for Prometheus' file-based discovery.
RAY_DISCOVERY_FILE = "/tmp/ray/prom_metrics_service_discovery.json"
SCRAPE_INTERVAL = "10s"


def served_model_name(prometheus_cfg, model_path: str) -> str:
    """The ``model_name`` label of the engine's metrics: the last part of ``served_model_name``
    (verl's default is the model's path), else of the model's folder."""
    name = prometheus_cfg.served_model_name or model_path
    return os.path.basename(str(name).rstrip("/")) or str(name)


def serve_engine_metrics() -> str:
    """Serve this process's Prometheus registry, where vLLM's stat logger records, on all
    interfaces; returns the "host:port" Prometheus scrapes."""
    from prometheus_client import start_http_server

    port = get_free_port()
    start_http_server(port, addr="0.0.0.0")
    return f"{get_node_ip()}:{port}"


def scrape_config(targets: list[str]) -> dict:
    """Prometheus' configuration: the rollout engines' metrics and Ray's."""
    return {"global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": SCRAPE_INTERVAL},
            "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [RAY_DISCOVERY_FILE]}]},
                               {"job_name": "rollout", "static_configs": [{"targets": sorted(targets)}]}]}


def _write_and_reload(config: dict, path: str, port: int) -> str | None:
    """On one node: write the file (atomically: Prometheus may be reading it) and POST the reload;
    returns the Prometheus that reloaded, or None when none answered."""
    import yaml

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(f"{path}.tmp", "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    os.replace(f"{path}.tmp", path)
    url = f"http://{get_node_ip()}:{port}/-/reload"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=10) as reply:
            return url if reply.status == 200 else None
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def publish_targets(prometheus_cfg, targets: list[str]) -> list[str]:
    """Write the scrape configuration for `targets` on every alive Ray node and reload the
    Prometheus there; returns the reload URLs that answered."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    config = scrape_config(targets)
    write = ray.remote(num_cpus=0)(_write_and_reload)
    calls = [write.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
             .remote(config, str(prometheus_cfg.file), int(prometheus_cfg.port))
             for node in ray.nodes() if node["Alive"]]
    reloaded = [url for url in ray.get(calls) if url]
    logger.info("Prometheus: the rollout engines' metrics are at %s; %s lists them on each node.",
                ", ".join(f"http://{target}/metrics" for target in sorted(targets)), prometheus_cfg.file)
    if reloaded:
        logger.info("Prometheus reloaded its configuration: %s", ", ".join(reloaded))
    else:
        logger.warning("No Prometheus answered at port %s on any node; start one with --config.file=%s "
                       "--web.enable-lifecycle to scrape the rollout's metrics.", prometheus_cfg.port,
                       prometheus_cfg.file)
    return reloaded
