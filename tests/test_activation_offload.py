"""`model.enable_activation_offload` (verl's key): the saved-tensor hooks move exactly the non-weight
activations a training forward saves, and the backward pass computes the same gradients from the
copies; the key's place in the config (FSDP only, as in verl). On CUDA, the engine's update with
it is checked in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hybrid_rl.config import ConfigError, validate_config
from hybrid_rl.config_keys import compose_config
from hybrid_rl.engines import activation_offload
from hybrid_rl.engines.activation_offload import ActivationOffload
from tests.engine_helpers import actor_config, make_engine

OFFLOAD = "actor_rollout_ref.model.enable_activation_offload=true"


def forward_backward(model, ids, hooks):
    with hooks:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


def expected_offload_bytes(model, ids, min_bytes: int) -> int:
    """What the forward saves outside the weights' storage, counted by plain hooks."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = [0]

    def count(tensor):
        size = tensor.numel() * tensor.element_size()
        if size >= min_bytes and tensor.untyped_storage().data_ptr() not in weights:
            saved[0] += size
        return tensor

    forward_backward(model, ids, torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor))
    return saved[0]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_hooks_move_the_activations_and_keep_the_gradients(tiny_model_dir, monkeypatch, checkpointing):
    # The tiny model's tensors are small: a lower floor makes most of them count.
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 4096)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(5, model.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    plain = forward_backward(model, ids, torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))
    hooks = ActivationOffload(torch.device("cpu"))
    offloaded = forward_backward(model, ids, hooks)
    assert hooks.offloaded_bytes == expected_offload_bytes(model, ids, 4096) > 0
    for name, grad in plain.items():
        torch.testing.assert_close(offloaded[name], grad, rtol=0, atol=0)
    if checkpointing:  # the checkpointed layers saved only their inputs
        model.gradient_checkpointing_disable()
        assert hooks.offloaded_bytes < 0.5 * expected_offload_bytes(model, ids, 4096)


def test_weights_and_their_views_stay(monkeypatch):
    monkeypatch.setattr(activation_offload, "MIN_OFFLOAD_BYTES", 0)
    layer = torch.nn.Linear(8, 8)
    x = torch.randn(3, 8, requires_grad=True)
    hooks = ActivationOffload(torch.device("cpu"))
    with hooks:
        y = torch.sigmoid(layer(x))  # linear saves x and weight.t(); sigmoid its output
    y.sum().backward()
    assert hooks.offloaded_bytes == x.numel() * 4 + y.numel() * 4


def test_no_hooks_on_the_cpu_engine(tiny_model_dir):
    """On CPU the activations are in host memory already: the key is taken and changes nothing."""
    engine = make_engine(actor_config("fsdp2", extra=[OFFLOAD]), tiny_model_dir)
    assert engine.activation_offload is None


@pytest.mark.parametrize("overrides, refused", [
    ([OFFLOAD, "actor_rollout_ref.actor.strategy=megatron"], "actor_rollout_ref.actor.strategy=megatron"),
    (["critic.model.enable_activation_offload=true", "critic.strategy=megatron", "algorithm.adv_estimator=gae"],
     "critic.strategy=megatron"),
])
def test_the_megatron_engine_is_refused(overrides, refused):
    with pytest.raises(ConfigError, match=f"enable_activation_offload=true offloads .* {refused}"):
        validate_config(compose_config(overrides))


def test_a_megatron_reference_beside_an_fsdp_actor_is_taken():
    """The reference trains nothing, so saves nothing for a backward pass."""
    validate_config(compose_config([OFFLOAD, "actor_rollout_ref.ref.strategy=megatron"]))
