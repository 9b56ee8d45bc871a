"""Profiling with torch.profiler (hybrid_rl/profiler.py): windows over steps, ranges per worker
method, one profiler per process shared by colocated roles, and verl's keys checked at start."""

from __future__ import annotations

import gzip
import json

import pytest
import torch

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.controller import Dispatch, register
from hybrid_rl.profiler import ProcessProfiler, ProfileSettings, StepWindows, role_settings


def trace_names(path) -> set[str]:
    with gzip.open(path, "rt") as f:
        return {event.get("name") for event in json.load(f)["traceEvents"]}


class Worker:
    """Stands in for a worker role: registered methods that multiply matrices, one calling another."""

    def __init__(self, profiler: ProcessProfiler):
        self.profiler = profiler

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def update_actor(self):
        return torch.randn(64, 64) @ torch.randn(64, 64)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def generate_sequences(self):
        return self.update_actor() + 1  # a nested call stays a range of the outer call's trace


@pytest.fixture
def profiler(monkeypatch):
    """A fresh process profiler in place of the module's one (which registered methods use)."""
    fresh = ProcessProfiler()
    monkeypatch.setattr("hybrid_rl.profiler.PROCESS_PROFILER", fresh)
    return fresh


def settings(tmp_path, ranks=(0,), discrete=False, contents=()):
    return ProfileSettings(ranks=frozenset(ranks), contents=frozenset(contents), discrete=discrete,
                           save_path=str(tmp_path))


def test_a_window_traces_the_registered_calls(profiler, tmp_path):
    worker = Worker(profiler)
    worker.update_actor()  # not profiled: nothing written
    profiler.start("actor_rollout_ref", settings(tmp_path), rank=0, step=3)
    worker.generate_sequences()
    worker.update_actor()
    profiler.stop("actor_rollout_ref", step=3)
    worker.update_actor()
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    assert files == ["actor_rollout_ref_rank0.json.gz", "actor_rollout_ref_rank0.txt"]
    names = trace_names(tmp_path / "step3" / "actor_rollout_ref_rank0.json.gz")
    assert {"generate_sequences", "update_actor", "aten::mm"} <= names
    table = (tmp_path / "step3" / "actor_rollout_ref_rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table


def test_discrete_mode_writes_one_trace_per_call(profiler, tmp_path):
    worker = Worker(profiler)
    profiler.start("critic", settings(tmp_path, discrete=True, contents=("cpu", "shapes")), rank=0, step=1)
    worker.update_actor()
    worker.update_actor()
    worker.generate_sequences()
    profiler.stop("critic", step=1)
    traces = sorted(p.name for p in (tmp_path / "step1").glob("*.json.gz"))
    assert traces == ["critic_rank0_generate_sequences.json.gz", "critic_rank0_update_actor.json.gz",
                      "critic_rank0_update_actor_2.json.gz"]
    assert "update_actor" in trace_names(tmp_path / "step1" / "critic_rank0_generate_sequences.json.gz")


def test_colocated_roles_share_the_process_profiler(profiler, tmp_path):
    worker = Worker(profiler)
    profiler.start("actor_rollout_ref", settings(tmp_path), rank=1, step=4)  # rank 1 is not listed
    profiler.start("critic", settings(tmp_path, ranks=(1,)), rank=1, step=4)
    profiler.start("reward_model", settings(tmp_path, ranks=(1,)), rank=1, step=4)
    worker.update_actor()
    profiler.stop("actor_rollout_ref", step=4)  # never started here: changes nothing
    profiler.stop("critic", step=5)
    assert not list(tmp_path.rglob("*.json.gz"))  # the reward model's role still has it open
    profiler.stop("reward_model", step=5)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.json.gz")) == [
        "steps4-5/critic+reward_model_rank1.json.gz"]


def test_the_finish_hook_runs_once_after_the_traces_on_the_chosen_ranks(profiler, tmp_path):
    """verl's finish_hook_cmd: run by the shell with VERL_PROFILE_* set, once per process after the
    last window's traces are written, on finish_hook_ranks (else the profiled ranks)."""
    log = tmp_path / "hook.log"
    command = (f'ls "$VERL_PROFILE_SAVE_PATH"/step2 | wc -l >> {log}; '
               f'echo "$VERL_PROFILE_TOOL $VERL_PROFILE_RANK $VERL_PROFILE_ROLE" >> {log}')
    hooked = ProfileSettings(ranks=frozenset({0}), contents=frozenset(), discrete=False, save_path=str(tmp_path),
                             finish_hook_cmd=command, finish_hook_ranks=frozenset({0, 1}))
    worker = Worker(profiler)
    profiler.start("actor_rollout_ref", hooked, rank=0, step=2)
    profiler.start("critic", hooked, rank=0, step=2)
    worker.update_actor()
    profiler.stop("actor_rollout_ref", step=2)
    profiler.finish("actor_rollout_ref", hooked, rank=0)
    assert not log.exists()  # the colocated critic's window is open: no trace written yet
    profiler.stop("critic", step=2)
    profiler.finish("critic", hooked, rank=0)
    assert log.read_text().split("\n") == ["2", "torch 0 actor_rollout_ref", ""]  # the trace and its table, once
    # Rank 1 profiles nothing but is chosen for the hook; rank 2 is neither.
    ProcessProfiler().finish("critic", hooked, rank=1)
    ProcessProfiler().finish("critic", hooked, rank=2)
    assert log.read_text().split("\n")[2:] == ["2", "torch 1 critic", ""]


def test_a_failing_finish_hook_is_reported_and_training_goes_on(profiler, tmp_path, caplog):
    failing = ProfileSettings(ranks=None, contents=frozenset(), discrete=False, save_path=str(tmp_path),
                              finish_hook_cmd="echo uploading; exit 3", finish_hook_ranks=None)
    with caplog.at_level("INFO", logger="hybrid_rl.profiler"):
        profiler.finish("actor_rollout_ref", failing, rank=0)
    assert "finish_hook_cmd: uploading" in caplog.text and "exited with 3 (training goes on)" in caplog.text


def test_the_finish_hook_follows_verl_keys():
    cfg = validate_config(compose_config(PROFILE + ["global_profiler.finish_hook_cmd='tar czf t.tgz .'"]))
    assert role_settings(cfg, "actor_rollout_ref").finish_hook_cmd == "tar czf t.tgz ."
    assert role_settings(cfg, "actor_rollout_ref").finish_hook_ranks == frozenset({0})  # the profiled ranks
    every = validate_config(compose_config(PROFILE + ["global_profiler.finish_hook_cmd=true",
                                                      "global_profiler.finish_hook_all_ranks=true"]))
    assert role_settings(every, "actor_rollout_ref").finish_hook_ranks is None


def test_windows_of_steps():
    alone, joined = StepWindows([2, 3, 7], continuous=False), StepWindows([2, 3, 7], continuous=True)
    assert [s for s in range(1, 9) if alone.ends(s)] == [2, 3, 7]
    assert [s for s in range(1, 9) if joined.ends(s)] == [3, 7]


PROFILE = ["global_profiler.tool=torch", "global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=true"]


def test_role_settings_follow_verl_keys(tmp_path):
    cfg = validate_config(compose_config(PROFILE + [
        f"global_profiler.save_path={tmp_path}", "actor_rollout_ref.actor.profiler.all_ranks=true",
        "actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,stack]",
        "actor_rollout_ref.actor.profiler.tool_config.torch.discrete=true"]))
    assert role_settings(cfg, "actor_rollout_ref") == ProfileSettings(
        ranks=None, contents=frozenset({"cpu", "stack"}), discrete=True, save_path=str(tmp_path),
        finish_hook_ranks=None)  # the hook's ranks follow the profiled ones (every rank) unless set
    # The rollout pool's settings follow the actor's unless set (verl's interpolation).
    assert role_settings(cfg, "rollout").discrete is True
    assert role_settings(cfg, "critic") is None
    default = validate_config(compose_config(PROFILE))
    assert role_settings(default, "actor_rollout_ref").ranks == frozenset({0})  # verl: rank 0 unless listed
    assert role_settings(validate_config(compose_config([])), "actor_rollout_ref") is None


def test_a_role_profiles_with_its_own_tool():
    """verl's role-level profiler.tool: torch for the actor alone, with no global tool."""
    cfg = validate_config(compose_config(["global_profiler.steps=[2]", "actor_rollout_ref.actor.profiler.enable=true",
                                          "actor_rollout_ref.actor.profiler.tool=torch",
                                          "critic.profiler.enable=true"]))
    assert role_settings(cfg, "actor_rollout_ref") is not None
    assert role_settings(cfg, "critic") is None


@pytest.mark.parametrize("overrides, expected", [
    (["global_profiler.tool=nsys"], r"global_profiler.tool=nsys is not supported yet \(use torch, PyTorch's profiler"),
    (["actor_rollout_ref.actor.profiler.enable=true"], r"records nothing without a profiler tool: set "
     r"global_profiler.tool=torch \(or actor_rollout_ref.actor.profiler.tool=torch\)"),
    (PROFILE + ["actor_rollout_ref.actor.profiler.tool=null"], "actor.profiler.enable=true records nothing without"),
    (["global_profiler.tool=torch", "actor_rollout_ref.actor.profiler.enable=true"],
     r"profiles the steps listed in global_profiler.steps.*got None"),
    (["global_profiler.tool=torch", "global_profiler.steps=[0]", "actor_rollout_ref.actor.profiler.enable=true"],
     "step numbers >= 1"),
    (["global_profiler.tool=torch", "global_profiler.steps=[1]"], "no role's profiler is enabled"),
    (PROFILE + ["actor_rollout_ref.actor.profiler.tool_config.torch.contents=[cpu,gpu]"],
     r"contents lists \['gpu'\]"),
    (PROFILE + ["actor_rollout_ref.actor.profiler.ranks=[0,1]"], r"\[1\] are not ranks of its 1 processes"),
    (PROFILE + ["critic.profiler.tool=nsys"], r"critic.profiler.tool=nsys is not supported yet \(use torch"),
    (["global_profiler.finish_hook_cmd=true"], "finish_hook_cmd runs after the last profiled step, and nothing is"),
    (PROFILE + ["global_profiler.finish_hook_ranks=[2]"], r"finish_hook_ranks=\[2\]: \[2\] are not ranks of its 1"),
], ids=["nsys", "enable-without-tool", "role-tool-null", "no-steps", "step-zero", "no-role", "contents", "ranks", "role-tool",
        "finish-hook-without-profiling", "finish-hook-ranks"])
def test_bad_profiler_settings_fail_at_start(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        validate_config(compose_config(overrides))


def test_the_reference_follows_the_actor_profiler():
    """verl's scripts enable ref.profiler next to the actor's; here it is the actor's process."""
    cfg = validate_config(compose_config(PROFILE + ["actor_rollout_ref.ref.profiler.enable=true",
                                                    "trainer.n_gpus_per_node=2",
                                                    "actor_rollout_ref.actor.profiler.ranks=[1]"]))
    assert role_settings(cfg, "actor_rollout_ref").ranks == frozenset({1})
