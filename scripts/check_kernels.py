#!/usr/bin/env python
"""Compile every Triton codec kernel for GPU targets, no GPU needed, as the codecs launch them.

The configurations are recorded, not restated. Each codec encodes and decodes an empty CPU tensor of
a model site's shape through the Triton backend. Meanwhile a hook stands in for Triton's launcher
(JITFunction.run) and keeps each launch's arguments, grid and options instead of running it. Each
launch is then specialised as Triton's launcher would (create_function_from_signature: dtypes,
16-byte divisibility of pointers and ints). It is compiled with triton.compile for GPUTarget("cuda",
cc, 32). Per kernel it reports, from the cubin (read by the bundled cuobjdump and nvdisasm) and
the PTX:

- registers and spilled bytes (the stack and local memory ptxas gave the kernel);
- the share of activation bytes moved by 16-byte (128-bit) vector accesses. It counts the ld.global
  / st.global instructions whose address derives from the activation pointer (the encode's input,
  the decode's output), each weighted by its width.
- 64-bit integer division or remainder (div/rem .s64/.u64);
- conversion instructions in the SASS (F2I, I2F, FRND). A Hopper GPU runs them at an eighth of the
  rate it adds (an Ampere at a quarter): one per element bounds a codec by them, not by memory.
- races: global memory a program reads then writes, or writes then reads, with no barrier between,
  in two thread layouts (analyse_ttgir, from the TTGIR): another warp may be ahead or behind.

and per codec call the kernels it launches with their programs (grid size): fewer programs than a
GPU has SMs leave SMs idle.

    python scripts/check_kernels.py [--targets 90 80 70] [--dtypes bf16 fp16 fp32]
                                    [--json out.json]

It must run without TRITON_INTERPRET, which replaces the kernels. The PTX analysis (analyse_ptx)
imports anywhere.
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import math
import os
import re
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

from megatron_adacc import codecs  # noqa: E402
from megatron_adacc.codecs import codec as codec_module  # noqa: E402

# Model sites, [tokens, channels]: GPT-345M (seq 2048 x micro-batch 4; hidden 1024, fc1
# 4096, Q/K/V rows of 64 per head) and Llama-3-8B (8192 tokens; hidden 4096, fc1 14336,
# heads of 128); Llama-3-70B's fc1 half (28672) for the widest rows naive_int4 holds whole.
SITES = {
    "gpt345m-hidden": (2048 * 4, 1024),
    "gpt345m-fc1": (2048 * 4, 4096),
    "gpt345m-qkv": (2048 * 4 * 16, 64),
    "llama8b-hidden": (8192, 4096),
    "llama8b-fc1": (8192, 14336),
    "llama8b-qkv": (8192 * 32, 128),
    "llama70b-fc1": (8192, 28672),
}
# Q/K/V sites serve channel_int4 only; it serves nothing else.
QKV_CODECS = ("channel_int4",)
# fp32: the outlier codec's RMSNorm sites (x * rstd, saved in fp32).
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEFAULT_DTYPES = tuple(DTYPES)
TARGETS = (90, 80, 70)
# The pointer argument holding the activation: what a kernel reads (encode) or writes (decode).
ACTIVATION_ARG = {
    "_sym_encode": "x_ptr", "_sym_decode": "out_ptr", "_sym_encode_exact": "x_ptr",
    "_sym_decode_exact": "out_ptr", "_outlier_select": "x_ptr",
    "_channel_encode": "x_ptr", "_channel_decode": "out_ptr", "_asym_encode": "x_ptr",
    "_asym_decode": "out_ptr", "_mask_pack": "x_ptr", "_mask_pack_checked": "x_ptr",
    "_mask_unpack": "out_ptr",
}
VECTOR_BYTES = 16
NVIDIA_BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"


@dataclass
class Launch:
    """One kernel launch a codec made: the kernel, its arguments, grid and where it came from."""

    fn: JITFunction
    args: tuple
    kwargs: dict
    grid: tuple
    codec: str
    site: str
    dtype: str
    phase: str

    @property
    def kernel(self) -> str:
        return self.fn.fn.__name__


@dataclass
class Report:
    """What one compiled kernel configuration holds."""

    kernel: str
    target: int
    constexprs: dict
    num_warps: int
    used_by: list = field(default_factory=list)  # "codec site dtype phase" that launch it
    registers: int | None = None
    spill_bytes: int | None = None
    vector_share: float | None = None
    activation_bytes: dict = field(default_factory=dict)  # access width (bytes) -> bytes a thread
    div64: list = field(default_factory=list)
    conversions: int | None = None  # F2I, I2F and FRND instructions in the SASS
    hazards: list = field(default_factory=list)  # analyse_ttgir's reads overwritten unordered
    compile_s: float = 0.0
    error: str | None = None


@contextlib.contextmanager
def recording():
    """Record launches of Triton kernels into the yielded list instead of running them.

    Meanwhile the codecs take the Triton backend for CPU tensors."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("check_kernels compiles for a GPU: unset TRITON_INTERPRET")
    from megatron_adacc.codecs.triton import TRITON_KERNELS

    launches: list[tuple] = []

    def record(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs, grid))

    with mock.patch.object(JITFunction, "run", record), \
            mock.patch.object(codec_module, "kernels_for", lambda backend, device: TRITON_KERNELS):
        yield launches


def _site_input(name: str, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if name == "bitmask" and dtype == torch.bool:
        return torch.empty(shape, dtype=torch.bool)
    return torch.empty(shape, dtype=dtype)


def codec_launches(sites=SITES, dtypes=DTYPES) -> list[Launch]:
    """Every launch of every codec's encode and decode at each site and dtype.

    Bitmask is launched with a bool mask too."""
    result = []
    for name in codecs.NAMES:
        for site, shape in sites.items():
            if (site.endswith("qkv")) != (name in QKV_CODECS):
                continue
            variants = dict(dtypes)
            if name == "bitmask":
                variants["bool"] = torch.bool
            for label, dtype in variants.items():
                codec = codecs.get(name, backend="triton")
                x = _site_input(name, shape, dtype)
                with recording() as launches:
                    payload = codec.encode(x)
                encoded = len(launches)
                with recording() as more:
                    codec.decode(payload)
                for i, (fn, args, kwargs, grid) in enumerate(launches + more):
                    phase = "encode" if i < encoded else "decode"
                    result.append(Launch(fn, args, kwargs, grid, name, site, label, phase))
    return result


def _specialise(launch: Launch, target: GPUTarget):
    """(signature, constexprs, attrs, options) of the launch, as JITFunction.run derives them."""
    fn = launch.fn
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(launch.kwargs, debug=False)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization,
                                                          options)
    return signature, constexprs, attrs, options


def _cuobjdump_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local-memory bytes: spills) of the kernel in ``cubin``, read by cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([str(NVIDIA_BIN / "cuobjdump"), "-res-usage", f.name],
                             capture_output=True, text=True, check=True)
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", run.stdout)
    return int(match.group(1)), int(match.group(2)) + int(match.group(3))


# SASS opcodes that convert between integer and float or round to an integer.
CONVERSIONS = re.compile(r"^\s*/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?(?:F2I|I2F|FRND)\b", re.M)


def _instructions(cubin: bytes) -> bytes:
    """The machine code of ``cubin`` (an ELF64 file): its .text sections, in order."""
    table = int.from_bytes(cubin[0x28:0x30], "little")
    size, count, names = struct.unpack_from("<HHH", cubin, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", cubin, table + i * size) for i in range(count)]
    strings = headers[names][4]
    code = b""
    for name, *_, offset, length, _, _, _, _ in headers:
        if cubin[strings + name:cubin.index(b"\0", strings + name)].startswith(b".text."):
            code += cubin[offset:offset + length]
    return code


def sass_conversions(cubins: list[bytes], cc: int) -> list[int | None]:
    """How many conversion instructions (CONVERSIONS) each sm_``cc`` kernel in ``cubins`` holds.

    nvdisasm takes half a second to start whatever it reads, so every kernel's machine code goes
    through one run, as one raw instruction binary. None each where the bundled nvdisasm no longer
    disassembles the target (sm_70 in CUDA 13)."""
    if not cubins:
        return []
    starts, code = [], b""
    for cubin in cubins:
        starts.append(len(code))
        code += _instructions(cubin)
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        f.write(code)
        f.flush()
        run = subprocess.run([str(NVIDIA_BIN / "nvdisasm"), "--binary", f"SM{cc}", f.name],
                             capture_output=True, text=True)
    if run.returncode != 0:
        return [None] * len(cubins)
    counts = [0] * len(cubins)
    for match in CONVERSIONS.finditer(run.stdout):
        counts[bisect.bisect_right(starts, int(match.group(1), 16)) - 1] += 1
    return counts


_REG = re.compile(r"%[a-z]+\d+")
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[a-z0-9]+)*)\s+(.*)")


def _pointer_sources(ptx: str, pointer_params: set[str]) -> dict[str, set[str]]:
    """For every PTX register, the pointer parameters its value derives from.

    It is a flow-insensitive fixed point over every instruction; loaded values carry none."""
    sources: dict[str, set[str]] = {}
    defs = []
    for line in ptx.splitlines():
        line = line.strip().split("//")[0]
        if not line or line.startswith((".", "{", "}", "$")):
            continue
        line = re.sub(r"^@!?%p\d+\s+", "", line)
        opcode, _, operands = line.partition(" ")
        regs = _REG.findall(operands)
        if not regs or opcode.startswith(("st.", "bar", "@", "ret")):
            continue
        if opcode.startswith("ld.param"):
            param = re.search(r"\[(\w+)\]", operands)
            sources[regs[0]] = {param.group(1)} & pointer_params if param else set()
        elif opcode.startswith(("ld.", "atom.")):
            continue
        else:
            defs.append((regs[0], regs[1:]))
    changed = True
    while changed:
        changed = False
        for dst, srcs in defs:
            merged = set().union(*(sources.get(s, set()) for s in srcs)) if srcs else set()
            if not merged <= sources.setdefault(dst, set()):
                sources[dst] |= merged
                changed = True
    return sources


def _access_bytes(suffix: str) -> int:
    vector = re.search(r"\.v(\d)", suffix)
    width = re.search(r"\.[bfsu](\d+)$", suffix)
    return (int(vector.group(1)) if vector else 1) * int(width.group(1)) // 8


def analyse_ptx(ptx: str, kernel: str, param_names: list[str],
                activation: str) -> tuple[dict, list]:
    """(bytes a thread moves through the activation pointer by access width, 64-bit div/rem count).

    Args:
        ptx: the kernel's PTX.
        param_names: the kernel's non-constexpr arguments in order. PTX names them
            {kernel}_param_{i}.
    """
    pointer_params = {f"{kernel}_param_{i}" for i, name in enumerate(param_names)
                      if name.endswith("_ptr")}
    target_param = f"{kernel}_param_{param_names.index(activation)}"
    sources = _pointer_sources(ptx, pointer_params)
    widths: dict[int, int] = {}
    for line in ptx.splitlines():
        match = _ACCESS.search(line)
        if not match:
            continue
        address = re.search(r"\[\s*(%[a-z]+\d+)", match.group(3))
        if address and target_param in sources.get(address.group(1), set()):
            size = _access_bytes(match.group(2))
            widths[size] = widths.get(size, 0) + size
    div64 = sorted(set(re.findall(r"\b(?:div|rem)(?:\.[a-z]+)*\.[su]64\b", ptx)))
    return widths, div64


# A TTGIR value defined from a pointer (splat, addptr, broadcast, ...), and the layout of a
# load's or store's pointer tensor: the last "#..." of the type after its colon.
_DEFINED_FROM = re.compile(r"^\s*(%[\w.]+) = [\w.]+ (%[\w.]+)")
_MEMORY_OP = re.compile(r"\btt\.(load|store) (%[\w.]+)")
_POINTER_LAYOUT = re.compile(r"!tt\.ptr<[^>]*>, (#[\w.]+(?:<\{[^}]*\}>)?)>")


def analyse_ttgir(ttgir: str) -> list[str]:
    """Global memory a program reads then writes, or writes then reads, in two thread layouts.

    Triton orders a program's global accesses per thread only. When a load's pointer tensor and a
    store's to the same pointer argument are laid out differently, with no barrier between, the
    element one thread accesses second may be another warp's, and that warp may be ahead or
    behind. A ``tl.debug_barrier()`` (ttg.barrier) between them orders them. Regions are read in
    text order; an else branch starts from the state its if began with.
    """
    roots: dict[str, str] = {}
    header = re.search(r"tt\.func \w+ @\w+\((.*)$", ttgir, re.M)
    for name in re.findall(r"(%\w+): !tt\.ptr", header.group(1) if header else ""):
        roots[name] = name
    # (load or store, pointer argument) -> the layouts accessed since the last barrier
    seen: dict[tuple[str, str], set[str]] = {}
    # Per open region: None, or an if's (accesses at its start, those its then branch ended with).
    regions: list[tuple | None] = []
    hazards = []
    for number, line in enumerate(ttgir.splitlines(), 1):
        stripped = line.strip()
        if stripped.startswith("}"):
            region = regions.pop() if regions else None
            if region is not None and stripped.startswith("} else {"):
                regions.append((region[0], seen))
                seen = _copied(region[0])
            elif region is not None and region[1] is not None:  # after an else: either branch's
                seen = {key: seen.get(key, set()) | region[1].get(key, set())
                        for key in {*seen, *region[1]}}
            continue
        if "ttg.barrier" in stripped or "gpu.barrier" in stripped:
            seen = {}
        defined = _DEFINED_FROM.match(line)
        if defined and defined.group(2) in roots and "!tt.ptr" in line:
            roots[defined.group(1)] = roots[defined.group(2)]
        access = _MEMORY_OP.search(line)
        layout = _POINTER_LAYOUT.search(line)
        if access and layout and access.group(2) in roots:
            kind, root, layout = access.group(1), roots[access.group(2)], layout.group(1)
            other = "store" if kind == "load" else "load"
            if seen.get((other, root), set()) - {layout}:
                before = sorted(seen[(other, root)] - {layout})[0]
                hazards.append(f"{root[1:]}: {_PAST[other]} as {before}, {_PAST[kind]} as "
                               f"{layout} (ttgir line {number})")
            seen.setdefault((kind, root), set()).add(layout)
        if stripped.endswith("{"):
            regions.append((_copied(seen), None) if "scf.if" in stripped else None)
    return hazards


_PAST = {"load": "read", "store": "stored"}


def _copied(seen: dict) -> dict:
    return {key: set(layouts) for key, layouts in seen.items()}


_CACHE: dict[tuple, Report] = {}
_CUBINS: dict[int, bytes] = {}  # id() of a Report in _CACHE -> its cubin


def check_launch(launch: Launch, cc: int) -> Report:
    """The Report of ``launch`` compiled for sm_``cc`` (cached by its specialisation)."""
    target = GPUTarget("cuda", cc, 32)
    signature, constexprs, attrs, options = _specialise(launch, target)
    key = (launch.kernel, cc, str(signature), str(sorted(constexprs.items())), str(attrs),
           str(options))
    used_by = f"{launch.codec} {launch.site} {launch.dtype} {launch.phase}"
    if key in _CACHE:
        _CACHE[key].used_by.append(used_by)
        return _CACHE[key]
    named = {launch.fn.arg_names[path[0]]: value for path, value in constexprs.items()}
    report = Report(launch.kernel, cc, {k: v for k, v in named.items() if k.isupper()},
                    options.num_warps, [used_by])
    _CACHE[key] = report
    start = time.perf_counter()
    try:
        compiled = triton.compile(ASTSource(launch.fn, signature, constexprs, attrs), target=target,
                                  options=options.__dict__)
    except Exception as e:  # a target Triton no longer compiles for: reported, not raised
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        report.compile_s = time.perf_counter() - start
        return report
    report.compile_s = time.perf_counter() - start
    report.registers, report.spill_bytes = _cuobjdump_usage(compiled.asm["cubin"])
    _CUBINS[id(report)] = compiled.asm["cubin"]
    params = [name for name, kind in signature.items() if kind != "constexpr"]
    widths, report.div64 = analyse_ptx(compiled.asm["ptx"], compiled.metadata.name, params,
                                       ACTIVATION_ARG[launch.kernel])
    report.activation_bytes = widths
    report.hazards = analyse_ttgir(compiled.asm["ttgir"])
    total = sum(widths.values())
    report.vector_share = widths.get(VECTOR_BYTES, 0) / total if total else None
    return report


def check(targets=TARGETS, sites=SITES, dtypes=None) -> tuple[list[Report], list[dict]]:
    """Compile what the codecs launch at ``sites``.

    Returns:
        The Reports of every distinct kernel configuration, and the kernels each encode and decode
        launched there, in order."""
    dtypes = dtypes if dtypes is not None else {k: DTYPES[k] for k in DEFAULT_DTYPES}
    reports: list[Report] = []
    launched: dict[tuple, list[tuple[str, int]]] = {}
    for launch in codec_launches(sites, dtypes):
        call = (launch.codec, launch.site, launch.dtype, launch.phase)
        launched.setdefault(call, []).append((launch.kernel, math.prod(launch.grid)))
        for cc in targets:
            report = check_launch(launch, cc)
            if not any(r is report for r in reports):
                reports.append(report)
    for cc in targets:
        compiled = [r for r in reports if r.target == cc and not r.error]
        counts = sass_conversions([_CUBINS[id(report)] for report in compiled], cc)
        for report, count in zip(compiled, counts):
            report.conversions = count
    return reports, [dict(zip(("codec", "site", "dtype", "phase"), key),
                          kernels=[kernel for kernel, _ in calls],
                          programs=[programs for _, programs in calls])
                     for key, calls in launched.items()]


def table(reports: list[Report]) -> str:
    head = (f"{'kernel':<16} {'sm':>3} {'dtype':<5} {'warps':>5} {'regs':>4} {'spill':>5} "
            f"{'vec16%':>6} {'div64':>5} {'conv':>4} {'race':>4} {'compile s':>9}  "
            "config | used by")
    lines = [head, "-" * len(head)]
    for r in reports:
        config = " ".join(f"{k}={v}" for k, v in r.constexprs.items()
                          if k not in ("IN_BF16", "OUT_BF16"))
        sites = sorted({" ".join(u.split()[:2]) for u in r.used_by})
        dtype = "/".join(sorted({u.split()[2] for u in r.used_by}))
        if r.error:
            lines.append(f"{r.kernel:<16} {r.target:>3} {dtype:<5} {r.num_warps:>5}  "
                         f"not compiled: {r.error}")
            continue
        share = "-" if r.vector_share is None else f"{100 * r.vector_share:.0f}"
        used = "; ".join(sites[:3]) + (" ..." if len(sites) > 3 else "")
        lines.append(f"{r.kernel:<16} {r.target:>3} {dtype:<5} {r.num_warps:>5} {r.registers:>4} "
                     f"{r.spill_bytes:>5} {share:>6} {len(r.div64):>5} "
                     f"{'-' if r.conversions is None else r.conversions:>4} "
                     f"{len(r.hazards):>4} {r.compile_s:>9.2f}  "
                     f"{config} | {used}")
    return "\n".join(lines)


def _worst(values) -> str:
    known = [value for value in values if value is not None]
    return str(max(known)) if known else "-"


def summary(reports: list[Report]) -> str:
    """The worst case of each kernel at each target, over its configurations."""
    head = (f"{'kernel':<16} {'sm':>3} {'configs':>7} {'max regs':>8} {'spill':>5} "
            f"{'min vec16%':>10} {'div64':>5} {'max conv':>8} {'races':>5}")
    lines = [head, "-" * len(head)]
    for kernel, cc in sorted({(r.kernel, r.target) for r in reports if not r.error}):
        group = [r for r in reports if (r.kernel, r.target) == (kernel, cc) and not r.error]
        shares = [r.vector_share for r in group if r.vector_share is not None]
        share = f"{100 * min(shares):.0f}" if shares else "-"
        lines.append(f"{kernel:<16} {cc:>3} {len(group):>7} {max(r.registers for r in group):>8} "
                     f"{max(r.spill_bytes for r in group):>5} {share:>10} "
                     f"{sum(len(r.div64) for r in group):>5} "
                     f"{_worst(r.conversions for r in group):>8} "
                     f"{sum(len(r.hazards) for r in group):>5}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS))
    parser.add_argument("--dtypes", nargs="+", default=list(DEFAULT_DTYPES), choices=list(DTYPES))
    parser.add_argument("--json", type=Path, help="write the reports and launches here")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    reports, launches = check(tuple(args.targets), SITES, {k: DTYPES[k] for k in args.dtypes})
    elapsed = time.perf_counter() - start
    print(table(reports))
    print()
    print(summary(reports))
    failed = [r for r in reports if r.error]
    for cc in sorted({r.target for r in failed}):
        print(f"sm_{cc}: Triton {triton.__version__} did not compile "
              f"{sum(r.target == cc for r in failed)} configurations (see above)")
    for cc in args.targets:
        if not any(r.target == cc for r in failed):
            print(f"sm_{cc}: every configuration compiled")
    counts = sorted({(e["codec"], e["phase"], len(e["kernels"])) for e in launches})
    print("kernels per call: " + ", ".join(f"{c} {p} {n}" for c, p, n in counts))
    fewest = min((n, k, e["site"]) for e in launches for k, n in zip(e["kernels"], e["programs"]))
    print(f"fewest programs a launch: {fewest[0]} ({fewest[1]} at {fewest[2]})")
    print(f"{len(reports)} configurations compiled in {elapsed:.1f} s "
          f"({sum(r.compile_s for r in reports):.1f} s in triton.compile)")
    if args.json:
        data = {"triton": triton.__version__, "targets": args.targets,
                "reports": [asdict(r) for r in reports], "launches": launches}
        args.json.write_text(json.dumps(data, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
