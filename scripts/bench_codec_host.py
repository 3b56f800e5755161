"""The host time of each Triton codec's round trip: the wrappers, and Triton's launcher with them.

    python scripts/bench_codec_host.py [--shape 8 1024 1024] [--calls 2000] [--out FILE]

On the H200 (docs/gpu.md) a round trip took 150-270 us of host time against a 35 us device copy, so
back to back the codecs were bound by the host. This measures that host time on any machine, for
CPU tensors through the GPU code path (GPU tiles, no interpreter). Two columns:

- wrappers: geometry, allocations and views, with each kernel launch a no-op;
- with launcher: Triton's JITFunction.run as well (argument binding, specialisation, the kernel
  cache), up to the driver's launch. A stand-in driver reports an sm_90 device, and a stand-in
  compiled kernel takes each launch and does nothing.

Allocations are the host's, not the caching allocator's: keep the shape's tensors under glibc's
mmap threshold (32 MiB), or each allocation maps memory.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import time
from unittest import mock

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from megatron_adacc import codecs
from megatron_adacc.codecs import codec as codec_module


class _StandInDriver:
    """The driver calls JITFunction.run makes before a launch, for a GPU that is not there."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _StandInKernel:
    """A compiled kernel whose launch does nothing but count."""

    function = packed_metadata = None
    launches = 0

    def launch_metadata(self, *args):
        return None

    def run(self, *args):
        _StandInKernel.launches += 1


def _compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
    kernel = _StandInKernel()
    self.device_caches[device][0][key] = kernel   # as JITFunction._do_compile caches it
    return kernel


@contextlib.contextmanager
def triton_on_the_host(launch: bool):
    """CPU tensors through the Triton backend; with ``launch``, Triton's launcher runs too."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("bench_codec_host times the GPU code path: unset TRITON_INTERPRET")
    from megatron_adacc.codecs.triton import TRITON_KERNELS

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(codec_module, "kernels_for",
                                              lambda backend, device: TRITON_KERNELS))
        if launch:
            stack.enter_context(mock.patch.object(JITFunction, "_do_compile", _compile_nothing))
            # as it was: the default driver cannot be made without a GPU
            stack.callback(driver.set_active, driver._active)
            driver.set_active(_StandInDriver())
        else:
            stack.enter_context(mock.patch.object(
                JITFunction, "run", lambda self, *args, grid, warmup, **kwargs: None))
        yield


def host_us(name: str, x: torch.Tensor, calls: int, launch: bool) -> tuple[float, float]:
    """(microseconds of host time a round trip of ``name`` takes, kernel launches it makes).

    The time is the fastest of 25 loops, as timeit takes it: other work on the machine only
    ever adds time. Launches are counted with ``launch`` only."""
    codec = codecs.get(name, backend="triton")
    x = x > 0 if name == "bitmask" else x
    loops, per_loop = [], max(1, calls // 25)
    with triton_on_the_host(launch):
        for _ in range(20):
            codec.decode(codec.encode(x))
        _StandInKernel.launches = 0
        for _ in range(25):
            began = time.perf_counter()
            for _ in range(per_loop):
                codec.decode(codec.encode(x))
            loops.append((time.perf_counter() - began) / per_loop * 1e6)
    return min(loops), _StandInKernel.launches / (25 * per_loop)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 1024, 1024])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="bench_results/codec_host.json")
    args = parser.parse_args(argv)
    x = torch.randn(*args.shape).to(torch.bfloat16)
    rows = []
    for name in codecs.NAMES:
        wrappers, _ = host_us(name, x, args.calls, launch=False)
        with_launcher, launches = host_us(name, x, args.calls, launch=True)
        rows.append({"codec": name, "host_us": wrappers, "with_launcher_us": with_launcher,
                     "launches": launches})
    print(f"host time a round trip, bf16 {tuple(args.shape)} (us):")
    print(f"  {'codec':<13} {'wrappers':>9} {'with launcher':>14} {'launches':>9}")
    for row in rows:
        print(f"  {row['codec']:<13} {row['host_us']:9.1f} {row['with_launcher_us']:14.1f} "
              f"{row['launches']:9g}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"cpu": platform.processor() or platform.machine(), "shape": args.shape,
                   "calls": args.calls, "rows": rows}, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
