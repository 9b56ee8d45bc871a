"""The Megatron-core engine: tensor, pipeline (with virtual stages) and data parallelism.

The model is megatron's `GPTModel`, built from the HF folder and filled with the converted HF
weights (`model.py`, `convert.py`); the critic's and a reward model's end in a scalar head. A trained model
is wrapped in megatron's `DistributedDataParallel` (fp32 gradient buffers, reduced over the
data-parallel group) and stepped by megatron's optimizer (the distributed one with
`use_distributed_optimizer`); forward and backward run through megatron's pipeline
schedules, so with PP > 1 only the last stage sees outputs and runs the loss. Checkpoints are
megatron dist-checkpoints (torch DCP underneath) of the model and optimizer.

Precision: `megatron.dtype` (`auto`: what `hybrid_rl.hardware` picks for this GPU or CPU) is
either fp32 throughout, or megatron's own mixed precision: bf16/fp16 weights for compute, fp32
main weights in the optimizer (starting from the checkpoint's values). (Autocast, the FSDP engine's CPU path, does not reach into
megatron's hand-written linear backward.) All megatron calls run inside `model.device_layer`,
which on CPU is the device layer of `cpu.py`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from hybrid_rl.config_keys import plain
from hybrid_rl.engines import hf_model
from hybrid_rl.engines.base import (
    ROUTES_KEY, Head, ModelSpec, Output, TrainEngine, all_reduce_scalar,
)
from hybrid_rl.engines.megatron import convert
from hybrid_rl.engines.megatron import lora as mlora
from hybrid_rl.engines.megatron import model as mmodel
from hybrid_rl.engines.megatron import routing
from hybrid_rl.engines.megatron import schedule
from hybrid_rl.engines.routing import replay_mode
from hybrid_rl.engines.megatron.checks import (
    check_layout, context_parallel_size, expert_parallel_size, frozen_routers, parallel_sizes,
)
from hybrid_rl.models import model_config

logger = logging.getLogger(__name__)

# Without Transformer Engine and Apex (always on CPU) megatron-core warns at import that it uses
# its torch fallbacks, which is what this engine asks for; 0.16.1's own TransformerConfig default
# triggers its cuda_graph_scope deprecation warning.
for _message in (r"(Transformer Engine and )?Apex (is|are) not installed", r"full scope is deprecated"):
    warnings.filterwarnings("ignore", message=_message, category=UserWarning)

# What forward_backward returns per micro-batch for each output it computes.
OUTPUT_KEYS = {Output.LOG_PROBS: ("log_probs",), Output.LOG_PROBS_ENTROPY: ("log_probs", "entropy"),
               Output.LOG_PROBS_SUM_PI_SQUARED: ("log_probs", "sum_pi_squared"), Output.VALUES: ("values",),
               Output.SCORES: ("scores",)}
LAYOUT_FILE = "megatron_layout.json"  # the layout a checkpoint was saved in, and its optimizer state's format
FULL_RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


# megatron optimizer settings for GPUs: its state in host memory (on a CPU it is there already)
# and the precision-aware optimizer (Transformer Engine's fused Adam, CUDA only).
CUDA_OPTIMIZER_SETTINGS = ("optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
                           "use_torch_optimizer_for_cpu_offload", "use_precision_aware_optimizer", "pin_cpu_grads",
                           "pin_cpu_params")


def optimizer_overrides(key: str, override: Any, device: torch.device) -> dict:
    """verl's `optim.override_optimizer_config` for megatron's `OptimizerConfig`: its fields, over
    the engine's; on CPU without the GPU-only ones, which are dropped with a warning."""
    import dataclasses

    from megatron.core.optimizer import OptimizerConfig

    override = dict(plain(override) or {})
    fields = {field.name for field in dataclasses.fields(OptimizerConfig)}
    unknown = sorted(set(override) - fields)
    if unknown:
        raise ValueError(f"{key} sets {', '.join(unknown)}, which megatron-core's OptimizerConfig does not have; "
                         f"its fields: {', '.join(sorted(fields))}.")
    dropped = sorted(name for name in override if name in CUDA_OPTIMIZER_SETTINGS and device.type == "cpu")
    if dropped:
        logger.warning("%s: %s not applied on CPU (the optimizer state is in host memory already; the precision-aware "
                       "optimizer needs Transformer Engine on CUDA).", key, ", ".join(dropped))
    return {name: value for name, value in override.items() if name not in dropped}


class MegatronEngine(TrainEngine):
    """`strategy: megatron`; the role's `megatron` section sets the parallel layout."""

    def __init__(self, spec: ModelSpec, role_cfg: Any, device: torch.device):
        from megatron.core import parallel_state

        if spec.head in (Head.STEP_SCORE, Head.STEP_TAG):
            raise ValueError(f"{spec.role}: process reward models (token classifiers and step-tag scorers) run on the "
                             "FSDP engine; set its strategy to fsdp.")
        self.spec, self.device = spec, device
        megatron_cfg = role_cfg.megatron
        hf_config = model_config(spec.path, spec.model_cfg)
        self.layout = convert.Layout.from_hf_config(hf_config, value_head=spec.head in (Head.VALUE, Head.SCORE),
                                                    head_bias=spec.head is Head.VALUE)
        check_layout(spec.role_key, megatron_cfg, self.layout, dist.get_world_size())
        tp, pp, vpp = parallel_sizes(megatron_cfg)
        ep, cp = expert_parallel_size(megatron_cfg), context_parallel_size(megatron_cfg)
        self.parallel_layout = {"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
                                "virtual_pipeline_model_parallel_size": vpp, "context_parallel_size": cp,
                                "expert_model_parallel_size": ep}
        seed = int(megatron_cfg.get("seed", 42))
        dtype = hf_model.compute_dtype(megatron_cfg.get("dtype", "auto") or "auto", device)
        trainable = spec.optim_cfg is not None
        # LoRA (verl's model.lora.*) on the policy being trained (its reference is the same model
        # with the adapters off) or on the critic.
        lora = None
        if trainable and spec.head in (Head.LM, Head.VALUE) and mlora.enabled(spec.model_cfg):
            lora = mlora.LoraSettings.from_config(spec.model_cfg.lora, f"{spec.model_key}.lora",
                                                  value_head=spec.head is Head.VALUE)
            mlora.check_dtype(f"{lora.key}.dtype", lora.dtype, dtype)
        with self._megatron():
            mmodel.initialize_parallel(tp, pp, vpp, seed, ep, cp)
            if (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_pipeline_model_parallel_world_size(),
                    parallel_state.get_expert_model_parallel_world_size(),
                    parallel_state.get_context_parallel_world_size()) != (tp, pp, ep, cp):
                raise ValueError(f"{spec.role_key}.megatron sets TP={tp}, PP={pp}, EP={ep}, CP={cp}, but this "
                                 "process already runs another model with a different layout: the roles on Megatron "
                                 "must share tensor_model_parallel_size, pipeline_model_parallel_size, "
                                 "expert_model_parallel_size and context_parallel_size.")
            # Activations pass between pipeline stages in the compute dtype too.
            half = {} if dtype == torch.float32 else {
                "bf16": dtype == torch.bfloat16, "fp16": dtype == torch.float16, "params_dtype": dtype,
                "pipeline_dtype": dtype}
            overrides = transformer_overrides(f"{spec.role_key}.megatron.override_transformer_config",
                                              megatron_cfg.get("override_transformer_config"), device)
            if trainable:
                if spec.model_cfg.get("enable_gradient_checkpointing", False):
                    # Every layer recomputed in the backward pass, as the FSDP engine's per-layer
                    # checkpointing does, unless override_transformer_config sets recompute_*
                    # (verl's tree lists them as null).
                    for key, value in FULL_RECOMPUTE.items():
                        if overrides.get(key) is None:
                            overrides[key] = value
            overrides.update(half)
            replay = replay_mode(role_cfg)
            routing.check_replayable(spec.role_key, replay, self.layout)
            if replay != "disabled" and overrides.pop("moe_router_fusion", False):
                # Transformer Engine's fused top-k does not call megatron's replay hook.
                logger.warning("%s.megatron.override_transformer_config: moe_router_fusion not applied (router replay "
                               "needs megatron's own top-k).", spec.role_key)
            # Adapters sit beside megatron's own parallel linears (the local spec on CUDA too), and
            # latent attention converts to the local spec's layout (TE fuses its norms differently).
            te = mmodel.has_transformer_engine(device) and lora is None and self.layout.latent is None
            sequence_parallel = bool(megatron_cfg.get("sequence_parallel", False)) and tp > 1
            self.config = mmodel.transformer_config(hf_config, self.layout, vpp, sequence_parallel, overrides)
            # Built on the CPU (the same initial weights on every device), then moved, as megatron-LM does.
            self.models = [chunk.to(device) for chunk in mmodel.build_model(hf_config, self.layout, self.config,
                                                                           te, seed)]
            # Trained half-precision weights' float32 main weights start from the checkpoint's values.
            float32_copies = trainable and dtype != torch.float32
            if not role_cfg.get("load_weight", True):
                # verl <= 0.5's switch: megatron's own seeded initialisation (init_method_std), nothing read.
                exact = [{name: value.float() for name, value in chunk.state_dict().items()
                          if not name.endswith("_extra_state")} for chunk in self.models] if float32_copies else None
            elif megatron_cfg.get("use_dist_checkpointing", False):  # a model converted once, resharded here
                exact = mmodel.load_dist_weights(self.models, megatron_cfg.dist_checkpointing_path,
                                                 megatron_cfg.get("dist_checkpointing_prefix") or "",
                                                 self.layout.value_head, float32_copies)
            else:
                exact = mmodel.load_hf_weights(self.models, self.config, spec.path, self.layout, float32_copies)
            self.adapters = None
            if lora is not None:
                names = [mmodel.global_names(m, self.config, mmodel.vp_stage_of(self.config, i), modules=True)
                         for i, m in enumerate(self.models)]
                self.adapters = mlora.Adapters(self.models, names, lora, self.layout, seed)
                if float32_copies:
                    for index, tensors in enumerate(exact):
                        # The adapters' own values, before the chunks are cast to half precision.
                        tensors.update({name: param.float() for name, param in self.models[index].named_parameters()
                                        if mlora.is_adapter_tensor(name)})
            if trainable and frozen_routers(spec.role_key, megatron_cfg, self.layout):
                mmodel.freeze_routers(self.models)
            chunk_size = hf_model.forward_options(spec.model_cfg, dtype, device).head_chunk_size
            self.head = mmodel.ResponsePositionsHead(self.models, self.config.sequence_parallel, chunk_size,
                                                     self.layout.vocab)
            self.chunks = [self._half(m) for m in self.models]
            if self.adapters is not None:
                self.adapters.restore_dtype()
            # verl's router_replay (mixture-of-experts models): routes recorded or imposed per token.
            if replay != "disabled":
                self.route_replay = routing.RouteReplay(self.models, self.config, self.layout.num_layers,
                                                        self.layout.experts.count)
            if trainable:
                self._build_training(megatron_cfg, spec, role_cfg)
                if float32_copies:
                    self._exact_main_weights(exact)
            else:
                for param in (p for m in self.models for p in m.parameters()):
                    param.requires_grad_(False)
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        self.sequence_parallel_size = cp  # a micro-batch's token budget is per rank, as verl's
        self.pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        self.pp_size = pp
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        # verl's switches; on CPU everything is in host memory already.
        on_gpu = device.type == "cuda"
        self.offload_params = on_gpu and bool(megatron_cfg.get("param_offload", False))
        self.offload_optimizer = on_gpu and trainable and bool(megatron_cfg.get("optimizer_offload", False))
        self.offload_grads = on_gpu and trainable and bool(megatron_cfg.get("grad_offload", False))
        self.host_copies = {"params": HostCopies(), "optimizer": HostCopies()}
        if self.offload_params or self.offload_optimizer or self.offload_grads:
            self._place(False, self.offload_params, self.offload_optimizer, self.offload_grads)

    # ------------------------------------------------------------------ set-up
    def _megatron(self):
        return mmodel.device_layer(self.device)

    def _half(self, model: torch.nn.Module) -> torch.nn.Module:
        """megatron's half-precision wrapper when the config asks for bf16/fp16."""
        if not (self.config.bf16 or self.config.fp16):
            return model
        from megatron.core.transformer.module import Float16Module

        return Float16Module(self.config, model)

    def _build_training(self, megatron_cfg: Any, spec: ModelSpec, role_cfg: Any) -> None:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        distributed_optimizer = bool(megatron_cfg.get("use_distributed_optimizer", True))
        # verl's keys: a checkpoint whose optimizer state loads into any layout, at the cost of
        # gathering it on save (onto every rank, or, memory-efficient, over gloo onto the first
        # data-parallel rank only); otherwise only the data-parallel size may change on loading.
        self.optimizer_metadata = {
            "distrib_optim_sharding_type": ("fully_reshardable" if megatron_cfg.get("dist_ckpt_optim_fully_reshardable")
                                            else "dp_reshardable"),
            "distrib_optim_fully_reshardable_mem_efficient": bool(
                megatron_cfg.get("distrib_optim_fully_reshardable_mem_efficient", False))}
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=distributed_optimizer,
                                                   **(plain(megatron_cfg.get("override_ddp_config")) or {}))
        # Only the first chunk gets bucketed overlap, as megatron-LM does.
        self.chunks = [DistributedDataParallel(self.config, ddp_config, chunk, disable_bucketing=index > 0)
                       for index, chunk in enumerate(self.chunks)]
        self.config.finalize_model_grads_func = finalize_model_grads
        no_sync = [chunk.no_sync for chunk in self.chunks]
        self.config.no_sync_func = no_sync if len(no_sync) > 1 else no_sync[0]
        optim, optim_key = spec.optim_cfg, f"{spec.role_key}.optim"
        schedule_arguments = schedule.settings(optim_key, optim, spec.total_steps)
        betas = tuple(optim.betas)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(**{
                "optimizer": "adam", "lr": optim.lr, "min_lr": schedule_arguments["min_lr"],
                "weight_decay": optim.weight_decay, "adam_beta1": betas[0],
                "adam_beta2": betas[1], "clip_grad": float(role_cfg.grad_clip), "bf16": self.config.bf16,
                "fp16": self.config.fp16, "params_dtype": self.config.params_dtype,
                "use_distributed_optimizer": distributed_optimizer,
                **optimizer_overrides(f"{optim_key}.override_optimizer_config",
                                      optim.get("override_optimizer_config"), self.device)}),
            self.chunks)
        # megatron's per-group optimizers (one for dense models), each around a torch optimizer.
        self.optimizer_parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        self.scheduler = schedule.MegatronSchedule(self.optimizer, schedule_arguments)

    @torch.no_grad()
    def _exact_main_weights(self, exact: list[dict[str, torch.Tensor]]) -> None:
        """Start the optimizer's float32 main weights from the checkpoint's own values (`exact`,
        per chunk), not from their bf16/fp16 rounding that megatron copies from the model: an
        update smaller than half a rounding step then moves them from the first step on, as it
        moves the FSDP engine's float32 weights (measured: one bf16 update at lr 1e-5 changed the
        log-probs 5x less from rounded main weights)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        by_param = {param: exact[index][name] for index, model in enumerate(self.models)
                    for name, param in model.named_parameters()}
        for part in self.optimizer_parts:
            if isinstance(part, DistributedOptimizer):  # megatron's own way, from a state dict of the chunks
                part.reload_model_params(state_dict={f"model{index}": tensors for index, tensors in enumerate(exact)})
            else:  # its non-distributed mixed-precision optimizer takes no state dict there
                for model_group, main_group in zip(part.float16_groups, part.fp32_from_float16_groups):
                    for param, main in zip(model_group, main_group):
                        main.copy_(by_param[param])

    # ------------------------------------------------------------------ layout
    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def dp_group(self):
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def is_output_rank(self) -> bool:
        return self.tp_rank == 0 and self.cp_rank == 0 and self.pp_rank == self.pp_size - 1

    def num_params(self) -> int:
        from megatron.core import parallel_state

        # Each TP shard once, a TP-replicated weight (norms) from TP rank 0 only, the last
        # stage's copy of a tied embedding not at all; experts (megatron marks them `allreduce`
        # False) are dealt in equal blocks to the expert-parallel ranks.
        ep = parallel_state.get_expert_model_parallel_world_size()

        def counted(p) -> int:
            if not getattr(p, "allreduce", True):  # an expert's: the same on every TP rank
                return p.numel() * ep if self.tp_rank == 0 else 0
            if getattr(p, "shared_embedding", False) and self.pp_rank > 0:
                return 0
            return p.numel() if getattr(p, "tensor_model_parallel", False) or self.tp_rank == 0 else 0

        numel = sum(counted(p) for m in self.models for p in m.parameters())
        return int(all_reduce_scalar(numel, self.device, group=parallel_state.get_model_parallel_group()))

    # ------------------------------------------------------------------ compute
    def forward_backward(self, micros: list[dict[str, torch.Tensor]], output: Output, temperature: float,
                         loss_fn: Callable | None = None) -> list[dict]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        if output not in OUTPUT_KEYS:
            raise NotImplementedError(f"The Megatron engine computes log-probs, entropies, values and scores, not "
                                      f"{output.value}: use strategy=fsdp2 for the full-vocabulary KL "
                                      "(kl_loss_type=full).")
        # The interleaved schedule runs micro-batches in groups of PP; fillers (the first
        # micro-batch again, its loss times zero: no gradient, outputs dropped) complete them.
        fillers = self._filler_count(len(micros), training=loss_fn is not None)
        batch = [(micro, False) for micro in micros] + [(micros[0], True)] * fillers
        steps = len(batch)
        # Sequence parallelism splits a rank's positions over TP; context parallelism a row into
        # 2 x CP chunks.
        cp = self.config.context_parallel_size
        pad_to = (self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1) * (
            2 * cp if cp > 1 else 1)

        def forward_step(data_iterator, model):
            micro, filler = next(data_iterator)
            ids, positions, predict = mmodel.left_aligned(micro)
            if output is Output.SCORES:  # a reward model reads each row's last real token
                predict = micro["attention_mask"].sum(1, keepdim=True) - 1
            ids, positions = _pad_columns(ids, pad_to), _pad_columns(positions, pad_to)
            if replay is not None:
                replay.before_forward(self.chunks.index(model), micro, ids.shape[1], filler)
            place = mmodel.placement(predict, ids.shape[1])
            if cp > 1:
                ids, positions = mmodel.this_rank_part(ids), mmodel.this_rank_part(positions)
            with_entropy = output is Output.LOG_PROBS_ENTROPY
            scalar = output in (Output.VALUES, Output.SCORES)
            head_log_probs = None if scalar else (micro["responses"], temperature, with_entropy,
                                                  output is Output.LOG_PROBS_SUM_PI_SQUARED)
            with self.head.at(place, head_log_probs):
                outputs = model(ids, positions, None)

            def loss_func(outputs: torch.Tensor):
                outputs = self.head.outputs(outputs, place)
                if output is Output.VALUES:  # V(s_t): the value head's output before each response token
                    out = {"values": outputs[..., 0].float()}
                elif output is Output.SCORES:
                    out = {"scores": outputs[:, 0, 0].float()}
                else:  # the head gave (log-prob, entropy) pairs
                    out = dict(zip(OUTPUT_KEYS[output], outputs.float().unbind(-1)))
                if loss_fn is None:
                    return outputs.new_zeros(()), out
                loss, terms = loss_fn(out, micro)
                # The schedule divides every loss by the micro-batch count, and multiplies it by CP
                # for megatron's gradient averaging over the data- and context-parallel ranks.
                return loss * (0 if filler else steps), terms

            return outputs, loss_func

        iterators = [iter(batch) for _ in self.chunks]
        replay = self.route_replay
        lengths = [-(-m["input_ids"].shape[1] // pad_to) * pad_to for m in micros]
        with self._megatron(), (torch.no_grad() if loss_fn is None else contextlib.nullcontext()), (
                replay.pass_over(micros, lengths, training=loss_fn is not None)
                if replay is not None else contextlib.nullcontext()):
            results = get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=iterators if len(iterators) > 1 else iterators[0],
                model=self.chunks, num_microbatches=steps, seq_length=max(lengths),
                micro_batch_size=max(m["input_ids"].shape[0] for m in micros), forward_only=loss_fn is None)
        results = results[:len(micros)]
        if loss_fn is None and self.pp_size > 1:
            results = self._from_last_stage(results, micros, OUTPUT_KEYS[output])
        if replay is not None and replay.recorded:
            results = [{**result, ROUTES_KEY: replay.routes_of(index)} for index, result in enumerate(results)]
        return results

    def _filler_count(self, count: int, training: bool) -> int:
        """Fillers for the interleaved schedule: whole groups of micro-batches, and in training
        enough of them that the first stage does not run every forward pass before its first
        backward while the last stage already alternates. There, a stage's tensors go with
        their shapes first (variable sequence lengths), and the alternating stage's exchange
        would wait on the first stage for a gradient it sends only after the exchange."""
        vpp = self.config.virtual_pipeline_model_parallel_size
        if not vpp:
            return 0
        group = self.config.microbatch_group_size_per_vp_stage or self.pp_size
        # megatron's warm-up forward passes on the first stage (schedules.get_pp_rank_microbatches).
        first_stage_warmup = (self.pp_size - 1) * 2 + (vpp - 1) * group
        least = first_stage_warmup // vpp + 1 if training else group
        return -(-max(count, least) // group) * group - count

    def _from_last_stage(self, results: list[dict], micros: list[dict], keys: tuple[str, ...]) -> list[dict]:
        """The last stage's outputs on every stage, so every rank of a replica returns them."""
        src = dist.get_global_rank(self.pp_group, self.pp_size - 1)
        out = []
        for index, micro in enumerate(micros):
            mine = results[index] if results else {}
            received = {}
            for key in keys:
                shape = micro["responses"].shape[:1] if key == "scores" else micro["responses"].shape
                tensor = mine[key].float().contiguous() if key in mine else torch.empty(shape, device=self.device)
                dist.broadcast(tensor, src=src, group=self.pp_group)
                received[key] = tensor
            out.append(received)
        return out

    def optimizer_step(self, grad_clip: float) -> float:
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        optimizer = self.optimizer
        with self._megatron():
            found_inf = optimizer.prepare_grads()  # main gradients in place (shards with the distributed optimizer)
            norm = float(optimizer.get_grad_norm())
            if found_inf or not math.isfinite(norm):
                self.skipped_steps += 1
            else:
                for part in self.optimizer_parts:
                    params = part.get_parameters()
                    if params:
                        clip_grad_by_total_norm_fp32(params, grad_clip, norm)
                optimizer.step_with_ready_grads()  # then gathers the updated weights to every rank
            optimizer.zero_grad()
            for chunk in self.chunks:
                chunk.zero_grad_buffer()
        return norm

    @torch.no_grad()
    def _place(self, resident: bool, params: bool, optimizer: bool, grads: bool) -> None:
        if resident:
            for part, wanted in (("params", params), ("optimizer", optimizer)):
                if wanted:
                    self.host_copies[part].reload()
            if grads:
                for chunk in self.chunks:  # megatron reallocates them zeroed
                    chunk.restore_grad_buffers(synchronize=False)
            return
        weights = [p for m in self.models for p in m.parameters()]
        if optimizer:
            # The main (float32) weights and Adam's moments. With float32 weights the main weights
            # are the model's own or views of them: those move with the weights, if at all.
            own = {p.untyped_storage().data_ptr() for p in weights}
            state = [t for part in self.optimizer_parts for t in _optimizer_tensors(part.optimizer)
                     if t.device.type == self.device.type and t.untyped_storage().data_ptr() not in own]
            self.host_copies["optimizer"].offload(state)
        if params:
            self.host_copies["params"].offload(weights)
        if grads:
            for chunk in self.chunks:  # zero between updates: nothing to keep
                chunk.offload_grad_buffers(synchronize=False, empty_cache=False)

    # ------------------------------------------------------------------ weights and checkpoints
    def per_tensor_weights(self, dtype: torch.dtype | None,
                           only_trained: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        # Under LoRA, merged weights; only the adapted ones change in training.
        only = self.adapters.adapted_weights() if only_trained and self.adapters is not None else None
        with self._megatron(), self.resident():
            yield from mmodel.iter_hf_weights(self.models, self.config, self.layout, dtype, self.adapters, only)

    @property
    def has_adapter(self) -> bool:
        return self.adapters is not None

    def adapter_disabled(self):
        if self.adapters is None:
            return super().adapter_disabled()
        return self.adapters.disabled()

    def _sharded_state(self, loading: bool = False, optimizer: bool = True) -> dict:
        """The model's and (with `optimizer`) optimizer's tensors a checkpoint holds: under LoRA
        the adapters' only, and a critic's head (the frozen base comes from the model folder)."""
        state = {f"model{index}": {key: value for key, value in model.sharded_state_dict().items()
                                   if self.adapters is None or mlora.is_adapter_tensor(key) or (
                                       self.layout.value_head and mlora.is_head_tensor(key))}
                 for index, model in enumerate(self.models)}
        if optimizer:
            state["optimizer"] = self.optimizer.sharded_state_dict(state, is_loading=loading,
                                                                   metadata=self.optimizer_metadata)
        return state

    def _save_sharded(self, folder: str, background: bool = False) -> None:
        from megatron.core import dist_checkpointing

        os.makedirs(folder, exist_ok=True)  # megatron saves into an existing, empty folder
        with self._megatron():
            for part in self.optimizer_parts:  # before the first step (critic warm-up, an early stop)
                _create_adam_state(part.optimizer)
            request = dist_checkpointing.save(self._sharded_state(), folder, async_sharded_save=background)
            if background:
                self.pending_save = BackgroundMegatronSave(request, self._megatron)
            if self.adapters is not None:
                self.adapters.save_peft_config(folder)
        if dist.get_rank() == 0:
            with open(os.path.join(folder, LAYOUT_FILE), "w") as f:
                json.dump({**self.parallel_layout, "optimizer_sharding": self._optimizer_sharding}, f)
        # Every rank returns with the folder whole (a background save: once finished): one may load
        # it at once (the layout file included).
        dist.barrier()

    @property
    def _optimizer_sharding(self) -> str:
        """How the checkpoint holds the optimizer state: megatron's other optimizer keeps it per
        parameter, like the model (any layout loads it)."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        if not any(isinstance(part, DistributedOptimizer) for part in self.optimizer_parts):
            return "per parameter"
        return self.optimizer_metadata["distrib_optim_sharding_type"]

    def _check_layout_of(self, folder: str) -> None:
        """A `dp_reshardable` checkpoint loads into another data-parallel size only: refuse any
        other change of layout with the fix, before megatron fails on its shapes."""
        path = os.path.join(folder, LAYOUT_FILE)
        if not os.path.exists(path):
            return
        with open(path) as f:
            saved = json.load(f)
        changed = [f"{key} {saved[key]} -> {value}" for key, value in self.parallel_layout.items()
                   if saved.get(key) != value]
        if changed and saved["optimizer_sharding"] == "dp_reshardable":
            raise ValueError(f"The checkpoint in {folder} was saved in another Megatron layout ({', '.join(changed)}) "
                             "and its distributed optimizer state loads into the same layout only (megatron's "
                             "dp_reshardable format). Resume with the layout it was saved in; to change layouts, "
                             "save it with megatron.dist_ckpt_optim_fully_reshardable=true.")

    def _load_sharded(self, folder: str, optimizer: bool) -> None:
        from megatron.core import dist_checkpointing

        if optimizer:  # (the layout check is about the distributed optimizer state's format)
            self._check_layout_of(folder)
        with self._megatron(), torch.no_grad():  # the optimizer copies into views of the weights
            if optimizer:
                for part in self.optimizer_parts:
                    _create_adam_state(part.optimizer)
            state = dist_checkpointing.load(self._sharded_state(loading=True, optimizer=optimizer), folder)
            for index, model in enumerate(self.models):
                # Under LoRA the checkpoint holds the adapters (and a critic's head) only;
                # dist_checkpointing fails on a missing one.
                model.load_state_dict(state[f"model{index}"], strict=self.adapters is None)
            if not optimizer:
                self.optimizer.reload_model_params()  # main weights (bf16 / fp16 models) from the loaded ones
                return
            with _fully_reshardable_load_keeps_steps(self.optimizer_parts):
                self.optimizer.load_state_dict(state["optimizer"])
            # Without Apex / Transformer Engine, megatron-core 0.16.1's distributed optimizer
            # restores the step count into its param groups only: the parameters' Adam states
            # keep the step they had before loading (here 0), which skews Adam's bias correction.
            # Each gets the saved count, in a tensor of its own (torch's Adam increments it in place).
            for part in self.optimizer_parts:
                for group in part.optimizer.param_groups:
                    for param in group["params"]:
                        param_state = part.optimizer.state.get(param)
                        if param_state and "step" in group:
                            param_state["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


class BackgroundMegatronSave:
    """verl's `checkpoint.async_save` on the Megatron engine: megatron's own asynchronous save.
    Its request's shards are staged to host memory (on GPU) and a forked process writes them; a
    CPU rank's fork holds the shards as they were when it was made, whatever training changes
    after. `result()` waits for every rank's writer and runs megatron's finalisation (the
    metadata file, on rank 0); every rank must call it, as the trainer's commit does. megatron's
    queue synchronises its ranks with device tensors: on CPU it runs inside the device layer."""

    def __init__(self, request, device_layer: Callable):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.queue, self.device_layer = AsyncCallsQueue(), device_layer
        self.queue.schedule_async_request(request)

    def result(self) -> None:
        with self.device_layer():
            self.queue.maybe_finalize_async_calls(blocking=True)
        self.queue.close()


class HostCopies:
    """Tensors' device memory sent to host memory and brought back in place: each storage is
    copied to (pinned) host memory and resized to nothing, later resized back and refilled, so
    every tensor and every view of one stays valid. Megatron's weights are views of its DDP
    buffers (distributed optimizer), and its distributed optimizer's float32 main weights are
    views of float32 weights: moving `.data` (megatron's own optimizer offload) would part them."""

    def __init__(self):
        self.saved: list[tuple[torch.UntypedStorage, torch.Tensor]] = []

    def offload(self, tensors: list[torch.Tensor]) -> None:
        seen = set()
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:  # already away, or shared
                continue
            seen.add(storage.data_ptr())
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")
            host.copy_(_as_bytes(storage))
            storage.resize_(0)
            self.saved.append((storage, host))

    def reload(self) -> None:
        for storage, host in self.saved:
            storage.resize_(host.numel())
            # Asynchronous from pinned memory; the host allocator keeps `host` until the copy is done.
            _as_bytes(storage).copy_(host, non_blocking=True)
        self.saved = []


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    """A torch optimizer's parameters and per-parameter state tensors."""
    for group in optimizer.param_groups:
        yield from group["params"]
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


@torch.no_grad()
@contextlib.contextmanager
def _fully_reshardable_load_keeps_steps(parts: list) -> Iterator[None]:
    """megatron-core 0.16.1 loads a `fully_reshardable` optimizer checkpoint into torch's Adam
    (no Apex / Transformer Engine, always so on CPU) by setting each parameter's step from the
    groups' count, then asking the checkpoint for a step too: KeyError 'step'. Here each
    parameter's main weight and moments are copied from the checkpoint and its step is left as
    set; megatron's own copy runs where its Adam keeps no per-parameter step."""
    from megatron.core.optimizer.distrib_optimizer import HAVE_APEX_OR_TE, DistributedOptimizer

    def copy_without_step(part, model_param, tensors):
        group_index, group_order = part.model_param_group_index_map[model_param]
        main_param = part.optimizer.param_groups[group_index]["params"][group_order]
        main_param.copy_(tensors["param"])
        for key, value in part.optimizer.state[main_param].items():
            if key != "step":
                value.copy_(tensors[key])

    patched = [part for part in parts if isinstance(part, DistributedOptimizer)
               and not HAVE_APEX_OR_TE and not part.config.use_precision_aware_optimizer]
    for part in patched:
        part._set_main_param_and_optimizer_states = functools.partial(copy_without_step, part)
    try:
        yield
    finally:
        for part in patched:
            del part._set_main_param_and_optimizer_states


def _create_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter an Adam state equal to a fresh one (zero moments, step 0), made by a
    step at learning rate 0 on zero gradients (which changes no weight): megatron saves and loads
    only existing state."""
    if optimizer.state:
        return
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    optimizer.zero_grad(set_to_none=True)
    for state in optimizer.state.values():
        state["step"].zero_()


# Fused kernels of Transformer Engine, Apex or DeepEP (CUDA) that verl's scripts switch on: the
# same computation by other kernels, so on CPU megatron's torch code runs instead.
CUDA_KERNEL_SETTINGS = ("apply_rope_fusion", "gradient_accumulation_fusion", "masked_softmax_fusion",
                        "bias_activation_fusion", "bias_dropout_fusion", "persist_layer_norm", "moe_permute_fusion",
                        "moe_router_fusion", "moe_enable_deepep", "attention_backend")


def transformer_overrides(key: str, section: Any, device: torch.device) -> dict:
    """`override_transformer_config` as `TransformerConfig` arguments (enums from their names).
    Experts stay one module each (`moe_grouped_gemm` would change their weights' layout); on CPU
    the CUDA kernels' switches and DeepEP's `flex` dispatcher give way to megatron's torch code,
    with a warning."""
    from megatron.core.transformer.enums import AttnBackend

    overrides = dict(plain(section) or {})
    if overrides.pop("moe_grouped_gemm", False):
        logger.warning("%s: moe_grouped_gemm not applied (the engine keeps one module per expert).", key)
    if device.type == "cpu":
        dropped = [name for name in CUDA_KERNEL_SETTINGS if overrides.pop(name, None) not in (None, False)]
        if overrides.get("moe_token_dispatcher_type") == "flex":
            dropped.append(f"moe_token_dispatcher_type={overrides.pop('moe_token_dispatcher_type')}")
        if dropped:
            logger.warning("%s: %s not applied (CUDA kernels; megatron's torch code computes the same on CPU).",
                           key, ", ".join(dropped))
        # The CPU device layer tags the batched pipeline messages (see cpu.py); megatron's
        # unbatched ones hang on gloo.
        unbatched = [f"{name}={overrides.pop(name)}" for name, batched in (("batch_p2p_comm", True),
                                                                           ("overlap_p2p_comm", False))
                     if overrides.get(name, batched) != batched]
        if unbatched:
            logger.warning("%s: %s not applied on CPU (pipeline stages exchange batched messages over gloo).",
                           key, ", ".join(unbatched))
    if isinstance(overrides.get("attention_backend"), str):
        overrides["attention_backend"] = AttnBackend[overrides["attention_backend"]]
    return overrides


def _pad_columns(tensor: torch.Tensor, multiple: int) -> torch.Tensor:
    """Right-pad (B, S) to S a multiple of `multiple` (sequence and context parallelism split S)."""
    extra = -tensor.shape[1] % multiple
    return torch.nn.functional.pad(tensor, (0, extra)) if extra else tensor
