"""Outlier-channel selection by z-score (paper eq. z-score), PyTorch, any device."""
from __future__ import annotations

from typing import Callable

import torch

from megatron_adacc.codecs.int4 import EMPTY_SLOT, INDEX_DTYPE


def channel_abs_sums(x2d: torch.Tensor) -> torch.Tensor:
    """Sum of |x| over the rows of each column, in float64.

    That is exact enough that backends adding in different orders select the same outliers, and
    no finite input overflows."""
    return x2d.abs().sum(dim=0, dtype=torch.float64)


# The channel sums that pick the outliers are taken over a sample of the rows: an outlier
# channel is large in every token (the paper's persistent outlier channels), so every k-th row
# finds the same channels, and the statistics pass reads 1/k of the tensor. Summing every row
# was a whole extra read of the input, half of an encode's time.
STATISTICS_ROWS = 512


def statistics_step(rows: int) -> int:
    """k: the statistics read every k-th row, k = rows // STATISTICS_ROWS (1 below 2 x that)."""
    return max(1, rows // STATISTICS_ROWS)


def statistics_rows(x2d: torch.Tensor) -> torch.Tensor:
    """The rows whose channel_abs_sums choose the outlier channels: every k-th row, contiguous.

    k is statistics_step's."""
    step = statistics_step(x2d.shape[0])
    return x2d if step == 1 else x2d[::step].contiguous()


def outlier_channels(x2d: torch.Tensor, threshold: float,
                     abs_sums: Callable[[torch.Tensor], torch.Tensor] = channel_abs_sums
                     ) -> torch.Tensor:
    """The outlier codec's channels of x2d, as a bool mask over its columns.

    A channel is chosen when its sum of |x| over statistics_rows has a z-score above threshold
    (z_score_outliers). ``abs_sums`` is a backend's kernel for channel_abs_sums."""
    return z_score_outliers(abs_sums(statistics_rows(x2d)), threshold)


def z_score_outliers(sums: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which channels (a bool mask) have a sum of |x| whose z-score is above threshold.

    It uses device ops only, no host sync. Channels whose sum is not finite (NaN or Inf) are
    outliers by definition. They stay out of the mean and standard deviation of the others, which
    need two finite channels. The standard deviation is the population one, over channels.
    """
    finite = torch.isfinite(sums)
    count = finite.sum()
    mean = torch.where(finite, sums, 0.0).sum() / count
    std = (torch.where(finite, sums - mean, 0.0).square().sum() / count).sqrt()
    # std == 0 gives NaN or Inf z-scores only where the sums are all equal or degenerate;
    # NaN > threshold is False, so equal channels are never outliers.
    z = (sums - mean) / std
    return ~finite | ((count >= 2) & (z > threshold))


def select_channels(mask: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``capacity`` outlier channels of ``mask`` in channel order, sized on the host.

    Returns:
        (selected, index): the bool mask of the kept channels (mask & (cumsum(mask) <=
        capacity)), and their indices as INDEX_DTYPE [capacity], ascending, EMPTY_SLOT in the
        unused slots at the end. Device ops only: a prefix scan and a scatter.
    """
    rank = mask.cumsum(0)
    selected = mask & (rank <= capacity)
    channel = torch.arange(mask.numel(), dtype=INDEX_DTYPE, device=mask.device)
    # Each selected channel lands in its slot rank - 1; the others offer EMPTY_SLOT to some
    # slot, which max ignores against a channel (>= 0) and keeps when the slot stays empty.
    slot = (rank - 1).clamp(0, max(capacity - 1, 0))
    index = torch.full((capacity,), EMPTY_SLOT, dtype=INDEX_DTYPE, device=mask.device)
    if capacity:
        index.scatter_reduce_(0, slot, torch.where(selected, channel, EMPTY_SLOT), "amax")
    return selected, index


def outlier_select(x2d: torch.Tensor, threshold: float, capacity: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The outlier codec's exact channels of x2d: select_channels of outlier_channels."""
    return select_channels(outlier_channels(x2d, threshold), capacity)


def take_columns(x2d: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The columns ``index`` of x2d as [rows, len(index)], +0 in the unused slots' columns.

    ``index`` holds int slots, EMPTY_SLOT where unused."""
    values = x2d.index_select(1, index.long().clamp_min(0))
    return torch.where(index >= 0, values, values.new_zeros(()))


def put_columns(x2d: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
    """x2d[:, index] = values for the used slots (index >= 0), in place: take_columns' inverse.

    Each channel looks up the slot that holds it: a gather, no host sync."""
    if not index.numel():
        return
    slot = torch.arange(index.numel(), dtype=torch.int64, device=index.device)
    holder = torch.full((x2d.shape[1],), -1, dtype=torch.int64, device=x2d.device)
    holder.scatter_reduce_(0, index.long().clamp_min(0), torch.where(index >= 0, slot, -1), "amax")
    x2d.copy_(torch.where(holder >= 0, values.index_select(1, holder.clamp_min(0)), x2d))
