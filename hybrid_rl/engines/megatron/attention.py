"""Core attention for megatron's local layer spec (no Transformer Engine: always on CPU, and on
GPUs without TE) through `torch.nn.functional.scaled_dot_product_attention`.

megatron's own `DotProductAttention` materialises the (batch x heads x seq x seq) scores and keeps
the softmax of them for backward, per layer; SDPA's fused kernels keep one logsumexp per query
instead, as the FSDP engine's attention does. On CPU it runs in float32 like the FSDP engine's
(`hf_model._sdpa_in_float32`: PyTorch's bf16 flash-attention backward on CPU is the slower one).
An explicit attention mask (the engine passes none: rows are left-aligned, so the causal mask
alone hides the padding at their ends) and settings it does not use (a sliding window, a softmax
offset, query-key layer scaling, attention dropout in training) keep megatron's implementation,
except for latent attention: megatron's own class has no key and value widths of their own (the
local spec's `MLASelfAttention` passes them, as Transformer Engine's attention takes them), so
with latent attention this class is the only one there is.

Context parallelism (megatron's own attention has none; Transformer Engine's is CUDA-only): each
rank holds two of the sequence's 2 x CP chunks, `i` and `2 CP - 1 - i` (megatron's load-balanced
split, which its rotary embedding assumes), gathers every rank's keys and values (backward: their
gradients summed back to the rank that holds them), and attends from each of its two chunks to
the keys up to the chunk's end, causally within it.

Imported only inside the engine's device layer (megatron-core is imported at the top).
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.tensor_parallel import gather_from_sequence_parallel_region
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Same inputs and output as `DotProductAttention`: query (sq, b, heads, d), key and value
    (sk, b, groups, d) of this TP (and CP) rank; returns (sq, b, heads x d)."""

    def __init__(self, config, *args, k_channels: int | None = None, v_channels: int | None = None, **kwargs):
        # megatron's class refuses context parallelism outright; this one computes it itself.
        self.context_parallel = config.context_parallel_size
        self.latent = k_channels is not None  # latent attention's query/key and value widths (SDPA takes any)
        own = copy.copy(config)
        own.context_parallel_size = 1
        super().__init__(own, *args, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_mask, attention_bias, packed_seq_params):
            if self.context_parallel > 1 or self.latent:
                raise NotImplementedError(
                    "Context parallelism and latent attention without Transformer Engine support causal attention "
                    "without a mask, bias, sliding window, softmax offset, query-key layer scaling or attention "
                    "dropout; set context_parallel_size=1 or drop those override_transformer_config settings.")
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if self.context_parallel > 1:
            key, value = self._whole_sequence(key), self._whole_sequence(value)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads or groups, s, d)
        if q.device.type == "cpu":
            q, k, v = q.float(), k.float(), v.float()
        if self.context_parallel > 1 and causal:
            context = self._context_parallel_causal(q, k, v)
        else:
            context = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                     enable_gqa=k.shape[1] != q.shape[1])
        return context.to(query.dtype).permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _whole_sequence(self, tensor: torch.Tensor) -> torch.Tensor:
        """(s / CP, ...) of this rank -> (s, ...) in sequence order, from every CP rank's chunks."""
        size = self.context_parallel
        gathered = gather_from_sequence_parallel_region(tensor, group=parallel_state.get_context_parallel_group())
        chunks = gathered.chunk(2 * size)  # rank r holds chunks r and 2 CP - 1 - r, in that order
        return torch.cat([chunks[2 * r] for r in range(size)] + [chunks[2 * r + 1] for r in reversed(range(size))])

    def _context_parallel_causal(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        size, rank = self.context_parallel, parallel_state.get_context_parallel_rank()
        chunk = q.shape[2] // 2
        outputs = []
        for half, index in enumerate((rank, 2 * size - 1 - rank)):
            start = index * chunk
            visible = torch.ones(chunk, start + chunk, dtype=torch.bool, device=q.device).tril(diagonal=start)
            outputs.append(F.scaled_dot_product_attention(
                q[:, :, half * chunk:(half + 1) * chunk], k[:, :, :start + chunk], v[:, :, :start + chunk],
                attn_mask=visible, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1]))
        return torch.cat(outputs, dim=2)

    def _sdpa_applies(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        return (attention_mask is None and attention_bias is None and packed_seq_params is None
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None
                and not self.config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0))
