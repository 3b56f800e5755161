"""The one payload type every codec returns."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class Payload:
    """A compressed tensor: the decoded result's metadata plus the tensors that encode it.

    ``nbytes`` is computed from the tensors held, so it counts every byte the payload keeps alive:
    packed codes, scales, offsets, exception and outlier values and indices. Codecs never store
    views of their input here. Each tensor is freshly computed, so holding a payload does not pin
    the original activation.
    """

    codec: str
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return self.shape.numel()
