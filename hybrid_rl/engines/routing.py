"""Router replay for mixture-of-experts models (verl's `router_replay.mode`): the experts each token
was routed to, recorded in one forward pass and imposed on later ones.

- R2: the old-log-prob pass records the routes, and the update's passes replay them, so every
  mini-batch's ratio compares the same experts even after the weights have moved.
- R3: the rollout engine's routes (vLLM's `enable_return_routed_experts`) are replayed in the
  training passes, so training sees the experts that generated the tokens.

A route table lives in the batch as `routed_experts`: (rows, columns, num_hidden_layers, top_k)
expert indices aligned with `input_ids` (left-padded prompt, right-padded response), uint8 up to
256 experts (int16 beyond), as vLLM returns them. Padding positions hold `default_routes`.

This module holds the table and the replay in transformers' models (the FSDP engine, `RouteReplay`);
`megatron.routing` replays in megatron-core's routers. A transformers MoE layer's router (its
`mlp.gate`) returns (logits, top-k weights, top-k experts) for the layer's tokens flattened; a
forward hook records the experts, or replaces them with the table's and recomputes the weights at
those experts from the logits as the family's router computes them at its own (`ROUTER_WEIGHTS`).
The weights stay differentiable in the logits, so the router trains as it would have routed that way.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from hybrid_rl.engines.base import ROUTES_KEY

MODES = ("disabled", "R2", "R3")


def replay_mode(role_cfg: Any) -> str:
    """A role's router replay mode: verl 0.9's `megatron.router_replay.mode` or 0.7-0.8's
    `router_replay.mode` (disabled where neither is set)."""
    sections = ((role_cfg.get("megatron") or {}).get("router_replay"), role_cfg.get("router_replay"))
    modes = {mode for mode in ((section or {}).get("mode") for section in sections) if mode and mode != "disabled"}
    if len(modes) > 1:
        raise ValueError(f"megatron.router_replay.mode and router_replay.mode (verl 0.9's and 0.7-0.8's place for "
                         f"the same setting) differ: {' and '.join(sorted(modes))}; set one of them.")
    return modes.pop() if modes else "disabled"


def route_dtype(num_experts: int) -> torch.dtype:
    return torch.uint8 if num_experts <= 256 else torch.int16


def default_routes(top_k: int) -> torch.Tensor:
    """What padding positions (and tokens no engine routed) hold: experts 0..k-1, distinct as a
    router's choices are. They route nothing that is read: padding only follows real tokens."""
    return torch.arange(top_k)


def route_table(attention_mask: torch.Tensor, routes: list) -> torch.Tensor:
    """The rollout's routes as a batch's table. vLLM returns each sequence's as a (tokens - 1,
    layers, k) array over its prompt and response, without the last token (no forward pass routed
    it; its position predicts nothing); the sequence's tokens are the contiguous run of
    `attention_mask`'s ones ([left-padded prompt | right-padded response])."""
    rows, columns = attention_mask.shape
    arrays = [torch.as_tensor(r.astype("int16") if str(r.dtype) == "uint16" else r) for r in routes]
    layers, top_k = arrays[0].shape[1:]
    table = default_routes(top_k).to(arrays[0].dtype).expand(rows, columns, layers, top_k).clone()
    for row, array in enumerate(arrays):
        start, length = int(attention_mask[row].argmax()), int(attention_mask[row].sum())
        if len(array) < length - 1:
            raise RuntimeError(f"The rollout engine returned the routes of {len(array)} tokens for a sequence of "
                               f"{length}: router replay R3 needs every token's but the last.")
        count = min(len(array), length)
        table[row, start:start + count] = array[:count]
    return table


# ---------------------------------------------------------------------- transformers' routers
def _softmax_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Qwen2-MoE, Qwen3-MoE, Mixtral: the softmax over all experts at the chosen ones, rescaled to
    sum to 1 where the model renormalises (`norm_topk_prob`; Mixtral's always)."""
    weights = torch.softmax(logits.float(), dim=-1).gather(1, experts)
    if getattr(router, "norm_topk_prob", True):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights


def _deepseek_v2_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V2: the softmax at the chosen experts times `routed_scaling_factor`, not renormalised."""
    return torch.softmax(logits.float(), dim=-1).gather(1, experts) * router.routed_scaling_factor


def _deepseek_v3_weights(router, logits: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3: the sigmoid scores at the chosen experts (the correction bias steers only the
    choice), renormalised where `norm_topk_prob`, times `routed_scaling_factor`."""
    weights = logits.float().sigmoid().gather(1, experts)
    if router.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * router.routed_scaling_factor


# model_type -> the top-k weights its router gives chosen experts (router module, logits, experts).
ROUTER_WEIGHTS: dict[str, Callable] = {
    "qwen2_moe": _softmax_weights, "qwen3_moe": _softmax_weights, "mixtral": _softmax_weights,
    "deepseek_v2": _deepseek_v2_weights, "deepseek_v3": _deepseek_v3_weights}


def check_transformers_routers(key: str, mode: str, hf_config: Any) -> None:
    """`key`.router_replay.mode in the FSDP engine needs a model whose routers `RouteReplay` knows."""
    if mode == "disabled" or hf_config.model_type in ROUTER_WEIGHTS:
        return
    experts = any(getattr(hf_config, name, None) for name in ("num_experts", "num_local_experts", "n_routed_experts"))
    what = (f"its {hf_config.model_type} routers are not among those the FSDP engine replays "
            f"({', '.join(ROUTER_WEIGHTS)})" if experts else "this model has no experts")
    raise ValueError(f"{key}.router_replay.mode={mode} replays the routes of a mixture-of-experts model's routers; "
                     f"{what}. Set it to disabled.")


class Recorder:
    """What both engines' replays share: `record()`, inside which forward-only passes record
    routes, and `changed_share`, the share of (real token, MoE layer) pairs of the last pass that
    imposed routes whose imposed experts differ from the router's own choice under the current
    weights (None: that pass imposed none)."""

    recording = False
    changed_share: float | None = None

    @contextlib.contextmanager
    def record(self):
        self.recording = True
        try:
            yield
        finally:
            self.recording = False


class RouteReplay(Recorder):
    """Recording and imposing routes in a transformers model's MoE layers, micro-batch by
    micro-batch. Before each forward `place` says which micro-batch token each of the model's
    input tokens is (packed rows, a shared prompt, this rank's Ulysses slice); the routers' hooks
    then record or impose per token. Where gradient checkpointing recomputes a layer in the
    backward pass, the hook imposes the same micro-batch's routes again: they stay placed until
    the next micro-batch's."""

    def __init__(self, layers: list[torch.nn.Module], config: Any, group: dist.ProcessGroup | None = None):
        """`layers`: the model's decoder layers in order; `group`: the Ulysses group that splits
        each micro-batch's tokens (None: the tokens are this rank's alone)."""
        weights_at = ROUTER_WEIGHTS[config.model_type]
        self.group = group
        self.num_layers = len(layers)
        # The router itself, where peft wraps it to adapt its weight (LoRA's all-linear does).
        routers = {index: getattr(layer.mlp.gate, "get_base_layer", lambda: layer.mlp.gate)()
                   for index, layer in enumerate(layers) if hasattr(getattr(layer, "mlp", None), "gate")}
        if not routers:
            raise ValueError(f"Router replay found no mixture-of-experts router (mlp.gate) in this "
                             f"{config.model_type} model's {len(layers)} layers.")
        first = next(iter(routers.values()))
        self.top_k, self.dtype = first.top_k, route_dtype(first.num_experts)
        for index, router in routers.items():
            router.register_forward_hook(functools.partial(self._route, index, weights_at))
        self.counts, self.imposed = None, False  # of the pass running (`pass_over`)
        self._clear()

    def _clear(self) -> None:
        self.slots = self.split = self.targets = self.real = None
        self.recorded: dict[int, torch.Tensor] = {}
        self.counted: set[int] = set()

    @contextlib.contextmanager
    def pass_over(self):
        """One engine pass over micro-batches, after which `changed_share` is its own."""
        self.counts, self.imposed, self.changed_share = None, False, None
        try:
            yield
            if self.imposed:
                if self.group is not None:  # the other tokens of each micro-batch
                    dist.all_reduce(self.counts, group=self.group)
                self.changed_share = float(self.counts[0] / self.counts[1]) if self.counts[1] else 0.0
        finally:
            self._clear()

    def place(self, micro: dict[str, torch.Tensor], slots: torch.Tensor, tokens: int, split=None) -> None:
        """Before `micro`'s forward: `slots` (B, C) is each real token's index among the `tokens`
        input tokens of the model's rows flattened (-1 at padding; a shared prompt's tokens name
        one copy), `split` this rank's `ulysses.SequenceSlice` of them, if any."""
        self._clear()
        self.slots, self.split = slots, split
        flat = slots.flatten()
        real = flat >= 0
        # Each input token's micro-batch position; of a shared prompt copy, the first row's.
        positions = torch.arange(len(flat), device=flat.device)
        sources = torch.full((tokens,), len(flat), dtype=torch.long, device=flat.device)
        sources = sources.scatter_reduce(0, flat[real], positions[real], "amin")
        sources[sources == len(flat)] = -1
        if split is not None:
            width = split.local_len * split.parallel.size
            sources = torch.nn.functional.pad(sources, (0, width - tokens), value=-1)
            sources = sources[split.start:split.start + split.local_len]
        self.real = sources >= 0
        if ROUTES_KEY in micro:
            self.imposed = True
            table = micro[ROUTES_KEY].flatten(0, 1)
            targets = table[sources.clamp(min=0)].long()
            targets[~self.real] = default_routes(self.top_k).to(targets)
            self.targets = targets  # (this rank's input tokens, layers, k)

    def _route(self, layer: int, weights_at: Callable, router: torch.nn.Module, args, out):
        logits, weights, chosen = out
        if self.targets is None:
            if self.recording and self.real is not None:
                self.recorded[layer] = chosen.detach()
            return None
        experts = self.targets[:, layer]
        if layer not in self.counted:  # not again in a recomputation
            self.counted.add(layer)
            changed = (chosen.sort(-1).values != experts.sort(-1).values).any(-1) & self.real
            counts = torch.stack([changed.sum(), self.real.sum()]).double()
            self.counts = counts if self.counts is None else self.counts + counts
        return logits, weights_at(router, logits, experts).to(weights.dtype), experts

    def recorded_table(self) -> torch.Tensor | None:
        """The routes the last forward recorded, as its micro-batch's table (None if it recorded none)."""
        if not self.recorded:
            return None
        chosen = next(iter(self.recorded.values()))
        local = default_routes(self.top_k).to(chosen).expand(len(chosen), self.num_layers, self.top_k).clone()
        for layer, experts in self.recorded.items():
            local[:, layer] = experts
        if self.split is not None:  # every rank's slice of the row
            full = local.new_empty(len(local) * self.split.parallel.size, *local.shape[1:])
            dist.all_gather_into_tensor(full, local.contiguous(), group=self.split.parallel.group)
            local = full
        table = local[self.slots.clamp(min=0)]
        table[self.slots < 0] = default_routes(self.top_k).to(table)
        return table.to(self.dtype)
