"""Metric loggers: console, a JSON Lines file in the run folder, TensorBoard, Weights & Biases, MLflow
and SwanLab.

`trainer.logger` takes verl's names. wandb runs online when a W&B server is reachable and an API key
is configured, otherwise offline into the run folder (upload later with `wandb sync`); `WANDB_MODE`
overrides that choice. SwanLab does the same with `SWANLAB_API_KEY` (or a saved `swanlab login`) and
`SWANLAB_MODE` (`swanlab sync` uploads an offline run). MLflow logs to `MLFLOW_TRACKING_URI` when set,
else to a SQLite store in the run folder (`mlflow ui --backend-store-uri sqlite:///<run folder>/mlflow.db`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import socket
import time
from urllib.parse import urlparse

from tqdm import tqdm

from hybrid_rl.config_keys import leaves

logger = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow", "swanlab")
# verl's other logger names, refused with a pointer to the ones above.
VERL_ONLY_LOGGERS = ("vemlp_wandb", "clearml", "trackio", "file")
# Loggers whose package is an optional extra of hybrid-rl (pip install 'hybrid-rl[<name>]').
OPTIONAL_LOGGERS = ("mlflow", "swanlab")

# Shown on the console line of each step (every metric goes to the files).
CONSOLE_KEYS = (
    "critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm",
    "response_length/mean", "timing_s/step", "perf/throughput",
)


class Tracker:
    def __init__(self, loggers: list[str], run_dir: str, total_steps: int, progress_bar: bool = True,
                 project: str = "hybrid_rl", experiment: str = "run", config: dict | None = None,
                 label: str = "steps"):
        self.loggers = set(loggers)
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self.jsonl = open(os.path.join(run_dir, "metrics.jsonl"), "a") if "jsonl" in self.loggers else None
        self.tb = None
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(run_dir, "tensorboard"))
        self.wandb = _start_wandb(project, experiment, run_dir, config) if "wandb" in self.loggers else None
        self.mlflow = _start_mlflow(project, experiment, run_dir, config) if "mlflow" in self.loggers else None
        self.swanlab = _start_swanlab(project, experiment, run_dir, config) if "swanlab" in self.loggers else None
        self.bar = tqdm(total=total_steps, desc=label, unit="step", dynamic_ncols=True,
                        disable=not progress_bar)

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.jsonl:
            self.jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
            self.jsonl.flush()
        if self.tb:
            for key, value in metrics.items():
                self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.mlflow:
            self.mlflow.log_metrics({mlflow_name(k): v for k, v in metrics.items()}, step=step)
        if self.swanlab:
            self.swanlab.log(metrics, step=step)
        if "console" in self.loggers:
            keys = [k for k in CONSOLE_KEYS if k in metrics] + sorted(k for k in metrics if k.startswith("val"))
            tqdm.write(f"step {step}: " + " | ".join(f"{k}={_fmt(metrics[k])}" for k in keys))

    def advance(self, score: float | None = None) -> None:
        if score is not None:
            self.bar.set_postfix(score=f"{score:.3f}")
        self.bar.update(1)

    def advance_to(self, step: int) -> None:
        """Resume the progress bar at `step` (after loading a checkpoint)."""
        self.bar.update(step - self.bar.n)

    def close(self) -> None:
        self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
        if self.wandb:
            import wandb

            self.wandb.finish()
            # finish() returns before wandb's service process has flushed the run file; teardown waits for it
            # (the atexit hook that would otherwise do so is skipped when Ray or a signal ends the driver).
            wandb.teardown()
        if self.mlflow:
            self.mlflow.end_run()
        if self.swanlab:
            self.swanlab.finish()


def _start_wandb(project: str, experiment: str, run_dir: str, config: dict | None):
    import wandb

    mode = os.environ.get("WANDB_MODE")
    if not mode:
        mode = "online" if _reachable(wandb.Settings().base_url) and wandb.login(prompt=False, verify=False) \
            else "offline"
    run = wandb.init(project=project, name=experiment, dir=run_dir, config=config, mode=mode)
    if run.settings.mode == "offline":
        logger.info("wandb runs offline (no W&B server reachable or no API key; WANDB_MODE=online forces "
                    "it); upload it later with: wandb sync %s", os.path.dirname(run.dir))
    return run


def _start_swanlab(project: str, experiment: str, run_dir: str, config: dict | None):
    import swanlab

    settings = swanlab.Settings()  # the SWANLAB_* environment variables and a saved login
    mode = os.environ.get("SWANLAB_MODE") or ("online" if settings.api_key and _reachable(settings.api_host)
                                              else "offline")
    log_dir = os.environ.get("SWANLAB_LOG_DIR") or os.path.join(run_dir, "swanlog")
    run = swanlab.init(project=project, name=experiment, config=config, log_dir=log_dir, mode=mode)
    if mode == "offline":
        logger.info("swanlab runs offline (no SwanLab server reachable or no SWANLAB_API_KEY; SWANLAB_MODE=online "
                    "forces it); upload it later with: swanlab sync <the run folder under %s>", log_dir)
    return run


def _reachable(url: str, timeout_s: float = 3.0) -> bool:
    parsed = urlparse(url)
    try:
        socket.create_connection((parsed.hostname, parsed.port or (443 if parsed.scheme == "https" else 80)),
                                 timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _start_mlflow(project: str, experiment: str, run_dir: str, config: dict | None):
    import mlflow

    uri = mlflow_tracking_uri(run_dir)
    mlflow.set_experiment(experiment_id=mlflow_experiment(project, run_dir))
    mlflow.start_run(run_name=experiment)
    if config:
        mlflow.log_params({mlflow_name(k): v for k, v in leaves(config).items()})
    logger.info("mlflow logs to %s (experiment %s, run %s)", uri, project, experiment)
    return mlflow


def mlflow_tracking_uri(run_dir: str) -> str:
    """Where MLflow writes (the metrics and the rollout traces): ``MLFLOW_TRACKING_URI``, else a
    SQLite store in the run folder."""
    return os.environ.get("MLFLOW_TRACKING_URI") or _run_folder_store(run_dir)


def _run_folder_store(run_dir: str) -> str:
    return f"sqlite:///{os.path.abspath(run_dir)}/mlflow.db"


def mlflow_experiment(name: str, run_dir: str) -> str:
    """The id of the MLflow experiment ``name`` in the store of ``mlflow_tracking_uri(run_dir)``,
    made the current store; created if missing, in the run folder's own store with its artifacts
    (the traces' spans) in the run folder too, where MLflow would put them in ./mlruns of the
    working directory. The driver and the workers may both create it: the second takes the first's."""
    import mlflow
    from mlflow.exceptions import MlflowException

    uri = mlflow_tracking_uri(run_dir)
    mlflow.set_tracking_uri(uri)
    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    artifacts = os.path.join(os.path.abspath(run_dir), "mlartifacts") if uri == _run_folder_store(run_dir) else None
    try:
        return mlflow.create_experiment(name, artifact_location=artifacts)
    except MlflowException:  # created meanwhile by another process
        return mlflow.get_experiment_by_name(name).experiment_id


def mlflow_name(key: str) -> str:
    """MLflow names allow letters, digits and `_-. :/` only: `val-core/x/acc/mean@4` -> `..._at_4`."""
    return re.sub(r"[^\w\-. :/]", "_", key.replace("@", "_at_"))


def _fmt(value: float) -> str:
    if isinstance(value, float) and (abs(value) >= 1e4 or (value != 0 and abs(value) < 1e-3)) and math.isfinite(value):
        return f"{value:.3e}"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
