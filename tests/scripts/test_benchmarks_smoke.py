"""The evaluation suite's scripts run end to end on a tiny shape (no timings asserted)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_adacc.codecs.native import CFLAGS_ENV_VAR

from helpers import ROOT, forked
TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--no-compile",
        "--threads", "1"]


def _run(script, *flags, **environment):
    done = forked.run([os.path.join(ROOT, "scripts", script), *flags], cwd=ROOT,
                      env={**os.environ, **environment})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_accuracy_bench_refuses_a_profile_of_no_steps(tmp_path):
    done = forked.run([os.path.join(ROOT, "scripts", "bench_accuracy.py"), "--quick",
                       "--profile-repeats", "0", "--workdir", tmp_path], cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "bench_accuracy.py: error: --profile-repeats 0: must be a positive integer")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("attention, family", [("flash", "gpt"), ("unfused", "gpt"),
                                               ("flash", "llama")])
def test_throughput_and_max_batch_tiny(tmp_path, attention, family):
    _run("bench_throughput.py", "--quick", *TINY, "--attention-backend", attention,
         "--family", family,
         "--batches", "1", "2", "--budget-at", "1", "--warmup", "0", "--rounds", "2",
         "--ample-rounds", "3",
         "--out", str(tmp_path / "t.json"), "--publish", "", "--figure", str(tmp_path / "t.png"),
         **{CFLAGS_ENV_VAR: "-mno-avx512f"})
    data = json.loads((tmp_path / "t.json").read_text())
    assert (data["shape"]["attention"], data["shape"]["family"]) == (attention, family)
    # the run says which kernels it ran (the native codecs' vector path), and what chose them
    assert data["run"]["environment"][CFLAGS_ENV_VAR] == "-mno-avx512f"
    device = data["run"]["device"]
    assert "codecs native avx2)" in device or "codecs native generic)" in device
    rows = data["rows"]["budget@1"]
    assert rows["1"]["no optimisation"]["fits"] and not rows["2"]["no optimisation"]["fits"]
    assert rows["1"]["adacc auto"]["fits"]
    # memory ample at micro-batch 1: Adacc against no optimisation in CPU time, per round
    ample = data["summary"]["ample"]
    assert [e["micro_batch"] for e in ample] == [1] and ample[0]["adacc_vs_none"] > 0
    pair = data["ample_pairs"]["1"]["budget@1"]
    assert len(pair["none_cpu_s"]) == len(pair["adacc_cpu_s"]) == 3
    assert all(len(v["cpu_times_s"]) == 2 for v in data["variants"]["1"] if "times_s" in v)
    # micro-batch 2 is tight: what Adacc and naive INT4 add over the limit's step, and the most
    # Adacc may add to be 1.03x naive INT4, from the same wall medians as the ratios
    (tight,) = data["summary"]["tight"]
    headroom, steps = tight["naive_int4_headroom"], {m: r["median_step_s"]
                                                     for m, r in rows["2"].items() if r["fits"]}
    limit = next(v for v in data["variants"]["2"]
                 if v["method"] == "no optimisation")["median_step_s"]
    assert headroom["adacc_added_ms"] == pytest.approx((steps["adacc auto"] - limit) * 1e3)
    assert headroom["naive_added_ms"] == pytest.approx((steps["naive INT4"] - limit) * 1e3)
    assert headroom["allowed_added_ms"] == pytest.approx((steps["naive INT4"] / 1.03 - limit) * 1e3)
    # three layers: block recompute of one and of two is measured, three is full recompute
    _run("bench_max_batch.py", "--quick", *TINY, "--layers", "3", "--attention-backend", attention,
         "--family", family, "--budget-at", "1", "--cap", "4", "--out", str(tmp_path / "m.json"),
         "--publish", "", "--figure", str(tmp_path / "m.png"))
    data = json.loads((tmp_path / "m.json").read_text())
    methods = data["results"]["budget@1"]["methods"]
    assert methods["no optimisation"]["max_micro_batch"] == 1
    # re-running more layers whole keeps less: block recompute's micro-batch grows with them,
    # up to full recompute's (the last entry, every layer, is full recompute's own)
    per_layers = methods["megatron block recompute"]["per_layers"]
    measured = [per_layers[f"{n} of 3 layers"] for n in (1, 2)]
    assert measured == sorted(measured) and measured[-1] <= methods["megatron full recompute"][
        "max_micro_batch"]
    assert methods["adacc auto"]["max_micro_batch"] >= methods["megatron full recompute"][
        "max_micro_batch"]
    behind = {m for m, e in methods.items() if m != "adacc auto" and e["max_micro_batch"]
              > methods["adacc auto"]["max_micro_batch"]}
    assert data["targets"]["adacc_ge_every_method"] == (not behind)
    assert (tmp_path / "t.png").exists() and (tmp_path / "m.png").exists()


def test_results_page_from_published_json(tmp_path):
    out = tmp_path / "results.md"
    printed = _run("make_results_page.py", "--out", str(out))
    page = out.read_text()
    assert "# Evaluation results" in page
    # flash first, then unfused, then the plain accuracy runs and the stress setting beside them
    order = [page.index(h) for h in ("## 1. Flash attention", "## 2. Unfused attention",
                                     "## 3. Accuracy", "## 4. Accuracy, outlier stress")]
    assert order == sorted(order)
    # every target line on the page is printed, each with its verdict
    targets = [line for line in printed.splitlines() if line.startswith("- ")]
    assert targets and all(line in page for line in targets)
    assert all("**met**" in line or "**missed**" in line or "not measured" in line
               for line in targets)


# The GPT runs every method; the Llama the three whose code differs by family.
# Between them the two families run every method once (each run is a few seconds of setup).
@pytest.mark.parametrize("family, methods", [
    ("gpt", ["auto-no-outlier", "auto-lossy", "codecs-no-outlier", "quantize"]),
    ("llama", ["auto", "codecs", "quantize"])])
def test_accuracy_two_steps(tmp_path, family, methods):
    _run("bench_accuracy.py", "--quick", "--iters", "2", "--seeds", "1",
         "--budget-fractions", "0.5", "--profile-repeats", "1", "--family", family,
         "--methods", *methods,
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "a.json"), "--publish", "",
         "--figure", str(tmp_path / "a.png"))
    data = json.loads((tmp_path / "a.json").read_text())
    ran = {r["tag"]: r for r in data["runs"]}
    tags = {"none", *(f"{m}@0.5" if m.startswith("auto") else m for m in methods)}
    assert tags <= set(ran)
    assert not any(r.get("failed") for r in ran.values())
    auto = next(t for t in tags if t.startswith("auto"))
    assert ran["none"]["gap_pct"] == 0 and auto in data["gaps_pct"]
    assert (tmp_path / "a.png").exists()
    if "auto-lossy" in methods:     # its own fraction of its own, smaller range
        entry = data["probe"]["budgets"]["0.5"]
        assert entry["lossy_budget_bytes"] <= entry["budget_bytes"]
        assert data["targets"]["lossy_sources_gaps_pct"].keys() == {"auto-lossy@0.5"}


def test_codecs_quick(tmp_path):
    _run("bench_codecs.py", "--quick", "--backends", "native", "--out", str(tmp_path / "c.json"))
    data = json.loads((tmp_path / "c.json").read_text())
    assert {r["memory"] for r in data["results"]} == {"fresh", "recycled"}
    # Sizes and errors do not depend on the machine: those targets hold even on tiny inputs.
    size_and_error = [t for t in data["targets"] if "round trip" not in t["target"]]
    assert size_and_error and all(t["met"] for t in size_and_error), size_and_error
    speed = [t for t in data["targets"] if "round trip" in t["target"]]
    # one per codec, and issue 26's outlier_int4 targets in bf16 and fp32
    assert len(speed) == 8 and all("recycled memory" in t["target"] and t["value"] > 0
                                   for t in speed)
    # the CPU is told apart beyond its model name: "AMD EPYC" alone was Zen 4 or Zen 5
    fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if ":" in line
                  and line.split(":", 1)[0].strip() in ("model name", "cpu family", "model"))
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    cpu = data["machine"]["cpu"]
    assert cpu["model"] == fields["model name"]
    if "cpu family" in fields:  # x86's numbers (every machine of this project's so far)
        assert (cpu["cpu_family"], cpu["model_number"]) == (int(fields["cpu family"]),
                                                            int(fields["model"]))


def test_accuracy_stress_resumes_every_method_from_scaled_gains(tmp_path):
    work = tmp_path / "work"
    # the exact baseline and naive INT4: every stress path without the plain test's profiling
    _run("bench_accuracy.py", "--quick", "--stress", "--iters", "3", "--stress-pretrain", "2",
         "--methods", "quantize", "megatron-full-recompute", "--workdir", str(work),
         "--out", str(tmp_path / "s.json"), "--publish", "", "--figure", str(tmp_path / "s.png"))
    data = json.loads((tmp_path / "s.json").read_text())
    ran = {r["tag"]: r for r in data["runs"]}
    assert set(ran) == {"pretrain", "none", "quantize", "megatron-full-recompute"}
    assert not any(r.get("failed") for r in ran.values())
    # every method trained only the iteration after the checkpoint
    assert ran["pretrain"]["train_curve"][-1][0] == 2
    assert all(r["train_curve"][0][0] == 3 for tag, r in ran.items() if tag != "pretrain")
    # Megatron's full recompute is exact: the same loss as no optimisation, bit for bit
    assert ran["megatron-full-recompute"]["gap_pct"] == 0
    stress = data["stress"]["1234"]
    assert stress["iteration"] == 2 and len(stress["channels"]) == 4
    assert stress["factors"][0] == 10 and stress["factors"][-1] == 30
    # the scaled checkpoint holds the pretrained gains times the factors, nothing else changed
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    def entries(folder):
        return _load_state_dict_from_keys(checkpoint_id=str(work / folder / "iter_0000002"))

    before, after = entries("pretrained-seed1234"), entries("outlier-gains-seed1234")
    scale = torch.ones(before[stress["tensors"][0]].shape[-1])
    scale[stress["channels"]] = torch.tensor(stress["factors"])
    assert before.keys() == after.keys()
    for key, tensor in before.items():
        if not isinstance(tensor, torch.Tensor):  # megatron's extra state, the generators
            continue
        expected = tensor * scale if key in stress["tensors"] else tensor
        assert torch.equal(after[key], expected), key
    # two LayerNorms a layer, each stacked over the layers
    assert stress["tensors"] == ["decoder.layers.mlp.linear_fc1.layer_norm_weight",
                                 "decoder.layers.self_attention.linear_qkv.layer_norm_weight"]


def test_codec_host_time_covers_every_codec(tmp_path):
    from megatron_adacc import codecs

    # A process of its own: it takes Triton's GPU code path, which the forkserver's triton,
    # imported under TRITON_INTERPRET, has replaced.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench_codec_host.py"),
                           "--shape", "2", "64", "128", "--calls", "5",
                           "--out", str(tmp_path / "h.json")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    data = json.loads((tmp_path / "h.json").read_text())
    assert [r["codec"] for r in data["rows"]] == list(codecs.NAMES)
    assert all(r["host_us"] > 0 and r["with_launcher_us"] > 0 for r in data["rows"])
    # Triton's launcher ran through to the driver: a stand-in kernel took every launch
    assert {r["codec"]: r["launches"] for r in data["rows"]} == {
        name: 3 if name == "outlier_int4" else 2 for name in codecs.NAMES}
