"""The attention backend of a layer spec: megatron-core's unfused `DotProductAttention`, or
`FlashDotProductAttention`, the same module on PyTorch's `scaled_dot_product_attention`.

    --attention-backend unfused   megatron-core's local core attention (the s^2 tensors)
    --attention-backend flash     SDPA: its flash (or memory-efficient) kernel saves Q, K, V,
                                  the output and the log-sum-exp; no s^2 tensor exists
    --attention-backend auto      flash wherever this device's SDPA runs such a kernel with
                                  the configured attention dropout, else unfused

Megatron-LM names the flag the same and defaults to auto. On the CPU, SDPA runs its flash
kernel only without dropout (with dropout it falls back to its math path, which saves the
s^2 tensors under names the flash sites do not have), so auto picks flash there only at
attention dropout 0 and an explicit flash with dropout is refused. On CUDA the flash and
memory-efficient kernels draw their own dropout (their philox seed and offset are saved).
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

ATTENTION_BACKENDS = ("auto", "flash", "unfused")
# What megatron-core's local spec and this package's spec functions build unless told.
DEFAULT_SPEC_BACKEND = "unfused"


def flash_runs(attention_dropout: float, cuda: bool | None = None) -> bool:
    """Whether SDPA runs a kernel that saves only Q, K, V, the output and the log-sum-exp
    (flash or memory-efficient) at this attention dropout on this device."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    return cuda or attention_dropout == 0


def resolve_backend(backend: str, attention_dropout: float, cuda: bool | None = None) -> str:
    """"flash" or "unfused" for a configured backend (auto resolved for this device)."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    if backend == "auto":
        return "flash" if flash_runs(attention_dropout, cuda) else "unfused"
    if backend == "flash" and not flash_runs(attention_dropout, cuda):
        raise ValueError(
            f"--attention-backend flash with --attention-dropout {attention_dropout}: PyTorch's "
            "scaled_dot_product_attention on the CPU has no flash kernel with dropout (its math "
            "path would save the s^2 tensors); use attention dropout 0, or --attention-backend "
            "unfused or auto")
    return backend


class FlashDotProductAttention(DotProductAttention):
    """megatron-core's core attention computed by `scaled_dot_product_attention`.

    Megatron's constructor is kept (heads per tensor-parallel partition, softmax scale, the
    dropout probability); only the computation is SDPA's. Same call signature: query, key and
    value `[s, b, heads/partition, dim]`, output `[s, b, hidden/partition]`.
    """

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        # The softmax module and the dropout module of megatron's forward never run here;
        # the dropout module still holds the probability (and follows train/eval).
        resolve_backend("flash", self.attention_dropout.p)
        unsupported = {
            "grouped-query attention": (self.num_query_groups_per_partition
                                        != self.num_attention_heads_per_partition),
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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("FlashDotProductAttention supports neither packed sequences "
                             "nor an attention bias")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        # As megatron's softmax does: a given mask wins, else a causal type masks causally.
        # Megatron's masks are True where attention is masked out, SDPA's where it attends.
        # (With a mask tensor SDPA picks a kernel that takes one: not flash on the CPU.)
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        mask = None if attention_mask is None else ~attention_mask
        dropout = self.attention_dropout.p if self.training else 0.0
        seq, batch = query.shape[:2]
        # [s, b, np, hn] -> [b, np, s, hn] as views: SDPA saves views of linear_qkv's output,
        # one storage for Q, K and V.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))

        def attend():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                  is_causal=causal, scale=self.sdpa_scale)

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


def auto_core_attention(config, *args, **kwargs):
    """A core-attention builder (megatron calls it like a module class) that picks flash or
    unfused from the config's attention dropout on this device."""
    flash = resolve_backend("auto", config.attention_dropout) == "flash"
    cls = FlashDotProductAttention if flash else DotProductAttention
    return cls(config, *args, **kwargs)


_CORE_ATTENTION = {"auto": auto_core_attention, "flash": FlashDotProductAttention,
                   "unfused": DotProductAttention}


def local_layer_spec(attention_backend: str = DEFAULT_SPEC_BACKEND, **local_spec_kwargs):
    """megatron-core's local GPT layer spec with `attention_backend`'s core attention."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return with_attention_backend(get_gpt_layer_local_spec(**local_spec_kwargs),
                                  attention_backend)


def with_attention_backend(spec, backend: str):
    """A local-spec layer `spec` whose self-attention's core attention is `backend`'s."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")
    attention = spec.submodules.self_attention
    core = dataclasses.replace(attention.submodules, core_attention=_CORE_ATTENTION[backend])
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attention, submodules=core)))
