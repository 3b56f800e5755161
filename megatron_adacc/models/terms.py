"""The vocabulary of accelerator-model terms: what a layer part tells the analytic model.

A part describes each tensor it saves as functions of one tensor-parallel rank's dimensions
(``Dims``). So the analytic model (``planning/analytic/``) applies a device's rates to them and
knows no family.

A ``SiteTerm`` is one site's size (elements and dtype) and the forward work since the previous save:
matmul FLOPs and the DRAM traffic of the other ops. The families' parts declare theirs
(``models/gpt.py``, ``models/llama.py``). The parts every family shares (core attention, the
bias-dropout-adds) are the analytic model's.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from megatron_adacc.common.sites import LAYER_INPUT, SEGMENTS


@dataclass(frozen=True)
class Dims:
    """One tensor-parallel rank's dimensions."""
    seq: int            # sequence length (attention and the MLP see all of it)
    rows: int           # rows of the residual stream: seq / TP under sequence parallelism
    batch: int          # micro-batch size
    hidden: int         # hidden size (the residual stream's width)
    heads: int          # attention heads on this rank
    groups: int         # query groups on this rank
    head_dim: int
    ffn: int            # ffn hidden size on this rank
    act_bytes: int      # bytes per activation element
    act_dtype: str      # the activations' torch dtype name
    softmax_bytes: int  # bytes per element of the saved softmax output
    rotary_dim: int     # RoPE's rotary dimension
    mask_bytes: int = 1  # a dropout mask is bool on GPU

    @property
    def attn_width(self) -> int:
        """Attention width on this rank: its heads x head dimension."""
        return self.heads * self.head_dim


@dataclass(frozen=True)
class SiteTerm:
    """How big a site is, and what the forward runs since the previous save of its segment.

    Both are functions of the dims; the rebuild time is the sum along the segment. ``when`` reads
    the model shape (its dropouts, its softmax precision)."""

    elements: Callable[[Dims], int]
    dtype: Callable[[Dims], str]             # a torch dtype name
    flops: Callable[[Dims], float]           # matmul FLOPs since the previous save
    bytes_moved: Callable[[Dims], float]     # DRAM traffic of the non-matmul ops since then
    channels: Callable[[Dims], int]          # channels of what a codec encodes (its scales)
    when: Callable[[Any], bool] = lambda shape: True
    # The elements of its saved view where that is part of the tensor (Site.partial_view):
    # what a codec encodes. None: all of them.
    view_elements: Callable[[Dims], int] | None = None

    def element_bytes(self, d: Dims) -> int:
        return getattr(torch, self.dtype(d)).itemsize

    def bytes(self, d: Dims) -> int:
        return self.elements(d) * self.element_bytes(d)

    def encoded_elements(self, d: Dims) -> int:
        return (self.view_elements or self.elements)(d)

    def after(self, flops: Callable[[Dims], float]) -> "SiteTerm":
        """This save with ``flops`` more matmul work ahead of it.

        That is a linear layer that runs between the previous save and this one."""
        own = self.flops
        return replace(self, flops=lambda d: flops(d) + own(d))


# megatron's local layer has two norms: (their sites' prefix, the site of their input).
INPUT_NORM = ("ln1", LAYER_INPUT)
PRE_MLP_NORM = ("ln2", SEGMENTS["mlp"])


def act(d: Dims) -> str:
    return d.act_dtype


def fp32(d: Dims) -> str:   # norm statistics, RMSNorm's saves
    return "float32"


def stream(d: Dims) -> int:
    """Elements of the residual stream on this rank."""
    return d.rows * d.batch * d.hidden


def sbf(d: Dims) -> int:
    """Elements of one ffn-wide MLP tensor on this rank."""
    return d.seq * d.batch * d.ffn


def hidden_channels(d: Dims) -> int:
    return d.hidden


def no_flops(d: Dims) -> float:
    return 0.0


def no_bytes(d: Dims) -> float:
    return 0.0
