"""verl's `fsdp_config.full_determinism` on the FSDP engine: torch's deterministic kernels are on in
the engine's process afterwards, and on this CPU the update is the same bit for bit (torch's CPU
kernels here have no nondeterministic choice to take away)."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, step, weights


def _main(rank, model_dir, out_dir):
    runs = {}
    for flag in (False, True):  # the switch is per process and stays on: the plain run first
        cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.actor.fsdp_config.full_determinism={flag}"])
        engine = make_engine(cfg, model_dir)
        runs[flag] = {"metrics": step(engine, cfg, 1), "weights": weights(engine),
                      "deterministic": torch.are_deterministic_algorithms_enabled(),
                      "env": {k: os.environ.get(k) for k in ("CUBLAS_WORKSPACE_CONFIG", "NCCL_DETERMINISTIC",
                                                             "FLASH_ATTENTION_DETERMINISTIC")}}
    torch.save(runs, os.path.join(out_dir, "runs.pt"))


def test_full_determinism_turns_on_deterministic_kernels_and_keeps_the_update(tmp_path, tiny_tokenizer):
    """In a process of its own: the switches are global to the process."""
    model_dir = build_tiny_model(tmp_path / "model", tiny_tokenizer)
    mp.start_processes(_main, args=(model_dir, str(tmp_path)), nprocs=1, start_method="spawn")
    runs = torch.load(tmp_path / "runs.pt")
    assert not runs[False]["deterministic"] and runs[True]["deterministic"]
    assert runs[False]["env"] == dict.fromkeys(runs[False]["env"])
    assert runs[True]["env"] == {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "NCCL_DETERMINISTIC": "1",
                                 "FLASH_ATTENTION_DETERMINISTIC": "1"}
    assert runs[True]["metrics"] == runs[False]["metrics"]
    for name, tensor in runs[False]["weights"].items():
        assert torch.equal(runs[True]["weights"][name], tensor), name
