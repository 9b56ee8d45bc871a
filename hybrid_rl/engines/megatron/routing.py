"""Router replay in megatron-core's routers (verl's `router_replay.mode`; the modes and the route
table are `hybrid_rl.engines.routing`'s).

megatron-core's routers call `router_replay.get_replay_topk` around their top-k when the
attribute is set; `RouterRoutes` is that object here, one per router. A router sees its layer's
tokens as (S_local x B) hidden states flattened sequence-major: S_local is this rank's part of the
micro-batch's padded columns (two chunks of 2 x CP under context parallelism, then a contiguous
1 / TP of those under sequence parallelism), so token k is row k % B at local column k // B.
"""

from __future__ import annotations

import contextlib
from collections import deque

import torch
import torch.distributed as dist

from hybrid_rl.engines.base import ROUTES_KEY
from hybrid_rl.engines.megatron.model import left_aligned_columns, prompt_padding, this_rank_part
from hybrid_rl.engines.routing import Recorder, default_routes, route_dtype


def check_replayable(key: str, mode: str, layout) -> None:
    """`key`.router_replay.mode needs a model with experts (`layout`: convert.Layout)."""
    if mode != "disabled" and layout.experts is None:
        raise ValueError(f"{key}.router_replay.mode={mode} replays the routes of a mixture-of-experts model's "
                         "routers; this model has no experts. Set it to disabled.")


class RouterRoutes:
    """One router's part in recording or replaying (megatron-core calls `get_replay_topk`).

    Replay targets are queued per forward call in order. Where the layer is recomputed in the
    backward pass (activation checkpointing), the recomputation (the only call with gradients
    enabled: the checkpointed first pass runs without) takes from a second queue, in the order
    the forward calls came, which is the order megatron's schedules run the backward passes.
    A forward call also counts the real tokens (its target's mask) whose imposed experts differ
    from the ones the router would pick."""

    def __init__(self, layer: int, recomputed: bool):
        self.layer = layer  # index into the table's layer axis (megatron's layer_number - 1)
        self.recomputed = recomputed
        self.action: str | None = None  # "record", "replay" or None (route as the router would)
        self.recorded: list[torch.Tensor] = []
        self.forward: deque[tuple[torch.Tensor, torch.Tensor]] = deque()  # (experts, real token)
        self.recompute: deque[tuple[torch.Tensor, torch.Tensor]] = deque()
        self.changed: list[torch.Tensor] = []  # per forward call: (changed, real) token counts

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.action == "replay":
            recompute = self.recomputed and torch.is_grad_enabled()
            indices, real = (self.recompute if recompute else self.forward).popleft()
            indices = indices.to(scores.device)
            if not recompute:
                _, natural = default_compute_topk(scores.detach(), topk, num_groups=num_groups, group_topk=group_topk)
                changed = (natural.sort(-1).values != indices.sort(-1).values).any(-1) & real.to(scores.device)
                self.changed.append(torch.stack([changed.sum(), real.sum().to(changed.device)]))
            # The router's scores at the imposed experts: softmax / normalisation follow as usual.
            return scores.gather(1, indices), indices
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        if self.action == "record":
            self.recorded.append(indices.detach())
        return probs, indices


class RouteReplay(Recorder):
    """The routers of an engine's model chunks, and the conversions between a micro-batch's route
    table and each router's tokens."""

    def __init__(self, chunks: list[torch.nn.Module], config, num_layers: int, num_experts: int):
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router import TopKRouter

        recomputed = config.recompute_granularity == "full" or (
            config.recompute_granularity == "selective" and "moe" in (config.recompute_modules or ()))
        # Per chunk, the routers in it (a chunk is one model part in `forward_step`).
        self.routers: list[list[RouterRoutes]] = []
        for chunk in chunks:
            routes = []
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.router_replay = RouterRoutes(module.layer_number - 1, recomputed)
                    routes.append(module.router_replay)
            self.routers.append(routes)
        self.num_layers, self.top_k = num_layers, config.moe_router_topk
        self.dtype = route_dtype(num_experts)
        self.sequence_parallel = config.sequence_parallel
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.cp_size = parallel_state.get_context_parallel_world_size()
        # The ranks of one replica hold different layers (PP) or tokens (CP, SP) of its routes.
        self.groups = [group for size, group in (
            (self.tp_size, parallel_state.get_tensor_model_parallel_group()),
            (self.cp_size, parallel_state.get_context_parallel_group()),
            (parallel_state.get_pipeline_model_parallel_world_size(),
             parallel_state.get_pipeline_model_parallel_group())) if size > 1]
        self._recorded: list[torch.Tensor] = []

    @property
    def recorded(self) -> bool:
        """Whether the last pass recorded routes (`routes_of`)."""
        return bool(self._recorded)

    def local_columns(self, rows: int, length: int) -> torch.Tensor:
        """(B, S_local): the padded micro-batch column of each of this rank's tokens."""
        columns = torch.arange(length).expand(rows, -1)
        if self.cp_size > 1:
            columns = this_rank_part(columns)
        if self.sequence_parallel:
            width = columns.shape[1] // self.tp_size
            columns = columns[:, self.tp_rank * width:(self.tp_rank + 1) * width]
        return columns

    # ------------------------------------------------------------------ one forward_backward
    @contextlib.contextmanager
    def pass_over(self, micros: list[dict], padded_lengths: list[int], training: bool):
        """Inside: each micro-batch with a route table replays it; without one, a forward-only
        pass in `record()` records. `routes_of(index)` then gives micro-batch `index`'s table.
        (The schedule's fillers, repeats of the first micro-batch, queue and record their own.)"""
        replay = [ROUTES_KEY in micro for micro in micros]
        if any(replay) and not all(replay):
            raise ValueError(f"Some micro-batches carry `{ROUTES_KEY}` and some do not.")
        action = "replay" if replay and replay[0] else ("record" if self.recording and not training else None)
        for router in self._all():
            router.action = action
        self._training, self._recorded, self.changed_share = training, [], None
        try:
            yield
            if action == "record":
                self._recorded = [self._table(micro, index, padded_lengths[index])
                                  for index, micro in enumerate(micros)]
            elif action == "replay":
                self.changed_share = self._changed_share(micros[0]["input_ids"].device)
            leftover = [r.layer for r in self._all() if r.forward or r.recompute]
            if leftover:
                raise RuntimeError(f"Router replay: layers {leftover} were left replay targets; the forward and "
                                   "recomputation passes did not run in the order they were queued.")
        finally:
            for router in self._all():
                router.action = None
                router.recorded, router.forward, router.recompute, router.changed = [], deque(), deque(), []

    def before_forward(self, chunk_index: int, micro: dict, padded_length: int, filler: bool = False) -> None:
        """In `forward_step`, before the model chunk runs `micro` (a schedule's `filler`
        counts no tokens): queue its targets."""
        if ROUTES_KEY not in micro:
            return
        left = self.left_aligned(micro)
        rows = left.shape[0]
        left = torch.nn.functional.pad(left, (0, 0, 0, 0, 0, padded_length - left.shape[1]))
        left[:, micro["input_ids"].shape[1]:] = default_routes(self.top_k).to(left)
        columns = self.local_columns(rows, padded_length).to(left.device)
        # Left-aligned, a row's tokens are its first attention_mask.sum() columns.
        real = (columns < micro["attention_mask"].sum(1, keepdim=True)) & (not filler)
        real = real.transpose(0, 1).reshape(-1)
        for router in self.routers[chunk_index]:
            layer = left[:, :, router.layer].long()  # (B, S, k)
            local = layer.gather(1, columns.unsqueeze(-1).expand(-1, -1, self.top_k))
            targets = local.transpose(0, 1).reshape(-1, self.top_k)  # sequence-major, as the router sees
            router.forward.append((targets, real))
            if self._training and router.recomputed:
                router.recompute.append((targets, real))

    def routes_of(self, index: int) -> torch.Tensor:
        return self._recorded[index]

    def _changed_share(self, device: torch.device) -> float:
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for router in self._all():
            for changed in router.changed:
                counts += changed.to(counts)
        for group in self.groups:  # other tokens (SP, CP) or layers (PP) of the replica
            dist.all_reduce(counts, group=group)
        return float(counts[0] / counts[1]) if counts[1] else 0.0

    def _all(self):
        return (router for routers in self.routers for router in routers)

    # ------------------------------------------------------------------ table <-> left-aligned rows
    def left_aligned(self, micro: dict) -> torch.Tensor:
        """The micro-batch's table with each row shifted left by its prompt padding, as
        `model.left_aligned` shifts the tokens; positions past a row's tokens hold the default."""
        table, mask = micro[ROUTES_KEY], micro["attention_mask"]
        rows, length = mask.shape
        index = left_aligned_columns(micro)
        left = table.gather(1, index[..., None, None].expand(-1, -1, *table.shape[2:])).clone()
        steps = torch.arange(length, device=mask.device)
        left[steps.expand(rows, -1) >= mask.sum(1, keepdim=True)] = default_routes(self.top_k).to(left)
        return left

    def _table(self, micro: dict, index: int, padded_length: int) -> torch.Tensor:
        """The routes this replica's routers recorded for micro-batch `index`, as a table."""
        rows, length = micro["input_ids"].shape
        device = micro["input_ids"].device
        # Each rank writes what its routers saw, the rest stays 0; expert indices are >= 0, so a
        # maximum over the ranks holding other layers or tokens completes it.
        left = torch.zeros(rows, padded_length, self.num_layers, self.top_k, dtype=torch.int32, device=device)
        columns = self.local_columns(rows, padded_length).to(device)
        for routers in self.routers:
            for router in routers:
                recorded = router.recorded[index]  # (S_local x B, k)
                local = recorded.reshape(columns.shape[1], rows, self.top_k).transpose(0, 1).to(torch.int32)
                left[:, :, router.layer].scatter_(1, columns.unsqueeze(-1).expand(-1, -1, self.top_k), local)
        for group in self.groups:
            dist.all_reduce(left, op=dist.ReduceOp.MAX, group=group)
        # Back to the batch's columns: row b's column j is its left-aligned column j - padding.
        pad = prompt_padding(micro)
        steps = torch.arange(length, device=device)
        index_ = (steps - pad).clamp(min=0)
        table = left[:, :length].gather(1, index_[..., None, None].expand(-1, -1, self.num_layers, self.top_k))
        table[~micro["attention_mask"].bool()] = default_routes(self.top_k).to(table)
        return table.to(self.dtype)
