"""Outlier-channel selection by z-score (paper eq. z-score), PyTorch, any device."""
from __future__ import annotations

import torch


def channel_abs_sums(x2d: torch.Tensor) -> torch.Tensor:
    """Sum of |x| over the rows of each column, in float64: exact enough that backends which
    add in different orders select the same outliers (and no finite input overflows)."""
    return x2d.abs().sum(dim=0, dtype=torch.float64)


def outlier_channels(sums: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64) of the channels whose sum of |x| (channel_abs_sums) has a z-score
    above threshold.

    Channels whose sum is not finite (NaN or Inf) are outliers by definition and stay out of
    the mean and standard deviation of the others. The standard deviation is the population
    one, over channels.
    """
    finite = torch.isfinite(sums)
    finite_sums = sums[finite]
    if finite_sums.numel() >= 2:
        std, mean = torch.std_mean(finite_sums, correction=0)
        # std == 0 gives NaN or Inf z-scores only where the sums are all equal or
        # degenerate; NaN > threshold is False, so equal channels are never outliers.
        z = (sums - mean) / std
        is_outlier = ~finite | (z > threshold)
    else:
        is_outlier = ~finite
    return is_outlier.nonzero().view(-1)


def take_columns(x2d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The columns `index` (int64) of x2d, as a [rows, len(index)] tensor."""
    return x2d.index_select(1, index)


def put_columns(x2d: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """x2d[:, index] = values, in place (the inverse of take_columns)."""
    x2d.index_copy_(1, index, values)
