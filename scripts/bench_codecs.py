"""Benchmark the activation codecs: size, error and speed against a plain copy.

    python scripts/bench_codecs.py [--out bench_results/codecs.json] [--quick] [--backends native]
        [--threads 1]

Inputs:
- every tensor a tiny megatron-core GPT saves for backward, captured after some AdamW steps on the
  KJV text (byte-level tokens). Each is named by the module running when it was saved.
- synthetic tensors: heavy-tailed (Student-t) activations with outlier channels, softmax
  probabilities, and dropout masks.

Per codec, backend (torch: eager reference; native: fused C) and input it reports:
- compression ratio (payload bytes / input bytes) and relative error ||x - x^|| / ||x||;
- encode, decode and round-trip throughput, in GB/s of input;
- in the same run, on a tensor of the same size: a plain copy into an existing tensor, the
  memory-bandwidth ceiling. Also a clone, a copy that allocates its output as every decode must;
- the round trip against the copy paired per round, in wall and process CPU time (``paired``,
  ``cpu``). The speed targets use the CPU one for --threads 1.

The synthetic inputs are measured twice: with fresh memory, and with freed memory recycled (mallopt:
no mmap, no trimming). With glibc's defaults, large blocks come fresh from the kernel and every page
faults on first touch. A training step reuses memory instead, as the CUDA caching allocator does.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

import torch

from megatron_adacc import codecs
from megatron_adacc.profiling import allocator

INT4_CODECS = ("outlier_int4", "channel_int4", "asym_int4", "sym_int4", "naive_int4")
OUTLIER_ROUND_TRIP_TARGET = 0.45  # issue 26, native backend, on AVX2 and AVX-512 CPUs


# ------------------------------------------------------------------------------ inputs

def kjv_bytes() -> torch.Tensor:
    spec = importlib.util.find_spec("bible")
    path = Path(spec.submodule_search_locations[0]) / "data" / "kjv.jsonl"
    text = "\n".join(json.loads(line)["text"] for line in path.open(encoding="utf-8"))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def captured_activations(train_steps: int, batch: int, seq: int,
                         seed: int) -> dict[str, torch.Tensor]:
    """Every tensor saved for backward in one training step of a tiny GPT, after training it."""
    from megatron_adacc.models import build as gpt

    gpt.init_distributed()
    gpt.set_seed(seed)
    config = gpt.build_transformer_config(
        num_layers=2, hidden_size=128, num_attention_heads=4, hidden_dropout=0.1,
        attention_dropout=0.1
    )
    net = gpt.build_gpt_model(config, vocab_size=256, max_sequence_length=seq)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    tokens = kjv_bytes()
    gen = torch.Generator().manual_seed(seed)

    def batch_of_tokens():
        starts = torch.randint(0, tokens.numel() - seq - 1, (batch,), generator=gen)
        rows = torch.stack([tokens[s : s + seq + 1] for s in starts.tolist()])
        return rows[:, :-1], rows[:, 1:]

    for _ in range(train_steps):
        x, y = batch_of_tokens()
        loss = gpt.gpt_loss(net, x, y, torch.ones_like(x))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"tiny GPT: {train_steps} AdamW steps on KJV bytes, final loss {loss.item():.3f}")

    running: list[str] = []

    def leave(module, args, output):  # a forward hook returning non-None replaces the output
        running.pop()

    hooks = []
    for name, module in net.named_modules():
        hooks.append(module.register_forward_pre_hook(lambda m, a, n=name: running.append(n)))
        hooks.append(module.register_forward_hook(leave))
    parameters = {p.data_ptr() for p in net.parameters()}
    saved: dict[str, torch.Tensor] = {}
    seen: set[tuple] = set()

    def pack(t: torch.Tensor):
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.data_ptr() not in parameters and key not in seen:
            seen.add(key)
            owner = running[-1] if running and running[-1] else "model"
            index = sum(1 for k in saved if k.startswith(owner + "#"))
            saved[f"{owner}#{index}"] = t.detach().clone()
        return t

    x, y = batch_of_tokens()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = gpt.gpt_loss(net, x, y, torch.ones_like(x))
    loss.backward()
    for hook in hooks:
        hook.remove()
    return saved


def synthetic_inputs(rows: int, cols: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    heavy = torch.distributions.StudentT(3.0).sample((rows, cols))
    outlier_channels = torch.randperm(cols, generator=gen)[: max(1, cols // 100)]
    heavy[:, outlier_channels] *= 50
    scores = torch.randn(rows, cols, generator=gen) * 3
    keep = torch.rand(rows, cols, generator=gen) >= 0.1
    return {
        "heavy_tailed_outliers": heavy,
        "softmax_probs": torch.softmax(scores, dim=-1),
        "dropout_mask_bool": keep,
        "dropout_mask_float": keep.float() / 0.9,
    }


def cpu() -> dict:
    """The CPU, the vector extensions the native kernels can use, and the path their build took.

    The CPU is named by native.host: its model name, with its family and model numbers, which
    tell apart CPUs whose VM model name is the make alone."""
    from megatron_adacc.codecs import native
    from megatron_adacc.codecs.native import host

    this = host.host_cpu()
    return {"model": this.model, "cpu_family": this.family, "model_number": this.model_number,
            **{flag: flag in this.flags for flag in ("avx512f", "avx512bw", "avx2", "f16c")},
            "native_vector_isa": native.vector_isa() if native.available() else None}


# ----------------------------------------------------------------------------- measuring

def interleaved_times(fns: dict, reps: int) -> dict[str, list[tuple[float, float]]]:
    """Wall and process CPU seconds of each function in each round, timed in turns.

    The turns (a, b, c, a, b, c, ...) make all of them see the same load on a shared machine."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            wall, cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def paired_round_trip(times: dict[str, list[tuple[float, float]]], clock: int) -> float:
    """Median over rounds of copy time / (encode + decode time) within the round.

    A slow phase of a shared machine slows the whole round, not one side of the ratio. clock 0 is
    wall time, 1 the process's CPU time. With one thread, time spent descheduled by other jobs
    does not count in CPU time."""
    return statistics.median(copy[clock] / (enc[clock] + dec[clock])
                             for enc, dec, copy in zip(times["encode"], times["decode"],
                                                       times["copy"]))


def measure(codec, x: torch.Tensor, reps: int) -> dict | None:
    try:
        payload = codec.encode(x)  # also the warm-up (the native library builds on first use)
    except (TypeError, ValueError):
        return None  # not an input this codec takes (integer tokens, a non-mask, ...)
    x_hat = codec.decode(payload)
    in_bytes = x.numel() * x.element_size()
    src = torch.empty(in_bytes, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    # copy_: into an existing tensor, the bandwidth ceiling; clone: allocates (and page-faults)
    # its output, as every decode must.
    times = interleaved_times({
        "encode": lambda: codec.encode(x),
        "decode": lambda: codec.decode(payload),
        "copy": lambda: dst.copy_(src),
        "clone": src.clone,
    }, reps)
    t = {name: statistics.median(wall for wall, _ in ts) for name, ts in times.items()}
    norm = x.double().norm().item()
    err = (x.double() - x_hat.double()).norm().item()
    return {
        "input_bytes": in_bytes,
        "payload_bytes": payload.nbytes,
        "ratio": payload.nbytes / in_bytes,
        "rel_error": err / norm if norm else err,
        "encode_gbps": in_bytes / t["encode"] / 1e9,
        "decode_gbps": in_bytes / t["decode"] / 1e9,
        "roundtrip_gbps": in_bytes / (t["encode"] + t["decode"]) / 1e9,
        "copy_gbps": in_bytes / t["copy"] / 1e9,
        "clone_gbps": in_bytes / t["clone"] / 1e9,
        "roundtrip_per_copy_paired": paired_round_trip(times, 0),
        "roundtrip_per_copy_cpu": paired_round_trip(times, 1),
        "outlier_channels": (int((payload.tensors["outlier_index"] >= 0).sum())
                             if "outlier_index" in payload.tensors else 0),
        "outlier_capacity": _count(payload, "outlier_index"),
        "nan_scale_groups": (int(payload.tensors["scales"].float().isnan().sum())
                             if "scales" in payload.tensors else 0),
    }


def round_trip_per_copy(r: dict) -> float:
    """The speed figure the targets use: with one thread, the CPU-time ratio paired per round.

    Other jobs on a shared machine preempt the process, which wall time would count. With more
    threads, it is the wall-time ratio."""
    return r["roundtrip_per_copy_cpu"] if r["threads"] == 1 else r["roundtrip_per_copy_paired"]


def _count(payload, key: str) -> int:
    return payload.tensors[key].numel() if key in payload.tensors else 0


def bitmask_only_on_masks(codec: str, site: str) -> bool:
    return (codec == "bitmask") == ("mask" in site)


def run_suite(suite: str, inputs: dict[str, torch.Tensor], backends, dtypes, reps: int,
              applies=lambda codec, site: True, memory: str = "fresh") -> list[dict]:
    rows = []
    for backend in backends:
        for name in codecs.NAMES:
            codec = codecs.get(name, backend=backend)
            for site, tensor in inputs.items():
                if not applies(name, site):
                    continue
                for dtype in dtypes:
                    x = tensor if not tensor.is_floating_point() else tensor.to(dtype)
                    if not tensor.is_floating_point() and dtype != dtypes[0]:
                        continue  # bool/int tensors do not change with the float dtype
                    result = measure(codec, x, reps)
                    if result is not None:
                        rows.append({"suite": suite, "site": site, "shape": list(x.shape),
                                     "dtype": str(x.dtype), "codec": name, "backend": backend,
                                     "memory": memory, "threads": torch.get_num_threads(),
                                     **result})
    return rows


# ----------------------------------------------------------------------------- reporting

def print_site_table(rows: list[dict], dtype: str) -> None:
    """One line per captured site: ratio and relative error of every codec that takes it."""
    names = [n for n in codecs.NAMES if any(r["codec"] == n for r in rows)]
    by_site: dict[str, dict] = {}
    for r in rows:
        if (r["suite"] == "gpt" and r["dtype"] in (dtype, "torch.bool")
                and r["backend"] == rows[0]["backend"]):
            by_site.setdefault((r["site"], tuple(r["shape"])), {})[r["codec"]] = r
    print(f"\n(a) tiny GPT saved tensors, {dtype[6:]}: payload/input ratio and relative error "
          "per codec")
    print(f"{'site':58} {'shape':16}" + "".join(f" {n:>19}" for n in names))
    for (site, shape), per_codec in by_site.items():
        cells = "".join(
            f" {per_codec[n]['ratio']:8.3f} {per_codec[n]['rel_error']:10.2e}" if n in per_codec
            else f" {'-':>19}"
            for n in names)
        print(f"{site[-58:]:58} {'x'.join(map(str, shape)):16}{cells}")


def print_speed_summary(rows: list[dict]) -> None:
    """Throughput over all captured sites of a codec (total input bytes / total time)."""
    print("\n(a) tiny GPT, all sites together: throughput in GB/s of input")
    print(f"{'codec':12} {'backend':8} {'dtype':8} {'enc':>7} {'dec':>7} {'rt':>7} {'copy':>7} "
          f"{'rt/copy':>8}")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["suite"] == "gpt":
            groups.setdefault((r["codec"], r["backend"], r["dtype"]), []).append(r)
    for (codec, backend, dtype), rs in groups.items():
        total = sum(r["input_bytes"] for r in rs)
        t_enc = sum(r["input_bytes"] / r["encode_gbps"] for r in rs)
        t_dec = sum(r["input_bytes"] / r["decode_gbps"] for r in rs)
        t_copy = sum(r["input_bytes"] / r["copy_gbps"] for r in rs)
        print(f"{codec:12} {backend:8} {dtype[6:]:8} {total / t_enc:7.3f} {total / t_dec:7.3f} "
              f"{total / (t_enc + t_dec):7.3f} {total / t_copy:7.2f} "
              f"{t_copy / (t_enc + t_dec):8.1%}")


def print_table(rows: list[dict]) -> None:
    print("\n(b) synthetic inputs")
    header = f"{'memory':8} {'input':22} {'dtype':8} {'codec':12} {'backend':8} {'ratio':>6} " \
             f"{'rel.err':>9} {'enc GB/s':>8} {'dec GB/s':>8} {'rt GB/s':>8} {'copy':>6} " \
             f"{'clone':>6} {'rt/copy':>7} {'paired':>6} {'cpu':>6}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['memory']:8} {r['site'][-22:]:22} {r['dtype'].replace('torch.', ''):8} "
              f"{r['codec']:12} {r['backend']:8} {r['ratio']:6.3f} {r['rel_error']:9.2e} "
              f"{r['encode_gbps']:8.3f} {r['decode_gbps']:8.3f} {r['roundtrip_gbps']:8.3f} "
              f"{r['copy_gbps']:6.2f} {r['clone_gbps']:6.2f} "
              f"{r['roundtrip_gbps'] / r['copy_gbps']:7.1%} {r['roundtrip_per_copy_paired']:6.1%} "
              f"{r['roundtrip_per_copy_cpu']:6.1%}")


def check_targets(rows: list[dict]) -> list[dict]:
    synthetic = [r for r in rows if r["suite"] == "synthetic"]

    def pick(codec, site, dtype, backend=None, memory="fresh"):
        # Sizes and errors are the same on every backend (byte-identical payloads).
        return next((r for r in synthetic
                     if (r["codec"], r["site"], r["dtype"], r["memory"])
                     == (codec, site, dtype, memory)
                     and backend in (None, r["backend"])), None)

    checks = []
    for codec in ("sym_int4", "asym_int4", "channel_int4", "naive_int4"):
        site = "softmax_probs" if codec == "asym_int4" else "heavy_tailed_outliers"
        for dtype, limit in (("torch.bfloat16", 0.27), ("torch.float32", 0.14)):
            r = pick(codec, site, dtype)
            checks.append({"target": f"{codec} ratio on {dtype[6:]} <= {limit}",
                           "value": r["ratio"], "met": r["ratio"] <= limit})
    for dtype in ("torch.bfloat16", "torch.float32"):
        outlier, sym = (pick("outlier_int4", "heavy_tailed_outliers", dtype),
                        pick("sym_int4", "heavy_tailed_outliers", dtype))
        naive = pick("naive_int4", "heavy_tailed_outliers", dtype)
        rows = outlier["shape"][0]
        exact_bytes = outlier["outlier_capacity"] * (4 + rows * (2 if "bfloat16" in dtype else 4))
        checks.append({"target": "outlier_int4 bytes - sym_int4 bytes <= "
                                 f"{outlier['outlier_capacity']} exact channels with int32 indices "
                                 f"({exact_bytes} B), {dtype[6:]}",
                       "value": outlier["payload_bytes"] - sym["payload_bytes"],
                       "met": outlier["payload_bytes"] - sym["payload_bytes"] <= exact_bytes})
        checks.append({"target": f"naive/outlier rel.err on outlier data, {dtype[6:]} >= 3",
                       "value": naive["rel_error"] / outlier["rel_error"],
                       "met": naive["rel_error"] >= 3 * outlier["rel_error"]})
    mask = pick("bitmask", "dropout_mask_bool", "torch.bool")
    checks.append({"target": "bitmask ratio on a bool mask == 1/8", "value": mask["ratio"],
                   "met": mask["ratio"] == 0.125})
    # Speed: a round trip against a copy into an existing tensor, both with memory recycled (as
    # in a training step); with fresh memory the fair ceiling is a clone, given for reference.
    home = {"asym_int4": ("softmax_probs", "torch.bfloat16"),
            "bitmask": ("dropout_mask_bool", "torch.bool")}
    memory = "recycled" if any(r["memory"] == "recycled" for r in synthetic) else "fresh"
    for backend in sorted({r["backend"] for r in synthetic}):
        for codec in codecs.NAMES:
            where = home.get(codec, ("heavy_tailed_outliers", "torch.bfloat16"))
            r, fresh = (pick(codec, *where, backend=backend, memory=memory),
                        pick(codec, *where, backend=backend))
            fraction = round_trip_per_copy(r)
            checks.append({"target": f"{codec} [{backend}] round trip on {r['site']} >= 1/3 of "
                                     f"copy, {memory} memory (fresh memory: "
                                     f"{fresh['roundtrip_gbps'] / fresh['clone_gbps']:.0%} "
                                     "of a clone)",
                           "value": fraction, "met": fraction >= 1 / 3})
    for backend in sorted({r["backend"] for r in synthetic}):
        for dtype in ("torch.bfloat16", "torch.float32"):
            r = pick("outlier_int4", "heavy_tailed_outliers", dtype, backend=backend, memory=memory)
            fraction = round_trip_per_copy(r)
            checks.append({"target": f"outlier_int4 [{backend}] round trip on {r['site']} "
                                     f"{dtype[6:]} >= {OUTLIER_ROUND_TRIP_TARGET} of copy "
                                     f"(issue 26), {memory} memory",
                           "value": fraction, "met": fraction >= OUTLIER_ROUND_TRIP_TARGET})
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_results/codecs.json")
    parser.add_argument("--quick", action="store_true", help="small inputs: under a minute")
    parser.add_argument("--backends", default=None,
                        help="comma list of codec backends (default: torch,native)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads of torch and of the native kernels (default: torch's "
                             "choice; 1 is steadier when other jobs share the cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
        # read by the native kernels' OpenMP runtime when their library loads, below
        os.environ["OMP_NUM_THREADS"] = str(args.threads)
    warnings.filterwarnings("ignore")
    # a shared machine's timings are only as steady as its load
    load_at_start = list(os.getloadavg())
    machine = cpu()
    print(f"CPU: {machine['model']}; AVX-512F {machine['avx512f']}, "
          f"AVX-512BW {machine['avx512bw']}, AVX2 {machine['avx2']}, F16C {machine['f16c']}; "
          f"native kernels: {machine['native_vector_isa']}")

    backends = (args.backends or "torch,native").split(",")
    # 15 rounds: the median of 5 moved a round trip / copy by up to 0.16 between repeats in one
    # process
    steps, rows_cols, reps = (5, (256, 512), 1) if args.quick else (50, (4096, 4096), 15)
    dtypes = (torch.bfloat16, torch.float32)

    activations = captured_activations(steps, batch=8, seq=128, seed=args.seed)
    print(f"captured {len(activations)} saved tensors; synthetic inputs "
          f"{rows_cols[0]}x{rows_cols[1]}; torch threads {torch.get_num_threads()}")
    synthetic = synthetic_inputs(*rows_cols, seed=args.seed)
    results = run_suite("gpt", activations, backends, dtypes, reps) + run_suite(
        "synthetic", synthetic, backends, dtypes, reps, applies=bitmask_only_on_masks)
    # Fresh memory faults every page on first touch (on a VM about a microsecond per 4 KiB),
    # which caps a clone far below a copy. Recycled, as a training step's memory is, a clone
    # runs as fast as a copy.
    if allocator.recycle_freed_host_memory():  # from here on, for the rest of the process
        results += run_suite("synthetic", synthetic, backends, dtypes, reps,
                             applies=bitmask_only_on_masks, memory="recycled")
    else:
        print("could not make glibc recycle freed memory: speed targets use fresh memory")
    print_site_table(results, "torch.bfloat16")
    print_speed_summary(results)
    print_table([r for r in results if r["suite"] == "synthetic"])
    checks = check_targets(results)
    print("\ntargets")
    for c in checks:
        verdict = {True: "MET", False: "MISSED", None: "info"}[c["met"]]
        print(f"  [{verdict:6}] {c['target']}: {c['value']:.4g}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "cpu": machine, "load_average_at_start": load_at_start},
        "config": {"quick": args.quick, "backends": backends, "threads": args.threads,
                   "train_steps": steps, "synthetic_shape": rows_cols, "reps": reps},
        "results": results,
        "targets": checks,
    }, indent=1))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
