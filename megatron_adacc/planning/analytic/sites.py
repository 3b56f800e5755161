"""The sites of one layer as formulas of the shape: their bytes and the forward work before each.

The families' parts declare their own terms (models/: the norm, positions and MLP). The terms
of the parts every family shares, core attention and the bias-dropout-adds, are here.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from megatron_adacc.common import sites as site_table
from megatron_adacc.models.terms import (INPUT_NORM, PRE_MLP_NORM, Dims, SiteTerm, act, fp32,
                                         hidden_channels, no_bytes, no_flops, stream)
from megatron_adacc.planning.analytic.shape import DTYPE_NAMES, ModelShape


def _rng_moved_stream(d: Dims) -> float:
    return stream(d) * d.mask_bytes


def _rng_moved_attn(d: Dims) -> float:
    return d.heads * d.seq * d.seq * d.batch * d.mask_bytes


def _softmax(d: Dims) -> str:
    return "float32" if d.softmax_bytes == 4 else d.act_dtype


def _int64(d: Dims) -> str:
    return "int64"


def _bool(d: Dims) -> str:
    return "bool"


def _attention_dropout(shape: ModelShape) -> bool:
    return shape.attention_dropout > 0


def _probabilities_copied(shape: ModelShape) -> bool:
    # The matmul with V saves probabilities of their own: the dropout's output, or the
    # 16-bit cast of an fp32 softmax output.
    return shape.attention_dropout > 0 or (shape.softmax_in_fp32 and shape.activation_bytes == 2)


def _hidden_dropout(shape: ModelShape) -> bool:
    return shape.hidden_dropout > 0


def _qkv_flops(d: Dims) -> float:
    return 2 * d.seq * d.batch * d.hidden * (d.heads + 2 * d.groups) * d.head_dim


def _ahead(flops: Callable[[Dims], float], table: dict[str, SiteTerm]) -> dict[str, SiteTerm]:
    """``table`` with a linear layer's matmul ``flops`` run before its first save."""
    first = next(iter(table))
    return {**table, first: table[first].after(flops)}


def _qkv_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """What the positions save after linear_qkv, then Q, K and V as core attention saves
    them. Under sequence parallelism linear_qkv gathers the sequence first: from here on
    every tensor has the whole sequence and this rank's heads."""
    positions = shape.variant.positions
    if shape.attention_backend == "flash":
        # SDPA keeps K and V at the groups; V is its own copy beside RoPE's Q and K
        def heads(d):
            return d.heads + 2 * d.groups
    else:
        heads = positions.unfused_qkv_heads
    qkv = SiteTerm(lambda d: heads(d) * d.seq * d.batch * d.head_dim, act, no_flops,
                   lambda d: (d.heads + 2 * d.groups) * d.seq * d.batch * d.head_dim * d.act_bytes,
                   lambda d: heads(d) * d.head_dim)
    return _ahead(_qkv_flops, {**positions.site_terms, "qkv": qkv})


def _unfused_core_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    def attn(d):
        return d.heads * d.seq * d.seq * d.batch

    return {
        # Q K^T, scale and mask, softmax: scores written and read in 16 bit, probs written.
        "softmax_out": SiteTerm(attn, _softmax,
                                lambda d: 2 * d.batch * d.seq * d.seq * d.attn_width,
                                lambda d: attn(d) * (2 * d.act_bytes + d.softmax_bytes),
                                lambda d: d.seq),
        "attn_dropout_mask": SiteTerm(attn, _bool, no_flops, _rng_moved_attn, lambda d: d.seq,
                                      when=_attention_dropout),
        "attn_probs": SiteTerm(attn, act, no_flops,
                               lambda d: attn(d) * (d.softmax_bytes + d.mask_bytes + d.act_bytes),
                               lambda d: d.seq, when=_probabilities_copied),
        # The probabilities times V; linear_proj saves the context on entry.
        "context": SiteTerm(lambda d: d.seq * d.batch * d.attn_width, act,
                            lambda d: 2 * d.batch * d.seq * d.seq * d.attn_width,
                            lambda d: 2 * d.seq * d.batch * d.attn_width * d.act_bytes,
                            lambda d: d.attn_width),
    }


def _flash_core_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """What SDPA's flash (or memory-efficient) kernel saves after Q, K and V, in save order.
    The kernel computes Q K^T, softmax and the product with V in on-chip tiles: no s^2 tensor
    reaches memory, and causal masking skips the blocks above the diagonal (half the FLOPs of
    the unfused matmuls). Its output is the storage linear_proj saves (the context)."""
    return {
        "attn_lse": SiteTerm(lambda d: d.heads * d.seq * d.batch, fp32,
                             lambda d: 2 * d.batch * d.seq * d.seq * d.attn_width,
                             lambda d: (4 * d.seq * d.batch * d.attn_width * d.act_bytes
                                        + 4 * d.heads * d.seq * d.batch),
                             lambda d: d.heads),
        # CUDA's philox seed and offset: two int64 scalars, with dropout on.
        "attn_rng_state": SiteTerm(lambda d: 2, _int64, no_flops, no_bytes, lambda d: 1,
                                   when=_attention_dropout),
        "context": SiteTerm(lambda d: d.seq * d.batch * d.attn_width, act, no_flops, no_bytes,
                            lambda d: d.attn_width),
    }


def _mlp_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """linear_fc1's matmul (``fc1_width`` ffn widths: SwiGLU's two of its three matmuls),
    then what the MLP part saves; linear_fc2 saves its output."""
    mlp = shape.variant.mlp
    return _ahead(lambda d: 2 * d.seq * d.batch * d.hidden * (mlp.fc1_width * d.ffn),
                  mlp.terms(fused=shape.cuda_kernels and shape.bias_swiglu_fusion))


def layer_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """The sites of one megatron-core local-spec layer on one tensor-parallel rank, for the
    shape's layer variant (its parts' terms, models/) and attention backend, in the order
    forward saves them; each term's op costs are those of the ops since the previous save."""
    norm = shape.variant.norm
    def proj_flops(d):
        return 2 * d.seq * d.batch * d.attn_width * d.hidden

    # Without the bias-dropout-add mask, the next save after the context is ln2_in: the
    # output projection runs before it.
    ln2_in_flops = no_flops if _hidden_dropout(shape) else proj_flops
    core = (_flash_core_sites if shape.attention_backend == "flash" else _unfused_core_sites)
    table = {
        **norm.site_terms(*INPUT_NORM, cuda=shape.cuda_kernels),
        **_qkv_sites(shape),
        **core(shape),
        "bda1_mask": SiteTerm(stream, _bool, proj_flops, _rng_moved_stream, hidden_channels,
                              when=_hidden_dropout),
    }
    mlp_norm = norm.site_terms(*PRE_MLP_NORM, cuda=shape.cuda_kernels)
    # The bias-dropout-add; pre_mlp_layernorm saves its input on entry.
    mlp_norm["ln2_in"] = replace(mlp_norm["ln2_in"], flops=ln2_in_flops,
                                 bytes_moved=lambda d: (3 * stream(d) * d.act_bytes
                                                        + stream(d) * d.mask_bytes))
    table.update(mlp_norm)
    table.update(_mlp_sites(shape))
    # fc2, then the dropout of the second bias-dropout-add draws its mask.
    table["bda2_mask"] = SiteTerm(stream, _bool,
                                  lambda d: 2 * d.seq * d.batch * d.ffn * d.hidden,
                                  lambda d: stream(d) * d.act_bytes + _rng_moved_stream(d),
                                  hidden_channels, when=_hidden_dropout)
    return {name: term for name, term in table.items() if term.when(shape)}


def dims_of(shape: ModelShape, micro_batch_size: int) -> Dims:
    act_bytes = shape.activation_bytes
    t = shape.tensor_model_parallel_size
    rows = shape.seq_length // t if shape.sequence_parallel else shape.seq_length
    return Dims(seq=shape.seq_length, rows=rows, batch=micro_batch_size,
                hidden=shape.hidden_size, heads=shape.num_attention_heads // t,
                groups=shape.groups // t, head_dim=shape.head_dim, ffn=shape.ffn // t,
                act_bytes=act_bytes, act_dtype=DTYPE_NAMES[shape.precision],
                softmax_bytes=4 if shape.softmax_in_fp32 else act_bytes,
                rotary_dim=int(shape.head_dim * shape.rotary_percent))


def _full_bytes(shape: ModelShape, micro_batch_size: int, shared: bool) -> dict[str, int]:
    d = dims_of(shape, micro_batch_size)
    return {name: term.bytes(d) for name, term in layer_sites(shape).items()
            if site_table.get(name).shared == shared}


def site_bytes(shape: ModelShape, micro_batch_size: int) -> dict[str, int]:
    """Full size of every site of one layer (the sites it decides for)."""
    return _full_bytes(shape, micro_batch_size, shared=False)


def shared_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """The shared sites' one storage for every layer of a stage (RoPE's cos and sin): non-layer
    bytes that live until the stage's first layer backprops."""
    return sum(_full_bytes(shape, micro_batch_size, shared=True).values())


def embedding_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations the embedding saves for its backward (the first stage's): its dropout's
    mask. They live until the embedding backprops, after every layer."""
    d = dims_of(shape, micro_batch_size)
    return stream(d) if shape.hidden_dropout > 0 else 0


def output_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations of the final norm, the output layer and the loss (the last stage's),
    alive at the end of forward and freed by the loss backward before any layer backprops.

    The final norm saves what a layer's norm saves, and the output layer saves the norm's
    output. The logits exist in 16 bit, and the cross-entropy saves the softmax of an fp32 copy
    (2 + 4 bytes per logit; 4 in fp32). At GPT-2's vocabulary the logits dominate. Under
    tensor parallelism each rank holds its vocabulary shard's logits.
    """
    d = dims_of(shape, micro_batch_size)
    norms = sum(term.bytes(d) for term in shape.variant.norm.site_terms(
        "final", "final_in", cuda=shape.cuda_kernels).values())
    # In fp32 the cross-entropy needs no copy: it works in place on the logits.
    per_logit = 4 if d.act_bytes == 4 else d.act_bytes + 4
    vocabulary = shape.padded_vocab_size // shape.tensor_model_parallel_size
    logits = d.seq * d.batch * vocabulary * per_logit
    return norms + logits


def backward_workspace_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Gradients alive while one layer backprops, whatever the plan.

    That is the gradient of the residual stream plus the largest op's gradients: the attention
    scores' and probabilities' in the attention block, the fc1/GELU pair in the MLP."""
    d = dims_of(shape, micro_batch_size)
    residual = stream(d) * d.act_bytes
    # Unfused: the probabilities' output and input gradients, and the scores' gradient that
    # the backward of their view makes anew (AsStridedBackward's zeros). With two, a tiny
    # GPT's steps peaked 0.8 of an fp32 s^2 tensor above the prediction.
    attention = 3 * d.heads * d.seq * d.seq * d.batch * max(d.act_bytes, d.softmax_bytes)
    if shape.attention_backend == "flash":  # no s^2 gradient: dQ, dK, dV and the output's
        attention = 2 * d.seq * d.batch * (d.heads + d.groups) * d.head_dim * d.act_bytes
    # the activation's input gradient (fc1's output) and its output gradient
    mlp_pair = (shape.variant.mlp.fc1_width + 1) * d.seq * d.batch * d.ffn * d.act_bytes
    return residual + max(attention, mlp_pair)
