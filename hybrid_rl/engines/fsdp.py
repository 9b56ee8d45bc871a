"""The FSDP2 engine: a `transformers` model sharded with `fully_shard` over the data-parallel mesh.

Every parameter is a DTensor sharded over all ranks; each decoder layer is its own FSDP unit so
only one layer is gathered at a time. The fp32 weights are the masters: on GPU FSDP2 computes in
`fsdp_config.dtype` (mixed precision, fp32 gradient reduction), on CPU the forward is autocast.
A single CPU rank keeps the plain module (see `shard_model`). Checkpoints are
`torch.distributed.checkpoint` shards of the model and the optimizer (with LoRA, of the adapter
and its optimizer state only: the base weights are the model folder's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hybrid_rl import hardware
from hybrid_rl.engines import hf_model, lora, optimizers, routing, tiled_mlp, ulysses
from hybrid_rl.engines.activation_offload import ActivationOffload
from hybrid_rl.engines.base import ROUTES_KEY, Head, ModelSpec, Output, TrainEngine, lr_lambda


@functools.cache
def data_parallel_mesh(device_type: str, fsdp_size: int = -1) -> DeviceMesh:
    """The mesh the model is sharded over, one per layout and process (the actor, reference and
    critic share it): all ranks (`fsdp_size` -1 or the world size), or verl's hybrid sharding,
    where groups of `fsdp_size` ranks each shard the model and the groups replicate it (FSDP2 over
    a 2-D mesh: gradients reduce-scattered within a group, then all-reduced across groups)."""
    world = dist.get_world_size()
    if fsdp_size <= 0 or fsdp_size >= world:
        return init_device_mesh(device_type, (world,))
    return init_device_mesh(device_type, (world // fsdp_size, fsdp_size), mesh_dim_names=("replicate", "shard"))


def shard_model(model: torch.nn.Module, mesh: DeviceMesh | None, param_dtype: torch.dtype | None,
                reshard_after_forward: bool = True, cpu_offload: bool = False) -> torch.nn.Module:
    """Apply `fully_shard` to every decoder layer, then to the root (embeddings, norm, head).

    With one rank and no parameter dtype to cast to (CPU, where bf16 compute is autocast), FSDP
    would shard nothing and only copy every weight into, and every gradient out of, its flat
    buffers (~15 % of a CPU update): the module stays a plain one. So does a module built
    outside a process group (`mesh` None: a benchmark or a test in one process).

    `cpu_offload` (GPU only) keeps the sharded weights, their gradients and so the optimizer step
    in pinned host memory; each layer's weights are copied to the GPU for its forward and backward.
    """
    if mesh is None or (mesh.size() == 1 and param_dtype is None):
        return model
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    offload_policy = CPUOffloadPolicy(pin_memory=True) if cpu_offload else OffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                    offload_policy=offload_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward,
                offload_policy=offload_policy)
    return model


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers: the modules of the classes transformers must not split (also
    once `fully_shard` has swapped each one's class for an FSDP subclass of it)."""
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if any(cls.__name__ in layer_classes for cls in type(m).__mro__)]
    if not layers:
        raise ValueError(
            f"Cannot find decoder layers in {type(model).__name__} (no _no_split_modules); "
            "this architecture is not supported by the FSDP2 engine."
        )
    return layers


def compile_layers(model: torch.nn.Module) -> None:
    """`model.compile_layers`: torch.compile each decoder layer in place, with dynamic shapes (packed
    rows change length every micro-batch). Inductor fuses a layer's element-wise work (norms,
    rotary embedding, SiLU, dtype casts) into few kernels; FSDP2's hooks around each layer stay
    eager."""
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def build_optimizer(model: torch.nn.Module, optim_cfg: Any, total_steps: int, key: str = "optim"):
    """The role's optimizer (`engines/optimizers.py`: verl's optim.optimizer in optim.optimizer_impl,
    torch's AdamW by default) over the trained parameters, and its learning-rate schedule."""
    optimizer = optimizers.build(key, optim_cfg, [p for p in model.parameters() if p.requires_grad])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))
    return optimizer, scheduler


class FSDPEngine(TrainEngine):
    """`strategy: fsdp` or `fsdp2`; the role's `fsdp_config` sets the dtype and resharding."""

    checkpoint_group: dist.ProcessGroup | None = None  # background checkpoint writes' own gloo group

    def __init__(self, spec: ModelSpec, role_cfg: Any, device: torch.device):
        self.spec, self.device = spec, device
        fsdp_cfg = role_cfg.fsdp_config
        if fsdp_cfg.get("full_determinism", False):
            hardware.enable_full_determinism()
        dtype = hf_model.compute_dtype(fsdp_cfg.dtype, device)
        trainable = spec.optim_cfg is not None
        weights_dtype = self._weights_dtype(fsdp_cfg, dtype)
        if spec.head is Head.VALUE:
            model = hf_model.load_value_model(spec.path, spec.model_cfg, device, dtype=weights_dtype)
        elif spec.head in (Head.SCORE, Head.STEP_SCORE):
            model = hf_model.load_score_model(spec.path, spec.model_cfg, device, trainable=trainable,
                                              per_token=spec.head is Head.STEP_SCORE)
        else:  # the policy, or a step-tag scorer
            model = hf_model.load_causal_lm(spec.path, spec.model_cfg, device, trainable=trainable,
                                            dtype=weights_dtype)
        self.sequence_parallel = self._sequence_parallel_group(role_cfg, model, device)
        self.sequence_parallel_size = self.sequence_parallel.size if self.sequence_parallel else 1
        self.options = hf_model.forward_options(spec.model_cfg, dtype, device, self.sequence_parallel)
        if role_cfg.get("use_prefix_grouper", False) and not self.options.share_prompts:
            raise ValueError(f"{spec.role_key}.use_prefix_grouper=true shares each prompt through the dense mask of "
                             "padding-free rows, which needs model.use_remove_padding=true and, on GPU, SDPA: "
                             "flash-attention's varlen kernel takes no mask. Uninstall flash-attn for this run, or "
                             "set use_prefix_grouper=false.")
        # A trained policy or critic with LoRA: peft adapts `model` in place and freezes its base weights.
        self.peft = lora.attach(model, spec.model_cfg, autocast=self.options.autocast_dtype is not None,
                                key=spec.model_key, value_head=spec.head is Head.VALUE) if (
            spec.head in (Head.LM, Head.VALUE) and trainable and lora.enabled(spec.model_cfg)) else None
        if not trainable or self.peft is not None:
            if self.options.autocast_dtype is not None:
                # LoRA's base is merged into synced and exported weights: cast only where lossless.
                hf_model.cast_frozen_linears(model, self.options.autocast_dtype, lossless_only=self.peft is not None)
            elif device.type == "cpu" and dtype == torch.float32:
                # Float32 compute (no bf16 instructions): a bf16 checkpoint's frozen layers held in
                # bf16 and cast up at each use, exactly.
                hf_model.cast_frozen_linears(model, torch.bfloat16, upcast=True)
        self.lora_scalings = lora.scalings(self.peft) if self.peft is not None else {}
        # verl's router_replay (mixture-of-experts policies): routes recorded or imposed per token.
        replay = routing.replay_mode(role_cfg) if spec.head is Head.LM else "disabled"
        routing.check_transformers_routers(f"actor_rollout_ref.{spec.role}", replay, model.config)
        if replay != "disabled":
            group = self.sequence_parallel.group if self.sequence_parallel else None
            self.route_replay = routing.RouteReplay(decoder_layers(model), model.config, group)
            self.options = dataclasses.replace(self.options, routes=self.route_replay)
        tiled = spec.model_cfg.get("tiled_mlp") or {}
        if tiled.get("enabled", False):
            tiled_mlp.tile_mlps(decoder_layers(model), tiled.get("num_shards", 4), f"{spec.model_key}.tiled_mlp")
        if spec.model_cfg.get("compile_layers", False):
            compile_layers(model)
        self.share_prompts = self.options.share_prompts
        mesh = data_parallel_mesh(device.type, int(fsdp_cfg.get("fsdp_size", -1))) if dist.is_initialized() else None
        # On GPU FSDP2 casts the weights to the compute dtype; on CPU the forward is autocast.
        param_dtype = dtype if device.type == "cuda" else None
        # verl's switches; on CPU the weights are in host memory already. FSDP2's offload_policy
        # keeps the shards on the host for good (each layer copied over for its compute); the
        # other two move whole models between the GPU and the host around each use.
        on_gpu = device.type == "cuda"
        cpu_offload = on_gpu and bool(fsdp_cfg.get("offload_policy", False))
        self.module = shard_model(model, mesh, param_dtype,
                                  fsdp_cfg.reshard_after_forward if trainable else True, cpu_offload)
        if trainable:
            self.optimizer, self.scheduler = build_optimizer(self.module, spec.optim_cfg, spec.total_steps,
                                                               f"{spec.role_key}.optim")
        self.offload_params = on_gpu and not cpu_offload and bool(fsdp_cfg.get("param_offload", False))
        self.offload_optimizer = on_gpu and trainable and bool(fsdp_cfg.get("optimizer_offload", False))
        if self.offload_params:
            self._place(False, params=True, optimizer=False, grads=False)
        # verl's enable_activation_offload; on CPU the activations are in host memory already.
        self.activation_offload = ActivationOffload(device) if (
            on_gpu and trainable and spec.model_cfg.get("enable_activation_offload", False)) else None

    def _weights_dtype(self, fsdp_cfg: Any, compute_dtype: torch.dtype) -> torch.dtype:
        """verl's `fsdp_config.model_dtype`: the dtype the weights are held and trained in (and so
        the optimizer's state, which torch keeps in the weights' dtype). float32 by default, the
        compute dtype cast from it; bfloat16 halves the memory of weights, gradients and Adam's
        moments, each update then rounded to bfloat16. It must match a bfloat16 compute dtype:
        on CPU the forward is autocast, which widens no weight."""
        name = fsdp_cfg.get("model_dtype") or "fp32"
        weights_dtype = hardware.TORCH_DTYPES.get(str(name))
        key = f"{self.spec.role_key}.fsdp_config.model_dtype"
        if weights_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"{key}={name}: the weights are held in fp32 or bf16 (float16 would need loss scaling, "
                             "which is not built).")
        if weights_dtype == torch.bfloat16 and compute_dtype != torch.bfloat16:
            raise ValueError(f"{key}=bf16 needs bf16 compute, but fsdp_config.dtype gives {compute_dtype}: set "
                             "fsdp_config.dtype=bf16 too, or model_dtype=fp32.")
        if weights_dtype == torch.bfloat16 and lora.enabled(self.spec.model_cfg):
            raise ValueError(f"{key}=bf16 with LoRA: the adapters train over the base model in float32 here (its "
                             "frozen layers are held in bf16 where that is exact); set model_dtype=fp32.")
        return weights_dtype

    def _sequence_parallel_group(self, role_cfg: Any, model: torch.nn.Module,
                                 device: torch.device) -> ulysses.SequenceParallel | None:
        """The Ulysses group of `ulysses_sequence_parallel_size` consecutive ranks (None: 1)."""
        size = int(ulysses.configured_size(role_cfg))
        if size == 1:
            return None
        world = dist.get_world_size() if dist.is_initialized() else 1
        heads = model.config.num_attention_heads
        if world % size or heads < size:
            raise ValueError(f"{self.spec.role}: ulysses_sequence_parallel_size={size} must divide the {world} ranks "
                             f"and be at most the model's {heads} attention heads.")
        if not self.spec.model_cfg.get("use_remove_padding", False):
            raise ValueError(f"{self.spec.role}: ulysses_sequence_parallel_size={size} splits padding-free rows; "
                             "set use_remove_padding=true on the role's model.")
        if model.config._attn_implementation not in (hf_model.CPU_ATTENTION, "flash_attention_2"):
            raise ValueError(f"{self.spec.role}: ulysses_sequence_parallel_size={size} on GPU needs flash-attention "
                             "(pip install flash-attn): the padding-free rows of SDPA cannot be split.")
        mesh = ulysses.sequence_parallel_mesh(device.type, size)
        return ulysses.SequenceParallel(mesh.get_group("sp"), size, mesh.get_local_rank("sp"))

    @property
    def dp_rank(self) -> int:
        if self.sequence_parallel is not None:
            return dist.get_rank() // self.sequence_parallel_size
        return dist.get_rank() if dist.is_initialized() else 0

    @property
    def dp_size(self) -> int:
        return (dist.get_world_size() if dist.is_initialized() else 1) // self.sequence_parallel_size

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        if self.sequence_parallel is None:
            return None
        return ulysses.sequence_parallel_mesh(self.device.type, self.sequence_parallel_size).get_group("dp")

    @property
    def is_output_rank(self) -> bool:
        return self.sequence_parallel is None or self.sequence_parallel.rank == 0

    def num_params(self) -> int:
        return sum(p.numel() for p in self.module.parameters())

    def hf_module(self) -> torch.nn.Module:
        return self.module

    def forward(self, micro: dict[str, torch.Tensor], output: Output, temperature: float) -> dict[str, torch.Tensor]:
        """One micro-batch through the model (with gradients where enabled)."""
        if output is Output.VALUES:
            return {"values": hf_model.response_values(self.module, micro, self.options)}
        if output is Output.SCORES:
            return {"scores": hf_model.sequence_scores(self.module, micro, self.options)}
        if output is Output.TOKEN_SCORES:
            return {"token_scores": hf_model.response_token_scores(self.module, micro, self.options,
                                                                   self.spec.tag_token_ids)}
        if output is Output.LOGITS:
            return {"logits": hf_model.response_logits(self.module, micro, temperature, self.options)}
        if output is Output.TOP_LOG_PROBS:
            top_log_probs, top_ids = hf_model.response_top_log_probs(self.module, micro, self.spec.top_k, temperature,
                                                                     self.options)
            return {"top_log_probs": top_log_probs, "top_ids": top_ids}
        with_entropy = output is Output.LOG_PROBS_ENTROPY
        sum_pi_squared = output is Output.LOG_PROBS_SUM_PI_SQUARED
        log_probs, second = hf_model.response_log_probs(self.module, micro, temperature, self.options, with_entropy,
                                                        sum_pi_squared)
        if with_entropy or sum_pi_squared:
            return {"log_probs": log_probs, "entropy" if with_entropy else "sum_pi_squared": second}
        return {"log_probs": log_probs}

    def forward_backward(self, micros: list[dict[str, torch.Tensor]], output: Output, temperature: float,
                         loss_fn: Callable | None = None) -> list[dict]:
        replay = self.route_replay
        if replay is None and any(ROUTES_KEY in micro for micro in micros):
            raise ValueError(f"{self.spec.role}: the batch carries routes to replay, but this engine was built "
                             "without router_replay.mode: set it for the role whose model this is.")
        results = []
        offload = self.activation_offload
        if offload is not None:
            offload.offloaded_bytes = 0
        with replay.pass_over() if replay is not None else contextlib.nullcontext():
            for micro in micros:
                if loss_fn is None:
                    with torch.no_grad():
                        result = self.forward(micro, output, temperature)
                    recorded = replay.recorded_table() if replay is not None else None
                    results.append(result if recorded is None else {**result, ROUTES_KEY: recorded})
                    continue
                with offload if offload is not None else contextlib.nullcontext():
                    loss, terms = loss_fn(self.forward(micro, output, temperature), micro)
                loss.backward()
                results.append(terms)
        return results

    def pass_metrics(self) -> dict[str, float]:
        metrics = super().pass_metrics()
        if self.activation_offload is not None:
            metrics["activation_offload_gb"] = self.activation_offload.offloaded_bytes / 2**30
        return metrics

    def optimizer_step(self, grad_clip: float) -> float:
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm=grad_clip)
        norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    @torch.no_grad()
    def _place(self, resident: bool, params: bool, optimizer: bool, grads: bool) -> None:
        # FSDP's gradients are freed after every optimizer step already (`grads` is never set).
        device = self.device if resident else torch.device("cpu")
        if params:
            self.module.to(device)  # FSDP2 re-registers the moved shards as its parameters
        if optimizer:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device)

    def _full(self, tensor: torch.Tensor) -> torch.Tensor:
        if isinstance(tensor, DTensor):
            # Gathered on the compute device (CPU-offloaded shards included), as NCCL needs.
            tensor = tensor.to(self.device).full_tensor()
        return tensor.detach()

    def per_tensor_weights(self, dtype: torch.dtype | None,
                           only_trained: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # The module is the transformers model, so its state-dict names are Hugging Face's.
        state = self.module.state_dict()
        if self.peft is not None:
            weights = lora.merged_weights(state, self.lora_scalings, self._full, only_adapted=only_trained)
        else:
            weights = ((name, self._full(tensor)) for name, tensor in state.items())
        for name, tensor in weights:
            yield name, tensor if dtype is None else tensor.to(dtype=dtype)

    @property
    def has_adapter(self) -> bool:
        return self.peft is not None

    def adapter_disabled(self):
        if self.peft is None:
            return super().adapter_disabled()
        return self.peft.disable_adapter()

    def _sharded_state(self, optimizer: bool = True) -> dict:
        """The model's and (with `optimizer`) optimizer's state-dict entries a checkpoint holds, as
        DCP writes and reads them: under LoRA the adapter's only, and a critic's head (the frozen
        base comes from the model folder)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if optimizer:
            model_state, optim_state = get_state_dict(self.module, self._optimizers())
        else:  # (get_state_dict would give a fresh optimizer a state: one step at lr 0)
            model_state, optim_state = get_model_state_dict(self.module), {}
        if self.peft is not None:
            model_state = {name: t for name, t in model_state.items() if lora.is_trained_tensor(name)}
        return {"model": model_state, "optim": optim_state}

    def _save_sharded(self, folder: str, background: bool = False) -> None:
        import torch.distributed.checkpoint as dcp

        if background:
            # The write's own collectives run in a thread while training's run: on a group of their own.
            if dist.is_initialized() and self.checkpoint_group is None:
                self.checkpoint_group = dist.new_group(backend="gloo")
            self.pending_save = dcp.async_save(self._sharded_state(), checkpoint_id=folder,
                                               process_group=self.checkpoint_group)
        else:
            dcp.save(self._sharded_state(), checkpoint_id=folder)
        if self.peft is not None and self.dp_rank == 0:
            self.peft.peft_config[lora.ADAPTER].save_pretrained(folder)  # how to rebuild it (export)

    def _load_sharded(self, folder: str, optimizer: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._sharded_state(optimizer)
        dcp.load(state, checkpoint_id=folder)  # fails on a missing tensor, adapter ones included
        set_state_dict(self.module, self._optimizers() if optimizer else [], model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=StateDictOptions(strict=self.peft is None))

    def _optimizers(self) -> list:
        """The optimizer of a trained model; none for a frozen one (a reset reference is saved too)."""
        return [self.optimizer] if self.spec.optim_cfg is not None else []

    def local_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            yield name, param.to_local() if isinstance(param, DTensor) else param
