"""Triton kernels of the codecs (CUDA; the CPU under TRITON_INTERPRET=1), byte-identical to
the PyTorch reference.

Interim glue while the kernels move to the sync-free payload format (NaN scales for
non-finite groups, saturating decode, outlier_int4's fixed capacity: the contract in the
reference codecs): the int4 encodes and decodes run the reference; the Triton kernels still
serve the bitmask's packing and unpacking and the outlier codec's channel sums, whose
results did not change. The kernels' rewrite replaces this module.
"""

from megatron_adacc.codecs import outlier
from megatron_adacc.codecs import bitmask as reference_bitmask
from megatron_adacc.codecs.kernels import REFERENCE, Kernels
from megatron_adacc.codecs.triton import bitmask, sym_int4


def _outlier_select(x2d, threshold, capacity):
    if x2d.stride(1) != 1:
        return outlier.outlier_select(x2d, threshold, capacity)
    mask = outlier.outlier_channels(x2d, threshold, abs_sums=sym_int4.channel_abs_sums)
    return outlier.select_channels(mask, capacity)


def _mask_encode(flat):
    return reference_bitmask.mask_encode(flat, pack=bitmask.mask_pack)


def _mask_unpack(packed, numel, value=None):
    return reference_bitmask.expand_flags(bitmask.mask_unpack(packed, numel), value)


TRITON_KERNELS = Kernels(
    sym_encode=REFERENCE.sym_encode,
    sym_decode=REFERENCE.sym_decode,
    asym_encode=REFERENCE.asym_encode,
    asym_decode=REFERENCE.asym_decode,
    mask_encode=_mask_encode,
    mask_unpack=_mask_unpack,
    outlier_select=_outlier_select,
    take_columns=REFERENCE.take_columns,
)
