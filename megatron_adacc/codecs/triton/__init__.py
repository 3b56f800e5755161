"""Triton kernels of the codecs (CUDA; the CPU under TRITON_INTERPRET=1), one file per codec
family, byte-identical to the PyTorch reference, reading a view's rows where they lie as the
native ones (Kernels.strided_rows). The outlier codec reads its input once plus a
sample, as the native kernels do: a Triton pass for the channel sums over every k-th row
(outlier.statistics_rows), then the encoding pass, which zeroes the outlier channels as it
loads them; its
exact channels are taken with one PyTorch gather once the encode's one host read has sized
them, and written back in the decoding pass.

Triton covers the row-grouped int4 codecs (sym_int4, outlier_int4's inliers, naive_int4,
asym_int4) and the bitmask. Per-channel scales (channel_int4) reduce across rows and rows of
odd width pair codes across rows; those cases run the reference, which on CUDA is a handful
of fused-enough PyTorch kernels for the small Q/K/V tensors they serve.
"""

from megatron_adacc.codecs import asymmetric, int4, outlier, symmetric
from megatron_adacc.codecs import bitmask as reference_bitmask
from megatron_adacc.codecs.kernels import Kernels
from megatron_adacc.codecs.triton import asym_int4, bitmask, sym_int4


def _sym_encode(x2d, reduce_dim, dmax, zeroed=None):
    layout = int4.row_layout(x2d, zeroed) if reduce_dim == 1 else None
    if layout is None:
        # groups read in place as [rows, groups a row, width] are the reference's [groups,
        # width]; it raises on a wrong mask
        return symmetric.sym_encode(x2d.reshape(-1, x2d.shape[-1]), reduce_dim, dmax, zeroed)
    if zeroed is None:
        return sym_int4.sym_encode_rows(x2d, layout, dmax)
    # the exact channels' values: taken by the codec once their count is read
    return (*sym_int4.sym_encode_rows(x2d, layout, dmax, zeroed), None)


def _outlier_channels(x2d, threshold):
    if x2d.stride(1) != 1:
        return outlier.outlier_channels(x2d, threshold)
    return outlier.outlier_channels(x2d, threshold, abs_sums=sym_int4.channel_abs_sums)


def _sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact=None):
    if reduce_dim != 1 or shape2d[1] % 2:
        return symmetric.sym_decode(packed, scales, shape2d, reduce_dim, dtype, exact)
    return sym_int4.sym_decode_rows(packed, scales, shape2d, dtype, exact)


def _asym_encode(x2d, dmax):
    if x2d.shape[1] % 2:
        return asymmetric.asym_encode(x2d, dmax)
    return asym_int4.asym_encode_rows(x2d, dmax)


def _asym_decode(packed, scales, offsets, shape2d, dtype):
    if shape2d[1] % 2:
        return asymmetric.asym_decode(packed, scales, offsets, shape2d, dtype)
    return asym_int4.asym_decode_rows(packed, scales, offsets, shape2d, dtype)


def _mask_encode(flat):
    return reference_bitmask.mask_encode(flat, pack=bitmask.mask_pack)


def _mask_unpack(packed, numel, value=None):
    return reference_bitmask.expand_flags(bitmask.mask_unpack(packed, numel), value)


TRITON_KERNELS = Kernels(
    sym_encode=_sym_encode,
    count_unusable=int4.count_unusable,
    sym_decode=_sym_decode,
    asym_encode=_asym_encode,
    asym_decode=_asym_decode,
    mask_encode=_mask_encode,
    mask_unpack=_mask_unpack,
    outlier_channels=_outlier_channels,
    take_columns=outlier.take_columns,
    put_columns=outlier.put_columns,
    strided_rows=True,
)
