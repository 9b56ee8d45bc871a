"""What every model-holding worker role shares: its config, model folder and device set-up."""

from __future__ import annotations

import os

import torch
from omegaconf import OmegaConf

from hybrid_rl.controller import Dispatch, RankLayout, Worker, register
from hybrid_rl.controller.worker import set_env
from hybrid_rl.hardware import keep_freed_host_memory
from hybrid_rl.profiler import PROCESS_PROFILER, role_settings
from hybrid_rl.user_code import import_external_libs


class ModelWorker(Worker):
    """A worker role that trains or evaluates models through engines (`hybrid_rl.engines`): it
    keeps the resolved config (an OmegaConf copy of the driver's plain dict), the local model
    folder and the run length."""

    role = ""  # the key of hybrid_rl.profiler.ROLE_PROFILER_KEYS whose profiler settings it follows

    def __init__(self, config: dict, model_path: str, total_steps: int):
        super().__init__()
        from hybrid_rl.console import quiet_third_party_output

        quiet_third_party_output()
        self.cfg = OmegaConf.create(config)
        import_external_libs(self.cfg)  # what they register is needed before any model is read
        self.model_path = model_path
        self.total_steps = total_steps
        self.profile_settings = role_settings(self.cfg, self.role)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def start_profile(self, step: int) -> None:
        """Open this process's profiler for a window from `step` on, if this role profiles this rank."""
        PROCESS_PROFILER.start(self.role, self.profile_settings, self.rank, step)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def stop_profile(self, step: int, last: bool) -> None:
        """Close the window this role opened (its trace is written once no colocated role has it
        open); after the `last` profiled step, run the role's finish hook where it applies."""
        PROCESS_PROFILER.stop(self.role, step)
        if last:
            PROCESS_PROFILER.finish(self.role, self.profile_settings, self.rank)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def dispatch_layout(self, mesh: str) -> RankLayout:
        """The data-parallel layout of the engine named `mesh` (`actor`, `ref`, `critic`,
        `rollout`): the tensor and pipeline parallel ranks of one replica get the same rows.
        Without that engine every rank stands alone, so the method called says what is missing."""
        engine = getattr(self, mesh, None)
        if engine is None:
            return RankLayout(self.rank, self.world_size, True)
        return RankLayout(engine.dp_rank, engine.dp_size, engine.is_output_rank)

    def setup_device(self) -> torch.device:
        """Threads, device, host allocator (on CPU: `keep_freed_host_memory`) and process group of
        this worker process (idempotent across roles colocated in one process)."""
        threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
        if threads > 0:
            torch.set_num_threads(threads)
        use_cuda = self.cfg.trainer.device == "cuda"
        if use_cuda:
            # Ray gives each actor one visible GPU; vLLM picks its device from LOCAL_RANK.
            torch.cuda.set_device(0)
            set_env({"LOCAL_RANK": "0"})
        else:
            keep_freed_host_memory()
        self.init_process_group(timeout_s=self.cfg.actor_rollout_ref.nccl_timeout)
        return torch.device("cuda", 0) if use_cuda else torch.device("cpu")
