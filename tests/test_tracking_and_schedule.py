"""Loggers write what they promise; the learning-rate schedule follows its formula."""

from __future__ import annotations

import json
import math

import pytest
from omegaconf import OmegaConf

from hybrid_rl.tracking import Tracker
from hybrid_rl.engines.base import lr_lambda


def test_jsonl_tensorboard_and_console(tmp_path, capsys):
    tracker = Tracker(["console", "jsonl", "tensorboard"], str(tmp_path), total_steps=2, progress_bar=False)
    tracker.log({"critic/score/mean": 0.25, "actor/pg_loss": -0.5, "val/score/mean": 0.75}, step=1)
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.close()
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["actor/pg_loss"] == -0.5
    out = capsys.readouterr().out
    assert "step 1:" in out and "critic/score/mean=0.2500" in out and "val/score/mean=0.7500" in out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 0.25), (2, 0.5)]


def test_wandb_offline_run_in_the_run_folder(tmp_path, monkeypatch):
    """With no API key, wandb writes an offline run under the run folder that `wandb sync` can upload."""
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no_netrc"))
    tracker = Tracker(["wandb"], str(tmp_path), total_steps=2, progress_bar=False, project="p", experiment="e",
                      config={"trainer": {"project_name": "p"}})
    assert tracker.wandb.settings.mode == "offline"
    tracker.log({"critic/score/mean": 0.25, "val-core/arith/acc/mean@1": 0.5}, step=1)
    tracker.close()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    records = run_file.read_bytes()
    assert b"critic/score/mean" in records and b"val-core/arith/acc/mean@1" in records


def test_mlflow_logs_to_a_store_in_the_run_folder(tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_TRACKING_URI", "")  # recorded, so that teardown unsets what mlflow sets
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    tracker = Tracker(["mlflow"], str(tmp_path), total_steps=2, progress_bar=False, project="p", experiment="e",
                      config={"actor_rollout_ref": {"actor": {"ppo_epochs": 1}}})
    run_id = mlflow.active_run().info.run_id
    tracker.log({"critic/score/mean": 0.25, "val-core/arith/acc/mean@1": 0.5}, step=1)
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.close()
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    run = client.get_run(run_id)
    assert run.data.params == {"actor_rollout_ref.actor.ppo_epochs": "1"} and run.info.run_name == "e"
    history = client.get_metric_history(run_id, "critic/score/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.25), (2, 0.5)]
    assert run.data.metrics["val-core/arith/acc/mean_at_1"] == 0.5


def test_swanlab_offline_run_in_the_run_folder(tmp_path, monkeypatch):
    """verl's swanlab logger: with no API key, an offline run under the run folder that
    `swanlab sync` can upload, holding each metric at its step."""
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    for name in ("SWANLAB_MODE", "SWANLAB_API_KEY", "SWANLAB_LOG_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SWANLAB_ROOT", str(tmp_path / "no_login"))  # no saved `swanlab login`
    tracker = Tracker(["swanlab"], str(tmp_path), total_steps=2, progress_bar=False, project="p", experiment="e",
                      config={"trainer": {"project_name": "p"}})
    tracker.log({"critic/score/mean": 0.25, "val-core/arith/acc/mean@1": 0.5}, step=1)
    tracker.log({"critic/score/mean": 0.5}, step=2)
    tracker.close()
    (run_file,) = (tmp_path / "swanlog").glob("run-*/run-*.swanlab")
    reader, scalars = DataStoreReader(), []
    reader.open(run_file)
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        if record.HasField("scalar"):
            scalars.append((record.scalar.key, record.scalar.step, record.scalar.value.number))
    reader.close()
    assert scalars == [("critic/score/mean", 1, 0.25), ("val-core/arith/acc/mean@1", 1, 0.5),
                       ("critic/score/mean", 2, 0.5)]


def optim(**kw):
    base = dict(lr=1.0, lr_warmup_steps=-1, lr_warmup_steps_ratio=0.0, lr_scheduler_type="constant",
                min_lr_ratio=0.0, num_cycles=0.5)
    return OmegaConf.create({**base, **kw})


def test_constant_with_warmup_steps():
    """verl's count: the first update is step 0, at lr 0 in a warmup."""
    f = lr_lambda(optim(lr_warmup_steps=4), total_steps=10)
    assert [f(s) for s in range(6)] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    # zero_indexed_step shifts only verl's cosine schedule, not its constant one.
    assert lr_lambda(optim(lr_warmup_steps=4, zero_indexed_step=False), total_steps=10)(0) == 0.0


@pytest.mark.parametrize("zero_indexed", [True, False])
def test_warmup_ratio_then_cosine_to_min(zero_indexed):
    total, warmup, floor = 20, 5, 0.1
    f = lr_lambda(optim(lr_warmup_steps_ratio=0.25, lr_scheduler_type="cosine", min_lr_ratio=floor,
                        zero_indexed_step=zero_indexed), total)
    for update in range(total):
        count = update if zero_indexed else update + 1  # torchtitan's count starts at 1
        if count < warmup:
            expected = count / warmup
        else:
            progress = (count - warmup) / (total - warmup)
            expected = floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        assert f(update) == pytest.approx(expected), update
    assert f(total - (0 if zero_indexed else 1)) == pytest.approx(floor)


def test_warmup_style_is_the_older_name_of_lr_scheduler_type():
    from hybrid_rl.config import ConfigError, validate_config
    from hybrid_rl.config_keys import compose_config

    key = "actor_rollout_ref.actor.optim"
    cfg = compose_config([f"{key}.warmup_style=cosine"])
    validate_config(cfg)
    assert cfg.actor_rollout_ref.actor.optim.lr_scheduler_type == "cosine"
    with pytest.raises(ConfigError, match="warmup_style=constant and lr_scheduler_type=cosine are the same setting"):
        validate_config(compose_config([f"{key}.warmup_style=constant", f"{key}.lr_scheduler_type=cosine"]))
    with pytest.raises(ConfigError, match="warmup_style"):
        validate_config(compose_config([f"{key}.warmup_style=linear"]))
