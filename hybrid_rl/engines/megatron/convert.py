"""Exact Hugging Face <-> Megatron-core weight conversion for Llama-, Qwen2/3-, Mixtral- and DeepSeek-V3-shaped
models.

Megatron fuses what Hugging Face keeps apart: per query group, the rows of q, k and v sit
together in `linear_qkv` ([ng x (q_per_group + 2) x head_dim, hidden]), and `linear_fc1` stacks
gate over up. Tensor parallelism then splits these fused tensors by rows (query groups; gate and
up each) or by columns (`linear_proj`, `linear_fc2`), and the vocabulary rows of the embedding
and output layer, padded to a multiple of the TP size. Names use Megatron's local layer spec
(separate `input_layernorm` / `pre_mlp_layernorm`) and Transformer Engine's (the norms fused into
`linear_qkv` / `linear_fc1` as `layer_norm_weight`).

Mixture-of-experts layers (Mixtral, Qwen3-MoE) become megatron's `MoELayer`: a `router` and one
`SequentialMLP` expert per HF expert, each with its own `linear_fc1` (gate over up) and
`linear_fc2`, dealt to the expert-parallel ranks in blocks (rank r holds experts r*E/EP ...).
Weights are read from the model's files, one matrix per expert (Mixtral's files name the block
`block_sparse_moe` and the projections w1, w3, w2), and given back as transformers holds them:
each layer's experts stacked (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj`
[E, H, I]) beside the router (`mlp.gate.weight`).

DeepSeek-V3-shaped models (Moonlight, Kimi-K2) have multi-head latent attention: megatron's
`MLASelfAttention` holds HF's projections one to one (q_a_proj -> linear_q_down_proj, q_b_proj ->
linear_q_up_proj, kv_a_proj_with_mqa -> linear_kv_down_proj, kv_b_proj -> linear_kv_up_proj; the
down projections whole on every TP rank, the up projections split by heads). megatron's latent
attention rotates the rotary dimensions as DeepSeek's checkpoints lay them out, in neighbouring
pairs; for a checkpoint that rotates halves instead (config.json: rope_interleave=false) the
rotary rows of the query and of the shared rotary key are interleaved on the way in and put back
on the way out. Their routers score with a sigmoid and choose with a per-expert correction bias
(megatron's expert bias, held fixed as in transformers) among groups of experts; the first
`first_k_dense_replace` layers are dense.

Conversion only reshapes, concatenates, slices and reorders rows: HF -> Megatron -> HF is bit-exact.

Why not `mbridge`: its name maps know only Transformer Engine's fused names, and its model
builder asks for Transformer Engine's layer spec, which needs CUDA; on a CPU the local spec is
the only one megatron-core can build.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
                 "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
                 "DeepseekV3ForCausalLM")
# A critic's own folder (a value model saved by a run): the same backbones with a `score` head.
VALUE_ARCHITECTURES = ("LlamaForTokenClassification", "Qwen2ForTokenClassification", "Qwen3ForTokenClassification",
                       "MistralForTokenClassification")
# A reward model: the same backbones with a bias-free `score` head read at the last token.
SCORE_ARCHITECTURES = ("LlamaForSequenceClassification", "Qwen2ForSequenceClassification",
                       "Qwen3ForSequenceClassification", "MistralForSequenceClassification")
# A mixture-of-experts family's file names: (block, gate projection, up projection, down projection).
EXPERT_FILE_NAMES = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                     "qwen2_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                     "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                     "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
                     "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj")}
# Where a family keeps its shared expert (beside the routed ones, in every MoE layer).
SHARED_EXPERT_NAMES = {"qwen2_moe": "shared_expert", "deepseek_v2": "shared_experts", "deepseek_v3": "shared_experts"}
LATENT_FAMILIES = ("deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts model's expert layout (every decoder layer is one)."""

    count: int
    inner: int  # each expert's intermediate size
    top_k: int
    renormalize: bool  # the top-k routing weights are rescaled to sum to 1
    family: str  # a key of EXPERT_FILE_NAMES
    # A shared expert beside the routed ones in every MoE layer (0: none): its intermediate size;
    # Qwen2-MoE scales its output by a sigmoid gate (megatron's `moe_shared_expert_gate`).
    shared_inner: int = 0
    shared_gated: bool = False
    # DeepSeek's routing: the top k chosen among the `group_topk` best of `groups` expert groups,
    # their weights scaled by `scaling`; V3 scores with a sigmoid and chooses with a correction
    # bias added (the weights are the scores without it). The first `dense_layers` layers are dense.
    sigmoid: bool = False
    groups: int = 1
    group_topk: int = 1
    scaling: float = 1.0
    dense_layers: int = 0

    @classmethod
    def from_hf_config(cls, config) -> "Experts | None":
        if config.model_type == "mixtral":
            experts = cls(config.num_local_experts, config.intermediate_size, config.num_experts_per_tok, True,
                          "mixtral")
        elif config.model_type in ("qwen2_moe", "qwen3_moe"):
            if getattr(config, "mlp_only_layers", None) or getattr(config, "decoder_sparse_step", 1) != 1:
                raise ValueError(f"The Megatron engine converts {config.model_type} models whose every layer is a "
                                 "mixture of experts (config.json: decoder_sparse_step=1, mlp_only_layers=[]); use "
                                 "strategy=fsdp2 for this one.")
            shared = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
            experts = cls(config.num_experts, config.moe_intermediate_size, config.num_experts_per_tok,
                          bool(config.norm_topk_prob), config.model_type, shared, shared_gated=bool(shared))
        elif config.model_type in LATENT_FAMILIES:
            experts = cls.from_deepseek_config(config)
        else:
            return None
        if experts.top_k == 1 and experts.renormalize:
            raise ValueError("This model routes each token to one expert with weight 1 (its top-1 weight "
                             "renormalised); megatron routes a single expert only with its own probability. "
                             "Use strategy=fsdp2 for it.")
        return experts

    @classmethod
    def from_deepseek_config(cls, config) -> "Experts":
        """DeepSeek-V3's sigmoid routing (its groups scored by their best two experts), or V2's
        softmax routing as transformers computes it (not renormalised; groups scored by their best
        expert under `topk_method: group_limited_greedy`)."""
        v3 = config.model_type == "deepseek_v3"
        method = getattr(config, "topk_method", None)
        if not v3 and method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"This model routes with topk_method={method!r} (config.json), which transformers' "
                             "DeepSeek-V2 does not compute; use greedy or group_limited_greedy.")
        grouped = v3 or method == "group_limited_greedy"
        experts = cls(config.n_routed_experts, config.moe_intermediate_size, config.num_experts_per_tok,
                      v3 and bool(config.norm_topk_prob), config.model_type,
                      config.moe_intermediate_size * (config.n_shared_experts or 0), sigmoid=v3,
                      groups=(config.n_group or 1) if grouped else 1, group_topk=config.topk_group or 1,
                      scaling=float(config.routed_scaling_factor), dense_layers=config.first_k_dense_replace)
        # megatron always renormalises sigmoid weights over the top k, and scores a group by the
        # sum of its best top_k / group_topk experts.
        if v3 and experts.top_k > 1 and not experts.renormalize:
            raise ValueError("This model does not renormalise its top-k sigmoid routing weights (config.json: "
                             "norm_topk_prob=false); megatron always does. Use strategy=fsdp2 for it.")
        best = 2 if v3 else 1
        if experts.groups > 1 and experts.top_k // experts.group_topk != best:
            raise ValueError(f"This model scores its {experts.groups} expert groups by their best {best} expert(s) "
                             f"while choosing {experts.top_k} experts from {experts.group_topk} groups; megatron "
                             "scores a group by its best top_k / topk_group. Use strategy=fsdp2 for it.")
        return experts


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention shapes (per head: `nope` + `rope` query/key dims)."""

    q_rank: int | None  # the query's latent size (None: one q_proj, as DeepSeek-V2-Lite)
    kv_rank: int
    nope: int
    rope: int
    value: int
    interleaved: bool  # the checkpoint pairs neighbouring rotary dimensions (as megatron does)
    yarn: dict | None = None  # YaRN's settings (transformers' rope_parameters), None for plain rotary

    @classmethod
    def from_hf_config(cls, config, rope: dict) -> "LatentAttention":
        yarn = None
        if (rope.get("rope_type") or rope.get("type")) == "yarn":
            yarn = {"factor": float(rope["factor"]),
                    "original_max_position_embeddings": int(rope.get("original_max_position_embeddings")
                                                            or config.max_position_embeddings),
                    "beta_fast": float(rope.get("beta_fast") or 32), "beta_slow": float(rope.get("beta_slow") or 1),
                    "mscale": float(rope.get("mscale") or 1), "mscale_all_dim": float(rope.get("mscale_all_dim") or 0)}
        return cls(config.q_lora_rank, config.kv_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim, bool(getattr(config, "rope_interleave", True)), yarn)

    def interleaving_order(self, rows: int, head: int) -> torch.Tensor:
        """Row order that interleaves the two halves of each `head`-row block's last `rope` rows
        (first half's row i at 2i, second half's at 2i + 1)."""
        within = torch.arange(head)
        half = self.rope // 2
        start = head - self.rope
        within[start:] = start + torch.stack([torch.arange(half), torch.arange(half) + half], dim=1).flatten()
        return (torch.arange(rows // head).unsqueeze(1) * head + within).flatten()


@dataclass(frozen=True)
class Layout:
    """The shapes the conversion needs, from the model's HF config."""

    num_layers: int
    heads: int
    groups: int  # key/value heads
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool
    rope_theta: float
    value_head: bool = False  # a scalar head (HF `score`) instead of the LM head
    head_bias: bool = True  # the scalar head's bias: token classification (a critic) has one, sequence classification not
    qk_norm: bool = False  # Qwen3's RMSNorm of each query and key head
    experts: Experts | None = None
    latent: LatentAttention | None = None  # DeepSeek's latent attention instead of q/k/v projections

    @classmethod
    def from_hf_config(cls, config, value_head: bool = False, head_bias: bool = True) -> "Layout":
        """The layout of a model the conversion reproduces exactly; anything else is refused. A
        value model (the critic) or a reward model has no LM head, so nothing is tied to its
        embedding."""
        archs = list(getattr(config, "architectures", None) or [])
        if not set(archs) & set(ARCHITECTURES + VALUE_ARCHITECTURES + SCORE_ARCHITECTURES):
            raise ValueError(f"The Megatron engine converts {', '.join(ARCHITECTURES)} models; this model is "
                             f"{archs or config.model_type}. Use strategy=fsdp2 for it.")
        # transformers 5 keeps the rotary settings in `rope_parameters`, 4.x in rope_theta/rope_scaling.
        rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None))
        rope_type = rope.get("rope_type") or rope.get("type") or "default"
        latent = config.model_type in LATENT_FAMILIES
        known_rope = ("default", "yarn") if latent else ("default",)  # megatron's latent attention has YaRN
        problems = [f"rope type {rope_type!r}"] if rope_type not in known_rope else []
        if theta is None:
            problems.append("missing rope_theta")
        if getattr(config, "mlp_bias", False):
            problems.append("mlp_bias=true")
        if getattr(config, "layer_types", None) and set(config.layer_types) != {"full_attention"}:
            problems.append("sliding attention layers")
        sliding = getattr(config, "use_sliding_window", config.model_type in ("mistral", "mixtral"))  # Qwen2 has the switch
        if sliding and getattr(config, "sliding_window", None):
            problems.append("sliding attention window")
        if latent and getattr(config, "attention_bias", False):
            problems.append("attention_bias=true")
        # megatron's YaRN derives its attention factor and rounds its frequency range itself.
        problems += [f"YaRN setting {key}" for key in ("attention_factor", "truncate")
                     if rope_type == "yarn" and rope.get(key) not in (None, True)]
        if problems:
            raise ValueError(f"The Megatron engine does not reproduce this model's {', '.join(problems)} "
                             "(config.json); use strategy=fsdp2 for it.")
        heads = config.num_attention_heads
        return cls(num_layers=config.num_hidden_layers, heads=heads,
                   groups=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   vocab=config.vocab_size, tied=bool(config.tie_word_embeddings) and not value_head,
                   qkv_bias=bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
                                 or config.model_type == "qwen2"),
                   rope_theta=float(theta), value_head=value_head, head_bias=head_bias,
                   qk_norm=config.model_type in ("qwen3", "qwen3_moe"), experts=Experts.from_hf_config(config),
                   latent=LatentAttention.from_hf_config(config, rope) if latent else None)

    def padded_vocab(self, tp: int) -> int:
        return -(-self.vocab // tp) * tp


def is_dist_checkpoint(folder) -> bool:
    """A Megatron dist-checkpoint (torch DCP underneath, with megatron's own metadata.json)."""
    try:
        return "sharded_backend" in json.loads((Path(folder) / "metadata.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False


_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12]\.weight)")
# Megatron name (after decoder.layers.N.) -> HF names (after model.layers.N.), in fused order.
_LAYER_NAMES = {
    "input_layernorm.weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.layer_norm_weight": ["input_layernorm.weight"],
    "self_attention.linear_qkv.weight": ["self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                         "self_attn.v_proj.weight"],
    "self_attention.linear_qkv.bias": ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
    "self_attention.linear_proj.weight": ["self_attn.o_proj.weight"],
    "self_attention.q_layernorm.weight": ["self_attn.q_norm.weight"],
    "self_attention.k_layernorm.weight": ["self_attn.k_norm.weight"],
    "mlp.router.weight": ["mlp.gate.weight"],
    "mlp.router.expert_bias": ["mlp.gate.e_score_correction_bias"],
    # A layer's experts stacked (what `iter_hf_weights` gives), as transformers holds them.
    "mlp.experts.linear_fc1.weight": ["mlp.experts.gate_up_proj"],
    "mlp.experts.linear_fc2.weight": ["mlp.experts.down_proj"],
    "pre_mlp_layernorm.weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.layer_norm_weight": ["post_attention_layernorm.weight"],
    "mlp.linear_fc1.weight": ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    "mlp.linear_fc2.weight": ["mlp.down_proj.weight"],
    "mlp.shared_experts.linear_fc1.weight": ["mlp.shared_expert.gate_proj.weight", "mlp.shared_expert.up_proj.weight"],
    "mlp.shared_experts.linear_fc2.weight": ["mlp.shared_expert.down_proj.weight"],
    "mlp.shared_experts.gate_weight": ["mlp.shared_expert_gate.weight"],
}
# Latent attention's names instead (no fused tensors: one HF tensor each).
_LATENT_NAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
}
# Latent attention's linears: megatron's module name -> transformers'.
LATENT_PROJECTIONS = {mcore.split(".")[1]: hf.split(".")[1] for mcore, hf in _LATENT_NAMES.items()
                      if mcore.split(".")[1].startswith("linear_")}
_GLOBAL_NAMES = {
    "embedding.word_embeddings.weight": ["model.embed_tokens.weight"],
    "decoder.final_layernorm.weight": ["model.norm.weight"],
    "output_layer.weight": ["lm_head.weight"],
    "value_head.weight": ["score.weight"],
    "value_head.bias": ["score.bias"],
}
_COLUMN_SPLIT = ("linear_proj.weight", "linear_fc2.weight")  # split along the input dimension
# Latent attention's projections split by rows (heads); its down projections are replicated.
_ROW_SPLIT = ("linear_q_proj.weight", "linear_q_up_proj.weight", "linear_kv_up_proj.weight")
_REPLICATED = ("norm.weight", "layer_norm_weight", "mlp.router.weight", "mlp.router.expert_bias",
               "shared_experts.gate_weight", "linear_q_down_proj.weight", "linear_kv_down_proj.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def with_layer_offset(name: str, offset: int) -> str:
    """A pipeline stage's tensor name with model-wide layer numbering (its layers start at `offset`)."""
    match = _LAYER.fullmatch(name)
    return f"decoder.layers.{int(match.group(1)) + offset}.{match.group(2)}" if match else name


def with_expert_offset(name: str, offset: int) -> str:
    """An expert-parallel rank's expert tensor name with model-wide expert numbering (its experts
    start at `offset`)."""
    return re.sub(r"(mlp\.experts\.local_experts\.)(\d+)\.", lambda m: f"{m.group(1)}{int(m.group(2)) + offset}.",
                  name)


def stacked_expert_name(name: str) -> str:
    """`decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight` -> the name of layer N's
    experts stacked, `decoder.layers.N.mlp.experts.linear_fc1.weight`; other names unchanged."""
    return re.sub(r"mlp\.experts\.local_experts\.\d+\.", "mlp.experts.", name)


def is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def hf_names(name: str, layout: "Layout | None" = None, in_files: bool = True) -> list[str]:
    """The HF tensors one Megatron tensor (global layer and expert numbering) is made of. `layout`
    gives the family's own names (latent attention, a shared expert) and, `in_files`, the names in
    the model's files for one expert's tensors and a mixture-of-experts router; else the names
    transformers gives them."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _LAYER.fullmatch(name)
    experts = layout.experts if layout is not None else None
    if match and experts is not None and in_files:
        expert = _EXPERT.fullmatch(match.group(2))
        block, gate, up, down = EXPERT_FILE_NAMES[experts.family]
        if expert:
            prefix = f"model.layers.{match.group(1)}.{block}.experts.{expert.group(1)}"
            parts = [gate, up] if expert.group(2) == "linear_fc1.weight" else [down]
            return [f"{prefix}.{part}.weight" for part in parts]
        if match.group(2) == "mlp.router.weight":
            return [f"model.layers.{match.group(1)}.{block}.gate.weight"]
    if match and layout is not None and layout.latent is not None and match.group(2) in _LATENT_NAMES:
        return [f"model.layers.{match.group(1)}.{_LATENT_NAMES[match.group(2)]}"]
    if not match or match.group(2) not in _LAYER_NAMES:
        raise KeyError(f"No Hugging Face name for the Megatron tensor {name!r}.")
    parts = _LAYER_NAMES[match.group(2)]
    if experts is not None and experts.family in SHARED_EXPERT_NAMES:
        parts = [part.replace("mlp.shared_expert.", f"mlp.{SHARED_EXPERT_NAMES[experts.family]}.") for part in parts]
    return [f"model.layers.{match.group(1)}.{part}" for part in parts]


def _rope_order(name: str, layout: Layout) -> torch.Tensor | None:
    """For a latent-attention tensor whose checkpoint rotates halves: the HF rows in the order
    megatron holds them (see the module's docstring); None for every other tensor."""
    latent = layout.latent
    if latent is None or latent.interleaved:
        return None
    if name.endswith(("linear_q_proj.weight", "linear_q_up_proj.weight")):
        return latent.interleaving_order(layout.heads * (latent.nope + latent.rope), latent.nope + latent.rope)
    if name.endswith("linear_kv_down_proj.weight"):
        return latent.interleaving_order(latent.kv_rank + latent.rope, latent.kv_rank + latent.rope)
    return None


def to_megatron(name: str, hf: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    """The full (unsplit) Megatron tensor `name` from its HF parts (`hf_names(name)` order)."""
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        q, k, v = hf
        per_group = layout.heads // layout.groups
        rest = q.shape[1:]
        fused = torch.cat([q.reshape(layout.groups, per_group * layout.head_dim, *rest),
                           k.reshape(layout.groups, layout.head_dim, *rest),
                           v.reshape(layout.groups, layout.head_dim, *rest)], dim=1)
        return fused.reshape(-1, *rest)
    if name.endswith("linear_fc1.weight"):  # gate over up, as one expert's too
        return torch.cat(hf, dim=0)
    (tensor,) = hf
    order = _rope_order(name, layout)
    return tensor if order is None else tensor[order]


def to_hf(name: str, tensor: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of the full Megatron tensor `name` (inverse of `to_megatron`)."""
    names = hf_names(name, layout, in_files=False)
    order = _rope_order(name, layout)
    if order is not None:
        tensor = tensor[torch.argsort(order)]
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        per_group = layout.heads // layout.groups
        rest = tensor.shape[1:]
        grouped = tensor.reshape(layout.groups, (per_group + 2) * layout.head_dim, *rest)
        q, k, v = grouped.split([per_group * layout.head_dim, layout.head_dim, layout.head_dim], dim=1)
        parts = [q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)]
    elif name.endswith("linear_fc1.weight") and not is_expert(name):
        parts = list(tensor.chunk(2, dim=0))
    elif name in _VOCAB:
        parts = [tensor[:layout.vocab]]  # without the TP padding rows
    else:
        parts = [tensor]
    return list(zip(names, parts))


def split_tp(name: str, full: torch.Tensor, tp: int, layout: Layout) -> list[torch.Tensor]:
    """The TP ranks' shards of a full Megatron tensor."""
    if name in _VOCAB:
        padded = full.new_zeros(layout.padded_vocab(tp), *full.shape[1:])
        padded[:full.shape[0]] = full
        return list(padded.chunk(tp, dim=0))
    if not is_tensor_parallel(name):
        return [full] * tp
    if name.endswith(_COLUMN_SPLIT):
        return list(full.chunk(tp, dim=1))
    if name.endswith(_ROW_SPLIT):
        return list(full.chunk(tp, dim=0))
    if name.endswith("linear_fc1.weight"):
        gate, up = full.chunk(2, dim=0)
        return [torch.cat(parts, dim=0) for parts in zip(gate.chunk(tp, dim=0), up.chunk(tp, dim=0))]
    if name.endswith("linear_qkv.weight") or name.endswith("linear_qkv.bias"):
        # Whole query groups per rank; with fewer groups than ranks, equal row blocks of the
        # fused tensor (megatron gathers the qkv output and picks its group).
        return list(full.chunk(tp, dim=0))
    raise KeyError(f"No tensor-parallel split for the Megatron tensor {name!r}.")


def merge_tp(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `split_tp` (vocabulary padding kept; `to_hf` drops it)."""
    if len(shards) == 1:
        return shards[0]
    if name.endswith(_COLUMN_SPLIT):
        return torch.cat(shards, dim=1)
    if name.endswith("linear_fc1.weight"):
        halves = [shard.chunk(2, dim=0) for shard in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if name in _VOCAB or name.endswith(("linear_qkv.weight", "linear_qkv.bias") + _ROW_SPLIT):
        return torch.cat(shards, dim=0)
    return shards[0]


def is_tensor_parallel(name: str) -> bool:
    """Whether TP ranks hold different shards of `name` (norms, the value head, a router and its
    bias, a shared expert's gate, latent attention's down projections and the experts, with an
    expert tensor-parallel size of 1, are replicated)."""
    return (not name.endswith(_REPLICATED)
            and not name.startswith("value_head.") and not is_expert(name))


# The model's tensors in a Megatron dist-checkpoint (the optimizer's are under "optimizer.").
DIST_CHECKPOINT_PREFIXES = ("embedding.", "decoder.", "output_layer.")


def decoder_layers(key: str, tensor: torch.Tensor) -> list[tuple[int, str, torch.Tensor]]:
    """A dist-checkpoint's `decoder.layers.*` tensor, read whole, as (layer number, name within
    the layer, that layer's tensor): stacked along dim 0, or where megatron keys layers that
    differ (dense and MoE) one by one, `decoder.layers.N.*` holds layer N's own."""
    rest = key[len("decoder.layers."):]
    number, _, inner = rest.partition(".")
    if number.isdigit():
        return [(int(number), inner, tensor)]
    return [(index, rest, layer) for index, layer in enumerate(tensor)]


def hf_state_from_dist_checkpoint(tensors: dict[str, torch.Tensor], layout: Layout) -> dict[str, torch.Tensor]:
    """HF-named tensors from a Megatron dist-checkpoint's model tensors, read whole: each
    `decoder.layers.*` tensor stacks all layers along dim 0 (an experts tensor then all of a
    layer's experts along dim 1, as transformers stacks them), or, where the layers differ
    (dense and MoE), `decoder.layers.N.*` holds layer N's own, and TP shards are already merged
    (the vocabulary padding stays, `to_hf` drops it). A critic's `output_layer` is its value head."""
    state = {}
    for key, tensor in tensors.items():
        if key.startswith("decoder.layers."):
            # A layer's experts are stacked there too: [layers, experts, ...].
            parts = [(f"decoder.layers.{index}.{rest.replace('mlp.experts.experts.', 'mlp.experts.')}", layer)
                     for index, rest, layer in decoder_layers(key, tensor)]
        elif layout.value_head and key.startswith("output_layer."):
            parts = [(key.replace("output_layer.", "value_head."), tensor)]
        else:
            parts = [(key, tensor)]
        for name, part in parts:
            state.update(to_hf(name, part, layout))
    return state
