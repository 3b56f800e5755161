"""Outlier-channel selection by z-score (paper eq. z-score), PyTorch, any device."""
from __future__ import annotations

import torch


def outlier_channels(x2d: torch.Tensor, threshold: float) -> torch.Tensor:
    """Indices (int64) of the columns of x2d whose sum of |x| has a z-score above threshold.

    Columns whose sum is not finite (NaN, Inf, or fp32 overflow of huge values) are outliers
    by definition and stay out of the mean and standard deviation of the others. The
    standard deviation is the population one, over channels.
    """
    sums = x2d.abs().sum(dim=0, dtype=torch.float32)
    finite = torch.isfinite(sums)
    finite_sums = sums[finite].double()
    if finite_sums.numel() >= 2:
        std, mean = torch.std_mean(finite_sums, correction=0)
        # std == 0 gives NaN or Inf z-scores only where the sums are all equal or
        # degenerate; NaN > threshold is False, so equal channels are never outliers.
        z = (sums.double() - mean) / std
        is_outlier = ~finite | (z > threshold)
    else:
        is_outlier = ~finite
    return is_outlier.nonzero().view(-1)
