"""Readings of the CUDA caching allocator: its peaks over a stretch of work, and the memory a
process may still plan for. On a CPU there is no caching allocator between tensors and
memory, so every reading is zero and the memory to plan for is unknown (None)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

# Kept back from the default budget: NCCL's communicator buffers and the cuBLAS workspaces
# are taken from the device on the first collective and matmul, after set-up, outside the
# allocator that planning sees.
BUDGET_MARGIN_BYTES = 1 << 30


@dataclass
class Peaks:
    allocated_before: int = 0   # bytes in tensors when the watch began
    max_allocated: int = 0      # the most bytes in tensors at once during it
    max_reserved: int = 0       # the most bytes the allocator held from the device during it


@contextlib.contextmanager
def watch(device: torch.device) -> Iterator[Peaks]:
    """The allocator's peaks over the block on ``device`` (read when the block ends)."""
    peaks = Peaks()
    if device.type != "cuda":
        yield peaks
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    peaks.allocated_before = torch.cuda.memory_allocated(device)
    yield peaks
    torch.cuda.synchronize(device)
    peaks.max_allocated = torch.cuda.max_memory_allocated(device)
    peaks.max_reserved = torch.cuda.max_memory_reserved(device)


def plannable_bytes() -> int | None:
    """The memory this process may plan for on its current GPU: what the device has free now
    plus what the process already holds through the allocator (its model among it), less
    BUDGET_MARGIN_BYTES. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - BUDGET_MARGIN_BYTES
