"""Core attention of the local layer spec through PyTorch's fused `scaled_dot_product_attention`.

Megatron's local `DotProductAttention` materialises the [b * heads, s, s] score matrix, repeats
the key/value heads of grouped-query attention, and applies the causal mask and softmax as
separate ops. On CPU (where Transformer Engine's fused attention does not exist) that is most
of the attention's time at small scale. `SDPAttention` computes the same causal softmax
attention with one fused kernel (grouped heads without repeating them); everything else (the
projections, RoPE, the layer) stays Megatron's. It takes over only where the result is the
same: a causal mask and no explicit mask tensor, no attention dropout while training, no
attention bias, no packed sequences, vanilla softmax, no sliding window; anything else runs
Megatron's own computation (`DotProductAttention.forward`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType


class SDPAttention(DotProductAttention):
    """`DotProductAttention` (its constructor and attributes) with a fused causal forward."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """[sq, b, heads, d] queries, [sk, b, groups, d] keys and values -> [sq, b, heads * d]."""
        if not self._fused_applies(attention_mask, attn_mask_type, attention_bias, packed_seq_params):
            return super().forward(
                query, key, value, attention_mask, attn_mask_type, attention_bias, packed_seq_params
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads or groups, s, d]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=self.softmax_scale, enable_gqa=k.size(1) != q.size(1)
        )
        return out.permute(2, 0, 1, 3).reshape(query.size(0), query.size(1), self.hidden_size_per_partition)

    def _fused_applies(self, attention_mask, attn_mask_type, attention_bias, packed_seq_params) -> bool:
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        dropout = self.attention_dropout.p if self.training else 0.0
        return (
            attention_mask is None
            and mask_type == AttnMaskType.causal
            and attention_bias is None
            and packed_seq_params is None
            and dropout == 0.0
            and self.softmax_offset is None
            and self.scale_mask_softmax.window_size is None
            and not self.config.apply_query_key_layer_scaling
        )
