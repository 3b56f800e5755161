"""scripts/gpu_check.py: without CUDA it says so in one line and exits 0; its report renders
every outcome (the checks themselves need a GPU)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402


def test_without_cuda_it_says_so_and_exits_zero(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out, doc = tmp_path / "check.json", tmp_path / "gpu.md"
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"),
                           "--out", str(out), "--doc", str(doc)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)"]
    assert not out.exists() and not doc.exists()


def test_report_renders_passes_failures_and_missing_measurements():
    results = {
        "device": "NVIDIA H100", "torch": "2.6.0a0", "config": "configs/gpt-345m.yaml",
        "micro_batch_size": 4, "iters": 30,
        "codecs": {"cases": 2, "mismatches": ["bitmask torch.bool (7,): decoded tensors differ"],
                   "ok": False,
                   "speed": [{"codec": "naive_int4", "input_bytes": 1000, "payload_bytes": 262,
                              "copy_ms": 0.5, "round_trip_ms": 2.0,
                              "round_trip_of_copy": 0.25}]},
        "exactness": {"host_syncs_per_step": {"bf16 stock": 0, "bf16 recompute all": 2},
                      "mismatches": [], "ok": True},
        "training": {
            "runs": [{"name": "no optimisation", "tokens_per_s": 1234.5,
                      "max_memory_allocated": 3 << 30, "max_memory_reserved": None,
                      "skipped_steps": 2, "plan_swaps": 1,
                      "trace": {"step_ms": 120.04, "kernel_ms": 100.0, "host_syncs": 3,
                                "top_kernels": [["gemm", 60.0], ["softmax", 20.25]]}},
                     {"name": "adacc auto at 60%", "error": "infeasible budget"},
                     {"name": "adacc auto at 80%", "tokens_per_s": 1000.0,
                      "max_memory_allocated": 1 << 30, "max_memory_reserved": 2 << 30,
                      "plan_table": ["adacc: policy auto", "site  action", "budget 2 MiB"]}],
            "budgets": [{"budget_bytes": 2 << 30, "max_memory_allocated": None,
                         "predicted_peak_bytes": 1 << 30, "ok": False}],
            "ok": False},
    }
    page = gpu_check.markdown(results)
    assert "1 mismatches:\n\n- bitmask torch.bool (7,): decoded tensors differ" in page
    assert "| bf16 recompute all | 2 |" in page
    assert "| 2,048 | - | 1,024 | NO |" in page
    assert "| no optimisation | 1,234 | 3,072 | - | 2 | 1 | 120.0 | 100.0 | 3 |" in page
    assert "| adacc auto at 60% | failed: infeasible budget | | | | | | | |" in page
    assert "- no optimisation: gemm 60.0; softmax 20.2" in page
    assert ("Plan of adacc auto at 80%, as the run printed it:\n\n```text\n"
            "adacc: policy auto\nsite  action\nbudget 2 MiB\n```") in page
    assert "| naive_int4 | 0.262 | 0.500 | 2.000 | 0.25 |" in page


def test_report_says_which_checks_did_not_run():
    results = {"device": "NVIDIA H100", "torch": "2.6.0a0", "config": "configs/gpt-345m.yaml",
               "micro_batch_size": 4, "iters": 30,
               "exactness": {"host_syncs_per_step": {}, "mismatches": [], "ok": True}}
    page = gpu_check.markdown(results)
    assert "## codecs\n\nNot run." in page and "## training\n\nNot run." in page
    assert "strict attribution: equal." in page


def test_the_trace_summary_adds_up_the_traced_steps_kernels_and_waits(tmp_path):
    def event(name, cat, dur):
        return {"ph": "X", "name": name, "cat": cat, "dur": dur, "ts": 0}

    events = [event("ProfilerStep#9", "user_annotation", 5000),
              event("gemm", "kernel", 1500), event("gemm", "kernel", 1500),
              event("softmax", "kernel", 700), event("cudaStreamSynchronize", "cuda_runtime", 9),
              event("cudaLaunchKernel", "cuda_runtime", 4), event("aten::mm", "cpu_op", 800),
              {"ph": "i", "name": "gemm", "cat": "kernel"}]
    (tmp_path / "rank0.123.pt.trace.json").write_text(json.dumps({"traceEvents": events}))
    assert gpu_check.trace_summary(str(tmp_path)) == {
        "step_ms": 5.0, "kernel_ms": 3.7, "host_syncs": 1,
        "top_kernels": [["gemm", 3.0], ["softmax", 0.7]]}
    assert gpu_check.trace_summary(str(tmp_path / "none")) == {}


def test_the_plan_table_is_cut_from_a_runs_output():
    out = "loading\nadacc: policy auto (x)\nsite  layers\nqkv   0-3\nbudget 1 MiB; static\niter 1"
    assert gpu_check.plan_table(out) == ["adacc: policy auto (x)", "site  layers", "qkv   0-3",
                                         "budget 1 MiB; static"]
    assert gpu_check.plan_table("iter 1\niter 2") == []
