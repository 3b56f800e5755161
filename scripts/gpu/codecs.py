"""(a) Codecs: payloads byte-identical to the reference; each round trip timed against a copy."""
from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time

import torch

from gpu.common import (CODEC_GRAPH_S, FLOAT_DTYPES, Deadline, Sizes, bits_of, device_kind,
                        synchronize)


# channel_int4 serves the Q/K/V sites: a scale per head channel over [tokens x heads, head dim].
# Its round trip is timed on the same elements in that layout (Llama's heads of 128), not as a
# hidden state, whose thousands of channels it never meets.
SITE_CHANNELS = {"channel_int4": 128}


def speed_shape(name: str, shape) -> tuple:
    """The shape ``name``'s round trip is timed at: ``shape``, or its elements as its sites."""
    channels = SITE_CHANNELS.get(name)
    return tuple(shape) if channels is None else (math.prod(shape) // channels, channels)


def _codec_input(name: str, shape, dtype, gen, device) -> torch.Tensor:
    if name == "bitmask":  # a dropout mask: bool on CUDA, 0 and 1/(1-p) in a float dtype
        keep = torch.rand(shape, generator=gen, device=device) >= 0.1
        return keep if dtype == torch.bool else keep.to(dtype) / 0.9
    x = torch.randn(shape, generator=gen, device=device) * 4
    if x.shape[-1] > 8:
        x[..., 5] *= 80  # an outlier channel
    x.view(-1)[[3, 10]] = torch.tensor([float("nan"), float("-inf")], device=device)
    return (torch.sigmoid(x) if name == "asym_int4" else x).to(dtype)




def _same_decoded(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Bit for bit, NaN matching any NaN.

    A NaN-scale group's decoded NaN bits are not part of the payload format: they follow the
    device's arithmetic."""
    if expected.dtype == torch.bool:
        return torch.equal(expected, actual)
    nan = expected.isnan()
    return (torch.equal(nan, actual.isnan())
            and torch.equal(bits_of(expected.masked_fill(nan, 0)),
                            bits_of(actual.masked_fill(nan, 0))))


def codec_identity(device, sizes: Sizes, deadline: Deadline, gen) -> dict:
    """The device backend's payloads and decoded tensors against the PyTorch reference's.

    It covers every codec, dtype and shape, and a view's strided rows (a SwiGLU fc1 output's
    gate)."""
    from megatron_adacc import codecs

    gate_half_of = (8, 4, 2 * 64)
    cases, mismatches, skipped = 0, [], 0
    for name in codecs.NAMES:
        reference, fast = codecs.get(name, backend="torch"), codecs.get(name)
        dtypes = list(FLOAT_DTYPES.values()) + ([torch.bool] if name == "bitmask" else [])
        for dtype, shape in itertools.product(dtypes, [*sizes.codec_shapes, gate_half_of]):
            if deadline.left() <= 0:
                skipped += 1
                continue
            x = _codec_input(name, shape, dtype, gen, device)
            if shape is gate_half_of:
                x = x[..., :shape[-1] // 2]
            expected, actual = reference.encode(x), fast.encode(x)
            case = f"{name} {dtype} {tuple(x.shape)}{'' if x.is_contiguous() else ' view'}"
            cases += 1
            if expected.tensors.keys() != actual.tensors.keys():
                mismatches.append(f"{case}: payload keys differ")
                continue
            mismatches += [f"{case}: payload tensor {key!r} differs"
                           for key, tensor in expected.tensors.items()
                           if not torch.equal(bits_of(tensor), bits_of(actual.tensors[key]))]
            if not _same_decoded(reference.decode(expected), fast.decode(actual)):
                mismatches.append(f"{case}: decoded tensors differ")
    return {"cases": cases, "skipped_cases": skipped, "mismatches": mismatches,
            "ok": not mismatches}


def time_calls(fn, device, loops: int, calls: int) -> dict:
    """Time ``loops`` loops of ``calls`` back-to-back calls of ``fn``; medians over the loops.

    Returns:
        The device's time per call (CUDA events around the loop; the host clock on a CPU), and the
        host's time per call up to the last launch, the device not waited on."""
    fn(), fn()  # compiles, and warms the caching allocator
    synchronize(device)
    device_ms, host_us = [], []
    for _ in range(loops):
        if device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        launched = time.perf_counter()
        if device.type == "cuda":
            end.record()
            end.synchronize()
            device_ms.append(start.elapsed_time(end) / calls)
        else:
            device_ms.append((launched - began) * 1e3 / calls)
        host_us.append((launched - began) * 1e6 / calls)
    return {"device_ms": statistics.median(device_ms), "host_us": statistics.median(host_us)}


def time_graph(fn, loops: int, calls: int) -> float:
    """Milliseconds per call of ``fn``, replayed from one CUDA graph of ``calls`` calls.

    It is the median of ``loops`` replays. It raises when capture fails (a host sync inside
    ``fn``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    times = []
    for _ in range(loops):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)


def codec_speed(device, sizes: Sizes, deadline: Deadline, gen, emit) -> list[dict]:
    """Each codec's round trip of one bf16 activation against a copy into an existing tensor.

    Bitmask gets a float dropout mask. Both are timed with events."""
    from megatron_adacc import codecs

    rows = []
    for name in codecs.NAMES:
        if deadline.left() <= 0:
            rows.append({"codec": name, "skipped": "out of time"})
            continue
        x = _codec_input(name, speed_shape(name, sizes.speed_shape), torch.bfloat16, gen, device)
        codec, target = codecs.get(name), torch.empty_like(x)
        payload = sum(t.numel() * t.element_size() for t in codec.encode(x).tensors.values())
        copy = time_calls(lambda: target.copy_(x), device, sizes.speed_loops,
                          sizes.speed_calls)
        trip = time_calls(lambda: codec.decode(codec.encode(x)), device, sizes.speed_loops,
                          sizes.speed_calls)
        rows.append({"codec": name, "shape": list(x.shape),
                     "input_bytes": x.numel() * x.element_size(),
                     "payload_bytes": payload, "copy_ms": copy["device_ms"],
                     "copy_host_us": copy["host_us"], "round_trip_ms": trip["device_ms"],
                     "round_trip_host_us": trip["host_us"],
                     "round_trip_of_copy": copy["device_ms"] / trip["device_ms"],
                     "loops": sizes.speed_loops, "calls_per_loop": sizes.speed_calls})
        emit(rows)
    return rows


def codec_graphs(rows: list[dict], sizes: Sizes, deadline: Deadline, gen, emit,
                 device: str = "cuda") -> None:
    """Each codec's round trip, its parts and a copy replayed from CUDA graphs, into ``rows``.

    The parts say where a round trip's time goes: its encode, its decode, and outlier_int4's
    channel selection (the first of its encode's two kernels). A capture that fails (a host
    sync inside) is recorded as such."""
    from megatron_adacc import codecs

    for row in rows:
        if "skipped" in row or deadline.left() <= 0:
            continue
        x = _codec_input(row["codec"], speed_shape(row["codec"], sizes.speed_shape),
                         torch.bfloat16, gen, device)
        codec, target = codecs.get(row["codec"]), torch.empty_like(x)
        payload = codec.encode(x)
        calls = {"copy": lambda: target.copy_(x),
                 "round_trip": lambda: codec.decode(codec.encode(x)),
                 "encode": lambda: codec.encode(x), "decode": lambda: codec.decode(payload)}
        if codec.name == "outlier_int4":
            calls["select"] = _selection(codec, x)
        try:
            for part, call in calls.items():
                row[f"{part}_graph_ms"] = time_graph(call, sizes.speed_loops, sizes.speed_calls)
        except Exception as exc:  # noqa: BLE001 - a capture refused is a finding
            row["graph_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
        emit(rows)


def _selection(codec, x: torch.Tensor):
    """outlier_int4's channel selection of ``x`` alone, as its encode launches it."""
    from megatron_adacc.codecs.backend import kernels_for

    kernels = kernels_for(codec.backend, x.device)
    rows, capacity = x.reshape(-1, x.shape[-1]), codec.capacity_for(x.shape)
    return lambda: kernels.outlier_select(rows, codec.threshold, capacity)


def codecs_worker(device, sizes: Sizes, deadline: Deadline, emit) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    report = {"speed_shape": list(sizes.speed_shape)}
    # events first: they are what the lease is for; then identity; graph capture last, since
    # a failed capture can leave the CUDA context unusable for what would follow it
    report["speed"] = codec_speed(device, sizes, deadline, gen,
                                  lambda rows: emit({**report, "speed": rows}))
    emit(report)
    # the graphs' device times are kept their share: byte identity takes whatever it is given
    graphs_s = CODEC_GRAPH_S[device_kind(device.type == "cpu")] * len(report["speed"])
    report.update(codec_identity(device, sizes, Deadline(deadline.left() - graphs_s), gen))
    emit(report)
    if device.type == "cuda":
        codec_graphs(report["speed"], sizes, deadline, gen,
                     lambda rows: emit({**report, "speed": rows}))


