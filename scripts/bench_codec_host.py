"""The host time of each Triton codec's round trip, with its kernel launches made no-ops.

    python scripts/bench_codec_host.py [--shape 8 1024 4096] [--calls 2000] [--out FILE]

On the H200 (docs/gpu.md) a round trip took 150-270 us of host time against a 35 us device copy, so
back to back the codecs were bound by the host. This measures the part the wrappers own (geometry,
allocations, views), on any machine. The kernels are replaced by no-ops under TRITON_INTERPRET=1, so
nothing runs on a device and Triton's own launcher is left out.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

os.environ["TRITON_INTERPRET"] = "1"   # before triton is imported: CPU tensors are accepted

import torch  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from megatron_adacc import codecs  # noqa: E402


def _no_launch(self, grid):
    return lambda *args, **kwargs: None


def host_us(name: str, x: torch.Tensor, calls: int) -> float:
    """Microseconds of host time a round trip of ``name`` takes, launches excluded."""
    codec = codecs.get(name, backend="triton")
    x = x > 0 if name == "bitmask" else x
    for _ in range(20):
        codec.decode(codec.encode(x))
    began = time.perf_counter()
    for _ in range(calls):
        codec.decode(codec.encode(x))
    return (time.perf_counter() - began) / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 1024, 4096])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--out", default="bench_results/codec_host.json")
    args = parser.parse_args(argv)
    interpreter.InterpretedFunction.__getitem__ = _no_launch
    x = torch.randn(*args.shape).to(torch.bfloat16)
    rows = [{"codec": name, "host_us": host_us(name, x, args.calls)} for name in codecs.NAMES]
    print(f"host time a round trip, launches excluded, bf16 {tuple(args.shape)}:")
    for row in rows:
        print(f"  {row['codec']:<13} {row['host_us']:7.1f} us")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as handle:
        json.dump({"cpu": platform.processor() or platform.machine(), "shape": args.shape,
                   "calls": args.calls, "rows": rows}, handle, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
