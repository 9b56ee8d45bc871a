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
from hybrid_rl.engines import Output
from hybrid_rl.profiler import (
    FirstUpdateProfiler, ProcessProfiler, ProfileSettings, StepWindows, UpdateWindow, role_settings, update_window)
from tests.engine_helpers import actor_config, loss_fn, make_engine, rollout_batch


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


UPDATE_PROFILE = "actor_rollout_ref.actor.profile"


def profiler_steps(path) -> list[str]:
    with open(path) as f:
        return sorted({event["name"] for event in json.load(f)["traceEvents"]
                       if event.get("name", "").startswith("ProfilerStep#")})


def test_verls_update_profile_records_the_chosen_optimizer_steps_of_the_first_update(tiny_model_dir, tmp_path):
    """verl 0.4-0.5's actor.profile: optimizer steps 1 and 2 of the first update's four (step 0
    warms the profiler up), on rank 0 only when profile_ranks is null; later updates add nothing."""
    cfg = actor_config("fsdp2", extra=["actor_rollout_ref.actor.ppo_epochs=4", f"{UPDATE_PROFILE}.use_profile=true",
                                       f"{UPDATE_PROFILE}.step_start=1", f"{UPDATE_PROFILE}.step_end=3",
                                       f"{UPDATE_PROFILE}.save_path={tmp_path}"])
    assert update_window(cfg, rank=1) is None
    profiler = FirstUpdateProfiler(update_window(cfg, rank=0), rank=0)
    engine = make_engine(cfg, tiny_model_dir)
    for seed in (1, 2):
        with profiler.recording() as after_step:
            metrics = engine.update(rollout_batch(seed), cfg.actor_rollout_ref.actor, rollout_n=2, seed=seed,
                                    output=Output.LOG_PROBS_ENTROPY, temperature=0.7, loss_fn=loss_fn,
                                    after_step=after_step)
        assert (after_step is None) == (seed == 2) and torch.isfinite(torch.tensor(metrics["actor/grad_norm"]))
    (trace,) = tmp_path.iterdir()
    assert trace.name == "prof_start_1_end_3_rank_0.json"
    assert profiler_steps(trace) == ["ProfilerStep#1", "ProfilerStep#2"]
    with open(trace) as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert {"aten::mm", "Optimizer.step#AdamW.step"} <= names  # the forward-backward and the optimizer step


def test_an_update_profile_past_the_last_optimizer_step_keeps_what_it_recorded(tmp_path):
    profiler = FirstUpdateProfiler(UpdateWindow(start=0, end=5, save_path=str(tmp_path / "p")), rank=3)
    with profiler.recording() as after_step:
        for _ in range(2):
            torch.randn(32, 32) @ torch.randn(32, 32)
            after_step()
    # The update's rest after its last optimizer step is the third step of the trace.
    assert profiler_steps(tmp_path / "p" / "prof_start_0_end_5_rank_3.json") == [
        "ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2"]
    failing = FirstUpdateProfiler(UpdateWindow(start=0, end=1, save_path=str(tmp_path / "q")), rank=0)
    with pytest.raises(RuntimeError), failing.recording():
        raise RuntimeError("the update failed")
    assert not (tmp_path / "q").exists()  # no trace of a failed update


def test_verls_update_profile_keys():
    megatron = ["trainer.n_gpus_per_node=2", f"{UPDATE_PROFILE}.use_profile=true", f"{UPDATE_PROFILE}.step_start=0",
                f"{UPDATE_PROFILE}.step_end=1"]
    cfg = validate_config(compose_config(megatron + [f"{UPDATE_PROFILE}.profile_ranks=[0,1]"],
                                         config_name="ppo_megatron_trainer"))
    assert update_window(cfg, rank=1) == UpdateWindow(0, 1, cfg.global_profiler.save_path)  # save_path null


@pytest.mark.parametrize("overrides, expected", [
    (["step_start=2", "step_end=2"], r"step_start=2 and step_end=2 choose.*set 0 <= step_start < step_end"),
    (["step_end=1"], r"step_start=-1 and step_end=1"),
    (["step_start=0", "step_end=1", "profile_ranks=[2]"], r"profile_ranks=\[2\]: \[2\] are not ranks of the actor's 2"),
    (["step_start=4", "step_end=5"], r"step_start=4, but an update makes 4 optimizer steps"),
], ids=["empty-window", "verls-default-start", "ranks", "past-the-update"])
def test_bad_update_profile_settings_fail_at_start(overrides, expected):
    base = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_epochs=2", "data.train_batch_size=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=4", f"{UPDATE_PROFILE}.use_profile=true"]
    with pytest.raises(ConfigError, match=expected):
        validate_config(compose_config(base + [f"{UPDATE_PROFILE}.{o}" for o in overrides],
                                       config_name="ppo_megatron_trainer"))


def test_the_update_profile_and_the_step_profiler_are_one_at_a_time():
    with pytest.raises(ConfigError, match="both profile the actor's processes"):
        validate_config(compose_config(PROFILE + [f"{UPDATE_PROFILE}.use_profile=true", f"{UPDATE_PROFILE}.step_start=0",
                                                  f"{UPDATE_PROFILE}.step_end=1"], config_name="ppo_megatron_trainer"))
