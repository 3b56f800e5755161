"""``FlashDotProductAttention``: megatron-core's core attention on PyTorch's SDPA.

It is ``--attention-backend flash`` (see attention_backend.py), on ``scaled_dot_product_attention``.
Its flash (or memory-efficient) kernel saves Q, K, V, the output and the log-sum-exp; on CUDA with
dropout also its philox seed and offset. Those are the sites sites.py names for this layer.
Grouped-query attention runs as SDPA's ``enable_gqa``. On the CPU that is its flash kernel,
with outputs and fp32 gradients bitwise those of repeating K and V
(tests/models/test_flash_attention.py).
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_adacc.models.attention_backend import resolve_backend


class FlashDotProductAttention(DotProductAttention):
    """megatron-core's core attention computed by ``scaled_dot_product_attention``.

    Megatron's constructor is kept: heads per tensor-parallel partition, softmax scale, the dropout
    probability. Only the computation is SDPA's. The call signature is the same: query, key and
    value ``[s, b, heads/partition, dim]``, output ``[s, b, hidden/partition]``.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # The softmax module and the dropout module of megatron's forward never run here;
        # the dropout module still holds the probability (and follows train/eval).
        resolve_backend("flash", self.attention_dropout.p)
        # Grouped-query attention is SDPA's enable_gqa: K and V keep their groups (each
        # serves heads / groups query heads), no repeated copy is made or saved.
        self.enable_gqa = (self.num_query_groups_per_partition
                           != self.num_attention_heads_per_partition)
        unsupported = {
            "a softmax offset": self.softmax_offset is not None,
            "window attention": self.scale_mask_softmax.window_size is not None,
        }
        for what, present in unsupported.items():
            if present:
                raise ValueError(f"--attention-backend flash does not support {what} yet; "
                                 "use --attention-backend unfused")
        # Megatron divides the scale by the layer number under query-key layer scaling and
        # its softmax multiplies it back; SDPA applies the product once.
        coeff = self.layer_number if config.apply_query_key_layer_scaling else 1
        self.sdpa_scale = self.softmax_scale * coeff

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # A mask tensor or a bias would send SDPA to a kernel that takes one (on the CPU its
        # math path, which saves the s^2 tensors the flash sites do not name). Under the
        # causal type the mask is the one Megatron-LM's data loader makes for it, which
        # Transformer Engine's flash attention ignores too.
        if (attention_mask is not None and mask_type != AttnMaskType.causal) \
                or attention_bias is not None:
            raise ValueError("--attention-backend flash masks by the mask type (causal or "
                             "none), not by an attention mask or bias tensor; use "
                             "--attention-backend unfused for those")
        if packed_seq_params is not None:
            raise ValueError("--attention-backend flash does not support packed sequences")
        seq, batch = query.shape[:2]
        # megatron's softmax masks causally only past one query (one query attends to all)
        causal = mask_type == AttnMaskType.causal and seq > 1
        dropout = self.attention_dropout.p if self.training else 0.0
        if value.untyped_storage().data_ptr() != query.untyped_storage().data_ptr():
            # RoPE made Q and K new tensors: V alone would keep linear_qkv's whole output
            # [s, b, groups x (heads/groups + 2) x dim] alive for backward; its own copy
            # frees the rest.
            value = value.contiguous()
        # [s, b, np, hn] -> [b, np, s, hn] as views: SDPA saves views of linear_qkv's output,
        # one storage for Q, K and V (without RoPE).
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        def attend():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=causal,
                                                  scale=self.sdpa_scale,
                                                  enable_gqa=self.enable_gqa)

        if dropout > 0 and not self.config.sequence_parallel:
            # megatron draws attention dropout from the tensor-parallel generator
            with tensor_parallel.get_cuda_rng_tracker().fork():
                out = attend()
        else:
            out = attend()
        # SDPA writes its output in the query's memory order, [s, b, np, hn], so this is a
        # view of the very tensor it saves (reshape copies only where a kernel chose another
        # layout).
        return out.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)
