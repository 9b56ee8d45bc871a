"""Turn rollouts into token-level rewards with a per-sample score function."""

from __future__ import annotations

import asyncio
import functools
import inspect
import math
import numbers
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["RewardFunctionError", "RewardManager"]


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned a non-finite score, for one sample."""


def _fn_name(fn: Callable) -> str:
    base = fn
    while isinstance(base, functools.partial):
        base = base.func
    module = getattr(base, "__module__", None)
    qualname = getattr(base, "__qualname__", None) or getattr(base, "__name__", None) or repr(base)
    name = f"{module}.{qualname}" if module and not module.startswith("hybrid_rl_custom_reward_") else qualname
    return name + ("(partial)" if isinstance(fn, functools.partial) else "")


def _as_python(value: Any) -> Any:
    """numpy scalars/0-d arrays -> Python objects, so strings and dicts behave normally."""
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    if isinstance(value, np.generic):
        return value.item()
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (numbers.Real, np.bool_, np.number)) or (
        isinstance(value, torch.Tensor) and value.numel() == 1
    )


class RewardManager:
    """Per-sample ("naive") reward manager.

    For each row the valid response tokens are decoded, ``compute_score`` is
    called with keyword arguments ``data_source``, ``solution_str``,
    ``ground_truth`` and ``extra_info``, and the scalar score is written at the
    last valid response token; every other position is zero.

    ``compute_score`` may return a number (bool/int/float) or a dict with a
    ``"score"`` entry; extra dict keys are returned per sample in ``extra``.

    Process supervision: a dict with ``"step_rewards"`` (one float per reasoning step) and
    ``"step_ends"`` (each step's end as a character offset into the response, exclusive) puts
    each step's reward on the token holding the step's last character instead, and ``extra``
    then carries a (B, T) bool ``"step_mask"`` of those tokens (``"score"`` defaults to the sum).
    """

    def __init__(
        self,
        tokenizer,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        num_examine: int = 0,
    ):
        if compute_score is None:
            from . import default_compute_score

            compute_score = default_compute_score
        if not callable(compute_score):
            raise TypeError(f"compute_score must be callable, got {type(compute_score).__name__}")
        self.tokenizer = tokenizer
        self.compute_score = compute_score
        self.reward_fn_key = reward_fn_key
        self.num_examine = int(num_examine)
        self._name = _fn_name(compute_score)

    # ------------------------------------------------------------------ helpers
    def _call(self, i: int, data_source, solution_str: str, ground_truth, extra_info):
        try:
            result = self.compute_score(
                data_source=data_source,
                solution_str=solution_str,
                ground_truth=ground_truth,
                extra_info=extra_info,
            )
            if inspect.isawaitable(result):
                result = asyncio.run(_await(result))
        except Exception as exc:
            raise RewardFunctionError(
                f"reward function {self._name} raised {type(exc).__name__}: {exc} "
                f"(sample index {i}, data_source={data_source!r}, ground_truth={ground_truth!r}, "
                f"response[:200]={solution_str[:200]!r})"
            ) from exc
        return result

    def _step_positions(self, i: int, ids: list[int], solution_str: str, result: dict) -> list[tuple[int, float]]:
        """(token index, reward) of each step; a step ends on the token whose decoded prefix first
        reaches the step's end offset."""
        rewards, ends = result.get("step_rewards"), result.get("step_ends")
        if not isinstance(rewards, (list, tuple)) or not isinstance(ends, (list, tuple)) or len(rewards) != len(ends):
            raise TypeError(
                f"reward function {self._name} returned step_rewards/step_ends for sample {i} that are not "
                "two lists of equal length (one reward and one character end offset per step)")
        prefix_lengths = [len(self.tokenizer.decode(ids[:k + 1], skip_special_tokens=True)) for k in range(len(ids))]
        positions = []
        for reward, end in zip(rewards, ends):
            if not _is_number(reward) or not math.isfinite(float(reward)):
                raise RewardFunctionError(f"reward function {self._name} returned step reward {reward!r} for "
                                          f"sample index {i}; step rewards must be finite numbers")
            if not isinstance(end, int) or not 0 < end <= len(solution_str):
                raise TypeError(f"reward function {self._name} returned step end {end!r} for sample {i}; ends "
                                f"are character offsets in 1..{len(solution_str)} (the response length)")
            token = next((k for k, length in enumerate(prefix_lengths) if length >= end), len(ids) - 1)
            positions.append((max(token, 0), float(reward)))
        return positions

    def _to_score(self, i: int, data_source, result) -> tuple[float, dict]:
        extras: dict = {}
        if isinstance(result, dict) and "step_rewards" in result and "score" not in result:
            result = {**result, "score": float(sum(result["step_rewards"] or [0.0]))}
        if isinstance(result, dict):
            if "score" not in result:
                raise TypeError(
                    f"reward function {self._name} returned a dict without a 'score' key "
                    f"(keys: {sorted(map(str, result))}) for sample {i} (data_source={data_source!r}); "
                    "expected a float/int/bool or a dict containing 'score'"
                )
            extras = {k: _as_python(v) for k, v in result.items() if k != "score"}
            raw = result["score"]
            if not _is_number(raw):
                raise TypeError(
                    f"reward function {self._name} returned dict['score'] of type {type(raw).__name__} "
                    f"for sample {i} (data_source={data_source!r}); expected a float/int/bool"
                )
        elif _is_number(result):
            raw = result
        else:
            raise TypeError(
                f"reward function {self._name} returned {type(result).__name__} "
                f"for sample {i} (data_source={data_source!r}); "
                "expected a float/int/bool or a dict with a 'score' key"
            )
        score = float(raw.item() if isinstance(raw, torch.Tensor) else raw)
        if not math.isfinite(score):
            raise RewardFunctionError(
                f"reward function {self._name} returned a non-finite score ({score}) "
                f"for sample index {i}, data_source={data_source!r}; rewards must be finite numbers"
            )
        return score, extras

    # --------------------------------------------------------------------- call
    def __call__(self, batch) -> tuple[torch.Tensor, dict[str, list]]:
        responses: torch.Tensor = batch["responses"]
        if responses.ndim != 2:
            raise ValueError(f"batch['responses'] must be (B, T), got shape {tuple(responses.shape)}")
        bsz, resp_len = responses.shape
        if "response_mask" in batch:
            response_mask = batch["response_mask"]
        elif "attention_mask" in batch:
            response_mask = batch["attention_mask"][:, -resp_len:]
        else:
            raise KeyError("batch needs a 'response_mask' (or 'attention_mask') tensor to find valid response tokens")
        valid_resp_len = response_mask.to(torch.long).sum(dim=-1).tolist()

        if self.reward_fn_key not in batch:
            raise KeyError(
                f"batch has no non-tensor {self.reward_fn_key!r} (data.reward_fn_key); "
                f"available keys: {batch.keys()}"
            )
        data_sources = batch[self.reward_fn_key]
        if "reward_model" not in batch:
            raise KeyError(
                "batch has no non-tensor 'reward_model' (dict with 'ground_truth'); "
                f"available keys: {batch.keys()}"
            )
        reward_models = batch["reward_model"]
        extra_infos = batch["extra_info"] if "extra_info" in batch else None

        prompts = batch["prompts"] if "prompts" in batch else None
        prompt_valid: list[int] | None = None
        if self.num_examine > 0 and prompts is not None:
            if "attention_mask" in batch:
                prompt_valid = batch["attention_mask"][:, : prompts.shape[1]].to(torch.long).sum(-1).tolist()
            else:
                prompt_valid = [prompts.shape[1]] * bsz

        reward = torch.zeros(bsz, resp_len, dtype=torch.float32, device=responses.device)
        step_mask = None
        extra: dict[str, list] = {"score": []}
        extra_keys_seen: list[str] = []
        per_sample_extras: list[dict] = []

        for i in range(bsz):
            n_valid = int(valid_resp_len[i])
            ids = responses[i, :n_valid].tolist()
            solution_str = self.tokenizer.decode(ids, skip_special_tokens=True)
            data_source = _as_python(data_sources[i])
            rm = _as_python(reward_models[i])
            if not isinstance(rm, dict) or "ground_truth" not in rm:
                raise ValueError(
                    f"sample {i}: reward_model must be a dict with a 'ground_truth' entry, got {rm!r}"
                )
            ground_truth = _as_python(rm["ground_truth"])
            extra_info = _as_python(extra_infos[i]) if extra_infos is not None else None

            result = self._call(i, data_source, solution_str, ground_truth, extra_info)
            score, extras = self._to_score(i, data_source, result)

            if isinstance(result, dict) and "step_rewards" in result:
                if step_mask is None:
                    step_mask = torch.zeros(bsz, resp_len, dtype=torch.bool, device=responses.device)
                for token, step_reward in self._step_positions(i, ids, solution_str, result):
                    reward[i, token] += step_reward
                    step_mask[i, token] = True
                extras = {k: v for k, v in extras.items() if k not in ("step_rewards", "step_ends")}
            else:
                reward[i, max(n_valid - 1, 0)] = score
            extra["score"].append(score)
            per_sample_extras.append(extras)
            for k in extras:
                if k not in extra_keys_seen:
                    extra_keys_seen.append(k)

            if i < self.num_examine:
                prompt_str = None
                if prompts is not None and prompt_valid is not None:
                    p_ids = prompts[i, prompts.shape[1] - prompt_valid[i]:].tolist()
                    prompt_str = self.tokenizer.decode(p_ids, skip_special_tokens=True)
                print(f"[reward {i}] data_source: {data_source}")
                print(f"[prompt] {prompt_str}")
                print(f"[response] {solution_str}")
                print(f"[ground_truth] {ground_truth}")
                print(f"[score] {score}" + (f" {extras}" if extras else ""))

        for k in extra_keys_seen:
            if k == "score":
                continue
            extra[k] = [e.get(k) for e in per_sample_extras]
        if step_mask is not None:
            extra["step_mask"] = step_mask
        return reward, extra


async def _await(awaitable):
    return await awaitable
