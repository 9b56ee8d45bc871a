"""Profiling worker processes with `torch.profiler` over chosen training steps, with verl's keys.

`global_profiler.steps=[...]` chooses the steps; each role's `profiler.enable`, `profiler.tool=torch`
(which follows `global_profiler.tool` unless set), `all_ranks` / `ranks` and
`tool_config.torch.{contents, discrete}` choose its processes and what they record. The driver
starts and stops the profiler of every worker process around those steps (`Trainer.fit`), and
every `@register`-ed worker method is a named range in the trace (`controller.decorator.register`).
torch.profiler is one per process, so the roles colocated in one process share one trace. After
the last profiled step, `finish_hook_cmd` runs once on the ranks `finish_hook_ranks` /
`finish_hook_all_ranks` choose (else the profiled ones), e.g. to upload `$VERL_PROFILE_SAVE_PATH`,
as in verl.

Per profiled process, under `global_profiler.save_path`: `step<N>/<roles>_rank<r>.json.gz` (a
Chrome trace for Perfetto or chrome://tracing; `steps<A>-<B>/` when
`profile_continuous_steps=true` joins consecutive steps) and `.txt` beside it: the operator
table, most self time first. In discrete mode each worker call gets its own pair of files,
`<roles>_rank<r>_<method>[_<k>]` (the k-th call of that method in the window), written as the
call returns, so all of a window's go under its first step's folder.

verl 0.4-0.5's Megatron actor profiler (`actor_rollout_ref.actor.profile.*`, in the
`ppo_megatron_trainer` tree) is `FirstUpdateProfiler`: on the ranks `profile_ranks` lists (else
rank 0), the actor's first update, its optimizer steps `step_start` to `step_end` - 1 (the first is
0), as one Chrome trace with shapes and stacks, `<save_path>/prof_start_<s>_end_<e>_rank_<r>.json`
(verl's name; save_path null: global_profiler.save_path, where verl fails).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import os
import warnings
from collections import Counter

logger = logging.getLogger(__name__)

# What tool_config.torch.contents may list (verl's names).
TORCH_CONTENTS = ("cpu", "cuda", "memory", "shapes", "stack")
# Worker role -> the profiler config it follows. The colocated worker follows the actor's, as in
# verl; its reference model and rollout engine run inside it.
ROLE_PROFILER_KEYS = {
    "actor_rollout_ref": "actor_rollout_ref.actor.profiler",
    "critic": "critic.profiler",
    "reward_model": "reward_model.profiler",
    "rollout": "actor_rollout_ref.rollout.profiler",  # the rollout pool of asynchronous training
}
OPERATOR_ROWS = 60
# The driver's calls that open and close a window are not ranges in it.
UNTRACED_METHODS = frozenset({"start_profile", "stop_profile"})


@dataclasses.dataclass(frozen=True)
class ProfileSettings:
    ranks: frozenset[int] | None  # None: every rank
    contents: frozenset[str]
    discrete: bool  # one trace per worker call instead of one per step
    save_path: str
    finish_hook_cmd: str | None = None  # a shell command run once, after the last profiled step
    finish_hook_ranks: frozenset[int] | None = frozenset()  # None: every rank

    def covers(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks

    def runs_finish_hook(self, rank: int) -> bool:
        return bool(self.finish_hook_cmd) and (self.finish_hook_ranks is None or rank in self.finish_hook_ranks)


def role_settings(cfg, role: str) -> ProfileSettings | None:
    """How `role`'s processes are profiled, or None when they are not (`cfg` is resolved)."""
    from omegaconf import OmegaConf

    key = ROLE_PROFILER_KEYS.get(role)
    node = OmegaConf.select(cfg, key) if key else None
    # A role's tool follows global_profiler.tool unless set (verl's interpolation).
    if (node is None or not node.enable or node.get("tool") != "torch"
            or not OmegaConf.select(cfg, "global_profiler.steps")):
        return None
    torch_cfg = OmegaConf.select(node, "tool_config.torch") or {}
    ranks = None if node.all_ranks else frozenset(node.ranks or [0])
    # verl: the hook's ranks are its own when set, else the profiled ones.
    hook_ranks = None if node.get("finish_hook_all_ranks") else (
        frozenset(node.finish_hook_ranks) if node.get("finish_hook_ranks") else ranks)
    return ProfileSettings(ranks=ranks, contents=frozenset(torch_cfg.get("contents") or ()),
                           discrete=bool(torch_cfg.get("discrete", False)),
                           save_path=str(node.save_path or cfg.global_profiler.save_path),
                           finish_hook_cmd=node.get("finish_hook_cmd") or None, finish_hook_ranks=hook_ranks)


class StepWindows:
    """The profiled steps, each a window of its own, or runs of consecutive ones as one window
    (`profile_continuous_steps`). A window opens at a listed step when none is open (so also at
    a resumed run's first step inside a run)."""

    def __init__(self, steps, continuous: bool):
        self.steps = frozenset(int(s) for s in steps or ())
        self.continuous = continuous

    def ends(self, step: int) -> bool:
        return step in self.steps and not (self.continuous and step + 1 in self.steps)


def _activities(contents: frozenset[str]) -> list:
    """What tool_config.torch.contents asks torch.profiler to record (nothing listed: all there is)."""
    import torch
    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] if not contents or "cpu" in contents else []
    if (not contents or "cuda" in contents) and torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return activities or [ProfilerActivity.CPU]  # contents=[cuda] in a process without a GPU


def _torch_profile(contents: frozenset[str]):
    from torch.profiler import profile

    return profile(activities=_activities(contents), record_shapes="shapes" in contents,
                   profile_memory="memory" in contents, with_stack="stack" in contents)


@dataclasses.dataclass(frozen=True)
class UpdateWindow:
    """The optimizer steps `start` to `end` - 1 of the actor's first update (verl 0.4-0.5's profile.*)."""
    start: int
    end: int
    save_path: str


def update_window(cfg, rank: int) -> UpdateWindow | None:
    """The window `actor_rollout_ref.actor.profile` gives this rank, or None (`cfg` is checked)."""
    from omegaconf import OmegaConf

    profile = OmegaConf.select(cfg, "actor_rollout_ref.actor.profile")
    if profile is None or not profile.use_profile or rank not in (profile.profile_ranks or [0]):
        return None
    return UpdateWindow(profile.step_start, profile.step_end, profile.save_path or cfg.global_profiler.save_path)


class FirstUpdateProfiler:
    """verl 0.4-0.5's Megatron actor profiler: a torch.profiler schedule over the optimizer steps of
    the first update it is given (later updates are not recorded, as in verl)."""

    def __init__(self, window: UpdateWindow | None, rank: int):
        self.window = window
        self.rank = rank

    @contextlib.contextmanager
    def recording(self):
        """Around an update: yields what to call after each optimizer step (None: nothing is
        recorded), and writes the trace when the update returns."""
        window, self.window = self.window, None
        if window is None:
            yield None
            return
        from torch.profiler import profile, schedule

        # verl's schedule: the step before the window warms the profiler up (none before step 0).
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Profiler won't be using warmup")
            steps = schedule(wait=max(window.start - 1, 0), warmup=int(window.start > 0),
                             active=window.end - window.start, repeat=1)
        with profile(activities=_activities(frozenset()), schedule=steps, record_shapes=True, with_stack=True) as prof:
            yield prof.step
        os.makedirs(window.save_path, exist_ok=True)
        path = os.path.join(window.save_path, f"prof_start_{window.start}_end_{window.end}_rank_{self.rank}.json")
        prof.export_chrome_trace(path)
        logger.info("rank %d: the actor's update profile (optimizer steps %d to %d) written to %s", self.rank,
                    window.start, window.end - 1, path)


class ProcessProfiler:
    """The profiler of this process: started by the first role whose settings cover the rank,
    written when the last of those roles stops it."""

    def __init__(self):
        self.roles: list[str] = []  # the roles whose window is open
        self.joined: list[str] = []  # every role of this window, for the file names
        self.settings: ProfileSettings | None = None
        self.rank = 0
        self.first_step = self.step = 0
        self.window = None  # the running torch profiler of a whole window
        self.in_call = False  # discrete mode: a call's own trace is open (calls nest when one calls another)
        self.calls: Counter[str] = Counter()  # discrete mode: calls per method in this step
        self.finish_hooks: dict[str, tuple[str, ProfileSettings]] = {}  # command -> (role, settings), to run

    def start(self, role: str, settings: ProfileSettings | None, rank: int, step: int) -> None:
        if settings is None or not settings.covers(rank) or role in self.roles:
            return
        self.roles.append(role)
        if len(self.roles) > 1:  # a colocated role started it
            self.joined.append(role)
            return
        self.joined = [role]
        self.settings, self.rank, self.first_step, self.step = settings, rank, step, step
        self.calls.clear()
        if not settings.discrete:
            self.window = _torch_profile(settings.contents)
            self.window.start()

    def stop(self, role: str, step: int) -> None:
        if role not in self.roles:
            return
        self.roles.remove(role)
        self.step = step
        if self.roles or self.window is None:
            return
        self.window.stop()
        self.write(self.window, "")
        self.window = None

    def finish(self, role: str, settings: ProfileSettings | None, rank: int) -> None:
        """After the last profiled step: `role`'s finish_hook_cmd, when this rank is chosen for it,
        runs once the traces of this process are written (each command once per process)."""
        if settings is not None and settings.runs_finish_hook(rank):
            self.finish_hooks.setdefault(settings.finish_hook_cmd, (role, settings))
        if self.roles:  # a colocated role's window is still open: its trace is not written yet
            return
        for command, (hook_role, hook_settings) in self.finish_hooks.items():
            run_finish_hook(command, hook_settings.save_path, rank, hook_role)
        self.finish_hooks.clear()

    @property
    def active(self) -> bool:
        return bool(self.roles)

    @contextlib.contextmanager
    def call(self, name: str):
        """A named range for one worker method; in discrete mode, its own trace."""
        from torch.profiler import record_function

        if not self.active:
            yield
            return
        if not self.settings.discrete or self.in_call:  # a range in the open trace
            with record_function(name):
                yield
            return
        own = _torch_profile(self.settings.contents)
        self.in_call = True
        try:
            with own, record_function(name):
                yield
        finally:
            self.in_call = False
        self.calls[name] += 1
        count = self.calls[name]
        self.write(own, f"_{name}" + (f"_{count}" if count > 1 else ""))

    def write(self, prof, suffix: str) -> None:
        steps = f"step{self.step}" if self.step == self.first_step else f"steps{self.first_step}-{self.step}"
        folder = os.path.join(self.settings.save_path, steps)
        os.makedirs(folder, exist_ok=True)
        stem = os.path.join(folder, f"{'+'.join(sorted(self.joined))}_rank{self.rank}{suffix}")
        prof.export_chrome_trace(stem + ".json.gz")
        sort_by = "self_cuda_time_total" if any(a.name == "CUDA" for a in prof.activities) else "self_cpu_time_total"
        with open(stem + ".txt", "w") as f:
            f.write(prof.key_averages().table(sort_by=sort_by, row_limit=OPERATOR_ROWS) + "\n")
        logger.info("profile of rank %d written to %s.json.gz (operator table: .txt)", self.rank, stem)


def run_finish_hook(command: str, save_path: str, rank: int, role: str) -> None:
    """`command` in a shell, with verl's variables naming the traces (so a verl user's upload
    command works unchanged); its output is logged, and a failure is reported, never raised."""
    import subprocess

    env = {**os.environ, "VERL_PROFILE_SAVE_PATH": save_path, "VERL_PROFILE_TOOL": "torch",
           "VERL_PROFILE_RANK": str(rank), "VERL_PROFILE_PID": str(os.getpid()), "VERL_PROFILE_ROLE": role}
    logger.info("rank %d: profiling finished; running finish_hook_cmd: %s", rank, command)
    try:
        done = subprocess.run(["/bin/sh", "-c", command], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    except OSError as exc:
        logger.warning("rank %d: profiler finish_hook_cmd could not start (%s): %s", rank, exc, command)
        return
    for line in done.stdout.splitlines():
        logger.info("rank %d finish_hook_cmd: %s", rank, line)
    if done.returncode:
        logger.warning("rank %d: profiler finish_hook_cmd exited with %d (training goes on): %s", rank,
                       done.returncode, command)


PROCESS_PROFILER = ProcessProfiler()


def profiled_method(fn):
    """`fn` (a worker method) as a named range of this process's profiler while it runs."""
    name = fn.__name__
    if name in UNTRACED_METHODS:
        return fn
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def wrapper(*args, **kwargs):
            with PROCESS_PROFILER.call(name):
                return await fn(*args, **kwargs)
    else:
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with PROCESS_PROFILER.call(name):
                return fn(*args, **kwargs)
    return wrapper
