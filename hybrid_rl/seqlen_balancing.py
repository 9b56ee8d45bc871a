"""Token-count balancing: token-budget micro-batches inside a worker, and equal work for every
data-parallel rank on the driver.

The cost of a set of rows is the number of tokens a padding-free forward computes for it (see
`engines/packing.py`): each row's real response tokens, plus its real prompt tokens once per
distinct prompt when prompts are shared, or once per row otherwise. Rows with the same prompt
form one unit, so a group of responses stays together (and shares its prompt) unless the unit
alone exceeds a budget.
"""

from __future__ import annotations

import heapq

import torch

from hybrid_rl.protocol import Batch


def row_lengths(batch: Batch) -> tuple[list[tuple[int, ...]], list[int], list[int]]:
    """Per row: its real prompt tokens (the sharing key), prompt length and response length."""
    resp_len = batch["responses"].shape[1]
    prompt_len = batch["input_ids"].shape[1] - resp_len
    ids, real = batch["input_ids"], batch["attention_mask"].bool()
    prompts = [tuple(row[:prompt_len][m[:prompt_len]].tolist()) for row, m in zip(ids, real)]
    responses = real[:, prompt_len:].sum(-1).tolist()
    return prompts, [len(p) for p in prompts], responses


def cost_units(batch: Batch, share_prompts: bool) -> tuple[list[list[int]], list[int]]:
    """Rows grouped into units (same prompt when shared, else single rows) and their token costs."""
    prompts, prompt_lens, response_lens = row_lengths(batch)
    if not share_prompts:
        return [[i] for i in range(len(batch))], [p + r for p, r in zip(prompt_lens, response_lens)]
    units: dict[tuple[int, ...], list[int]] = {}
    for i, key in enumerate(prompts):
        units.setdefault(key, []).append(i)
    rows = list(units.values())
    return rows, [prompt_lens[u[0]] + sum(response_lens[i] for i in u) for u in rows]


def balanced_partition(costs: list[int], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split items into k bins with near-equal total cost: largest item first into the lightest
    bin (LPT). With `equal_size` every bin gets len(costs) // k items (len must divide)."""
    if equal_size and len(costs) % k:
        raise ValueError(f"{len(costs)} items cannot be split into {k} equal bins")
    capacity = len(costs) // k if equal_size else len(costs)
    bins: list[list[int]] = [[] for _ in range(k)]
    heap = [(0, b) for b in range(k)]
    for item in sorted(range(len(costs)), key=lambda i: -costs[i]):
        load, b = heapq.heappop(heap)
        bins[b].append(item)
        if len(bins[b]) < capacity:  # a full bin leaves the heap for good
            heapq.heappush(heap, (load + costs[item], b))
    return [sorted(b) for b in bins]


def token_budget_bins(batch: Batch, max_tokens: int, share_prompts: bool) -> int:
    """How many micro-batches of at most `max_tokens` tokens this batch needs (first-fit
    decreasing over units; a unit over the budget is split into single rows)."""
    units, costs = cost_units(batch, share_prompts)
    _, prompt_lens, response_lens = row_lengths(batch)
    items = []
    for unit, cost in zip(units, costs):
        items += [cost] if cost <= max_tokens else [prompt_lens[i] + response_lens[i] for i in unit]
    loads: list[int] = []
    for cost in sorted(items, reverse=True):
        fit = next((b for b, load in enumerate(loads) if load + cost <= max_tokens), None)
        if fit is None:
            loads.append(cost)
        else:
            loads[fit] += cost
    return len(loads)


def split_into(batch: Batch, k: int, share_prompts: bool) -> list[torch.Tensor]:
    """Row indices of k micro-batches with balanced token counts. Units stay whole when there
    are at least k of them; otherwise rows are balanced one by one (k never exceeds the row
    count, so no micro-batch is empty)."""
    units, costs = cost_units(batch, share_prompts)
    if len(units) < k:
        units, costs = cost_units(batch, share_prompts=False)
    bins = balanced_partition(costs, k)
    return [torch.tensor(sorted(i for u in b for i in units[u])) for b in bins]


def balance_permutation(batch: Batch, world_size: int, share_prompts: bool) -> torch.Tensor:
    """A row order whose `world_size` equal contiguous chunks (one per data-parallel rank) carry
    near-equal token counts. Prompt groups stay whole when they split evenly over the ranks."""
    units, costs = cost_units(batch, share_prompts)
    sizes = {len(u) for u in units}
    if len(sizes) != 1 or len(units) % world_size:
        units, costs = cost_units(batch, share_prompts=False)
    if len(units) % world_size:
        return torch.arange(len(batch))  # the dispatcher pads uneven batches anyway
    bins = balanced_partition(costs, world_size, equal_size=True)
    return torch.tensor([i for b in bins for u in b for i in units[u]])
