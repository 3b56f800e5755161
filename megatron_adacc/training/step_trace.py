"""Megatron-LM's --profile: the training steps from --profile-step-start to
--profile-step-end traced on the ranks --profile-ranks names, by PyTorch's profiler
(--use-pytorch-profiler: one trace per rank in --tensorboard-dir, for TensorBoard, Perfetto or
chrome://tracing) or as a CUDA profiler range with NVTX ranges for an outer
``nsys profile --capture-range=cudaProfilerApi``.

Steps are numbered as Megatron-LM numbers them: the traced steps begin after
--profile-step-start iterations and the trace stops once --profile-step-end are done, counted
from the start of training (a resumed run keeps the count). PyTorch's profiler warms up on the
step before the first traced one, as Megatron-LM's schedule does.
"""
from __future__ import annotations

import argparse

import torch


class StepTrace:
    """Call ``before_step(iteration)`` and ``after_step(iteration)`` around every step
    (``iteration``: the steps done by then) and ``close()`` at the end."""

    def __init__(self, args: argparse.Namespace, rank: int, device: torch.device,
                 first_iteration: int):
        begin = max(args.profile_step_start, first_iteration)
        self.begin, self.end = begin, args.profile_step_end
        self.enabled = args.profile and rank in args.profile_ranks and begin < self.end
        if args.profile and rank == 0 and first_iteration >= self.end:
            print(f"--profile: steps {args.profile_step_start}-{args.profile_step_end} were "
                  f"done before the resumed iteration {first_iteration}; nothing traced")
        self._profiler = self._nvtx = None
        if self.enabled and args.use_pytorch_profiler:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            warmup = 1 if begin > first_iteration else 0
            self._profiler = torch.profiler.profile(
                activities=activities,
                schedule=torch.profiler.schedule(wait=begin - first_iteration - warmup,
                                                 warmup=warmup, active=self.end - begin,
                                                 repeat=1),
                on_trace_ready=torch.profiler.tensorboard_trace_handler(
                    args.tensorboard_dir, worker_name=f"rank{rank}"),
                record_shapes=True, with_stack=True)
            self._profiler.start()

    def before_step(self, iteration: int) -> None:
        if self.enabled and self._profiler is None and iteration == self.begin:
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after_step(self, iteration: int) -> None:
        if self._profiler is not None:
            self._profiler.step()
        elif self._nvtx is not None and iteration == self.end:
            self._stop_range()

    def close(self) -> None:
        """Writes what a run ended before --profile-step-end traced."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        elif self._nvtx is not None:
            self._stop_range()

    def _stop_range(self) -> None:
        self._nvtx.__exit__(None, None, None)
        self._nvtx = None
        torch.cuda.cudart().cudaProfilerStop()
