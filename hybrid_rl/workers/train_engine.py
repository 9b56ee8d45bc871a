"""FSDP2 training engine: build a causal LM, shard it, compute response log-probs, optimise.

One instance holds one model (the actor, or the frozen reference). Every parameter is a DTensor
sharded over the data-parallel mesh; each decoder layer is its own FSDP unit so only one layer
is gathered at a time.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybrid_rl.algorithms import entropy_from_logits

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def load_causal_lm(path: str, model_cfg: Any, device: torch.device, trainable: bool):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.get("trust_remote_code", False))
    for key, value in (model_cfg.get("override_config") or {}).items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation="sdpa",
        trust_remote_code=model_cfg.get("trust_remote_code", False),
    )
    model.to(device)
    if trainable:
        if model_cfg.get("enable_gradient_checkpointing", False):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    # Training and log-prob forwards never decode, so no KV cache.
    model.config.use_cache = False
    return model


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """Apply `fully_shard` to every decoder layer, then to the root (embeddings, norm, head)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"Cannot find decoder layers in {type(model).__name__} (no _no_split_modules); "
            "this architecture is not supported by the FSDP2 engine."
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return model


def response_log_probs(model: torch.nn.Module, micro: dict[str, torch.Tensor], temperature: float,
                       with_entropy: bool, entropy_grad: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the response tokens under `model`, logits divided by temperature.

    The batch is [left-padded prompt | right-padded response]; only the last T+1 positions' logits
    are computed (`logits_to_keep`), which predict the T response tokens.
    """
    responses = micro["responses"]
    resp_len = responses.shape[1]
    out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                position_ids=micro["position_ids"], use_cache=False, logits_to_keep=resp_len + 1)
    logits = out.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    log_probs = logits.gather(-1, responses.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    entropy = None
    if with_entropy:
        # Entropy only needs a graph when it is part of the loss (entropy bonus).
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits)
    return log_probs, entropy


def lr_lambda(optim_cfg: Any, total_steps: int):
    """Warmup then constant or cosine decay, as a multiplier of the base learning rate."""
    warmup = optim_cfg.get("lr_warmup_steps", -1)
    if warmup is None or warmup < 0:
        warmup = int(optim_cfg.get("lr_warmup_steps_ratio", 0.0) * total_steps)
    kind = optim_cfg.get("lr_scheduler_type", "constant")
    min_ratio = optim_cfg.get("min_lr_ratio", 0.0) or 0.0
    cycles = optim_cfg.get("num_cycles", 0.5)

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * cycles * progress))
        return max(min_ratio, min_ratio + (1.0 - min_ratio) * cosine)

    return factor


def build_optimizer(model: torch.nn.Module, optim_cfg: Any, total_steps: int):
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim_cfg.lr, betas=tuple(optim_cfg.get("betas", (0.9, 0.999))),
        weight_decay=optim_cfg.get("weight_decay", 0.01),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))
    return optimizer, scheduler


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip by the global gradient norm across all shards; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_sum(value: float, device: torch.device) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return float(t.item())
