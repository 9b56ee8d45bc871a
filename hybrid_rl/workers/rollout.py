"""Rollout engines: sample responses for a batch of prompts on this rank.

`VLLMRollout` runs one in-process vLLM engine per rank (`external_launcher`), created after the
trainer's process group. `HFRollout` uses `transformers` generate on the actor's own (sharded)
weights. Both return the same tensors: prompts, responses, response_mask, input_ids,
attention_mask, position_ids and the sampled tokens' log-probs (`rollout_log_probs`); vLLM with
`enable_rollout_routing_replay` also each token's experts (`routed_experts`, router replay R3).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
from typing import Any, Iterable

import numpy as np
import torch

from hybrid_rl.config_keys import plain
from hybrid_rl.controller.worker import set_env
from hybrid_rl.engines.base import ROUTES_KEY
from hybrid_rl.engines.routing import route_table
from hybrid_rl.hardware import host_memory_bytes
from hybrid_rl.models import checkpoint_layout
from hybrid_rl.prometheus import serve_engine_metrics, served_model_name
from hybrid_rl.protocol import Batch, Sampling
from hybrid_rl.rewards.manager import AGENT_SCORE_KEY
from hybrid_rl.rollout_trace import RolloutTracer, Span, now_ns
from hybrid_rl.workers.vllm_cpu import (expert_layers, in_place_sync, keep_loadable_weights, kept_weight_bytes,
                                        load_weights_in_place, norm_priority, register_norm_kernels,
                                        unlink_shared_memory_names)


def greedy_settings() -> dict:
    return {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "n": 1}


def sampling_settings(cfg: Any, validate: bool) -> dict:
    """The sampling knobs of `rollout` (or `rollout.val_kwargs` for validation). Training rollouts
    with `rollout.beam_search` take each group from one beam search of width `n` instead."""
    if not validate and cfg.beam_search:
        return {**greedy_settings(), "beam_width": int(cfg.n)}
    src = cfg.val_kwargs if validate else cfg
    if not src.do_sample:
        return {**greedy_settings(), "n": int(src.n) if validate else 1}
    return {
        "temperature": float(src.temperature),
        "top_p": float(src.top_p),
        "top_k": int(src.top_k),
        "n": int(src.n) if validate else 1,
    }


def training_temperature(cfg: Any) -> float:
    """The temperature of the training rollouts' log-probs, at which the trainer computes its own:
    beam search ranks the untempered policy."""
    return 1.0 if cfg.beam_search else float(cfg.temperature)


def beam_groups(batch: Batch) -> list[tuple[int, int]]:
    """(first row, row count) of each run of rows with the same `uid`: a prompt's group, whose
    rows get that prompt's best beams, best first."""
    groups: list[tuple[int, int]] = []
    for i, uid in enumerate(batch["uid"]):
        if groups and batch["uid"][groups[-1][0]] == uid:
            groups[-1] = (groups[-1][0], groups[-1][1] + 1)
        else:
            groups.append((i, 1))
    return groups


def prompt_token_lists(batch: Batch) -> list[list[int]]:
    if "prompt_ids" in batch.non_tensors:
        return [list(map(int, ids)) for ids in batch["prompt_ids"]]
    ids, mask = batch["input_ids"], batch["attention_mask"].bool()
    return [row[m].tolist() for row, m in zip(ids, mask)]


def assemble_rollout(batch: Batch, responses: list[list[int]], log_probs: list[list[float]],
                     response_length: int, pad_token_id: int, eos_token_ids: Iterable[int],
                     loss_masks: list[list[int]] | None = None) -> Batch:
    """Pad responses to `response_length` and build the full [prompt | response] sequence tensors
    the trainer consumes. A single-turn response ends at its first EOS; a multi-turn trajectory
    is kept whole, and its `loss_masks` (0 on the tokens tools wrote) become `response_mask`."""
    eos = set(eos_token_ids)
    n = len(responses)
    resp = torch.full((n, response_length), pad_token_id, dtype=torch.long)
    resp_attention = torch.zeros((n, response_length), dtype=torch.long)
    resp_mask = torch.zeros((n, response_length), dtype=torch.long)
    resp_logp = torch.zeros((n, response_length), dtype=torch.float32)
    for i, (tokens, lps) in enumerate(zip(responses, log_probs)):
        tokens = tokens[:response_length]
        if loss_masks is None:
            length = next((j + 1 for j, t in enumerate(tokens) if t in eos), len(tokens))
            resp_mask[i, :length] = 1
        else:
            length = len(tokens)
            resp_mask[i, :length] = torch.tensor(loss_masks[i][:length], dtype=torch.long)
        resp[i, :length] = torch.tensor(tokens[:length], dtype=torch.long)
        resp_attention[i, :length] = 1
        resp_logp[i, :length] = torch.tensor(lps[:length], dtype=torch.float32)
    prompts = batch["input_ids"]
    prompt_mask = batch["attention_mask"]
    attention_mask = torch.cat([prompt_mask, resp_attention], dim=1)
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp_min(0)
    out = Batch(
        tensors={
            "prompts": prompts,
            "responses": resp,
            "response_mask": resp_mask,
            "input_ids": torch.cat([prompts, resp], dim=1),
            "attention_mask": attention_mask,
            "position_ids": position_ids,
            "rollout_log_probs": resp_logp,
        },
        non_tensors=dict(batch.non_tensors),
        meta=batch.meta,
    )
    return out


def tool_loop(cfg: Any, tokenizer, eos_token_ids: list[int]):
    """The multi-turn tool loop over this rank's engine (`rollout.multi_turn.enable`), else None."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    if not rollout_cfg.multi_turn.enable:
        return None
    from hybrid_rl import agent

    tools = agent.setup(rollout_cfg, tokenizer, cfg.data.apply_chat_template_kwargs)
    return agent.MultiTurnRollout(rollout_cfg.multi_turn, tokenizer, tools.tools, eos_token_ids,
                                  rollout_cfg.response_length, tools.chat_template_kwargs, tools.interactions)


def verl_agent_loops(cfg: Any, tokenizer):
    """The user's verl agent loops (`rollout.agent.agent_loop_config_path`), else None."""
    path = cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path
    if path is None:
        return None
    from hybrid_rl.agent.verl_agent_loops import VerlAgentLoops, load_agent_loops

    return VerlAgentLoops(cfg, tokenizer, load_agent_loops(path))


def call_settings(cfg: Any, prompts: Batch, engine) -> dict:
    """The sampling settings of a generate call (`prompts.meta.sampling`: the rollout's settings,
    `rollout.val_kwargs`, or greedy); seeds the sampler for it."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    sampling = prompts.meta.sampling
    if sampling is Sampling.GREEDY:
        settings = greedy_settings()
    else:
        settings = sampling_settings(rollout_cfg, validate=sampling is Sampling.VALIDATE)
    # verl's rollout.ignore_eos: every response runs to the length limit, EOS tokens included.
    settings["ignore_eos"] = bool(rollout_cfg.get("ignore_eos", False))
    # Sampling depends only on (seed, step, replica, kind of call), so a resumed run samples
    # exactly what an uninterrupted one would.
    torch.manual_seed(hash((cfg.trainer.seed, prompts.meta.step, engine.dp_rank, sampling.value)) % 2**62)
    return settings


def generate_batch(engine, multi_turn, cfg: Any, prompts: Batch, pad_token_id: int, eos_token_ids: list[int],
                   tracer: RolloutTracer | None = None, agent_loops=None) -> Batch:
    """One response (or agent trajectory) per row, sampled as `prompts.meta.sampling` says: the
    rollout's settings, `rollout.val_kwargs`, or greedy; `tracer` writes the rows' traces. With the
    tool loop (`multi_turn`) or verl agent loops of the user's (`agent_loops`), each row runs the
    agent loop its `agent_name` names (`agent.row_agent_names`)."""
    rollout_cfg = cfg.actor_rollout_ref.rollout
    if multi_turn is not None or agent_loops is not None:
        from hybrid_rl.agent import TOOL_AGENT, row_agent_names

        names = row_agent_names(prompts["agent_name"] if "agent_name" in prompts else [None] * len(prompts),
                                rollout_cfg)
        if set(names) != {TOOL_AGENT} or agent_loops is not None:
            return by_agent_loop(engine, multi_turn, agent_loops, cfg, prompts, pad_token_id, eos_token_ids, tracer,
                                 names)
    settings = call_settings(cfg, prompts, engine)
    sampling = prompts.meta.sampling
    if multi_turn is not None:
        from hybrid_rl.agent import trajectory_tensors

        rows, prompt_ids = conversation_rows(prompts), prompt_token_lists(prompts)
        trajectories = multi_turn.run(engine, prompt_ids, settings, rows)
        if tracer is not None:
            tracer.log(prompts, prompt_ids, [t.tokens for t in trajectories],
                       [t.log_probs for t in trajectories], [t.spans for t in trajectories],
                       validate=sampling is not Sampling.TRAIN)
        out = assemble_rollout(prompts, [t.tokens for t in trajectories], [t.log_probs for t in trajectories],
                               rollout_cfg.response_length, pad_token_id, eos_token_ids,
                               loss_masks=[t.loss_mask for t in trajectories])
        for key, counts in trajectory_tensors(trajectories, interactions=bool(multi_turn.interactions)).items():
            out[key] = counts
        # verl's count: the prompt, then each assistant, tool and interaction turn.
        out["num_turns"] = torch.tensor([t.assistant_turns + t.user_turns + 1 for t in trajectories])
        # What the reward function reads of the trajectory, as verl gives it: the tools' extra
        # fields, the interaction's scores and each tool call's reward.
        out["extra_info"] = [{**row["extra_info"], **t.extra_fields, "turn_scores": t.turn_scores,
                              "tool_rewards": t.tool_rewards} for row, t in zip(rows, trajectories)]
        return out
    start = now_ns()
    if sampling is Sampling.TRAIN and rollout_cfg.get("use_fire_sampling", False):
        tokens, log_probs = fire_generate(engine, prompts, settings, rollout_cfg.response_length,
                                          raw_log_probs=rollout_cfg.logprobs_mode == "raw_logprobs")
    else:
        tokens, log_probs = engine.generate(prompts, settings, rollout_cfg.response_length)
    if tracer is not None:
        end = now_ns()
        tracer.log(prompts, prompt_token_lists(prompts), tokens, log_probs,
                   [[Span("generate", start, end, tokens=(0, len(t)))] for t in tokens],
                   validate=sampling is not Sampling.TRAIN)
    out = assemble_rollout(prompts, tokens, log_probs, rollout_cfg.response_length, pad_token_id,
                           () if settings["ignore_eos"] else eos_token_ids)
    if sampling is Sampling.TRAIN and engine.routes is not None:  # for router replay R3
        out[ROUTES_KEY] = route_table(out["attention_mask"], engine.routes)
    return out


def by_agent_loop(engine, multi_turn, agent_loops, cfg: Any, prompts: Batch, pad_token_id: int,
                  eos_token_ids: list[int], tracer: RolloutTracer | None, names: list[str]) -> Batch:
    """Each row through the agent loop ``names`` gives it (single_turn_agent: one generation;
    tool_agent: the tool loop; else one of the user's verl agent loops), in the rows' order. Every
    row carries verl's `num_turns`, and with the tool loop on its columns too (single-turn rows
    one assistant turn, no tool calls), so that every rank's part of the batch has the same keys."""
    from hybrid_rl.agent import SINGLE_TURN_AGENT, TOOL_AGENT, trajectory_tensors
    from hybrid_rl.agent.loop import Trajectory

    # The user's loops run together, so that their requests share the engine's batches.
    kinds = [n if n in (SINGLE_TURN_AGENT, TOOL_AGENT) else "" for n in names]
    parts, order = [], []
    for name in sorted(set(kinds)):
        rows = np.flatnonzero(np.array([kind == name for kind in kinds]))
        if name == TOOL_AGENT:
            if multi_turn is None:  # the driver checked the rows: a bug if reached
                raise ValueError("rows ask for the tool loop (agent_name=tool_agent), which is off")
            part = generate_batch(engine, multi_turn, cfg, prompts[rows], pad_token_id, eos_token_ids, tracer)
        elif name == SINGLE_TURN_AGENT:
            part = generate_batch(engine, None, cfg, prompts[rows], pad_token_id, eos_token_ids, tracer)
            part["num_turns"] = torch.full((len(rows),), 2)  # the prompt and the answer, as verl counts
            turns = [Trajectory(assistant_turns=1) for _ in rows]
        else:
            part, turns = verl_agent_loop_part(engine, agent_loops, cfg, prompts[rows], [names[i] for i in rows],
                                               pad_token_id, eos_token_ids, tracer)
        if agent_loops is not None and AGENT_SCORE_KEY not in part:  # rows no loop of the user's scored
            part[AGENT_SCORE_KEY] = torch.full((len(rows),), float("nan"))
        if multi_turn is not None and name != TOOL_AGENT:
            for key, counts in trajectory_tensors(turns, interactions=bool(multi_turn.interactions)).items():
                part[key] = counts
            part["extra_info"] = [{**(info or {}), "turn_scores": [], "tool_rewards": []} for info in part["extra_info"]]
        parts.append(part)
        order.append(rows)
    return Batch.concat(parts)[np.argsort(np.concatenate(order))]


def verl_agent_loop_part(engine, agent_loops, cfg: Any, prompts: Batch, names: list[str], pad_token_id: int,
                         eos_token_ids: list[int], tracer: RolloutTracer | None) -> tuple[Batch, list]:
    """Rows of the user's verl agent loops (``names``): each row's prompt is the one its loop
    rendered; its trajectory's loss mask is the loop's response_mask; the loop's extra_fields and
    num_turns reach the reward function's extra_info, as in verl. Also each row's engine calls, as
    assistant turns."""
    from hybrid_rl.agent.loop import Trajectory
    from hybrid_rl.agent.verl_agent_loops import row_kwargs
    from hybrid_rl.data.dataset import left_padded

    settings = call_settings(cfg, prompts, engine)
    rows = [row_kwargs({key: values[i] for key, values in prompts.non_tensors.items() if key != "prompt_ids"})
            for i in range(len(prompts))]
    start = now_ns()
    results = agent_loops.run(engine, names, rows, settings)
    end = now_ns()
    prompt_ids = [r.prompt_ids for r in results]
    input_ids, attention_mask = left_padded(prompt_ids, pad_token_id, prompts["input_ids"].shape[1])
    rendered = Batch({"input_ids": input_ids, "attention_mask": attention_mask},
                     {**prompts.non_tensors, "prompt_ids": prompt_ids}, prompts.meta)
    if tracer is not None:
        tracer.log(rendered, prompt_ids, [r.tokens for r in results], [r.log_probs for r in results],
                   [[Span(f"agent loop {name}", start, end, tokens=(0, len(r.tokens)))]
                    for name, r in zip(names, results)],
                   validate=prompts.meta.sampling is not Sampling.TRAIN)
    out = assemble_rollout(rendered, [r.tokens for r in results], [r.log_probs for r in results],
                           cfg.actor_rollout_ref.rollout.response_length, pad_token_id, eos_token_ids,
                           loss_masks=[r.loss_mask for r in results])
    out["extra_info"] = [{**(info or {}), **r.extra_fields, "num_turns": r.num_turns}
                         for info, r in zip(prompts["extra_info"], results)]
    out["num_turns"] = torch.tensor([r.num_turns for r in results])
    out[AGENT_SCORE_KEY] = torch.tensor([float("nan") if r.reward_score is None else r.reward_score for r in results])
    return out, [Trajectory(assistant_turns=r.generations) for r in results]


# FIRE's first token: sampled this hot, among the 16 likeliest tokens unless rollout.top_k narrows it.
FIRE_TEMPERATURE, FIRE_TOP_K = 30.0, 16


def fire_top_k(top_k: int) -> int:
    """How many of the likeliest tokens FIRE draws the first token from, given the rollout's top_k."""
    return int(top_k) if top_k > 0 else FIRE_TOP_K


def fire_generate(engine, prompts: Batch, settings: dict, response_length: int,
                  raw_log_probs: bool = False) -> tuple[list, list]:
    """FIRE sampling (Chen et al. 2024, "Flaming-hot Initiation with Regular Execution",
    arXiv:2410.21236; verl 0.3's `rollout.use_fire_sampling`): each response's first token is
    drawn at temperature 30 from the top 16 (or `top_k`) tokens, under `top_p`, and the rest with
    the rollout's own settings after it. vLLM takes no temperature above 2, so the first token is
    drawn here from the engine's log-probs of the candidates (its log-prob: the hot distribution's,
    or with `raw_log_probs` the model's). A response whose first token is EOS ends there
    (assemble_rollout cuts it)."""
    candidates, log_probs = engine.top_next_tokens(prompts, fire_top_k(settings["top_k"]))
    # Softmax is shift-invariant: log-probs renormalised over the candidates give the same hot distribution.
    hot = log_probs / FIRE_TEMPERATURE
    if settings["top_p"] < 1.0:
        probs, order = torch.softmax(hot, dim=-1).sort(dim=-1, descending=True)
        outside = (probs.cumsum(dim=-1) - probs) >= settings["top_p"]  # the smallest set holding top_p
        hot = hot.masked_fill(torch.zeros_like(outside).scatter(-1, order, outside), float("-inf"))
    hot_log_probs = torch.log_softmax(hot, dim=-1)
    choice = torch.multinomial(hot_log_probs.exp(), 1)
    first = candidates.gather(1, choice)
    first_log_probs = (log_probs if raw_log_probs else hot_log_probs).gather(1, choice)
    extended = Batch({"input_ids": torch.cat([prompts["input_ids"], first], dim=1),
                      "attention_mask": torch.cat([prompts["attention_mask"], torch.ones_like(first)], dim=1)},
                     meta=prompts.meta)
    if "prompt_ids" in prompts.non_tensors:
        extended["prompt_ids"] = [list(map(int, ids)) + [int(token)] for ids, token in zip(prompts["prompt_ids"], first)]
    rest, rest_log_probs = engine.generate(extended, settings, response_length - 1)
    return ([[int(token)] + tail for token, tail in zip(first[:, 0], rest)],
            [[float(log_prob)] + tail for log_prob, tail in zip(first_log_probs[:, 0], rest_log_probs)])


def conversation_rows(prompts: Batch) -> list[dict]:
    """What interaction agents and tools read of each prompt: its chat messages, ``extra_info``
    (with ``interaction_kwargs`` and ``tools_kwargs``), data source and ground truth."""
    def column(key):
        return prompts[key] if key in prompts.non_tensors else [None] * len(prompts)

    return [{"raw_prompt": list(raw or []), "extra_info": dict(info or {}), "data_source": source,
             "ground_truth": (reward or {}).get("ground_truth")}
            for raw, info, source, reward in zip(column("raw_prompt"), column("extra_info"), column("data_source"),
                                                 column("reward_model"))]


def resolve_enforce_eager(enforce_eager: bool | None, device_type: str) -> bool:
    """`rollout.enforce_eager: null`: eager on CPU, compiled (CUDA graphs) on GPU. On CPU vLLM's
    compiled model generates ~1.25x faster in float32 on AVX2 (1.3x in bf16 on AMX) but adds
    ~120 s to a first run and ~16 s to later ones (docs/benchmarks.md): eager starts a user's
    first run soonest."""
    return device_type == "cpu" if enforce_eager is None else bool(enforce_eager)


def context_length(cfg: Any) -> int:
    """The engine's context window: `rollout.max_model_len`, else exactly prompt + response."""
    return cfg.max_model_len or cfg.prompt_length + cfg.response_length


# vLLM engine arguments that verl's scripts still pass but vLLM has dropped, translated as verl
# translates them for newer vLLM: old name -> its value -> the arguments that now say the same.
RENAMED_ENGINE_ARGS = {
    # vLLM 0.13 folded the switch into the cache's size: 0 GB is no multimodal processor cache.
    "disable_mm_preprocessor_cache": lambda disable: {"mm_processor_cache_gb": 0} if disable else {},
}


def current_engine_args(kwargs: dict) -> dict:
    """`kwargs` with the dropped names of `RENAMED_ENGINE_ARGS` in their current form."""
    current = {name: value for name, value in kwargs.items() if name not in RENAMED_ENGINE_ARGS}
    for name, translate in RENAMED_ENGINE_ARGS.items():
        if name in kwargs:
            current.update(translate(kwargs[name]))
    return current


def engine_kwargs(cfg: Any, device_type: str, latent_attention: bool = False, eager: bool = False) -> dict:
    """`rollout.engine_kwargs.vllm` (older names in their current form), and on CPU, where vLLM's
    KV blocks hold 128 tokens, blocks of 32 under prefix caching: it shares only full blocks, so
    with 128 every prompt shorter than that is computed in full, again for each of its n samples
    and for the chat template's preamble that all prompts begin with. 32 is the smallest block
    vLLM-CPU's attention takes; it made the default step's rollout 30 % faster, and cost ~5 % where
    nothing was shared (docs/benchmarks.md).

    An `eager` CPU engine also takes vLLM-CPU's fused RMSNorm kernels (`vllm_cpu.norm_priority`,
    unless the user sets the ops' priority): a compiled one gets inductor's fusion of the native
    norm, and vLLM turns on its norm-fusion passes for a priority that does not start with native.

    A model with DeepSeek's multi-head latent attention (`latent_attention`) keeps vLLM-CPU's
    blocks of 16 (its MLA kernel takes no other; prefix caching is off there) and gets torch's
    rotary embedding: vLLM-CPU's rotary kernel rotates (tokens, heads x dim) inputs as vLLM's torch
    code does but not (tokens, heads, dim) ones of more than one head, which DeepSeek's attention
    passes it (on a random DeepSeek-V3 in float32: log-probs up to 8e-3 from transformers' from
    the second position on with the kernel, 4.8e-7 with torch's). Its attention runs on vLLM-CPU's
    reference MLA backend (`CPU_MLA`) unless the user names a backend: on a CPU with AMX vLLM
    would pick its AMX backend, which takes no float32 weights (a float32 engine does not start:
    "expect weight to be bfloat16, float16, int8 ...") and packs its own copy of the latent
    up-projection when the model loads, which a push does not pack again (vLLM 0.32's amx_mla.py,
    read; not run here)."""
    kwargs = current_engine_args(dict(cfg.engine_kwargs.vllm))
    sizes = cfg.get("cudagraph_capture_sizes")
    if sizes and device_type == "cuda" and not eager:  # verl's: the batch sizes vLLM captures CUDA graphs for
        compilation = dict(kwargs.get("compilation_config") or {})
        compilation["cudagraph_capture_sizes"] = [int(size) for size in sizes]
        kwargs["compilation_config"] = compilation
    if device_type == "cpu" and latent_attention:
        compilation = dict(kwargs.get("compilation_config") or {})
        compilation["custom_ops"] = [*compilation.get("custom_ops", []), "-rotary_embedding"]
        kwargs["compilation_config"] = compilation
        if not kwargs.get("attention_backend") and not (kwargs.get("attention_config") or {}).get("backend"):
            kwargs["attention_backend"] = "CPU_MLA"
    elif device_type == "cpu" and cfg.enable_prefix_caching:
        kwargs.setdefault("block_size", 32)
    if device_type == "cpu" and eager and not {"ir_op_priority", "kernel_config"} & set(kwargs):
        kwargs["ir_op_priority"] = norm_priority()
    return kwargs


def same_model_config(model_cfg: Any) -> dict:
    """vLLM's arguments for the model config the trainer builds (`models.model_config`): verl's
    `hf_config_path` and `override_config` (which verl's engine does not get), so that both compute
    with the same settings."""
    if model_cfg is None:
        return {}
    args = {"hf_config_path": model_cfg.get("hf_config_path") or None,
            "hf_overrides": plain(model_cfg.get("override_config")) or None}
    return {key: value for key, value in args.items() if value is not None}


def quantized(cfg: Any, model_args: dict) -> dict:
    """`model_args` plus vLLM's arguments for verl's `rollout.quantization=torchao`: vLLM quantizes
    each weight as it loads it (online), with the torchao config of `quantization_config_file`."""
    if not cfg.get("quantization"):
        return model_args
    overrides = {**model_args.get("hf_overrides", {}), "quantization_config_file": cfg.quantization_config_file}
    return {**model_args, "quantization": cfg.quantization, "hf_overrides": overrides}


def uses_latent_attention(model_path: str) -> bool:
    """Whether the model's attention is DeepSeek's multi-head latent attention (MLA)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path).get_text_config(), "kv_lora_rank", None) is not None


def engine_env(cfg: Any, device_type: str) -> dict[str, str]:
    """What vLLM reads from the environment, for an engine in this process (deterministic
    external launcher); a variable the user set keeps its value where it is only a default."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device_type == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", str(cfg.kv_cache_gib))
        # vLLM-CPU compiles with plain inductor, whose AOT artifact its loader cannot reload
        # ("'function' object has no attribute 'finalize_loading'"), so every start compiled
        # again; inductor's own cache is reused across runs.
        env["VLLM_USE_AOT_COMPILE"] = os.environ.get("VLLM_USE_AOT_COMPILE", "0")
    if cfg.get("full_determinism", False):
        # verl's switch: kernels whose results do not depend on the batch a request shares (GPU only).
        env["VLLM_BATCH_INVARIANT"] = "1"
    if cfg.get("enable_rollout_routing_replay", False):
        # The experts each token was routed to (router replay R3): vLLM returns them from its V2
        # model runner only.
        env["VLLM_USE_V2_MODEL_RUNNER"] = os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1")
    return env


class VLLMRollout:
    """An in-process vLLM engine that shares the process (and the trainer's process group)."""

    def __init__(self, model_path: str, cfg: Any, device: torch.device, eos_token_ids: list[int],
                 model_cfg: Any = None):
        set_env(engine_env(cfg, device.type))  # before vLLM is imported
        self.return_routes = bool(cfg.get("enable_rollout_routing_replay", False))
        self.routes: list | None = None  # of the last generate_ids call, with return_routes
        from vllm import LLM

        from hybrid_rl.hardware import resolve_dtype

        max_model_len = context_length(cfg)
        # The trainer keeps float32 masters; the engine gets copies in this dtype.
        dtype = resolve_dtype(cfg.dtype, device.type, "engine").dtype
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        # vLLM forms its tensor-parallel groups from consecutive ranks; each group is one replica
        # whose ranks generate the same prompts in lock-step, so they share a seed.
        tp = cfg.tensor_model_parallel_size
        self.dp_rank, self.dp_size, self.is_output_rank = rank // tp, world // tp, rank % tp == 0
        # On GPU the engine releases its memory between rollouts so the trainer can use it
        # (vLLM-CPU has no sleep mode: there, trainer and engine memory coexist).
        self.sleep_between_rollouts = device.type == "cuda" and bool(cfg.free_cache_engine)
        self.asleep = False
        prometheus = bool(cfg.prometheus.enable)
        eager = resolve_enforce_eager(cfg.enforce_eager, device.type)
        self.eager_helpers = eager and device.type == "cpu"
        # vLLM collects garbage five times while it starts (and freezes the heap after): with all
        # that is loaded so far frozen first, each pass sees only the engine's new objects (~1.5 s less).
        gc.freeze()
        if device.type == "cpu":
            register_norm_kernels()
        try:
            self.llm = LLM(
                model=model_path,
                dtype=dtype,
                tensor_parallel_size=cfg.tensor_model_parallel_size,
                distributed_executor_backend="external_launcher",
                enforce_eager=eager,
                # Random weights, no file read: the worker pushes the actor's weights, already in the
                # engine's dtype, right after start (`sync_weights`).
                load_format="dummy", use_tqdm_on_load=False,
                gpu_memory_utilization=cfg.gpu_memory_utilization,
                max_model_len=max_model_len,
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=max(cfg.max_num_batched_tokens, max_model_len),
                enable_prefix_caching=cfg.enable_prefix_caching,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                # processed_logprobs (verl's default): log-probs of the distribution actually
                # sampled from (after temperature/top-k/top-p); raw_logprobs: of the model's own.
                logprobs_mode=cfg.get("logprobs_mode") or "processed_logprobs",
                # FIRE reads the log-probs of its first token's candidates (vLLM's default: up to 20).
                max_logprobs=max(20, fire_top_k(cfg.top_k)) if cfg.get("use_fire_sampling") else 20,
                scheduling_policy=cfg.get("scheduling_policy") or "fcfs",
                seed=int(cfg.seed) + self.dp_rank,
                enable_sleep_mode=self.sleep_between_rollouts,
                enable_return_routed_experts=self.return_routes,
                # vLLM's statistics: its periodic throughput log and the metrics Prometheus scrapes.
                disable_log_stats=bool(cfg.disable_log_stats),
                **({"served_model_name": served_model_name(cfg.prometheus, model_path)} if prometheus else {}),
                **quantized(cfg, same_model_config(model_cfg)),
                **engine_kwargs(cfg, device.type, latent_attention=uses_latent_attention(model_path), eager=eager),
            )
        except RuntimeError as exc:
            if "SHMManager failed. errno: 17" in str(exc):
                raise RuntimeError(
                    "vLLM-CPU's tensor-parallel group could not create its shared memory: a segment of the "
                    "same name, left by an earlier run on this machine that was killed while its engine "
                    "started, still exists. Remove it (rm /dev/shm/*cpushm_*) when no other vLLM-CPU "
                    "run is starting here, and start again.") from exc
            raise
        self.on_cpu = device.type == "cpu"
        if self.on_cpu:
            unlink_shared_memory_names()
        self.kept_weight_bytes = sum(self.llm.apply_model(kept_weight_bytes)) if self.on_cpu else 0
        # (Not with vLLM's LoRA adapters on: its loader then names the wrapped layers otherwise; nor
        # quantized, where vLLM's reload quantizes each push again.)
        self.load_in_place = (self.on_cpu and self.llm.llm_engine.vllm_config.lora_config is None
                              and not cfg.get("quantization")
                              and in_place_sync(cfg.cpu_in_place_sync, self.kept_weight_bytes,
                                                int(os.environ.get("LOCAL_WORLD_SIZE", 1)), host_memory_bytes()))
        if self.on_cpu and not self.load_in_place and any(self.llm.apply_model(lambda model: bool(expert_layers(model)))):
            lora = self.llm.llm_engine.vllm_config.lora_config is not None
            raise ValueError(
                f"{model_path} is a mixture-of-experts model: vLLM-CPU reloads expert weights without packing "
                "them for its experts kernel, so a push through its reload would give the engine wrong experts. "
                "hybrid-rl loads them in place instead, which needs "
                + ("no vLLM LoRA adapters (drop actor_rollout_ref.rollout.engine_kwargs.vllm.enable_lora)." if lora else
                   f"actor_rollout_ref.rollout.cpu_in_place_sync=true (it is {cfg.cpu_in_place_sync}; the kept copies "
                   f"take {self.kept_weight_bytes / 1e9:.1f} GB a rank)."))
        if self.load_in_place:
            self.llm.apply_model(keep_loadable_weights)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.checkpoint_layout = checkpoint_layout(self.llm.llm_engine.model_config.hf_config)
        # Rotary cos/sin caches are not checkpoint weights: vLLM restores its own after every
        # reload and warns "RotaryEmbedding: Failed to load weights" each time. (Set after the
        # engine exists: its logging set-up resets levels.)
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)
        # Chat models often end a turn with a token other than the tokenizer's EOS.
        self.stop_token_ids = list(eos_token_ids)
        # The ranks of a tensor-parallel group run the same scheduler: one of them serves the metrics.
        self.metrics_address = serve_engine_metrics() if prometheus and self.is_output_rank else None

    def settings(self) -> dict:
        """The engine's settings as vLLM resolved them (logged by the driver at start)."""
        from vllm.distributed import get_tensor_model_parallel_world_size

        config = self.llm.llm_engine.vllm_config
        return {"dtype": str(self.dtype).removeprefix("torch."), "max_model_len": config.model_config.max_model_len,
                "chunked_prefill": config.scheduler_config.enable_chunked_prefill,
                "prefix_caching": config.cache_config.enable_prefix_caching,
                "block_size": config.cache_config.block_size,
                "eager": config.model_config.enforce_eager, "tensor_parallel": get_tensor_model_parallel_world_size(),
                **({"cpu_in_place_sync": self.load_in_place} if self.on_cpu else {}),
                **({"quantization": config.model_config.quantization} if config.model_config.quantization else {}),
                **({"metrics": self.metrics_address} if self.metrics_address else {})}

    @contextlib.contextmanager
    def sampling(self):
        """Around every call that samples: the engine woken first and, where it sleeps between
        rollouts, put back to sleep after. An eager CPU engine still compiled vLLM's small
        torch.compile'd helpers at its first rollout (on this path, the one that ranks each sampled
        token's log-prob): 2-2.8 s with inductor's cache warm, 3.5 s cold, for the same integers
        that eager ops give. Eager here means eager for them too."""
        if self.asleep:
            self.llm.wake_up()  # allocations already resident (weights after a sync) are skipped
            self.asleep = False
        with torch.compiler.set_stance("force_eager") if self.eager_helpers else contextlib.nullcontext():
            yield
        if self.sleep_between_rollouts:
            # Level 1: weights go to host memory (restored on wake-up), the KV cache is dropped.
            self.llm.sleep(level=1)
            self.asleep = True

    def generate(self, batch: Batch, settings: dict, response_length: int) -> tuple[list, list]:
        if settings.get("beam_width"):
            return self.beam_search(batch, settings["beam_width"], response_length)
        prompts = prompt_token_lists(batch)
        return self.generate_ids(prompts, settings, [response_length] * len(prompts))

    def generate_ids(self, prompts: list[list[int]], settings: dict, max_tokens: list[int],
                     stop: list[str] | None = None, stop_token_ids: list[int] | None = None) -> tuple[list, list]:
        """One continuation of each token list (at most its ``max_tokens``; ending at a stop token,
        the model's EOS ids unless ``stop_token_ids`` are given or ``settings`` ask to ignore EOS, or
        after the first of the ``stop`` texts), with the sampled tokens' log-probs."""
        from vllm import SamplingParams

        ignore_eos = settings.get("ignore_eos", False)
        if stop_token_ids is None:
            stop_token_ids = [] if ignore_eos else self.stop_token_ids
        by_limit = {limit: SamplingParams(
            n=1, max_tokens=limit, temperature=settings["temperature"],
            top_p=settings["top_p"], top_k=settings["top_k"], logprobs=0, ignore_eos=ignore_eos,
            # Stop texts are matched on the detokenised output; token ids alone need no text.
            detokenize=bool(stop), stop=stop, include_stop_str_in_output=bool(stop), stop_token_ids=stop_token_ids,
        ) for limit in set(max_tokens)}
        params = [by_limit[limit] for limit in max_tokens]
        with self.sampling():
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        self.routes = [out.outputs[0].routed_experts for out in outputs] if self.return_routes else None
        tokens, log_probs = [], []
        for out in outputs:
            completion = out.outputs[0]
            tokens.append(list(completion.token_ids))
            log_probs.append([step[tok].logprob for step, tok in zip(completion.logprobs, completion.token_ids)])
        return tokens, log_probs

    def top_next_tokens(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest next tokens after each row's prompt, (rows, k), and their log-probs in
        the engine's logprobs mode (processed: renormalised over the k)."""
        from vllm import SamplingParams

        params = SamplingParams(n=1, max_tokens=1, temperature=1.0, top_k=k, logprobs=k, detokenize=False)
        with self.sampling():
            outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_token_lists(batch)], params,
                                        use_tqdm=False)
        # Each position's entries: the k ranked tokens, and the sampled one (one of them here).
        ranked = [sorted(out.outputs[0].logprobs[0].items(), key=lambda item: item[1].rank)[:k] for out in outputs]
        return (torch.tensor([[token for token, _ in row] for row in ranked], dtype=torch.long),
                torch.tensor([[entry.logprob for _, entry in row] for row in ranked], dtype=torch.float32))

    def beam_search(self, batch: Batch, beam_width: int, response_length: int) -> tuple[list, list]:
        """Each group's rows get the best beams of one vLLM beam search of its prompt (best first,
        by vLLM's length-normalised log-probability), with their tokens' log-probs."""
        from vllm.sampling_params import BeamSearchParams

        groups = beam_groups(batch)
        prompts = prompt_token_lists(batch)
        with self.sampling():
            outputs = self.llm.beam_search([{"prompt_token_ids": prompts[start]} for start, _ in groups],
                                           BeamSearchParams(beam_width=beam_width, max_tokens=response_length))
        tokens, log_probs = [], []
        for (start, count), output in zip(groups, outputs):
            prompt_len = len(prompts[start])
            for k in range(count):
                beam = output.sequences[min(k, len(output.sequences) - 1)]
                response = list(beam.tokens[prompt_len:])
                steps = beam.logprobs[len(beam.logprobs) - len(response):]
                tokens.append(response)
                log_probs.append([step[token].logprob for step, token in zip(steps, response)])
        return tokens, log_probs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream HF-named full tensors into the engine, then drop KV blocks computed with the
        old weights. On CPU they are copied into the kept weights (`vllm_cpu.keep_loadable_weights`)
        and the changed layers repacked; elsewhere vLLM's `reload_weights` loads them in place.
        Names and shapes are the trained module's, put into the checkpoint files' layout here."""
        weights = self.checkpoint_layout(weights)
        if self.load_in_place:
            self.llm.apply_model(lambda model: load_weights_in_place(model, weights))
        else:
            if self.asleep:
                # Weights back on the GPU to be overwritten; the KV cache stays released until
                # the next generate.
                self.llm.wake_up(tags=["weights"])
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights,
                                                              "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()


class HFRollout:
    """`transformers` generate on the actor's sharded module; ranks stay in lock-step through
    `synced_gpus` so FSDP's per-layer all-gathers line up even when ranks finish early."""

    def __init__(self, module: torch.nn.Module, pad_token_id: int, eos_token_ids: list[int],
                 raw_log_probs: bool = False):
        import torch.distributed as dist

        self.module = module
        # rollout.logprobs_mode=raw_logprobs: log-probs of the model's logits, not of the sampler's.
        self.raw_log_probs = raw_log_probs
        # Every rank generates its own rows.
        self.dp_rank, self.dp_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        self.is_output_rank = True
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.routes = None  # transformers' generate returns no routes

    @torch.no_grad()
    def top_next_tokens(self, batch: Batch, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The k likeliest next tokens after each row's prompt, (rows, k), and the model's log-probs
        of them (one forward of the prompts, on every rank as FSDP's all-gathers need)."""
        device = next(self.module.parameters()).device
        mask = batch["attention_mask"]
        was_training = self.module.training
        self.module.eval()
        logits = self.module(input_ids=batch["input_ids"].to(device), attention_mask=mask.to(device),
                             position_ids=(mask.cumsum(dim=1) - 1).clamp_min(0).to(device)).logits[:, -1]
        self.module.train(was_training)
        log_probs, tokens = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return tokens.cpu(), log_probs.cpu()

    @torch.no_grad()
    def generate(self, batch: Batch, settings: dict, response_length: int) -> tuple[list, list]:
        import torch.distributed as dist

        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        device = next(self.module.parameters()).device
        greedy = settings["temperature"] == 0.0
        beam_width = settings.get("beam_width")
        kwargs = dict(do_sample=not greedy, max_new_tokens=response_length,
                      pad_token_id=self.pad_token_id,
                      eos_token_id=[] if settings.get("ignore_eos") else self.eos_token_ids,
                      output_scores=True, output_logits=self.raw_log_probs, return_dict_in_generate=True,
                      use_cache=True,
                      synced_gpus=dist.is_initialized() and dist.get_world_size() > 1)
        if beam_width:  # one search per group, from its first row
            groups = beam_groups(batch)
            firsts = torch.tensor([start for start, _ in groups])
            input_ids, attention_mask = input_ids[firsts], attention_mask[firsts]
            kwargs.update(num_beams=beam_width, num_return_sequences=beam_width)
        elif not greedy:
            kwargs.update(temperature=settings["temperature"], top_p=settings["top_p"],
                          top_k=settings["top_k"] if settings["top_k"] > 0 else None)
        was_training = self.module.training
        self.module.eval()
        out = self.module.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                   **kwargs)
        self.module.train(was_training)
        generated = out.sequences[:, input_ids.shape[1]:].cpu()
        if beam_width:
            # Each returned beam's token log-probs, traced back through the beams it came from.
            token_logp = self.module.compute_transition_scores(out.sequences, out.scores, out.beam_indices,
                                                               normalize_logits=False).float().cpu()
            rows = [g * beam_width + min(k, beam_width - 1) for g, (_, count) in enumerate(groups) for k in range(count)]
            return generated[rows].tolist(), token_logp[rows].tolist()
        # Scores are the processed logits the sampler used: their log-softmax is the log-prob.
        logits = out.logits if self.raw_log_probs else out.scores
        step_logp = torch.stack([torch.log_softmax(s.float(), dim=-1) for s in logits], dim=1).cpu()
        token_logp = step_logp.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        return generated.tolist(), token_logp.tolist()
