"""A Megatron-core `GPTModel` built from a Hugging Face folder, and its weights in and out.

`initialize_parallel` sets up megatron's tensor / pipeline / data-parallel groups over the
default process group; `build_model` makes this rank's model chunks (one per virtual pipeline
stage) with the local layer spec, filled with the HF weights (`convert` splits them for TP);
`iter_hf_weights` yields full tensors with HF names, one at a time, gathered over TP and
broadcast from the pipeline stage that holds them, on every rank. On `trainer.device=cpu` all of
it runs inside `cpu.cpu_device_layer()`.
"""

from __future__ import annotations

import contextlib
import glob
import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron.cpu import check_version, cpu_device_layer
from hybrid_rl.engines.megatron.lora import Adapters, is_adapter_tensor


def device_layer(device: torch.device):
    """The context every megatron call runs in: the CPU device layer on CPU, nothing on GPU."""
    if device.type == "cpu":
        check_version()
        return cpu_device_layer()
    return contextlib.nullcontext()


def initialize_parallel(tp: int, pp: int, vpp: int | None, seed: int, ep: int = 1, cp: int = 1) -> None:
    """megatron's process groups (once per process) and its model-parallel RNG; experts are
    split over `ep` ranks and never over tensor-parallel ranks; each sequence over `cp` ranks."""
    from megatron.core import parallel_state, tensor_parallel

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vpp,
                                                 context_parallel_size=cp, expert_model_parallel_size=ep,
                                                 expert_tensor_parallel_size=1)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(hf_config, layout: convert.Layout, vpp: int | None, sequence_parallel: bool,
                       overrides: dict | None = None):
    """megatron's `TransformerConfig` (`MLATransformerConfig` for latent attention) for the HF
    config: fp32 weights unless `overrides` (the engine's precision, then the user's
    `override_transformer_config`) say otherwise."""
    from megatron.core import parallel_state
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    experts = {} if layout.experts is None else moe_settings(layout)
    latent = {} if layout.latent is None else latent_settings(layout)
    settings = dict(
        num_layers=layout.num_layers, hidden_size=hf_config.hidden_size, num_attention_heads=layout.heads,
        num_query_groups=layout.groups, kv_channels=layout.head_dim, ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=layout.qkv_bias,
        attention_dropout=0.0, hidden_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
        context_parallel_size=parallel_state.get_context_parallel_world_size(),
        virtual_pipeline_model_parallel_size=vpp, sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=torch.float32, pipeline_dtype=torch.float32, use_cpu_initialization=True,
        # Prompts and responses vary in length from batch to batch.
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        # The fused kernels need CUDA extensions (Apex / Transformer Engine).
        masked_softmax_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, persist_layer_norm=False, qk_layernorm=layout.qk_norm,
        **experts, **latent)
    config_class = TransformerConfig if layout.latent is None else MLATransformerConfig
    return config_class(**{**settings, **(overrides or {})})


def moe_settings(layout: convert.Layout) -> dict:
    """megatron's settings for the model's experts and routers."""
    from megatron.core import parallel_state

    experts = layout.experts
    settings = dict(
        num_moe_experts=experts.count, moe_ffn_hidden_size=experts.inner, moe_router_topk=experts.top_k,
        # Softmax over the top-k logits is the top-k probabilities renormalised; without
        # renormalisation, the softmax over all experts comes first.
        moe_router_pre_softmax=not experts.renormalize,
        expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=1, moe_grouped_gemm=False,
        # transformers adds no load-balancing loss to the model's output in training either.
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
        moe_shared_expert_intermediate_size=experts.shared_inner or None,
        moe_shared_expert_gate=experts.shared_gated)
    if experts.family in convert.LATENT_FAMILIES:
        settings.update(
            moe_router_topk_scaling_factor=experts.scaling,
            moe_router_dtype="fp32",  # transformers scores DeepSeek's routers in float32 whatever the weights'
            moe_layer_freq=[0] * experts.dense_layers + [1] * (layout.num_layers - experts.dense_layers))
    if experts.sigmoid:
        # The correction bias is a fixed buffer in transformers: megatron's update of it off.
        settings.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                        moe_router_bias_update_rate=0.0)
    if experts.groups > 1:
        settings.update(moe_router_num_groups=experts.groups, moe_router_group_topk=experts.group_topk)
    return settings


def latent_settings(layout: convert.Layout) -> dict:
    """`MLATransformerConfig`'s shapes and rotary settings for the model's latent attention."""
    latent = layout.latent
    settings = dict(multi_latent_attention=True, q_lora_rank=latent.q_rank, kv_lora_rank=latent.kv_rank,
                    qk_head_dim=latent.nope, qk_pos_emb_head_dim=latent.rope, v_head_dim=latent.value,
                    rotary_base=layout.rope_theta)
    if latent.yarn is None:
        return {**settings, "rope_type": "rope", "rotary_scaling_factor": 1.0}
    yarn = latent.yarn
    return {**settings, "rope_type": "yarn", "rotary_scaling_factor": yarn["factor"],
            "original_max_position_embeddings": yarn["original_max_position_embeddings"],
            "beta_fast": yarn["beta_fast"], "beta_slow": yarn["beta_slow"], "mscale": yarn["mscale"],
            "mscale_all_dim": yarn["mscale_all_dim"]}


def has_transformer_engine(device: torch.device) -> bool:
    """Whether to build with Transformer Engine's layer spec (fused kernels, sequence parallel
    norms): on CUDA where it is installed. Elsewhere the local spec, plain torch modules."""
    return device.type == "cuda" and transformer_engine_installed()


def transformer_engine_installed() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(hf_config, layout: convert.Layout, config, transformer_engine: bool = False,
                seed: int = 0) -> list[torch.nn.Module]:
    """This rank's model chunks (one per virtual pipeline stage), with random weights; with
    `layout.value_head` the last stage ends in a `ValueHead` (initialised from `seed`)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    tp = parallel_state.get_tensor_model_parallel_world_size()
    if transformer_engine:  # Llama / Qwen / Mixtral layouts only (the engine builds latent attention locally)
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=layout.experts.count if layout.experts else None, moe_grouped_gemm=False,
            qk_layernorm=layout.qk_norm)
    else:
        moe_spec = local_layer_spec(layout, experts=layout.experts is not None)
        dense_layers = layout.experts.dense_layers if layout.experts else 0
        dense_spec = local_layer_spec(layout, experts=False) if dense_layers else moe_spec
    chunks = []
    for stage in range(config.virtual_pipeline_model_parallel_size or 1):
        vp_stage = vp_stage_of(config, stage)
        if not transformer_engine:  # the final norm too, which megatron would take from its own choice
            offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
            layers = range(offset, offset + get_num_layers_to_build(config, vp_stage))
            block = TransformerBlockSubmodules(
                layer_specs=[dense_spec if layer < dense_layers else moe_spec for layer in layers],
                layer_norm=TorchRMSNorm)
        chunk = GPTModel(
            config, spec if transformer_engine else block, vocab_size=layout.padded_vocab(tp),
            max_sequence_length=hf_config.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=layout.tied, position_embedding_type="rope",
            rotary_base=layout.rope_theta, parallel_output=False, vp_stage=vp_stage)
        if layout.experts is not None and tp > 1 and parallel_state.get_expert_model_parallel_world_size() == 1:
            # With EP=1 megatron takes the experts for dense weights, reduced over the data-parallel
            # ranks only; but under TP (with sequence parallelism) each TP rank runs its whole
            # experts (expert TP is 1) on its own tokens. Marked as expert weights, their gradients
            # are summed over the expert-data-parallel group, which spans the TP ranks.
            for name, param in chunk.named_parameters():
                if convert.is_expert(name):
                    param.allreduce = False
        if layout.value_head and chunk.post_process:
            chunk.output_layer = ValueHead(config, getattr(hf_config, "initializer_range", 0.02), seed,
                                           layout.head_bias)
        chunks.append(chunk)
    return chunks


def local_layer_spec(layout: convert.Layout, experts: bool):
    """megatron's local layer spec for the model's layers (with `experts`, its MoE layers), with
    torch's RMSNorm and SDPA attention in place of megatron's own."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from hybrid_rl.engines.megatron.attention import SDPAttention

    latent = layout.latent is not None
    if latent:
        from megatron.core.transformer import multi_latent_attention

        # megatron-core 0.16.1 takes Transformer Engine for present whenever its wrappers import,
        # which they do without it (as placeholders), then type-checks modules against them.
        multi_latent_attention.HAVE_TE = transformer_engine_installed()
    # One module per expert (SequentialMLP), whose weights convert one to one.
    spec = get_gpt_layer_local_spec(num_experts=layout.experts.count if experts else None, moe_grouped_gemm=False,
                                    qk_layernorm=layout.qk_norm or latent, multi_latent_attention=latent,
                                    normalization="RMSNorm")
    attention = spec.submodules.self_attention.submodules
    attention.core_attention = SDPAttention
    spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = TorchRMSNorm
    if latent:
        from megatron.core.post_training.modelopt.layers import Linear

        attention.q_layernorm = attention.kv_layernorm = LatentRMSNorm
        # The down projections whole on every TP rank, over the rank's part of the sequence (as
        # Transformer Engine's spec has them): the local spec's column-parallel ones give the shared
        # rotary key, which each rank uses for its own heads only, the gradient of those heads alone.
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
    elif layout.qk_norm:
        attention.q_layernorm = attention.k_layernorm = TorchRMSNorm
    return spec


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm for the local layer spec, under sequence parallelism too (megatron's own
    wrapper refuses it): a norm works token by token, so on a rank's part of the sequence it is
    unchanged; only its weight's gradient, from that part alone, must be summed over the
    tensor-parallel ranks, which megatron does for parameters marked `sequence_parallel`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel


class LatentRMSNorm(TorchRMSNorm):
    """The norms of the query's and the key-value latents: transformers' DeepSeek-V3 gives them
    epsilon 1e-6 whatever the model's `rms_norm_eps`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **unused):
        super().__init__(config, hidden_size, eps=1e-6)


class ValueHead(torch.nn.Linear):
    """The critic's or a reward model's scalar head in place of GPTModel's output layer: hidden
    -> 1, with a bias as transformers' token-classification `score` (the critic), without one as
    its sequence-classification `score` (a reward model); replicated on the TP ranks, it takes
    whole sequences (`ResponsePositionsHead` gathers them under sequence parallelism), so every TP
    rank computes the same values and the same head gradients."""

    def __init__(self, config, init_std: float, seed: int, bias: bool = True):
        super().__init__(config.hidden_size, 1, bias=bias, dtype=config.params_dtype)
        with torch.no_grad():  # the same fresh head on every rank
            self.weight.copy_(torch.randn(self.weight.shape, generator=torch.Generator().manual_seed(seed)) * init_std)
            if bias:
                self.bias.zero_()

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        return super().forward(hidden), None


def global_names(chunk: torch.nn.Module, config, vp_stage: int | None, modules: bool = False) -> dict[str, str]:
    """This chunk's weight names (with `modules`, its module names) -> names with model-wide
    layer and expert numbers (no `_extra_state`, no LoRA adapter tensors: they have no HF name)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    local_experts = (config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    expert_offset = parallel_state.get_expert_model_parallel_rank() * local_experts
    value_head = isinstance(getattr(chunk, "output_layer", None), ValueHead)
    names = (name for name, _ in chunk.named_modules()) if modules else (
        name for name in chunk.state_dict() if not name.endswith("_extra_state") and not is_adapter_tensor(name))
    return {name: convert.with_expert_offset(convert.with_layer_offset(
                name.replace("output_layer.", "value_head.") if value_head else name, offset), expert_offset)
            for name in names}


def vp_stage_of(config, index: int) -> int | None:
    return index if config.virtual_pipeline_model_parallel_size else None


def freeze_routers(chunks: list[torch.nn.Module]) -> None:
    """Every mixture-of-experts router and shared-expert gate stays as loaded (verl's
    `moe_config.freeze_moe_router`): left out of the gradient buffers and the optimizer."""
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            if ".mlp.router." in name or ".mlp.shared_experts.gate_" in name:
                param.requires_grad_(False)


def save_dist_weights(chunks: list[torch.nn.Module], folder: str) -> None:
    """The chunks' weights alone as a megatron dist-checkpoint in `folder` (what
    `use_dist_checkpointing` reads): megatron's checkpoint names, every layer's tensor stacked
    over the layers, resharded to any TP x PP layout on load."""
    from megatron.core import dist_checkpointing

    os.makedirs(folder, exist_ok=True)
    state = {}
    for chunk in chunks:
        state.update(chunk.sharded_state_dict())
    dist_checkpointing.save(state, folder)


@torch.no_grad()
def load_dist_weights(chunks: list[torch.nn.Module], folder: str, prefix: str = "",
                      fresh_head: bool = False, float32_copies: bool = False) -> list[dict] | None:
    """Fill the chunks from a megatron dist-checkpoint of model weights (`save_dist_weights`;
    `prefix` before every name, verl's `dist_checkpointing_prefix`), this rank's shards only.
    With `fresh_head` (a critic from a policy's weights) the output layer keeps its initial
    weights, as verl does. With `float32_copies`, returns the weights as `load_hf_weights` does:
    read in float32, so that half-precision chunks' main weights can start from the checkpoint's
    values."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
    from megatron.core.dist_checkpointing.serialization import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException

    def read_in_float32(item):
        if isinstance(item, (ShardedTensor, ShardedTensorFactory)) and item.data.is_floating_point():
            item.data = torch.empty_like(item.data, dtype=torch.float32)
        return item

    exact = []
    for chunk in chunks:
        sharded = {key: value for key, value in chunk.sharded_state_dict(prefix=prefix).items()
                   if not (fresh_head and key.startswith(f"{prefix}output_layer."))}
        if float32_copies:
            dict_list_map_inplace(read_in_float32, sharded)
        try:
            loaded = dist_checkpointing.load(sharded, folder, strict=StrictHandling.ASSUME_OK_UNEXPECTED)
        except (Exception, CheckpointException) as exc:  # torch DCP's is a BaseException, holding megatron's
            cause = next(iter(exc.failures.values()))[0] if isinstance(exc, CheckpointException) else exc
            raise ValueError(f"The Megatron dist-checkpoint {folder} does not fit this model ({cause}): convert the "
                             "model's own Hugging Face folder with tools/convert_hf_to_mcore.py.") from exc
        state = {key[len(prefix):]: value for key, value in loaded.items()}
        missing, _ = chunk.load_state_dict(state, strict=False)
        missing = [key for key in missing if not (fresh_head and key.startswith("output_layer."))
                   and not key.endswith("_extra_state")]
        if missing:
            raise ValueError(f"The Megatron dist-checkpoint {folder} lacks {missing[:5]}.")
        exact.append({name: state[name] if name in state else value.float()
                      for name, value in chunk.state_dict().items() if not name.endswith("_extra_state")})
    return exact if float32_copies else None


@torch.no_grad()
def load_hf_weights(chunks: list[torch.nn.Module], config, path: str, layout: convert.Layout,
                    float32_copies: bool = False) -> list[dict] | None:
    """Fill the chunks with the HF safetensors weights in `path`, each rank its own TP shard.
    With `float32_copies`, returns each chunk's weights at the files' own precision (a weight the
    files lack, at the model's value): half-precision chunks round them, an optimizer's float32
    main weights should not."""
    from megatron.core import parallel_state
    from safetensors import safe_open

    tp = parallel_state.get_tensor_model_parallel_world_size()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    files = {}
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, "pt") as handle:
            files.update({key: file for key in handle.keys()})

    def read(hf_name: str) -> torch.Tensor:
        if hf_name == "lm_head.weight" and layout.tied:  # the last stage's copy of the embedding
            hf_name = "model.embed_tokens.weight"
        if hf_name not in files:
            raise ValueError(f"{path} has no tensor {hf_name!r}; is it a complete {', '.join(convert.ARCHITECTURES)} "
                             "checkpoint?")
        with safe_open(files[hf_name], "pt") as handle:
            return handle.get_tensor(hf_name)

    exact = []
    for index, chunk in enumerate(chunks):
        state = chunk.state_dict()
        exact.append({})
        for local, name in global_names(chunk, config, vp_stage_of(config, index)).items():
            if name.startswith("value_head.") and not set(convert.hf_names(name)) <= files.keys():
                exact[-1][local] = state[local].float()  # a causal LM's folder: the critic's head is fresh
                continue
            full = convert.to_megatron(name, [read(n) for n in convert.hf_names(name, layout)], layout)
            shard = convert.split_tp(name, full, tp, layout)[tp_rank]
            if shard.shape != state[local].shape:
                raise ValueError(f"{name}: the checkpoint gives {tuple(shard.shape)} for this rank, the model "
                                 f"expects {tuple(state[local].shape)}.")
            state[local].copy_(shard)
            if float32_copies:
                exact[-1][local] = shard.float().contiguous()
    return exact if float32_copies else None


@torch.no_grad()
def iter_hf_weights(chunks: list[torch.nn.Module], config, layout: convert.Layout, dtype: torch.dtype | None,
                    adapters: Adapters | None = None, only: set[str] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Every weight as a full tensor with its HF name in `dtype` (None: float32), on every rank, one at a time:
    the TP shards are gathered, and each pipeline stage's tensors are broadcast to the others.
    With tied embeddings the first stage's embedding is sent as both `model.embed_tokens.weight`
    and `lm_head.weight`, as transformers' state dict has it (the last stage's copy is skipped).
    A mixture-of-experts layer's experts come stacked, gathered from the expert-parallel ranks.
    With LoRA `adapters`, adapted weights come merged; `only`: just the tensors of those
    model-wide names."""
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    ep_group = parallel_state.get_expert_model_parallel_group()
    tp, ep = dist.get_world_size(tp_group), dist.get_world_size(ep_group)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    device = next(chunks[0].parameters()).device
    states = [chunk.state_dict() for chunk in chunks]
    if adapters is not None:
        states = [adapters.merged_state(index, state) for index, state in enumerate(states)]
    # Global name -> this rank's tensors of it: one, or a layer's local experts (stacked below).
    mine: dict[str, list[torch.Tensor]] = {}
    for index, chunk in enumerate(chunks):
        for local, name in global_names(chunk, config, vp_stage_of(config, index)).items():
            if not (layout.tied and name == "output_layer.weight") and (only is None or name in only):
                mine.setdefault(convert.stacked_expert_name(name), []).append(states[index][local].detach())
    # Every stage learns which stage holds which tensor, and its TP-merged shape and dtype.
    owned = [None] * dist.get_world_size(pp_group)
    shapes = [(name, ((len(tensors) * ep,) if convert.is_expert(name) else ()) + tuple(tensors[0].shape))
              for name, tensors in mine.items()]
    dist.all_gather_object(owned, shapes, group=pp_group)
    for stage, entries in enumerate(owned):
        for name, shard_shape in entries:
            if stage == pp_rank:
                shard = torch.stack(mine[name]) if convert.is_expert(name) else mine[name][0]
                if convert.is_expert(name) and ep > 1:  # each expert-parallel rank holds a block of experts
                    blocks = [torch.empty_like(shard) for _ in range(ep)]
                    dist.all_gather(blocks, shard.contiguous(), group=ep_group)
                    shard = torch.cat(blocks)
                if tp > 1 and convert.is_tensor_parallel(name):
                    shards = [torch.empty_like(shard) for _ in range(tp)]
                    dist.all_gather(shards, shard.contiguous(), group=tp_group)
                    full = convert.merge_tp(name, shards)
                else:
                    full = shard
                full = full.to(torch.float32).contiguous()
            else:
                full = None
            if len(owned) > 1:
                shape = torch.tensor(full.shape if full is not None else [0] * len(shard_shape), device=device)
                dist.broadcast(shape, src=dist.get_global_rank(pp_group, stage), group=pp_group)
                if full is None:
                    full = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=device)
                dist.broadcast(full, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            for hf_name, tensor in convert.to_hf(name, full, layout):
                tensor = tensor if dtype is None else tensor.to(dtype)
                yield hf_name, tensor
                if layout.tied and hf_name == "model.embed_tokens.weight":
                    # transformers' state dict names the tied output layer too, and vLLM's weight
                    # reload leaves an unnamed one at its dummy values.
                    yield "lm_head.weight", tensor


def left_aligned(micro: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[left-padded prompt | right-padded response] rows shifted left by their prompt padding.

    megatron's rotary embedding numbers the positions of a row 0, 1, ... and ignores position
    ids, so each row must start with its first real token to get the positions transformers
    gives it (`attention_mask.cumsum() - 1`). Padding then sits only at the end, where the causal
    mask hides it from every real token. Returns (input_ids, position_ids, predict): `predict`
    (B, T_response) is the index of the position whose output predicts each response token.
    """
    ids = micro["input_ids"]
    rows, length = ids.shape
    prompt_len = length - micro["responses"].shape[1]
    pad = prompt_padding(micro)
    steps = torch.arange(length, device=ids.device)
    shifted = ids.gather(1, left_aligned_columns(micro))
    predict = (prompt_len - pad - 1) + torch.arange(micro["responses"].shape[1], device=ids.device)
    return shifted, steps.expand(rows, -1), predict


def prompt_padding(micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, 1): each row's left padding of its prompt."""
    mask = micro["attention_mask"]
    prompt_len = mask.shape[1] - micro["responses"].shape[1]
    return prompt_len - mask[:, :prompt_len].sum(dim=1, keepdim=True)


def left_aligned_columns(micro: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, S): the column of the batch's row that each left-aligned position takes (`left_aligned`)."""
    length = micro["attention_mask"].shape[1]
    steps = torch.arange(length, device=micro["attention_mask"].device)
    return (steps + prompt_padding(micro)).clamp(max=length - 1)


def response_log_probs(chunk: torch.nn.Module, micro: dict[str, torch.Tensor], temperature: float,
                       vocab: int, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of the response tokens at `temperature` and the entropies of those
    next-token distributions (zeros unless `with_entropy`), from a whole-model chunk (PP=1)
    whose output layer gathers the vocabulary (`parallel_output=False`)."""
    ids, positions, predict = left_aligned(micro)
    return logits_to_log_probs(at_positions(chunk(ids, positions, None), predict), micro["responses"],
                               temperature, vocab, with_entropy)


def at_positions(outputs: torch.Tensor, predict: torch.Tensor) -> torch.Tensor:
    """(B, S, X) outputs of every position -> (B, T, X) at the positions `predict` names."""
    return outputs.gather(1, predict.unsqueeze(-1).expand(-1, -1, outputs.shape[-1]))


@dataclass
class Placement:
    """Where the outputs that are read (one per response token, or one per row) sit among this
    rank's sequence positions: all of them at their own positions without context parallelism
    (`owned` None), else each on the one context-parallel rank that holds its position."""

    local: torch.Tensor  # (B, T): index into this rank's part of the sequence
    owned: torch.Tensor | None = None  # (B, T): whether this rank holds it


def placement(predict: torch.Tensor, length: int) -> Placement:
    """`predict` (B, T), positions in a (padded) sequence of `length`, on this context-parallel
    rank, which holds chunks r and 2 CP - 1 - r of the sequence's 2 CP (megatron's split)."""
    from megatron.core import parallel_state

    size, rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    if size == 1:
        return Placement(predict)
    chunk = length // (2 * size)
    index, mirrored = predict // chunk, 2 * size - 1 - rank
    owned = (index == rank) | (index == mirrored)
    local = torch.where(index == rank, predict - rank * chunk, predict - (mirrored - 1) * chunk)
    return Placement(torch.where(owned, local, 0), owned)


def this_rank_part(tensor: torch.Tensor) -> torch.Tensor:
    """(B, S) -> (B, S / CP): this context-parallel rank's two chunks of each row."""
    from megatron.core.utils import get_batch_on_this_cp_rank

    return get_batch_on_this_cp_rank({"part": tensor})["part"]


class ResponsePositionsHead:
    """Runs the output layer (LM or value head) of `chunks` only where its outputs are read: at
    the position before each response token. A forward pre-hook narrows the hidden states
    (S, B, H) to the positions set for the forward in progress (`at`), so the output layer
    returns (B, T_response, V) logits instead of (B, S, V): with long prompts, a fraction of the
    head's compute and of the logits' memory. Under context parallelism each rank runs it at the
    positions it holds only, and `outputs` sums the ranks' parts into every rank's (B, T, X).

    Given the response tokens too (`at(place, log_probs=...)`), an LM output layer returns
    their log-probs and entropies, (B, T_response, 2) float32, instead of logits: it runs over
    `chunk_size` positions at a time, each chunk checkpointed, so that neither pass holds more
    than one chunk's logits (with a 150k vocabulary, 0.6 GB per 1k positions in float32, several
    times over for the softmax and entropy that backward needs), as the FSDP engine's chunked head
    does. The backward pass computes each chunk's logits again.

    Under sequence parallelism the hook first gathers the TP ranks' parts of the sequence (as
    megatron's GPTModel does for its last-token logits), and the output layer then runs as
    without it on the gathered states: each rank's gradient of them, summed over the TP ranks by
    the layer's backward (a vocabulary-parallel LM head) or the same on every rank (a replicated
    value head), is split back to the rank's own part.
    """

    def __init__(self, chunks: list[torch.nn.Module], sequence_parallel: bool, chunk_size: int, vocab: int):
        self.sequence_parallel, self.chunk_size, self.vocab = sequence_parallel, chunk_size, vocab
        self.place, self.log_probs = None, None
        for chunk in chunks:
            if chunk.post_process:
                layer = chunk.output_layer
                layer.register_forward_pre_hook(self._narrow)
                if not isinstance(layer, ValueHead):
                    layer.forward = self._log_probs_forward(layer.forward)
                    if sequence_parallel:  # its input is whole sequences now (megatron's own switch)
                        layer.sequence_parallel, layer.allreduce_dgrad = False, True

    def _narrow(self, module, args):
        hidden, place = args[0], self.place
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        if place.owned is None:  # (T, B, H), as the output layer expects (S, B, H)
            index = place.local.t().unsqueeze(-1).expand(-1, -1, hidden.shape[-1])
            return (hidden.gather(0, index), *args[1:])
        rows = torch.arange(place.local.shape[0], device=hidden.device).unsqueeze(1).expand_as(place.local)
        return (hidden[place.local[place.owned], rows[place.owned]].unsqueeze(1), *args[1:])  # (N, 1, H)

    def _log_probs_forward(self, logits_forward):
        def forward(hidden, *args, **kwargs):
            if self.log_probs is None:
                return logits_forward(hidden, *args, **kwargs)
            responses, temperature, with_entropy, sum_pi_squared = self.log_probs
            # In the narrowed hidden states' order.
            targets = responses.t().reshape(-1) if self.place.owned is None else responses[self.place.owned]
            flat = hidden.reshape(-1, 1, hidden.shape[-1])

            def chunk_outputs(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                logits = logits_forward(h, *args, **kwargs)[0][:, 0]
                return torch.stack(logits_to_log_probs(logits, t, temperature, self.vocab, with_entropy,
                                                       sum_pi_squared), dim=-1)

            # One empty chunk when there is no response position (a pipeline filler), so the
            # output still depends on the weights as the schedule's backward expects.
            outputs = [checkpoint(chunk_outputs, flat[start:start + self.chunk_size],
                                  targets[start:start + self.chunk_size], use_reentrant=False)
                       for start in range(0, max(flat.shape[0], 1), self.chunk_size)]
            return torch.cat(outputs).view(*hidden.shape[:2], 2), None

        return forward

    @contextlib.contextmanager
    def at(self, place: Placement, log_probs: tuple[torch.Tensor, float, bool, bool] | None = None):
        """Within the block the head runs at `place`; with `log_probs` (responses (B, T_response),
        temperature, with_entropy, sum_pi_squared) an LM head returns their log-probs and
        entropies (or Σ_v π_v²)."""
        self.place, self.log_probs = place, log_probs
        try:
            yield
        finally:
            self.place, self.log_probs = None, None

    def outputs(self, head_outputs: torch.Tensor, place: Placement) -> torch.Tensor:
        """The head's outputs (B, T_response, X) at the response positions, on every
        context-parallel rank."""
        if place.owned is None:
            return head_outputs
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

        # (1, N, X) at the positions this rank holds
        mine = head_outputs.new_zeros(*place.owned.shape, head_outputs.shape[-1]).index_put(
            (place.owned,), head_outputs[0])
        # Each output is computed on one rank; backward hands each rank the gradient of all.
        return reduce_from_tensor_model_parallel_region(mine, group=parallel_state.get_context_parallel_group())


def logits_to_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float,
                        vocab: int, with_entropy: bool, sum_pi_squared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The response tokens' log-probs and entropies (Σ_v π_v² instead with `sum_pi_squared`)
    from the last stage's (B, T, padded V) logits at the positions that predict them."""
    from hybrid_rl.algorithms import entropy_from_logits, sum_pi_squared_from_logits, token_log_probs

    logits = logits[..., :vocab].float() / temperature  # the TP padding rows are not tokens
    log_probs = token_log_probs(logits, responses)
    if sum_pi_squared:
        return log_probs, sum_pi_squared_from_logits(logits)
    entropy = entropy_from_logits(logits) if with_entropy else torch.zeros_like(log_probs)
    return log_probs, entropy
