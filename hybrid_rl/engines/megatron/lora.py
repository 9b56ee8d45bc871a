"""LoRA on the Megatron engine, with verl's Megatron keys (`actor_rollout_ref.model.lora.*`, and
the critic's `critic.model.lora.*`: `type`, `rank`, `alpha`, `target_modules` or
`exclude_modules`, `lora_A_init_method`, `lora_B_init_method`, `dropout`, `dropout_position`,
`dtype`, `adapter_path`).

Each adapted layer is one of megatron's linears (`linear_qkv`, `linear_proj`, `linear_fc1`,
`linear_fc2`, an expert's too; of latent attention `linear_q_proj`, `linear_q_down_proj`,
`linear_q_up_proj`, `linear_kv_down_proj`, `linear_kv_up_proj`) with a `LoraAdapter` beside it
(the child `<name>_adapter` of the same parent, so every base weight keeps its name): a forward hook adds
scaling * B A x to the layer's output. With `type=lora` (megatron-bridge's default) a fused layer
gets one adapter: query, key and value (and gate and up) share A. With `type=canonical_lora`
each of its projections has its own (`linear_q_adapter`, ..., `linear_fc1_up_adapter`), which
adds to that projection's rows of the fused output, as peft's adapters of the HF model do. An
adapter is split over TP as its layer is: beside a column-parallel layer A is whole and B holds
this rank's output rows; beside a row-parallel one A holds this rank's input columns and B is
whole; beside a replicated one (latent attention's down projections) both are whole. The whole
factor's input (or output) is exchanged over TP ranks so that every rank computes what a single
process would; under sequence parallelism it sees this rank's tokens only,
so its gradient is summed over TP as a sequence-parallel norm's is (`sequence_parallel`).

The base model is frozen (only adapters are in megatron's DDP buffers and optimizer; a critic's
value head, new, trains whole beside them), the reference policy is the model with its adapters
switched off, the rollout and the exported model
get merged weights W + scaling * B A (`merged_state`), and checkpoints hold the adapters alone
(and a critic's head). `dtype: float32` keeps the adapters in float32 beside a bf16/fp16 model
(they compute in float32 on the layer's input and add their output in the layer's dtype), as
peft keeps a half-precision model's adapters on the FSDP engine: the optimizer then steps them
directly, and an update smaller than a half-precision rounding step still moves the policy.
(megatron-bridge's LoRA imports Transformer Engine at module level and pins transformers < 5,
so it cannot run here; this is the same arithmetic on megatron-core's own layers.)
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import zlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybrid_rl.engines.base import all_reduce_scalar
from hybrid_rl.engines.lora import HEAD_MODULES, VALUE_HEAD
from hybrid_rl.engines.megatron import convert
from hybrid_rl.hardware import TORCH_DTYPES

logger = logging.getLogger(__name__)

ADAPTER_SUFFIX = "_adapter"
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
# The HF projections of each fused Megatron layer, in `convert.hf_names` order.
HF_PARTS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
            "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",),
            **{mcore: (hf,) for mcore, hf in convert.LATENT_PROJECTIONS.items()}}
# canonical_lora's names for the projections of a fused layer (megatron-bridge's), in the same order.
CANONICAL_PARTS = {"linear_qkv": ("linear_q", "linear_k", "linear_v"), "linear_fc1": ("linear_fc1_gate", "linear_fc1_up")}
PART_OF = {part: (fused, index) for fused, parts in CANONICAL_PARTS.items() for index, part in enumerate(parts)}


def enabled(model_cfg: Any) -> bool:
    """LoRA on the Megatron engine: `lora.rank` > 0 or an adapter to start from."""
    section = model_cfg.get("lora") or {}
    return int(section.get("rank", 0) or 0) > 0 or bool(section.get("adapter_path"))


def check_dtype(key: str, dtype: torch.dtype | None, model_dtype: torch.dtype) -> None:
    """`lora.dtype` (at `key`) is null, the model's, or float32: half-precision adapters beside
    a float32 model would be stepped in half precision, with no float32 copy to keep small updates."""
    if dtype not in (None, model_dtype, torch.float32):
        name = str(dtype).removeprefix("torch.")
        raise ValueError(f"{key}={name}: the adapters are kept in the model's {str(model_dtype).removeprefix('torch.')} "
                         f"(megatron.dtype; set null) or in float32; in {name} they would be trained without float32 "
                         "copies.")


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    exclude_modules: tuple[str, ...]
    a_init: str
    b_init: str
    adapter_path: str | None
    canonical: bool = False  # one adapter per projection of a fused layer
    key: str = "actor_rollout_ref.model.lora"  # where the settings are, for errors
    value_head: bool = False  # a critic: its head trains whole
    dropout: float = 0.0  # on the adapter's input (`pre`) or output (`post`), in training passes only
    dropout_position: str = "pre"
    dtype: torch.dtype | None = None  # the adapters' (None: the model's)

    @classmethod
    def from_config(cls, section: Any, key: str, value_head: bool = False) -> "LoraSettings":
        """From `model.lora` (at `key`); with `adapter_path`, rank, alpha and targets are the
        adapter's own (a critic's may hold its head, peft's `modules_to_save`)."""
        path = section.get("adapter_path")
        canonical = section.get("type", "lora") == "canonical_lora"
        targets = tuple(section.get("target_modules") or ())
        excluded = tuple(section.get("exclude_modules") or ())
        rank, alpha = int(section.get("rank") or 0), float(section.get("alpha"))
        if path:
            with open(os.path.join(os.path.expanduser(str(path)), "adapter_config.json")) as handle:
                saved = json.load(handle)
            heads = set(HEAD_MODULES) if value_head else set()
            if saved.get("use_dora") or saved.get("use_rslora") or set(saved.get("modules_to_save") or ()) - heads or (
                    saved.get("bias", "none") != "none"):
                raise ValueError(f"{key}.adapter_path={path!r}: DoRA, rsLoRA, biases and modules_to_save (other than "
                                 "a critic's head) are not supported; use a plain LoRA adapter.")
            rank, alpha, excluded = int(saved["r"]), float(saved["lora_alpha"]), ()
            saved_leaves = {str(name).rsplit(".", 1)[-1] for name in saved["target_modules"]}
            if canonical:  # each HF projection its own adapter
                targets = tuple(CANONICAL_PARTS.get(fused, (fused,))[index] for fused, parts in HF_PARTS.items()
                                for index, part in enumerate(parts) if part in saved_leaves)
            else:
                targets = tuple(fused for fused, parts in HF_PARTS.items() if set(parts) & saved_leaves)
        dtype = section.get("dtype")
        return cls(rank, alpha, targets, excluded, str(section.get("lora_A_init_method") or "xavier"),
                   str(section.get("lora_B_init_method") or "zero"), str(path) if path else None, canonical, key,
                   value_head, float(section.get("dropout") or 0.0), str(section.get("dropout_position") or "pre"),
                   TORCH_DTYPES[str(dtype)] if dtype else None)

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def matches(self, name: str) -> bool:
        """verl's / megatron-bridge's rule: a target is a layer's own name or a wildcard over
        its full name (`*.layers.0.*.linear_qkv`); `exclude_modules` instead adapts every
        layer except those it names."""
        if self.target_modules:
            return any(_names(t, name) for t in self.target_modules)
        return not any(_names(e, name) for e in self.exclude_modules)

    def unmatched_targets(self, names: list[str]) -> list[str]:
        """The target_modules that name none of `names` (e.g. verl's default `linear_qkv` on a
        model with latent attention, whose projections have names of their own)."""
        return [t for t in self.target_modules if not any(_names(t, name) for name in names)]


def _names(pattern: str, name: str) -> bool:
    """Whether a target (or excluded) module `pattern` names the layer `name`."""
    return name.rsplit(".", 1)[-1] == pattern or fnmatch.fnmatchcase(name, pattern)


def _init(tensor: torch.Tensor, method: str, generator: torch.Generator) -> torch.Tensor:
    """megatron-bridge's initialisations: xavier normal, kaiming uniform (a = sqrt 5, torch's
    default for a linear), normal (std 0.02), zero."""
    if method == "xavier":
        fan_out, fan_in = tensor.shape
        return tensor.normal_(0.0, (2.0 / (fan_in + fan_out)) ** 0.5, generator=generator)
    if method == "kaiming":
        bound = 1.0 / tensor.shape[1] ** 0.5  # kaiming_uniform_ with a = sqrt(5)
        return tensor.uniform_(-bound, bound, generator=generator)
    if method == "normal":
        return tensor.normal_(0.0, 0.02, generator=generator)
    return tensor.zero_()


class LoraAdapter(torch.nn.Module):
    """scaling * B A x beside one megatron parallel linear (`base`), split over TP as it is.
    `name` is the layer's model-wide name (`decoder.layers.N....linear_qkv`), or with `part` (the
    index of a projection of a fused layer, canonical LoRA) the projection's (`...linear_q`)."""

    def __init__(self, base: torch.nn.Module, name: str, settings: LoraSettings, layout: convert.Layout,
                 seed: int, part: int | None = None):
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.name, self.scaling, self.enabled = name, settings.scaling, True
        self.dropout, self.dropout_after = settings.dropout, settings.dropout_position == "post"
        self.column = isinstance(base, ColumnParallelLinear)
        # Latent attention's down projections: a plain linear, whole on every TP rank.
        replicated = not isinstance(base, (ColumnParallelLinear, RowParallelLinear))
        self.group = base.tp_group
        tp, tp_rank = self.group.size(), self.group.rank()
        # Experts' linears exchange nothing over TP (expert_tensor_parallel_size is 1).
        self.exchange = tp > 1 and not replicated and not base.explicit_expert_comm
        # Whether the adapter sees this rank's part of the sequence only.
        self.sequence_parallel = (self.exchange and base.sequence_parallel) or (
            replicated and tp > 1 and getattr(base.weight, "sequence_parallel", False))
        self.part = part
        layer = f"{name.rpartition('.')[0]}.{PART_OF[name.rpartition('.')[2]][0]}" if part is not None else name
        self.weight_name = f"{layer}.weight"
        out_features, in_features = ((base.out_features, base.in_features) if replicated
                                     else (base.output_size, base.input_size))
        # A projection's rows of this rank's fused output (None: all of them).
        self.rows = None if part is None else _part_rows(layer, part, base.output_size_per_partition, layout, tp,
                                                         settings.key)
        if part is not None:
            out_features = len(self.rows) * tp
        # Drawn whole from a generator of the layer's name, then split: the same adapter in every
        # layout.
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        a = _init(torch.empty(settings.rank, in_features), settings.a_init, generator)
        b = _init(torch.empty(out_features, settings.rank), settings.b_init, generator)
        sharded = "lora_B" if self.column else "lora_A"
        if self.exchange:
            if part is not None:  # a projection's rows are split over TP in equal blocks
                b = b.chunk(tp)[tp_rank]
            elif self.column:
                b = convert.split_tp(self.weight_name, b, tp, layout)[tp_rank]
            else:
                a = convert.split_tp(self.weight_name, a, tp, layout)[tp_rank]
        device = base.weight.device
        self.lora_A = torch.nn.Parameter(a.to(device))
        self.lora_B = torch.nn.Parameter(b.to(device))
        for param_name, param in (("lora_A", self.lora_A), ("lora_B", self.lora_B)):
            # megatron counts an expert's weights in the grad norm on every TP rank
            if getattr(base, "is_expert", False):
                set_tensor_model_parallel_attributes(param, True, 0, 1)
            elif param_name == sharded and self.exchange:
                set_tensor_model_parallel_attributes(param, True, 0 if self.column else 1, 1)
            elif self.sequence_parallel:  # the whole factor sees this rank's tokens only
                param.sequence_parallel = True
            # An expert's adapter is reduced over the expert-data-parallel ranks, as its layer.
            param.allreduce = getattr(base.weight, "allreduce", True)
        self.gated = self.column and part is None and name.endswith("linear_fc1")
        if self.rows is not None:
            self.rows = self.rows.to(device)
        base.register_forward_hook(self._add_to_output)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        if not self.dropout_after:  # the column adapter's input is the same on every TP rank (no SP)
            x = self._dropout(x, same_on_tp_ranks=self.column)
        h = F.linear(x.to(self.lora_A.dtype), self.lora_A)
        if self.exchange:
            if self.column:  # every rank needs A x of every token it computes outputs for
                h = (mappings.gather_from_sequence_parallel_region(h, group=self.group) if self.sequence_parallel
                     else mappings.copy_to_tensor_model_parallel_region(h, group=self.group))
            else:  # A x summed over the ranks' input columns, as the layer's output is
                h = (mappings.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
                     if self.sequence_parallel else mappings.reduce_from_tensor_model_parallel_region(h, group=self.group))
        out = F.linear(h, self.lora_B) * self.scaling
        # The row adapter's output is the same on every TP rank (no SP).
        return self._dropout(out, same_on_tp_ranks=not self.column) if self.dropout_after else out

    def _dropout(self, x: torch.Tensor, same_on_tp_ranks: bool) -> torch.Tensor:
        """Dropout in training passes only (log-prob passes run without gradients). A tensor every
        TP rank holds whole needs the same mask on each: the default generator, which megatron
        seeds alike on TP ranks; one whose ranks hold different parts (a TP shard, or their own
        tokens under sequence parallelism) draws from megatron's per-TP-rank generator."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        if not self.dropout or not (self.training and torch.is_grad_enabled()):
            return x
        if not self.exchange or (same_on_tp_ranks and not self.sequence_parallel):
            return F.dropout(x, self.dropout, training=True)
        with get_cuda_rng_tracker().fork():
            return F.dropout(x, self.dropout, training=True)

    def _add_to_output(self, module, args, output):
        if not self.enabled:
            return output
        out, bias = output
        if self.rows is None:
            return out + self(args[0]).to(out.dtype), bias
        return out.index_add(out.dim() - 1, self.rows, self(args[0]).to(out.dtype)), bias

    @torch.no_grad()
    def merged_into(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the float32 `weight` plus scaling * B A (both splits:
        B_local A_local; a projection's adapter adds to its rows only)."""
        delta = torch.mm(self.lora_B.float(), self.lora_A.float()) * self.scaling
        return weight + delta if self.rows is None else weight.index_add(0, self.rows, delta)

    def hf_modules(self, layout: convert.Layout) -> list[str]:
        """The HF modules (peft's adapted module names) this adapter stands for."""
        names = [n.removesuffix(".weight") for n in convert.hf_names(self.weight_name, layout)]
        return names if self.part is None else [names[self.part]]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """The factors for megatron's dist-checkpointing, split as the layer's weight is
        (gate and up halves of B each split, as megatron does for `linear_fc1`)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        axes = ({"lora_B": 0} if self.column else {"lora_A": 1}) if self.exchange else {}
        state = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axes,
                                                    sharded_offsets, tp_group=self.group,
                                                    dp_cp_group=(metadata or {}).get("dp_cp_group"))
        if self.gated and self.exchange:
            state[f"{prefix}lora_B"] = apply_swiglu_sharded_factory(
                state[f"{prefix}lora_B"], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
        return state


def _part_rows(layer: str, part: int, local_out: int, layout: convert.Layout, tp: int, key: str) -> torch.Tensor:
    """The rows of projection `part` in a TP rank's shard of the fused layer `layer`: of gate or
    up, one half; of query, key or value, its rows in each of the rank's query groups."""
    if layer.endswith("linear_fc1"):
        half = local_out // 2
        return torch.arange(part * half, (part + 1) * half)
    if layout.groups % tp:
        raise ValueError(f"{key}.type=canonical_lora needs the key/value heads ({layout.groups}) split evenly over "
                         f"tensor_model_parallel_size={tp}; use type=lora, or a TP size that divides them.")
    per_group, head = layout.heads // layout.groups, layout.head_dim
    start, size = ((0, per_group * head), (per_group * head, head), ((per_group + 1) * head, head))[part]
    block = (per_group + 2) * head
    return torch.cat([torch.arange(group * block + start, group * block + start + size)
                      for group in range(layout.groups // tp)])


def is_adapter_tensor(name: str) -> bool:
    return f"{ADAPTER_SUFFIX}.lora_" in name


def is_head_tensor(name: str) -> bool:
    """A value head's tensor (megatron's name for the head of the last stage)."""
    return name.startswith("output_layer.")


class Adapters:
    """The adapters of a model's chunks: attached, switched off, merged, loaded."""

    def __init__(self, chunks: list[torch.nn.Module], module_names: list[dict[str, str]], settings: LoraSettings,
                 layout: convert.Layout, seed: int):
        """Freeze `chunks` (but a critic's value head) and attach an adapter beside every
        matching linear; `module_names` maps each chunk's module names to model-wide ones."""
        from megatron.core.post_training.modelopt.layers import Linear
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        linears = (ColumnParallelLinear, RowParallelLinear, Linear)  # Linear: latent attention's down projections
        self.settings, self.layout, self.chunks = settings, layout, chunks
        # Per chunk: chunk-local layer name -> its adapters (several: a fused layer's projections).
        self.by_chunk: list[dict[str, list[LoraAdapter]]] = []
        layer_names: list[str] = []  # model-wide names of this rank's linears (and their projections)
        for chunk, names in zip(chunks, module_names):
            for name, param in chunk.named_parameters():
                param.requires_grad_(settings.value_head and is_head_tensor(name))
            adapters = {}
            for local, module in list(chunk.named_modules()):
                if not isinstance(module, linears) or ".layers." not in local:
                    continue
                parent_name, _, leaf = local.rpartition(".")
                parent = chunk.get_submodule(parent_name)
                layer_names.append(names[local])
                if settings.canonical and leaf in CANONICAL_PARTS:  # `linear_qkv` itself names all three
                    prefix = names[local].rpartition(".")[0]
                    layer_names.extend(f"{prefix}.{part}" for part in CANONICAL_PARTS[leaf])
                    chosen = [(index, part) for index, part in enumerate(CANONICAL_PARTS[leaf])
                              if settings.matches(f"{prefix}.{part}") or settings.matches(names[local])]
                    for index, part in chosen:
                        adapter = LoraAdapter(module, f"{prefix}.{part}", settings, layout, seed, index)
                        parent.add_module(part + ADAPTER_SUFFIX, adapter)
                        adapters.setdefault(local, []).append(adapter)
                elif settings.matches(names[local]):
                    adapter = LoraAdapter(module, names[local], settings, layout, seed)
                    parent.add_module(leaf + ADAPTER_SUFFIX, adapter)
                    adapters[local] = [adapter]
            self.by_chunk.append(adapters)
        # Counted over every rank: under PP a target may name only another stage's layers.
        device = next(chunks[0].parameters()).device
        if not all_reduce_scalar(sum(len(adapters) for adapters in self.by_chunk), device):
            leaves = sorted({n.rsplit(".", 1)[-1] for c in chunks for n, m in c.named_modules()
                             if isinstance(m, linears) and ".layers." in n})
            raise ValueError(f"{settings.key}.target_modules={list(settings.target_modules)} / exclude_modules="
                             f"{list(settings.exclude_modules)} leave no layer to adapt; the model's linear layers are "
                             f"{leaves} (or wildcards over full names, e.g. '*.layers.0.*.linear_qkv').")
        if settings.target_modules and not settings.adapter_path:
            self._warn_unmatched(settings, layer_names, device)
        if settings.adapter_path:
            self._load_peft(settings.adapter_path)

    @staticmethod
    def _warn_unmatched(settings: LoraSettings, layer_names: list[str], device: torch.device) -> None:
        """A target that no rank's layer has (under PP another stage's may) is worth a warning,
        not a stop: verl's default targets name linear_qkv, which latent attention lacks."""
        unmatched = settings.unmatched_targets(layer_names)
        flags = torch.tensor([t in unmatched for t in settings.target_modules], dtype=torch.int32, device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        unmatched = [t for t, flag in zip(settings.target_modules, flags.tolist()) if flag]
        if unmatched and dist.get_rank() == 0:
            leaves = sorted({name.rsplit(".", 1)[-1] for name in layer_names})
            logger.warning("%s.target_modules: %s adapt nothing in this model; its linear layers are %s.",
                           settings.key, unmatched, leaves)

    def restore_dtype(self) -> None:
        """Back to `lora.dtype` after megatron's Float16Module cast the chunks to half precision."""
        if self.settings.dtype is not None:
            for adapter in self._all():
                adapter.to(self.settings.dtype)

    @contextlib.contextmanager
    def disabled(self):
        adapters = list(self._all())
        for adapter in adapters:
            adapter.enabled = False
        try:
            yield
        finally:
            for adapter in adapters:
                adapter.enabled = True

    def merged_state(self, index: int, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Chunk `index`'s state dict with every adapted weight merged and no adapter tensors."""
        merged = {name: t for name, t in state.items() if not is_adapter_tensor(name)}
        for local, adapters in self.by_chunk[index].items():
            weight = state[f"{local}.weight"].float()
            for adapter in adapters:
                weight = adapter.merged_into(weight)
            merged[f"{local}.weight"] = weight
        return merged

    def _all(self) -> Iterator[LoraAdapter]:
        return (a for chunk in self.by_chunk for adapters in chunk.values() for a in adapters)

    def adapted_weights(self) -> set[str]:
        """Model-wide names of the weights this rank's adapters change."""
        return {a.weight_name for a in self._all()}

    def save_peft_config(self, folder: str) -> None:
        """peft's `adapter_config.json` for the whole model's adapters (every rank's, gathered:
        collective), written by rank 0: with it `hybrid-rl-export` rebuilds the adapter on the
        base model (`hf_adapter_state`) and writes it merged or in peft's format."""
        from peft import LoraConfig

        # Experts' adapters have no module of their own in transformers' model (its experts are
        # stacked tensors): the export merges them itself (`expert_deltas`).
        names = [None] * dist.get_world_size()
        dist.all_gather_object(names, sorted({m for a in self._all() if not convert.is_expert(a.weight_name)
                                              for m in a.hf_modules(self.layout)}))
        modules = sorted({name for rank_names in names for name in rank_names})
        if dist.get_rank() == 0:
            # A critic's: peft's token classifier, whose head is saved whole beside the adapter.
            LoraConfig(r=self.settings.rank, lora_alpha=self.settings.alpha, target_modules=modules, lora_dropout=0.0,
                       bias="none", task_type="TOKEN_CLS" if self.settings.value_head else "CAUSAL_LM",
                       modules_to_save=[VALUE_HEAD] if self.settings.value_head else None).save_pretrained(folder)

    @torch.no_grad()
    def _load_peft(self, path: str) -> None:
        """Start from a peft adapter folder of the HF model (what `PeftModel.save_pretrained`
        and `hybrid-rl-export --adapter-only` write). With type=lora a fused layer's projections
        must share A. A critic's adapter may hold its head: it replaces the one loaded."""
        from safetensors.torch import load_file

        file = os.path.join(os.path.expanduser(path), "adapter_model.safetensors")
        if not os.path.isfile(file):
            raise ValueError(f"{self.settings.key}.adapter_path={path!r} has no adapter_model.safetensors (a peft "
                             "adapter folder).")
        tensors = {name.removeprefix("base_model.model."): t for name, t in load_file(file).items()}
        for adapter in self._all():
            modules = adapter.hf_modules(self.layout)
            names = {f: [f"{m}.{f}.weight" for m in modules] for f in ("lora_A", "lora_B")}
            missing = [n for group in names.values() for n in group if n not in tensors]
            if missing:
                raise ValueError(f"{self.settings.key}.adapter_path={path!r} lacks {missing[:3]}, which {adapter.name} "
                                 "adapts (with type=lora a fused layer's projections are adapted together).")
            a_parts = [tensors[n] for n in names["lora_A"]]
            if any(not torch.equal(a, a_parts[0]) for a in a_parts[1:]):
                raise ValueError(f"{self.settings.key}.adapter_path={path!r}: {', '.join(names['lora_A'])} differ; "
                                 f"type=lora adapts the fused {adapter.name.rsplit('.', 1)[-1]} with one A "
                                 "(megatron-bridge's `lora`), so they must be equal; type=canonical_lora gives each "
                                 "projection its own.")
            tp, rank = adapter.group.size(), adapter.group.rank()
            a = a_parts[0]
            if adapter.part is not None:  # one projection's B, in equal row blocks over TP
                b = tensors[names["lora_B"][0]]
                b = b.chunk(tp)[rank] if tp > 1 else b
            else:
                b = convert.to_megatron(adapter.weight_name, [tensors[n] for n in names["lora_B"]], self.layout)
                if adapter.exchange and adapter.column:
                    b = convert.split_tp(adapter.weight_name, b, tp, self.layout)[rank]
                elif adapter.exchange:
                    a = convert.split_tp(adapter.weight_name, a, tp, self.layout)[rank]
            for param, value in (("lora_A", a), ("lora_B", b)):
                target = getattr(adapter, param)
                if value.shape != target.shape:
                    raise ValueError(f"{self.settings.key}.adapter_path={path!r}: {adapter.name}.{param} is "
                                     f"{tuple(value.shape)} here, {tuple(target.shape)} in this model.")
                target.copy_(value)
        if self.settings.value_head:
            for chunk in self.chunks:
                for name, param in chunk.named_parameters():
                    saved = tensors.get(name.replace("output_layer.", f"{VALUE_HEAD}.", 1))
                    if is_head_tensor(name) and saved is not None:
                        param.copy_(saved.reshape(param.shape))


def hf_adapter_state(tensors: dict[str, torch.Tensor], layout: convert.Layout,
                     adapter: str = "default") -> dict[str, torch.Tensor]:
    """A Megatron dist-checkpoint's adapter tensors (read whole, TP shards merged; layers as
    `convert.decoder_layers` reads them) under the names peft gives them in the HF model
    (`adapter` is peft's adapter name): a fused layer's A goes to each of its projections, its B
    is split as the weight is. Experts' adapters are not among them (see `expert_deltas`)."""
    state = {}
    for key, stacked in tensors.items():
        if not key.startswith("decoder.layers."):
            raise ValueError(f"{key}: not the adapter of a decoder layer.")
        if convert.is_expert(key):
            continue
        for index, rest, tensor in convert.decoder_layers(key, stacked):
            path, _, factor = rest.rpartition(".")
            module, _, leaf = path.removesuffix(ADAPTER_SUFFIX).rpartition(".")
            fused, part = PART_OF.get(leaf, (leaf, None))
            weight = f"decoder.layers.{index}.{module}.{fused}.weight"
            if part is not None:  # a projection's own adapter (canonical LoRA)
                parts = [(convert.hf_names(weight, layout)[part], tensor)]
            elif factor == "lora_B":
                parts = convert.to_hf(weight, tensor, layout)
            else:
                parts = [(name, tensor) for name in convert.hf_names(weight, layout)]
            for name, value in parts:
                state[f"{name.removesuffix('.weight')}.{factor}.{adapter}.weight"] = value.clone()
    return state


def expert_deltas(tensors: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """What a Megatron dist-checkpoint's experts' adapters (read whole: [layers, experts, ...], or
    one layer's [experts, ...]) add to each layer's experts, scaling * B A for every expert, under
    the names transformers holds a layer's stacked experts by (`mlp.experts.gate_up_proj`,
    `mlp.experts.down_proj`, megatron's orientation: [experts, out, in]). peft has no per-expert
    module to put them on."""
    deltas: dict[str, torch.Tensor] = {}
    for key, a_stacked in tensors.items():
        if not convert.is_expert(key) or not key.endswith(".lora_A"):
            continue
        b_layers = convert.decoder_layers(key, tensors[key.removesuffix("lora_A") + "lora_B"])
        for (index, rest, a), (_, _, b) in zip(convert.decoder_layers(key, a_stacked), b_layers):
            module, _, leaf = rest.removesuffix(f"{ADAPTER_SUFFIX}.lora_A").rpartition(".")
            fused, part = PART_OF.get(leaf, (leaf, None))
            module = module.replace("mlp.experts.experts", "mlp.experts")
            (name,) = convert.hf_names(f"decoder.layers.{index}.{module}.{fused}.weight")
            delta = torch.bmm(b.float(), a.float()) * scaling
            if part is not None:  # canonical LoRA: the gate's or the up projection's half of the rows
                halves = [torch.zeros_like(delta), torch.zeros_like(delta)]
                halves[part] = delta
                delta = torch.cat(halves, dim=1)
            deltas[name] = deltas[name] + delta if name in deltas else delta
    return deltas
