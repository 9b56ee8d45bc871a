"""The Hugging Face model inside an engine: loading a causal LM or a value model, and the
response forwards (padding-free packing, the chunked LM head, values).

These run on any module with the `transformers` interface, sharded or not: the FSDP engine calls
them on its FSDP2 module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hybrid_rl.hardware import TORCH_DTYPES, resolve_dtype, return_freed_host_memory
from hybrid_rl.models import model_config
from hybrid_rl.engines import packing
from hybrid_rl.engines.base import ROUTES_KEY
from hybrid_rl.engines.routing import RouteReplay
from hybrid_rl.engines.ulysses import SequenceParallel, sequence_parallel_attention


def load_causal_lm(path: str, model_cfg: Any, device: torch.device, trainable: bool,
                   dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    config = model_config(path, model_cfg)
    model = AutoModelForCausalLM.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation(device),
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
        embedding = model.get_input_embeddings()
        if embedding.weight is head.weight:
            # Tied weights: the chunked head writes a dense gradient into this tensor's .grad
            # (`packing.head_log_probs`), to which a sparse lookup gradient is added in place. A
            # dense one would be a (vocab x hidden) zero tensor filled, summed and freed on every
            # backward (6 % of an update on CPU).
            embedding.sparse = True
        model.train()
    else:
        model.requires_grad_(False)
        model.eval()
    # Training and log-prob forwards never decode, so no KV cache.
    model.config.use_cache = False
    return model


class UpcastLinear(torch.nn.Linear):
    """A frozen linear layer held in a narrower dtype than the float32 it computes in (a CPU
    without bf16 instructions): each use casts its weights up. Only layers whose values the
    narrow dtype holds exactly are held so, so the outputs are float32's, bit for bit."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def cast_frozen_linears(model: torch.nn.Module, dtype: torch.dtype, lossless_only: bool = False,
                        upcast: bool = False) -> int:
    """A model under CPU autocast to `dtype`: its frozen linear layers' weights and biases in
    `dtype` once, since autocast casts them to it in every forward anyway (the same outputs, bit
    for bit; half their memory). Trained tensors (a LoRA adapter), embeddings, a head tied to
    them, and norms stay float32, as autocast leaves them. With `lossless_only` a layer is cast
    only if its values are exactly representable in `dtype` (a bf16 checkpoint's are), for
    weights that are also merged and exported (LoRA's base). With `upcast` (float32 compute, no
    autocast; implies `lossless_only`) the layers cast become `UpcastLinear`s. The float32
    tensors left get memory of their own: a float32 checkpoint's tensors are views of its mapped
    file, whose pages all stay resident while any one of them is used. Returns the number of
    layers cast."""
    embedding = model.get_input_embeddings().weight
    cast = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear) or module.weight is embedding or module.weight.requires_grad:
            continue
        tensors = [t for t in (module.weight, module.bias) if t is not None]
        if (lossless_only or upcast) and not all(torch.equal(t.to(dtype).to(t.dtype), t) for t in tensors):
            continue
        module.to(dtype)
        if upcast:
            module.__class__ = UpcastLinear
        cast += 1
    if cast:
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.dtype != dtype:
                tensor.data = tensor.data.clone()
        return_freed_host_memory()  # the float32 copies a bf16 checkpoint was loaded into
    return cast


def load_value_model(path: str, model_cfg: Any, device: torch.device, dtype: torch.dtype = torch.float32):
    """`AutoModelForTokenClassification` with one label: the backbone's weights plus a freshly
    initialised linear value head on every position."""
    from transformers import AutoModelForTokenClassification

    config = model_config(path, model_cfg, scalar_head=True)
    model = AutoModelForTokenClassification.from_pretrained(
        path, config=config, dtype=dtype, attn_implementation=attn_implementation(device),
        trust_remote_code=model_cfg.trust_remote_code)
    if model_cfg.enable_gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.to(device).train()


def load_score_model(path: str, model_cfg: Any, device: torch.device, trainable: bool, per_token: bool = False):
    """A reward model: `AutoModelForSequenceClassification` with one label, or with `per_token` a
    process reward model, `AutoModelForTokenClassification` with one or two labels (see
    `position_scores`). From a folder that holds a causal LM (training a reward model from a
    policy), the score head is new."""
    from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

    config = model_config(path, model_cfg, scalar_head=True, keep_labels=per_token)
    if config.pad_token_id is None:
        # transformers' own pooling refuses batches without a pad id; `sequence_scores` reads
        # each row's last real token from the attention mask and ignores that pooling.
        config.pad_token_id = config.eos_token_id if isinstance(config.eos_token_id, int) else 0
    auto_class = AutoModelForTokenClassification if per_token else AutoModelForSequenceClassification
    model = auto_class.from_pretrained(
        path, config=config, dtype=torch.float32, attn_implementation=attn_implementation(device),
        trust_remote_code=model_cfg.trust_remote_code)
    if not isinstance(getattr(model, "score", None), torch.nn.Linear):
        raise ValueError(f"{type(model).__name__} has no linear `score` head; reward models of the Llama, Qwen2, "
                         "Mistral or Gemma families (transformers' generic classifiers) are supported.")
    model.config.use_cache = False
    model.requires_grad_(trainable)
    return model.to(device).train(trainable)


@dataclass(frozen=True)
class ForwardOptions:
    """How an engine runs its response forward passes (see `forward_options`)."""

    remove_padding: bool = False  # pack real tokens into rows (`packing.pack_rows`)
    share_prompts: bool = False  # one prompt copy per group of responses (needs a dense mask)
    dense_mask: bool = True  # False for varlen kernels (flash-attention), which take no mask
    head_chunk_size: int = 256  # positions per chunk of the LM head
    autocast_dtype: torch.dtype | None = None  # CPU mixed precision (fp32 weights stay the masters)
    sequence_parallel: SequenceParallel | None = None  # Ulysses: this rank runs a slice of each packed row
    routes: RouteReplay | None = None  # mixture-of-experts router replay of the policy's passes


def compute_dtype(requested: str, device: torch.device) -> torch.dtype:
    """An engine's `dtype` setting (`auto` as `hybrid_rl.hardware` resolves it for this device)."""
    return TORCH_DTYPES[resolve_dtype(requested, device.type, "train").dtype]


def forward_options(model_cfg: Any, dtype: torch.dtype, device: torch.device,
                    sequence_parallel: SequenceParallel | None = None) -> ForwardOptions:
    """`model.use_remove_padding`, `model.share_prompt_prefix` and `model.head_chunk_size` (a
    reward model's config has only the first two; a config without them runs padded rows),
    autocast to the compute `dtype` on CPU (on GPU the engine casts the weights itself), and the
    engine's sequence-parallel group, if any."""
    dense = attn_implementation(device) != "flash_attention_2"
    remove_padding = bool(model_cfg.get("use_remove_padding", False))
    return ForwardOptions(
        remove_padding=remove_padding,
        share_prompts=remove_padding and dense and bool(model_cfg.get("share_prompt_prefix", False)),
        dense_mask=dense, head_chunk_size=int(model_cfg.get("head_chunk_size", ForwardOptions.head_chunk_size)),
        autocast_dtype=cpu_autocast_dtype(dtype, device), sequence_parallel=sequence_parallel)


def cpu_autocast_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype to autocast a float32 model to on CPU (None: none; on GPU the engine casts the
    weights itself)."""
    return dtype if device.type == "cpu" and dtype != torch.float32 else None


CPU_ATTENTION = "hybrid_rl_sdpa_float32"


def _sdpa_in_float32(module, query, key, value, attention_mask, grid_tokens=None, token_slots=None, **kwargs):
    """transformers' SDPA attention with query, key and value upcast to float32 (a no-op for a
    float32 model). Under CPU bf16 autocast this is both more exact and faster: PyTorch's bf16
    flash-attention backward on CPU is ~2.5x slower than its float32 one on short rows.

    With `grid_tokens` and `token_slots` (a flat packing, `packing.pack_rows(flat=True)`) the model
    runs on one row of N real tokens: query, key and value are gathered into the (R, L) rows of
    `attention_mask` and the output is gathered back to the N tokens."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def to_rows(states):  # (1, heads, N, d) -> (R, heads, L, d)
        rows, width = attention_mask.shape[0], attention_mask.shape[-1]
        return states[0].index_select(1, grid_tokens).unflatten(1, (rows, width)).transpose(0, 1).float()

    flat = grid_tokens is not None
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = (to_rows(t) if flat else t.float() for t in (query, key, value))
        if attention_mask is not None:
            # Given a mask, transformers repeats grouped key/value heads (CUDA's kernels need it);
            # CPU's flash kernel takes them as they are: the default step's forward + backward
            # 3-6 % shorter. The head counts are read from the tensors, which under sequence
            # parallelism hold this rank's heads only.
            out = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, dropout_p=kwargs.get("dropout", 0.0),
                scale=kwargs.get("scaling"), enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
            weights = None
        else:
            out, weights = sdpa_attention_forward(module, q, k, v, attention_mask, **kwargs)
        if flat:  # out: (R, L, heads, d)
            out = out.flatten(0, 1).index_select(0, token_slots)[None]
    return out.to(query.dtype), weights


def attn_implementation(device: torch.device) -> str:
    """flash-attention 2 (varlen, no masks) on GPU when installed, else SDPA (in float32 on CPU).
    Both packed-row kernels also run sequence-parallel (`ulysses.sequence_parallel_attention`)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    if device.type == "cuda":
        import importlib.util

        if importlib.util.find_spec("flash_attn") is not None:
            from transformers.integrations.flash_attention import flash_attention_forward

            AttentionInterface.register("flash_attention_2", sequence_parallel_attention(flash_attention_forward))
            return "flash_attention_2"
        return "sdpa"
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(CPU_ATTENTION, sequence_parallel_attention(_sdpa_in_float32))
    AttentionMaskInterface.register(CPU_ATTENTION, sdpa_mask)
    return CPU_ATTENTION


def padded_inputs(micro: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's inputs for a micro-batch's rows as they are."""
    return {key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}


def packed_inputs(model: torch.nn.Module, micro: dict[str, torch.Tensor],
                  options: ForwardOptions) -> tuple[dict, packing.PackedRows]:
    """The model's inputs for a micro-batch packed into rows of real tokens (`packing.pack_rows`),
    and the packing, which says where each response token went. A model with our CPU attention
    runs them as one row without padding (`pack_rows(flat=True)`); only that attention function
    reads the extra inputs, so any other model keeps the padded rows. Under sequence parallelism
    the inputs are this rank's slice of that one row (`SequenceParallel.split`)."""
    prompt_len = micro["input_ids"].shape[1] - micro["responses"].shape[1]
    flat = options.dense_mask and getattr(model.config, "_attn_implementation", None) == CPU_ATTENTION
    packed = packing.pack_rows(micro["input_ids"], micro["attention_mask"], prompt_len, options.share_prompts,
                               options.dense_mask, flat=flat, routes=micro.get(ROUTES_KEY))
    inputs = {"input_ids": packed.input_ids, "position_ids": packed.position_ids,
              "attention_mask": packed.attention_mask}
    if flat:
        inputs.update(grid_tokens=packed.grid_tokens, token_slots=packed.token_slots)
    if options.sequence_parallel is not None:
        if packed.input_ids.shape[0] != 1:
            raise ValueError("Sequence parallelism needs the micro-batch in one padding-free row: flat packing (the CPU "
                             f"attention) or flash-attention, not {model.config._attn_implementation}.")
        inputs = options.sequence_parallel.split(inputs)
    return inputs, packed


def whole_row(inputs: dict, per_position: torch.Tensor) -> torch.Tensor:
    """A per-position output (1, L, ...) of `inputs`: under sequence parallelism this rank's
    slice of the row, gathered from the group into the whole row (1, L * size, ...)."""
    split = inputs.get("sequence_parallel")
    return per_position if split is None else split.gather(per_position[0])[None]


def autocast_to(device_type: str, dtype: torch.dtype | None):
    """CPU mixed precision to `dtype` (None: none)."""
    return torch.autocast(device_type, dtype=dtype or torch.bfloat16, enabled=dtype is not None)


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
    split = None
    if options.remove_padding:
        inputs, packed = packed_inputs(model, micro, options)
        # Packed predictions sit at different positions in each row: keep every hidden state
        # and pick them from the flattened rows (under sequence parallelism those in this
        # rank's slice; the group's are gathered after the forward).
        keep, targets, positions = 0, packed.targets, packed.keep
        split = inputs.get("sequence_parallel")
        if split is not None:
            mine, positions = split.local_offsets(packed.keep)
            targets = targets[mine]
        select = lambda hidden: hidden.flatten(0, 1)[positions]  # noqa: E731
    else:
        inputs = padded_inputs(micro)
        keep = torch.arange(prompt_len - 1, prompt_len + resp_len - 1, device=responses.device)
        targets = responses
        select = lambda hidden: hidden  # noqa: E731
    if options.routes is not None:  # which micro-batch token each of the model's tokens is
        if packed is not None:
            options.routes.place(micro, packed.slots, packed.input_ids.numel(), split)
        else:
            mask = micro["attention_mask"]
            slots = torch.arange(mask.numel(), device=mask.device).view(mask.shape)
            options.routes.place(micro, slots.masked_fill(mask == 0, -1), mask.numel())
    head = model.get_output_embeddings()
    with autocast_to(responses.device.type, options.autocast_dtype), \
            packing.replaced_head(head, lambda hidden: head_fn(select(hidden), targets, head)):
        out = model(**inputs, use_cache=False, logits_to_keep=keep).logits
    if split is not None:
        out = split.gather_at(out, packed.keep)
    return packing.unpack(out, packed, (batch, resp_len)) if packed is not None else out


def head_dtype(head: torch.nn.Module, options: ForwardOptions) -> torch.dtype:
    return options.autocast_dtype or head.weight.dtype


def response_log_probs(model: torch.nn.Module, micro: dict[str, torch.Tensor], temperature: float,
                       options: ForwardOptions, with_entropy: bool = True,
                       sum_pi_squared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs (B, T) of the response tokens at `temperature` and the entropies of those
    next-token distributions (zeros unless `with_entropy`; Σ_v π_v² instead with
    `sum_pi_squared`), computed in chunks without a (B, T, V) logits tensor."""

    def head_fn(hidden, targets, head):
        log_probs, entropy = packing.head_log_probs(hidden, head.weight, targets, temperature,
                                                    options.head_chunk_size, head_dtype(head, options),
                                                    with_entropy, into_grad=True, sum_pi_squared=sum_pi_squared)
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


def response_top_log_probs(model: torch.nn.Module, micro: dict[str, torch.Tensor], top_k: int, temperature: float,
                           options: ForwardOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """The `top_k` most likely tokens of each next-token distribution that predicts a response
    token: float32 log-probs (B, T, k) at `temperature` and their ids (B, T, k), best first (a
    distillation teacher's; the (B, T, V) logits exist one micro-batch at a time)."""
    def head_fn(hidden, targets, head):
        if head.weight.shape[0] > 2 ** 24:  # the ids travel as float32 beside the log-probs
            raise ValueError(f"a vocabulary of {head.weight.shape[0]} rows is too large for top-k log-probs")
        dtype = head_dtype(head, options)
        log_probs = torch.log_softmax((hidden.to(dtype) @ head.weight.to(dtype).T).float() / temperature, dim=-1)
        top = log_probs.topk(top_k, dim=-1)
        return torch.cat([top.values, top.indices.float()], dim=-1)

    out = response_head_outputs(model, micro, options, head_fn)
    return out[..., :top_k], out[..., top_k:].long()


def response_values(model: torch.nn.Module, micro: dict[str, torch.Tensor], options: ForwardOptions) -> torch.Tensor:
    """V(s_t) (B, T) for each response token t: the value head's output at the position that
    precedes it, computed in the role's dtype and, with `remove_padding`, on packed rows of real
    tokens (as the policy's forward)."""
    batch, resp_len = micro["responses"].shape
    with autocast_to(micro["input_ids"].device.type, options.autocast_dtype):
        if options.remove_padding:
            inputs, packed = packed_inputs(model, micro, options)
            values = whole_row(inputs, model(**inputs, use_cache=False).logits).flatten(0, 1)[packed.keep, 0]
            return packing.unpack(values.float(), packed, (batch, resp_len))
        out = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                    position_ids=micro["position_ids"], use_cache=False)
    return out.logits[:, -resp_len - 1:-1, 0].float()


def position_scores(model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                    autocast_dtype: torch.dtype | None) -> torch.Tensor:
    """The score head's output (R, L) at every position of `inputs` (ids, positions, mask): its
    value with one label, the probability of label 1 (a good step) with two. The head runs on
    every position inside the model's forward (where FSDP has gathered it); its output is read
    here rather than through transformers' pooling, which looks for pad ids instead of the mask."""
    captured = {}
    hook = model.score.register_forward_hook(lambda module, args, out: captured.update(scores=out))
    try:
        with autocast_to(inputs["input_ids"].device.type, autocast_dtype):
            model(**inputs, use_cache=False)
    finally:
        hook.remove()
    scores = captured["scores"].float()
    return scores.softmax(-1)[..., 1] if scores.shape[-1] == 2 else scores[..., 0]


def tag_position_scores(model: torch.nn.Module, inputs: dict[str, torch.Tensor], autocast_dtype: torch.dtype | None,
                        tag_token_ids: tuple[int, int]) -> torch.Tensor:
    """A step-tag scorer's P(good) (R, L) at every position of `inputs`: the softmax over the
    next-token logits of the (good, bad) `tag_token_ids`, computed for those two tokens only."""
    head = model.get_output_embeddings()
    ids = torch.tensor(tag_token_ids, device=inputs["input_ids"].device)
    two_logits = lambda hidden: hidden @ head.weight[ids].to(hidden.dtype).T  # noqa: E731
    with autocast_to(inputs["input_ids"].device.type, autocast_dtype), packing.replaced_head(head, two_logits):
        logits = model(**inputs, use_cache=False).logits
    return logits.float().softmax(-1)[..., 0]


def response_token_scores(model: torch.nn.Module, micro: dict[str, torch.Tensor], options: ForwardOptions,
                          tag_token_ids: tuple[int, int] | None = None) -> torch.Tensor:
    """A token classifier's score (B, T) at each response token's own position (zero at padding
    when the rows are packed); with `tag_token_ids`, a step-tag scorer's P(good) there."""
    responses = micro["responses"]

    def scores_at(inputs):
        if tag_token_ids is None:
            return position_scores(model, inputs, options.autocast_dtype)
        return tag_position_scores(model, inputs, options.autocast_dtype, tag_token_ids)

    if not options.remove_padding:
        return scores_at(padded_inputs(micro))[:, -responses.shape[1]:]
    inputs, packed = packed_inputs(model, micro, options)
    scores = whole_row(inputs, scores_at(inputs)).flatten()[packed.own]
    return packing.unpack(scores, packed, tuple(responses.shape))


def sequence_scores(model: torch.nn.Module, micro: dict[str, torch.Tensor], options: ForwardOptions) -> torch.Tensor:
    """A sequence classifier's score (B,) at each row's last real token (the rightmost position
    of the attention mask): its last response token when the rows are packed, which needs every
    response non-empty (otherwise the micro-batch runs padded)."""
    mask = micro["attention_mask"]
    response_lengths = mask[:, -micro["responses"].shape[1]:].sum(-1)
    rows = torch.arange(len(mask), device=mask.device)
    if options.remove_padding and bool((response_lengths > 0).all()):
        return response_token_scores(model, micro, options)[rows, response_lengths - 1]
    last = (torch.arange(mask.shape[1], device=mask.device) * mask.bool()).argmax(-1)
    return position_scores(model, padded_inputs(micro), options.autocast_dtype)[rows, last]
