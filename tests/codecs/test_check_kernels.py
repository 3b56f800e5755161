"""The Triton codec kernels compiled for sm_90 and sm_80 with no GPU (scripts/check_kernels.py),
at the configurations the codecs launch for GPT-345M- and Llama-3-8B-sized sites in bf16, fp16
and fp32: no spills, at most 128 registers, no 64-bit integer division, activations moved by
16-byte vector accesses, no conversion instruction per element, no global value written and
read by two warps unordered, one kernel per encode and decode (two for outlier_int4's
encode), each launching at least a GPU's SMs' worth of programs.

The script runs once per session, in a subprocess: it must import the kernels without
TRITON_INTERPRET, which this test session sets (conftest.py). Triton's own cache keeps the
compiled kernels between sessions; a cold run compiles 158 configurations (97 s of one core on
an AMD EPYC, measured with an empty TRITON_CACHE_DIR), a warm one takes 17 s.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
TARGETS = (90, 80)
# The training dtypes and fp32 (RMSNorm's saved values; a model trained without mixed precision).
# The script's default adds sm_70, half a minute more of compiling.
DTYPES = ("bf16", "fp16", "fp32")
MAX_REGISTERS = 128
MIN_VECTOR_SHARE = 0.75
# F2I, I2F and FRND run at an eighth of Hopper's adding rate: one per element made them the encodes'
# bound. The one left is the outlier selection's channel count, once per launch.
MAX_CONVERSIONS = 1
KERNELS_PER_CALL = {("outlier_int4", "encode"): 2}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("check_kernels") / "kernels.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_kernels.py"), "--targets",
                          *map(str, TARGETS), "--dtypes", *DTYPES, "--json", str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


def test_every_kernel_compiles_for_each_target(checked):
    data, stdout = checked
    reports = data["reports"]
    assert {r["target"] for r in reports} == set(TARGETS)
    assert [r for r in reports if r["error"]] == []
    kernels = {r["kernel"] for r in reports}
    assert kernels == {"_sym_encode", "_sym_decode", "_sym_encode_exact", "_sym_decode_exact",
                       "_outlier_select", "_asym_encode", "_asym_decode", "_channel_encode",
                       "_channel_decode", "_mask_pack", "_mask_pack_checked", "_mask_unpack"}
    for target in TARGETS:
        assert f"sm_{target}: every configuration compiled" in stdout


def test_no_spills_and_registers_bounded(checked):
    for r in checked[0]["reports"]:
        assert r["spill_bytes"] == 0, r
        assert 0 < r["registers"] <= MAX_REGISTERS, r


def test_no_64_bit_integer_division(checked):
    assert [(r["kernel"], r["div64"]) for r in checked[0]["reports"] if r["div64"]] == []


def test_activations_move_in_16_byte_vectors(checked):
    for r in checked[0]["reports"]:
        assert r["activation_bytes"], f"no access attributed to the activation: {r}"
        assert r["vector_share"] >= MIN_VECTOR_SHARE, r


def test_no_conversion_instruction_per_element(checked):
    reports = checked[0]["reports"]
    assert all(r["conversions"] is not None for r in reports), "SASS not disassembled"
    assert [(r["kernel"], r["used_by"][0], r["conversions"]) for r in reports
            if r["conversions"] > MAX_CONVERSIONS] == []


# An H100's and an H200's SMs: a launch of fewer programs leaves some idle.
MIN_PROGRAMS = 132


def test_every_launch_fills_a_gpu_at_model_sites(checked):
    # outlier_int4's selection launched a program per 64 channels: 16 on GPT-345M's hidden
    # states, whatever their rows.
    assert [(e["codec"], e["site"], e["kernels"], e["programs"]) for e in checked[0]["launches"]
            if min(e["programs"]) < MIN_PROGRAMS] == []


def test_no_program_orders_its_warps_global_accesses_by_luck(checked):
    assert [(r["kernel"], r["used_by"][0], r["hazards"]) for r in checked[0]["reports"]
            if r["hazards"]] == []


def test_one_kernel_per_encode_and_decode_at_model_sites(checked):
    launches = checked[0]["launches"]
    assert {e["codec"] for e in launches} >= {"sym_int4", "outlier_int4", "naive_int4", "asym_int4",
                                              "channel_int4", "bitmask"}
    for e in launches:
        assert len(e["kernels"]) == KERNELS_PER_CALL.get((e["codec"], e["phase"]), 1), e
    # the sites differ in the tiles they launch with: the configurations are the codecs', not one
    configs = {(r["kernel"], json.dumps(r["constexprs"], sort_keys=True))
               for r in checked[0]["reports"]}
    assert len({c for c in configs if c[0] == "_sym_encode"}) > 2


def test_the_ptx_analysis_attributes_accesses_and_finds_64_bit_division():
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_kernels import analyse_ptx

    ptx = """
    .visible .entry k(
    .param .u64 .ptr .global .align 1 k_param_0,
    .param .u64 .ptr .global .align 1 k_param_1,
    .param .u32 k_param_2
    )
    {
    ld.param.b64 %rd1, [k_param_0];
    ld.param.b64 %rd2, [k_param_1];
    ld.param.b32 %r1, [k_param_2];
    mad.wide.s32 %rd3, %r1, 2, %rd1;
    @%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd3 + 0 ];
    add.s64 %rd4, %rd2, 8;
    ld.global.b16 %rs1, [ %rd4 + 0 ];
    st.global.b16 [ %rd3 + 0 ], { %rs1 };
    @!%p2 st.global.v2.b32 [ %rd4 + 0 ], { %r2, %r3 };
    div.s64 %rd5, %rd4, %rd3;
    rem.u32 %r6, %r1, 3;
    }
    """
    widths, div64 = analyse_ptx(ptx, "k", ["x_ptr", "y_ptr", "n"], "x_ptr")
    assert widths == {16: 16, 2: 2}  # y_ptr's load and store are not the activation's
    assert div64 == ["div.s64"]
    assert analyse_ptx(ptx, "k", ["x_ptr", "y_ptr", "n"], "y_ptr")[0] == {2: 2, 8: 8}


# channel_int4's last statistics program before the barrier (2026-11-30), cut to its accesses:
# it read the extremes as #blocked1 and zeroed them as #blocked3 (its atomics' layout).
_READ_THEN_ZEROED = """
  tt.func public @k(%x_ptr: !tt.ptr<bf16>, %counter_ptr: !tt.ptr<i32>) {
    %stats_ptr = tt.addptr %counter_ptr, %c3_i32 : !tt.ptr<i32>, i32
    %7 = tt.splat %stats_ptr : !tt.ptr<i32> -> tensor<1024x!tt.ptr<i32>, #blocked1>
    %8 = tt.splat %stats_ptr : !tt.ptr<i32> -> tensor<1024x!tt.ptr<i32>, #blocked3>
    scf.if %32 {
      scf.for %first_col = %c0_i32 to %channels step %c1024_i32  : i32 {
        %hi_54 = tt.addptr %7, %col_50 : tensor<1024x!tt.ptr<i32>, #blocked1>, tensor<1024xi32>
        %hi_55 = tt.addptr %8, %col_51 : tensor<1024x!tt.ptr<i32>, #blocked3>, tensor<1024xi32>
        %hi_56 = tt.load %hi_54, %ok_52 {isVolatile = true} : tensor<1024x!tt.ptr<i32>, #blocked1>
        BARRIER
        tt.store %hi_55, %cst_21, %ok_53 : tensor<1024x!tt.ptr<i32>, #blocked3>
      } loc(#loc243)
    } loc(#loc73)
    tt.return
  }
"""


# outlier_int4's selection without its barriers, cut to its accesses: a column block's sums
# stored in one layout, read back by the selection in another.
_WRITTEN_THEN_READ = """
  tt.func public @k(%x_ptr: !tt.ptr<bf16>, %sums_ptr: !tt.ptr<f64>) {
    %1 = tt.splat %sums_ptr : !tt.ptr<f64> -> tensor<64x!tt.ptr<f64>, #blocked2>
    %2 = tt.addptr %1, %col : tensor<64x!tt.ptr<f64>, #blocked2>, tensor<64xi32>
    tt.store %2, %total, %ok : tensor<64x!tt.ptr<f64>, #blocked2>
    BARRIER
    %3 = tt.splat %sums_ptr : !tt.ptr<f64> -> tensor<1024x!tt.ptr<f64>, #blocked1>
    %4 = tt.addptr %3, %c : tensor<1024x!tt.ptr<f64>, #blocked1>, tensor<1024xi32>
    %s = tt.load %4, %in {isVolatile = true} : tensor<1024x!tt.ptr<f64>, #blocked1>
    tt.return
  }
"""


def test_the_ttgir_analysis_finds_a_write_read_back_in_another_layout():
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_kernels import analyse_ttgir

    assert analyse_ttgir(_WRITTEN_THEN_READ.replace("BARRIER", "")) == [
        "sums_ptr: stored as #blocked2, read as #blocked1 (ttgir line 9)"]
    assert analyse_ttgir(_WRITTEN_THEN_READ.replace("BARRIER", "ttg.barrier all")) == []


def test_the_ttgir_analysis_finds_a_read_overwritten_in_another_layout():
    sys.path.insert(0, str(ROOT / "scripts"))
    from check_kernels import analyse_ttgir

    racy = _READ_THEN_ZEROED.replace("BARRIER", "")
    assert analyse_ttgir(racy) == ["counter_ptr: read as #blocked1, stored as #blocked3 "
                                   "(ttgir line 12)"]
    assert analyse_ttgir(_READ_THEN_ZEROED.replace("BARRIER", "ttg.barrier all")) == []
    # the same layout: each thread stores what it read itself
    assert analyse_ttgir(racy.replace("#blocked3", "#blocked1")) == []
    # a store in the else branch never follows the if branch's load; one after the if does
    branched = racy.replace("scf.for %first_col = %c0_i32 to %channels step %c1024_i32  : i32 {",
                            "scf.if %33 {")
    branched = branched.replace("        tt.store", "      } else {\n        tt.store")
    assert analyse_ttgir(branched) == []
    store = "tt.store %hi_55, %cst_21, %ok_53 : tensor<1024x!tt.ptr<i32>, #blocked3>"
    after = branched.replace("    tt.return", f"    {store}\n    tt.return")
    assert analyse_ttgir(after) == ["counter_ptr: read as #blocked1, stored as #blocked3 "
                                    "(ttgir line 16)"]


_TWO_KERNELS = '''
import json
import sys
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, sys.argv[1])
from check_kernels import sass_conversions


@triton.jit
def rounds(x_ptr, y_ptr):
    offsets = tl.arange(0, 128)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets).to(tl.int32))


@triton.jit
def copies(x_ptr, y_ptr):
    offsets = tl.arange(0, 128)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets))


def cubin(fn, out):
    source = ASTSource(fn, {"x_ptr": "*fp32", "y_ptr": out}, {})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"]


converting, copying = cubin(rounds, "*i32"), cubin(copies, "*fp32")
print(json.dumps([sass_conversions([converting], 90), sass_conversions([copying], 90),
                  sass_conversions([converting, copying, converting], 90)]))
'''


def test_one_disassembly_counts_each_kernels_conversions_as_one_per_kernel_would(tmp_path):
    pytest.importorskip("triton")
    script = tmp_path / "two_kernels.py"
    script.write_text(_TWO_KERNELS)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(script), str(ROOT / "scripts")], capture_output=True,
                         text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    alone, none, together = json.loads(run.stdout)
    assert alone[0] > 0 and none == [0]
    assert together == [alone[0], 0, alone[0]]
