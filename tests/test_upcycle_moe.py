"""tools/upcycle_moe.py: a dense model's MLPs copied into every expert of a Mixtral model compute
what the dense model did, for any routing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

from upcycle_moe import upcycle  # noqa: E402


def test_an_upcycled_model_computes_what_the_dense_one_did(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    upcycle(tiny_model_dir, tmp_path / "moe", experts=4, top_k=2, router_std=0.5, seed=0)
    dense = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    moe = AutoModelForCausalLM.from_pretrained(tmp_path / "moe", dtype=torch.float32)
    assert moe.config.model_type == "mixtral" and moe.config.num_local_experts == 4
    ids = torch.randint(5, dense.config.vocab_size, (3, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(moe(ids).logits, dense(ids).logits, atol=1e-5)
    with pytest.raises(SystemExit, match="--top-k 5 must be between 1 and --experts"):
        upcycle(tiny_model_dir, tmp_path / "bad", experts=4, top_k=5, router_std=0.02, seed=0)
