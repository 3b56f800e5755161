"""Triton kernels of the codecs (CUDA; the CPU under TRITON_INTERPRET=1), one file per codec
family, byte-identical to the PyTorch reference. The outlier codec's channel sums, channel
zeroing and exact channels run as PyTorch ops.

Triton covers the row-grouped int4 codecs (sym_int4, outlier_int4's inliers, naive_int4,
asym_int4) and the bitmask. Per-channel scales (channel_int4) reduce across rows and rows of
odd width pair codes across rows; those cases run the reference, which on CUDA is a handful
of fused-enough PyTorch kernels for the small Q/K/V tensors they serve.
"""
from megatron_adacc.codecs import asymmetric, outlier, symmetric
from megatron_adacc.codecs import bitmask as reference_bitmask
from megatron_adacc.codecs.int4 import zero_channels
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.triton import asym_int4, bitmask, sym_int4


def _sym_encode(x2d, reduce_dim, dmax, zeroed=None):
    if reduce_dim != 1 or x2d.shape[1] % 2:
        return symmetric.sym_encode(x2d, reduce_dim, dmax, zeroed)
    return sym_int4.sym_encode_rows(zero_channels(x2d, zeroed), dmax)


def _sym_decode(packed, scales, shape2d, reduce_dim, dtype):
    if reduce_dim != 1 or shape2d[1] % 2:
        return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype)
    return sym_int4.sym_decode_rows(packed, scales, shape2d, dtype)


def _asym_encode(x2d, dmax):
    if x2d.shape[1] % 2:
        return asymmetric.asym_encode(x2d, dmax)
    return asym_int4.asym_encode_rows(x2d, dmax)


def _asym_decode(packed, scales, offsets, shape2d, dtype):
    if shape2d[1] % 2:
        return asymmetric.asym_decode(packed, scales, offsets, shape2d, dtype)
    return asym_int4.asym_decode_rows(packed, scales, offsets, shape2d, dtype)


def _mask_unpack(packed, numel, value=None):
    return reference_bitmask.expand_flags(bitmask.mask_unpack(packed, numel), value)


TRITON_KERNELS = Kernels(
    sym_encode=_sym_encode,
    sym_decode=_sym_decode,
    asym_encode=_asym_encode,
    asym_decode=_asym_decode,
    mask_pack=bitmask.mask_pack,
    mask_unpack=_mask_unpack,
    mask_value=reference_bitmask.mask_value,
    channel_abs_sums=outlier.channel_abs_sums,
    take_columns=outlier.take_columns,
    put_columns=outlier.put_columns,
)
