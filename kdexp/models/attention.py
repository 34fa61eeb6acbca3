"""Core attention through torch's scaled_dot_product_attention, a drop-in for megatron's DotProductAttention.

megatron-core's local layer spec computes softmax(Q K^T) V with two bmms over a [b x heads/TP, s, s] score tensor
(taken from its global memory buffer) and keeps the fp32 softmax output for the backward. ``SDPAttention`` takes the
same [s, b, heads, head_dim] query/key/value megatron's SelfAttention passes its core attention (after the q/k norms
and RoPE, which stay in the spec) and calls ``torch.nn.functional.scaled_dot_product_attention``: flash or
memory-efficient kernels on CUDA, a flash kernel on the CPU, none of which materialise the scores. What the backward
keeps is the inputs, the output and one fp32 log-sum-exp per query row and head.

Same contract as DotProductAttention: causal (kdexp's causal mask, or none: megatron's causal default), GQA (the
kernels' ``enable_gqa``, no repeated key/value), softmax scale 1/sqrt(head_dim) unless the layer passes one
(megatron's query-key layer scaling divides the scores by the layer number and multiplies them back in its softmax,
so it does not change the scale), attention dropout only in training, in megatron's model-parallel RNG stream as
DotProductAttention does. Selective recompute (trainer.recompute=selective) checkpoints this module like the
unfused one; with SDPA it saves only the log-sum-exp (the output is kept by linear_proj anyway).
"""
from __future__ import annotations

import math
from typing import Optional

import torch.nn.functional as F

# kdexp's cached causal mask: recognised by identity, so the causal kernel runs without reading it
from kdexp.models.build import _causal_mask as causal_mask


def _module_base():
    from megatron.core.transformer.module import MegatronModule

    return MegatronModule


class SDPAttention(_module_base()):
    """megatron's core-attention interface over torch SDPA (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None):
        super().__init__(config=config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.transformer.enums import AttnMaskType
        from megatron.core.utils import divide

        if config.context_parallel_size != 1:
            raise ValueError("model.attention=sdpa does not support context parallelism")
        if config.softmax_type != "vanilla" or config.window_size is not None:
            raise ValueError("model.attention=sdpa supports the plain causal softmax only (no sliding window, "
                             f"softmax_type={config.softmax_type!r})")
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.padding_causal):
            raise ValueError(f"model.attention=sdpa is causal self-attention; got attn_mask_type={attn_mask_type}")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        self.pg_collection, self.tp_group = pg_collection, pg_collection.tp
        tp = pg_collection.tp.size()
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        head_dim = divide(config.kv_channels * config.num_attention_heads, config.num_attention_heads)
        self.softmax_scale = 1.0 / math.sqrt(head_dim) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.current_max_attn_logits = None  # megatron's qk-clip reads it; never set here

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("model.attention=sdpa takes no packed sequences and no attention bias")
        sq, b = query.shape[:2]
        # [s, b, heads, d] -> [b, heads, s, d]: the layout SDPA expects (a permuted view; the kernels take strides)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        kw = {"enable_gqa": True} if self.heads != self.groups else {}
        if attention_mask is None or attention_mask is causal_mask(sq, query.device):
            mask, causal = None, sq > 1
        else:
            mask, causal = ~attention_mask, False  # SDPA's bool mask: True = may attend
        p = self.dropout_p if self.training else 0.0
        if p > 0 and not self.config.sequence_parallel:
            # as DotProductAttention: heads differ per TP rank, so their dropout draws from the model-parallel stream
            from megatron.core import tensor_parallel

            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                     scale=self.softmax_scale, **kw)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal,
                                                 scale=self.softmax_scale, **kw)
        # [b, heads, s, d] -> [s, b, heads * d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)
