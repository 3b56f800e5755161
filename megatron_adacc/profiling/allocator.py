"""Readings of the CUDA caching allocator: its peaks over a stretch of work, and plannable memory.

On a CPU there is no caching allocator between tensors and memory. Every reading is zero, and the
memory to plan for is unknown (None). On the host, glibc can be told to keep freed memory the way
the caching allocator keeps device memory (``recycle_freed_host_memory``).
"""
from __future__ import annotations

import contextlib
import ctypes
import resource
from dataclasses import dataclass
from typing import Iterator

import torch

# Kept back from the default budget: NCCL's communicator buffers and the cuBLAS workspaces
# are taken from the device on the first collective and matmul, after set-up, outside the
# allocator that planning sees.
BUDGET_MARGIN_BYTES = 1 << 30

_host_memory_recycled = False


@dataclass
class Peaks:
    allocated_before: int = 0   # bytes in tensors when the watch began
    max_allocated: int = 0      # the most bytes in tensors at once during it
    max_reserved: int = 0       # the most bytes the allocator held from the device during it


@contextlib.contextmanager
def watch(device: torch.device) -> Iterator[Peaks]:
    """The allocator's peaks over the block on ``device`` (read when the block ends).

    The caching allocator counts as the host allocates and frees, so it is read without waiting
    for the device: a training step watched runs ahead as one not watched."""
    peaks = Peaks()
    if device.type != "cuda":
        yield peaks
        return
    torch.cuda.reset_peak_memory_stats(device)
    peaks.allocated_before = torch.cuda.memory_allocated(device)
    yield peaks
    peaks.max_allocated = torch.cuda.max_memory_allocated(device)
    peaks.max_reserved = torch.cuda.max_memory_reserved(device)


def allocated(device: torch.device) -> int:
    """The bytes in tensors on ``device`` now; 0 on a CPU."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def reset_peak(device: torch.device) -> None:
    """Start a new allocated peak on ``device`` (host counters: no wait for the device)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak(device: torch.device) -> int | None:
    """The most bytes in tensors on ``device`` since ``reset_peak``; None on a CPU.

    The allocator counts on the host as the host asks, so this reads without waiting."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def plannable_bytes() -> int | None:
    """The memory this process may plan for on its current GPU; None without CUDA.

    It is what the device has free now, plus what the process already holds through the allocator
    (its model among it), less BUDGET_MARGIN_BYTES."""
    if not torch.cuda.is_available():
        return None
    device = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - BUDGET_MARGIN_BYTES


def recycle_freed_host_memory() -> bool:
    """Make glibc keep freed memory in its heap for the rest of the process; False without glibc.

    Every allocation is then served from the heap, as the CUDA caching allocator keeps device
    memory."""
    # With glibc's defaults a block above its mmap threshold (128 KiB, drifting up to 32 MiB
    # as such blocks are freed) comes fresh from the kernel, and each of its pages faults on
    # first touch, about a microsecond per 4 KiB on a VM. A CPU step's time then depended on
    # where the threshold had drifted: one 32 MiB decode profiled at 1.3 ms in one profile
    # and 10-90 ms in another, and the planner planned on whichever it saw.
    global _host_memory_recycled
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    _host_memory_recycled = (bool(libc.mallopt(m_mmap_max, 0))
                             and bool(libc.mallopt(m_trim_threshold, 2**31 - 1)))
    return _host_memory_recycled


def host_memory_recycled() -> bool:
    """Whether ``recycle_freed_host_memory`` has taken effect in this process."""
    return _host_memory_recycled


def host_pages_first_touched() -> int:
    """How many pages of host memory this process has first touched so far (its minor page faults).

    On recycled memory a training step repeats its allocations and touches none. A stretch of
    work that adds to the count grew the heap, and paid about a microsecond a page that later
    steps do not pay."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
