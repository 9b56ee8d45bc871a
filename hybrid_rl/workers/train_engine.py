"""FSDP2 training engine: build a causal LM, shard it, compute response log-probs, optimise.

One instance holds one model (the actor, or the frozen reference). Every parameter is a DTensor
sharded over the data-parallel mesh; each decoder layer is its own FSDP unit so only one layer
is gathered at a time. A single CPU rank keeps a plain module (see `shard_model`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from omegaconf import OmegaConf

from hybrid_rl import seqlen_balancing
from hybrid_rl.controller import Worker
from hybrid_rl.protocol import Batch
from hybrid_rl.workers import packing

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def model_config(path: str, model_cfg: Any, value_head: bool = False):
    """The model's HF config with `override_config` applied; for a value model, one output label
    and no dropout on the head (values must be deterministic)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=model_cfg.trust_remote_code)
    if value_head:
        config.num_labels = 1
        for key in ("classifier_dropout", "hidden_dropout"):
            if hasattr(config, key):
                setattr(config, key, 0.0)
    for key, value in (model_cfg.override_config or {}).items():
        setattr(config, key, value)
    return config


def load_causal_lm(path: str, model_cfg: Any, device: torch.device, trainable: bool):
    from transformers import AutoModelForCausalLM

    config = model_config(path, model_cfg)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation=attn_implementation(device),
        trust_remote_code=model_cfg.trust_remote_code,
    )
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None or getattr(config, "final_logit_softcapping", None):
        # The chunked head (`packing.head_log_probs`) computes plain h W^T.
        raise ValueError(f"{type(model).__name__}: LM heads with a bias or logit soft-capping are not supported.")
    model.to(device)
    if trainable:
        if model_cfg.enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    # Training and log-prob forwards never decode, so no KV cache.
    model.config.use_cache = False
    return model


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None,
                reshard_after_forward: bool = True) -> torch.nn.Module:
    """Apply `fully_shard` to every decoder layer, then to the root (embeddings, norm, head).

    With one rank and no parameter dtype to cast to (CPU, where bf16 compute is autocast), FSDP
    would shard nothing and only copy every weight into, and every gradient out of, its flat
    buffers (~15 % of a CPU update): the module stays a plain one.
    """
    if mesh.size() == 1 and param_dtype is None:
        return model
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    layer_classes = tuple(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in layer_classes]
    if not layers:
        raise ValueError(
            f"Cannot find decoder layers in {type(model).__name__} (no _no_split_modules); "
            "this architecture is not supported by the FSDP2 engine."
        )
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    return model


@dataclass(frozen=True)
class ForwardOptions:
    """How a worker runs its response forward passes (see `forward_options`)."""

    remove_padding: bool = False  # pack real tokens into rows (`packing.pack_rows`)
    share_prompts: bool = False  # one prompt copy per group of responses (needs a dense mask)
    dense_mask: bool = True  # False for varlen kernels (flash-attention), which take no mask
    head_chunk_size: int = 256  # positions per chunk of the LM head
    autocast_dtype: torch.dtype | None = None  # CPU mixed precision (fp32 weights stay the masters)


def compute_dtype(fsdp_cfg: Any, device: torch.device) -> torch.dtype:
    """`fsdp_config.dtype` (`auto` as `hybrid_rl.hardware` resolves it for this device)."""
    from hybrid_rl.hardware import resolve_dtype

    return DTYPES[resolve_dtype(fsdp_cfg.dtype, device.type, "train").dtype]


def param_dtype(fsdp_cfg: Any, device: torch.device) -> torch.dtype | None:
    """FSDP2's parameter dtype: the compute dtype on GPU; None on CPU, where it is autocast."""
    return compute_dtype(fsdp_cfg, device) if device.type == "cuda" else None


def forward_options(model_cfg: Any, fsdp_cfg: Any, device: torch.device) -> ForwardOptions:
    """`model.use_remove_padding`, `model.share_prompt_prefix` and `model.head_chunk_size`,
    plus the compute dtype: on GPU FSDP2 casts the weights itself, on CPU it is autocast."""
    dtype = compute_dtype(fsdp_cfg, device)
    dense = attn_implementation(device) != "flash_attention_2"
    remove_padding = bool(model_cfg.use_remove_padding)
    return ForwardOptions(
        remove_padding=remove_padding,
        share_prompts=remove_padding and dense and bool(model_cfg.share_prompt_prefix),
        dense_mask=dense, head_chunk_size=int(model_cfg.head_chunk_size),
        autocast_dtype=dtype if device.type == "cpu" and dtype != torch.float32 else None)


CPU_ATTENTION = "hybrid_rl_sdpa_float32"


def _sdpa_in_float32(module, query, key, value, attention_mask, **kwargs):
    """transformers' SDPA attention with query, key and value upcast to float32 (a no-op for a
    float32 model). Under CPU bf16 autocast this is both more exact and faster: PyTorch's bf16
    flash-attention backward on CPU is ~2.5x slower than its float32 one on short rows."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast(query.device.type, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(query.dtype), weights


def attn_implementation(device: torch.device) -> str:
    """flash-attention 2 (varlen, no masks) on GPU when installed, else SDPA (in float32 on CPU)."""
    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            return "flash_attention_2"
        return "sdpa"
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, _sdpa_in_float32)
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


def response_head_outputs(model: torch.nn.Module, micro: dict[str, torch.Tensor], options: ForwardOptions,
                          head_fn) -> torch.Tensor:
    """Run `model` on a micro-batch of [left-padded prompt | right-padded response] rows with its
    LM head replaced by `head_fn(hidden, targets, head)`, evaluated only at the positions that
    predict response tokens; returns its output laid out as (B, T, ...), zero at padding.
    """
    responses = micro["responses"]
    batch, resp_len = responses.shape
    prompt_len = micro["input_ids"].shape[1] - resp_len
    packed = None
    if options.remove_padding:
        packed = packing.pack_rows(micro["input_ids"], micro["attention_mask"], prompt_len,
                                   options.share_prompts, options.dense_mask)
        inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
                  "attention_mask": packed.attention_mask}
        # Packed predictions sit at different positions in each row: keep every hidden state
        # and pick them from the flattened rows.
        keep, targets = 0, packed.targets
        select = lambda hidden: hidden.flatten(0, 1)[packed.keep]  # noqa: E731
    else:
        inputs = {key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}
        keep = torch.arange(prompt_len - 1, prompt_len + resp_len - 1, device=responses.device)
        targets = responses
        select = lambda hidden: hidden  # noqa: E731
    head = model.get_output_embeddings()
    autocast = torch.autocast(responses.device.type, dtype=options.autocast_dtype or torch.bfloat16,
                              enabled=options.autocast_dtype is not None)
    with autocast, packing.replaced_head(head, lambda hidden: head_fn(select(hidden), targets, head)):
        out = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    return packing.unpack(out, packed, (batch, resp_len)) if packed is not None else out


def head_dtype(head: torch.nn.Module, options: ForwardOptions) -> torch.dtype:
    return options.autocast_dtype or head.weight.dtype


def response_log_probs(model: torch.nn.Module, micro: dict[str, torch.Tensor], temperature: float,
                       options: ForwardOptions, with_entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of the response tokens at `temperature` and the entropies of those
    next-token distributions (zeros unless `with_entropy`), computed in chunks without a
    (B, T, V) logits tensor."""

    def head_fn(hidden, targets, head):
        log_probs, entropy = packing.head_log_probs(hidden, head.weight, targets, temperature,
                                                    options.head_chunk_size, head_dtype(head, options),
                                                    with_entropy)
        return torch.stack([log_probs, entropy], dim=-1)

    out = response_head_outputs(model, micro, options, head_fn)
    return out[..., 0], out[..., 1]


def response_logits(model: torch.nn.Module, micro: dict[str, torch.Tensor], temperature: float,
                    options: ForwardOptions) -> torch.Tensor:
    """Float32 logits (B, T, V) that predict the T response tokens, divided by the temperature
    (only for losses that need whole distributions, such as the full KL)."""

    def head_fn(hidden, targets, head):
        dtype = head_dtype(head, options)
        return (hidden.to(dtype) @ head.weight.to(dtype).T).float() / temperature

    return response_head_outputs(model, micro, options, head_fn)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def lr_lambda(optim_cfg: Any, total_steps: int):
    """Warmup then constant or cosine decay, as a multiplier of the base learning rate."""
    warmup = optim_cfg.lr_warmup_steps
    if warmup is None or warmup < 0:
        warmup = int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    kind = optim_cfg.lr_scheduler_type
    min_ratio = optim_cfg.min_lr_ratio or 0.0
    cycles = optim_cfg.num_cycles

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        cosine = 0.5 * (1.0 + math.cos(2.0 * math.pi * cycles * progress))
        return max(min_ratio, min_ratio + (1.0 - min_ratio) * cosine)

    return factor


def build_optimizer(model: torch.nn.Module, optim_cfg: Any, total_steps: int):
    # The fused kernel (CPU and CUDA, DTensor shards included) makes one pass over each tensor;
    # the default for-each path costs ~5x more on CPU.
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=optim_cfg.lr, betas=tuple(optim_cfg.betas),
        weight_decay=optim_cfg.weight_decay, fused=True,
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim_cfg, total_steps))
    return optimizer, scheduler


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip by the global gradient norm across all shards; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    return float(norm)


def all_reduce_scalar(value: float, device: torch.device, op=dist.ReduceOp.SUM) -> float:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=op)
    return float(t.item())


def micro_batches(batch: Batch, micro_rows: int, max_tokens: int | None, share_prompts: bool,
                  device: torch.device) -> list[torch.Tensor]:
    """Row indices of micro-batches of `micro_rows` rows, or (with `max_tokens`, i.e.
    `use_dynamic_bsz`) of at most about that many tokens, balanced. Every rank then runs as many
    micro-batches as the rank that needs most, because each FSDP forward is a collective."""
    if max_tokens is None:
        return list(torch.arange(len(batch)).split(micro_rows))
    count = seqlen_balancing.token_budget_bins(batch, max_tokens, share_prompts)
    count = int(all_reduce_scalar(count, device, op=dist.ReduceOp.MAX))
    return seqlen_balancing.split_into(batch, count, share_prompts)


class ModelWorker(Worker):
    """A worker role that trains or evaluates one model: it keeps the resolved config (an
    OmegaConf copy of the driver's plain dict), the local model folder and the run length."""

    def __init__(self, config: dict, model_path: str, total_steps: int):
        super().__init__()
        from hybrid_rl.console import quiet_third_party_output

        quiet_third_party_output()
        self.cfg = OmegaConf.create(config)
        self.model_path = model_path
        self.total_steps = total_steps


def setup_device_and_mesh(worker, cfg: Any) -> tuple[torch.device, DeviceMesh]:
    """Threads, device and the data-parallel mesh of a worker process (idempotent across roles
    colocated in one process)."""
    import os

    threads = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)
    use_cuda = cfg.trainer.device == "cuda"
    if use_cuda:
        # Ray gives each actor one visible GPU; vLLM picks its device from LOCAL_RANK.
        torch.cuda.set_device(0)
        os.environ["LOCAL_RANK"] = "0"
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    worker.init_process_group(timeout_s=cfg.actor_rollout_ref.nccl_timeout)
    return device, init_device_mesh(device.type, (worker.world_size,))


FORWARD_TOKENS = "update_tokens"  # reported as <role>/update_tokens, per rank


def mini_batch_updates(model, optimizer, batch, *, mini_rows: int, micro_rows: int, max_tokens: int | None,
                       share_prompts: bool, epochs: int, shuffle: bool, seed: int, grad_clip: float,
                       device: torch.device, loss_fn) -> tuple[dict[str, list[float]], int]:
    """Epochs x mini-batches of optimizer steps with gradient accumulation over micro-batches
    (`micro_batches`).

    Before each mini-batch the token and sequence counts are all-reduced, and `loss_fn(tensors,
    agg_kwargs) -> (loss, terms)` normalises by them, so the accumulated gradient (after FSDP's
    average over ranks) is exactly that of the whole mini-batch. `terms` are floats already
    weighted the same way: their sum over micro-batches, averaged over ranks, is the exact
    mini-batch value. Returns per-mini-batch metrics and the number of skipped steps (non-finite
    gradient norm). `metrics[FORWARD_TOKENS]` counts the tokens each mini-batch's forward passes
    computed (padding-free count; see `seqlen_balancing`).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    metrics: dict[str, list[float]] = {}
    skipped = 0
    generator = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        epoch_batch = batch[torch.randperm(len(batch), generator=generator)] if shuffle else batch
        for mini in epoch_batch.split(mini_rows):
            mask = mini["response_mask"]
            agg_kwargs = {
                "global_num_tokens": all_reduce_scalar(float(mask.sum()), device),
                "global_num_seqs": all_reduce_scalar(float((mask.sum(-1) > 0).sum()), device),
                "dp_size": world,
            }
            optimizer.zero_grad(set_to_none=True)
            sums: dict[str, float] = {}
            forward_tokens = 0
            for rows in micro_batches(mini, micro_rows, max_tokens, share_prompts, device):
                micro = mini[rows]
                tensors = {k: micro[k].to(device) for k in micro.tensors.keys()}
                loss, terms = loss_fn(tensors, agg_kwargs)
                loss.backward()
                for key, value in terms.items():
                    sums[key] = combine_metric(key, sums.get(key), value)
                forward_tokens += sum(seqlen_balancing.cost_units(micro, share_prompts)[1])
            grad_norm = clip_grad_norm(model, grad_clip)
            if math.isfinite(grad_norm):
                optimizer.step()
            else:
                skipped += 1
            optimizer.zero_grad(set_to_none=True)
            for key, value in {**sums, "grad_norm": grad_norm, FORWARD_TOKENS: forward_tokens}.items():
                metrics.setdefault(key, []).append(value)
    return metrics, skipped


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory of this worker so far: CUDA allocations on GPU, the process's peak resident
    set on CPU (trainer, reference and the vLLM engine together)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def combine_metric(key: str, total: float | None, value: float) -> float:
    """Metrics named *_max combine by max, all others by sum."""
    if total is None:
        return value
    return max(total, value) if key.endswith("_max") else total + value


def summarise_updates(metrics: dict[str, list[float]], role: str) -> dict[str, float]:
    """Per-mini-batch metrics of `mini_batch_updates` -> one value each (max for *_max, the
    total for the token count, else the mean), named `<role>/<metric>` unless already namespaced."""
    def combine(key: str, values: list[float]) -> float:
        if key == FORWARD_TOKENS:
            return float(sum(values))
        return max(values) if key.endswith("_max") else sum(values) / len(values)

    return {(key if "/" in key else f"{role}/{key}"): combine(key, v) for key, v in metrics.items()}


def token_share(mask: torch.Tensor, agg_kwargs: dict) -> float:
    """Weight of a micro-batch's per-token means in the exact mini-batch mean (see
    `mini_batch_updates`)."""
    return float(mask.sum()) / max(agg_kwargs["global_num_tokens"], 1.0) * agg_kwargs["dp_size"]


def save_hf_model(model, config, folder: str, rank: int, role: str = "actor") -> None:
    """The whole trained model as a Hugging Face folder (float32 safetensors + `config`), written
    by rank 0. Every rank must call it: gathering the full tensors is a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from hybrid_rl.export import save_hf_weights

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        save_hf_weights(state, config, folder, role=role)


def save_sharded(model, optimizer, scheduler, folder: str, rank: int, extra: dict | None = None) -> None:
    """Each rank writes its shards of the model and optimizer (torch.distributed.checkpoint) plus
    its own scheduler and RNG states; everything loads back with `weights_only` loading."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({"scheduler": scheduler.state_dict(), "rng": rng, **(extra or {})},
               os.path.join(folder, f"extra_rank{rank}.pt"))


def load_sharded(model, optimizer, scheduler, folder: str, rank: int) -> dict:
    """Inverse of `save_sharded` (same world size); returns the rank's extra entries."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    extra = torch.load(os.path.join(folder, f"extra_rank{rank}.pt"), weights_only=True)
    scheduler.load_state_dict(extra.pop("scheduler"))
    rng = extra.pop("rng")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return extra
