"""tools/bench/engine.py on a tiny model: both engines report the same first update for the same
weights and batch, the weights they gather are the model's, and the FLOP count follows the
tokens."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench(strategy: str, model_dir: str, out: str) -> dict:
    subprocess.run([sys.executable, os.path.join(REPO, "tools", "bench", "engine.py"), "--strategy", strategy,
                    "--model", model_dir, "--prompts", "2", "--responses", "2", "--prompt-len", "6",
                    "--response-len", "8", "--steps", "2", "--device", "cpu", "--matmul-size", "64", "--json", out,
                    "actor_rollout_ref.actor.fsdp_config.dtype=fp32" if strategy == "fsdp"
                    else "actor_rollout_ref.actor.megatron.dtype=fp32"],
                   check=True, capture_output=True, cwd=REPO, timeout=300)
    with open(out) as f:
        return json.load(f)


def test_engine_bench_agrees_across_engines(tiny_model_dir, tmp_path):
    fsdp = bench("fsdp", tiny_model_dir, str(tmp_path / "fsdp.json"))
    megatron = bench("megatron", tiny_model_dir, str(tmp_path / "megatron.json"))
    for key in ("pg_loss", "grad_norm"):
        assert megatron["first_step"][key] == pytest.approx(fsdp["first_step"][key], rel=1e-4)
    with safe_open(os.path.join(tiny_model_dir, "model.safetensors"), "pt") as f:
        numel = sum(_numel(f.get_slice(name).get_shape()) for name in f.keys())
    for result in (fsdp, megatron):
        update = result["update"]
        assert result["settings"]["strategy"] in ("fsdp", "megatron")
        # bf16 bytes of every weight, plus the tied output layer sent under its own name.
        head = update["head_params"]
        assert result["gather_weights"]["gb"] * 1e9 == 2 * (numel + head)
        assert update["flops_per_rank"] == 6 * (update["nonembedding_params"] * update["tokens_per_rank"]
                                                 + head * update["response_tokens_per_rank"])
    # The Megatron engine computes a prompt copy per response, the FSDP engine one per group.
    assert megatron["update"]["tokens_per_rank"] > fsdp["update"]["tokens_per_rank"]


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
