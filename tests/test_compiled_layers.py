"""`actor_rollout_ref.model.compile_layers` on the FSDP engine: compiled decoder layers give the
eager engine's log-probs and updates (float32), with gradient checkpointing or a LoRA adapter
too, on packed rows whose length changes between micro-batches."""

from __future__ import annotations

import pytest
import torch

from hybrid_rl.engines import Output
from hybrid_rl.engines.fsdp import decoder_layers
from tests.conftest import build_tiny_model
from tests.engine_helpers import actor_config, make_engine, rollout_batch, step, weights

pytestmark = pytest.mark.slow


def run(model_dir: str, compiled: bool, extra=(), device=torch.device("cpu")) -> dict:
    cfg = actor_config("fsdp2", extra=[f"actor_rollout_ref.model.compile_layers={compiled}", *extra])
    torch.manual_seed(0)  # a LoRA adapter's A, as the worker seeds it
    engine = make_engine(cfg, model_dir, device)
    assert all((layer._compiled_call_impl is not None) == compiled for layer in decoder_layers(engine.hf_module()))
    return {"first": step(engine, cfg, 1), "second": step(engine, cfg, 2), "weights": weights(engine),
            "infer": engine.infer(rollout_batch(3), Output.LOG_PROBS_ENTROPY, 0.7, 3, None)}


def assert_same_training(eager: dict, compiled: dict) -> None:
    for update in ("first", "second"):
        for key in ("actor/loss", "actor/grad_norm"):
            assert compiled[update][key] == pytest.approx(eager[update][key], rel=1e-5)
    # Adam divides by the root of tiny second moments, so a rounding difference in a near-zero
    # gradient can move a weight by ~2e-5 over two steps; each step moves a weight by up to lr, 1e-3.
    for name, tensor in eager["weights"].items():
        torch.testing.assert_close(compiled["weights"][name], tensor, rtol=1e-5, atol=1e-4)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(compiled["infer"][key], eager["infer"][key], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("extra", [(), ("actor_rollout_ref.model.enable_gradient_checkpointing=true",),
                                   ("actor_rollout_ref.model.lora_rank=4",)], ids=["plain", "checkpointing", "lora"])
def test_compiled_layers_train_as_the_eager_ones(tmp_path, tiny_tokenizer, extra):
    torch._dynamo.reset()
    model_dir = build_tiny_model(tmp_path, tiny_tokenizer, num_layers=2, rope_theta=1e5)
    assert_same_training(run(model_dir, False, extra), run(model_dir, True, extra))
