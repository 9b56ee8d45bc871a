"""Core attention for megatron's local layer spec (no Transformer Engine: always on CPU, and on
GPUs without TE) through `torch.nn.functional.scaled_dot_product_attention`.

megatron's own `DotProductAttention` materialises the (batch x heads x seq x seq) scores and keeps
the softmax of them for backward, per layer; SDPA's fused kernels keep one logsumexp per query
instead, as the FSDP engine's attention does. On CPU it runs in float32 like the FSDP engine's
(`hf_model._sdpa_in_float32`: PyTorch's bf16 flash-attention backward on CPU is the slower one).
An explicit attention mask (the engine passes none: rows are left-aligned, so the causal mask
alone hides the padding at their ends) and settings it does not use (a sliding window, a softmax
offset, query-key layer scaling, attention dropout in training) keep megatron's implementation.

Imported only inside the engine's device layer (megatron-core is imported at the top).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """Same inputs and output as `DotProductAttention`: query (sq, b, heads, d), key and value
    (sk, b, groups, d) of this TP rank; returns (sq, b, heads x d)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if not self._sdpa_applies(attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # (b, heads or groups, s, d)
        if q.device.type == "cpu":
            q, k, v = q.float(), k.float(), v.float()
        context = F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=self.softmax_scale,
                                                 enable_gqa=k.shape[1] != q.shape[1])
        return context.to(query.dtype).permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)

    def _sdpa_applies(self, attention_mask, attention_bias, packed_seq_params) -> bool:
        return (attention_mask is None and attention_bias is None and packed_seq_params is None
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None
                and not self.config.apply_query_key_layer_scaling
                and not (self.training and self.attention_dropout.p > 0))
