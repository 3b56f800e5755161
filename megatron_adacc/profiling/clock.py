"""Clocks for timing calls inside a step: ``perf_counter`` on a CPU, CUDA events on a GPU.

A CUDA event is recorded on the stream and read later. So the calls of a step are timed where they
run, between the step's other kernels, and the host does not wait on the device in between.
``Spans`` reads every span of a step once the step is over: one wait, on its last mark. The profiler
times actions this way, and the step watch times steps. A CPU mark is its reading, always ready.
"""
from __future__ import annotations

import time
from typing import Callable

import torch


class HostClock:
    """Marks are ``perf_counter`` readings, ready at once."""

    deferred = False    # a mark can be read as soon as it is made

    def mark(self) -> float:
        return time.perf_counter()

    def ready(self, mark) -> bool:
        return True

    def seconds(self, start, end) -> float:
        return end - start


class DeviceClock:
    """Marks are CUDA events recorded on the current stream; reading one waits for it."""

    deferred = True     # read a step's marks after the step, not while it runs

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ready(self, mark) -> bool:
        return mark.query()

    def seconds(self, start, end) -> float:
        end.synchronize()
        return start.elapsed_time(end) / 1e3


def for_device(device: torch.device):
    """The clock of ``device``: CUDA events on a GPU, the host's counter otherwise."""
    return DeviceClock() if device.type == "cuda" else HostClock()


class Spans:
    """Calls timed inside one step by ``clock``, read together once the step is over."""

    def __init__(self, clock):
        self.clock = clock
        self._marks: list[tuple[object, object]] = []

    def time(self, fn: Callable[[], object]) -> tuple[object, int]:
        """``fn()``'s result and the index of its span (``read()``'s order)."""
        start = self.clock.mark()
        result = fn()
        self._marks.append((start, self.clock.mark()))
        return result, len(self._marks) - 1

    def read(self) -> list[float]:
        """Every span's seconds, in timing order; a device clock waits once, for the last."""
        if self._marks and not self.clock.ready(self._marks[-1][1]):
            self.clock.seconds(*self._marks[-1])      # waits for the step's last span
        return [self.clock.seconds(start, end) for start, end in self._marks]
