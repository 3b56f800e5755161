"""Each Triton codec's round trip under other launch geometries: the data for the tile heuristic.

    python scripts/bench_codec_geometry.py [--shape 8 1024 4096] [--out FILE] [--budget-s 60]

The codecs size every launch from two numbers in ``codecs/triton/launch.py``: the elements a
program moves (GPU_TILE) and the elements a thread moves (ELEMENTS_PER_THREAD, which sets
num_warps). This times each codec's encode + decode of one bf16 activation (channel_int4's in its
sites' shape, gpu.codecs.speed_shape), replayed from a CUDA graph (the device's time, without the
host's), under each pair, beside a device copy. Every geometry's payload must equal the shipped
geometry's byte for byte: a row that differs is marked. It stops starting geometries once
``--budget-s`` is spent. GPU only: on a CPU it says so and exits 0. Prints a table; writes JSON.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

TILES = (2048, 4096, 8192, 16384)
PER_THREAD = (16, 32, 64)


def clear_geometry_caches() -> None:
    """Forget every cached tile and launch option, so the next call sizes its launch anew."""
    from megatron_adacc.codecs import triton as kernels

    for name in dir(kernels):
        module = getattr(kernels, name)
        for attribute in vars(module).values() if hasattr(module, "__dict__") else ():
            if callable(getattr(attribute, "cache_clear", None)):
                attribute.cache_clear()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 1024, 4096])
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--out", default="codec_geometry.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_codec_geometry: no CUDA device here; nothing to time")
        return 0
    from gpu.codecs import _codec_input, speed_shape, time_graph
    from gpu.common import bits_of

    from megatron_adacc import codecs
    from megatron_adacc.codecs.triton import channel_int4, launch

    began, shipped = time.monotonic(), (launch.GPU_TILE, launch.ELEMENTS_PER_THREAD)
    # channel_int4 fixes its own tiles and warps; off the shipped row it takes the others' rule
    channel_shipped = (channel_int4.TILES, channel_int4.WARPS)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {name: _codec_input(name, speed_shape(name, args.shape), torch.bfloat16, gen,
                                 "cuda") for name in codecs.NAMES}
    source = torch.randn(args.shape, generator=gen, device="cuda").to(torch.bfloat16)
    target = torch.empty_like(source)
    copy_ms = time_graph(lambda: target.copy_(source), 5, 20)
    reference = {name: {key: tensor.clone() for key, tensor in
                        codecs.get(name).encode(x).tensors.items()}
                 for name, x in inputs.items()}
    rows = []
    geometries = [shipped] + [g for g in itertools.product(TILES, PER_THREAD) if g != shipped]
    for tile, per_thread in geometries:
        if time.monotonic() - began > args.budget_s:
            rows.append({"tile": tile, "per_thread": per_thread, "skipped": "out of time"})
            continue
        launch.GPU_TILE, launch.ELEMENTS_PER_THREAD = tile, per_thread
        channel_int4.TILES, channel_int4.WARPS = (
            channel_shipped if (tile, per_thread) == shipped else (1, None))
        clear_geometry_caches()
        row = {"tile": tile, "per_thread": per_thread, "round_trip_of_copy": {}}
        for name, x in inputs.items():
            codec = codecs.get(name)
            try:
                payload = codec.encode(x)
                # bits: the inputs hold NaN, which equals nothing
                same = all(torch.equal(bits_of(tensor), bits_of(reference[name][key]))
                           for key, tensor in payload.tensors.items())
                ms = time_graph(lambda: codec.decode(codec.encode(x)), 5, 20)
                row["round_trip_of_copy"][name] = copy_ms / ms if same else "payload differs"
            except Exception as exc:  # noqa: BLE001 - a geometry that fails is a finding
                row["round_trip_of_copy"][name] = f"{type(exc).__name__}: {str(exc)[:80]}"
        rows.append(row)
        print(f"tile {tile:>6} per thread {per_thread:>3}: " + ", ".join(
            f"{n} {v:.2f}" if isinstance(v, float) else f"{n} {v}"
            for n, v in row["round_trip_of_copy"].items()), flush=True)
    launch.GPU_TILE, launch.ELEMENTS_PER_THREAD = shipped
    channel_int4.TILES, channel_int4.WARPS = channel_shipped
    clear_geometry_caches()
    with open(args.out, "w") as handle:
        json.dump({"device": torch.cuda.get_device_name(), "shape": args.shape,
                   "copy_graph_ms": copy_ms, "shipped": list(shipped), "rows": rows}, handle,
                  indent=1)
    print(f"bench_codec_geometry: copy {copy_ms:.3f} ms; shipped tile {shipped[0]}, "
          f"{shipped[1]} a thread; {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
