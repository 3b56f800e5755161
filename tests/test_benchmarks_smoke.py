"""The evaluation suite's scripts run end to end on a tiny shape (no timings asserted)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--layers", "1", "--hidden", "64", "--heads", "2", "--seq", "32", "--no-compile",
        "--threads", "1"]


def _run(script, *flags):
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", script), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_throughput_and_max_batch_tiny(tmp_path):
    _run("bench_throughput.py", "--quick", *TINY, "--batches", "1", "2", "--budget-at", "1",
         "--warmup", "0", "--rounds", "1", "--out", str(tmp_path / "t.json"), "--publish", "",
         "--figure", str(tmp_path / "t.png"))
    data = json.loads((tmp_path / "t.json").read_text())
    rows = data["rows"]["budget@1"]
    assert rows["1"]["no optimisation"]["fits"] and not rows["2"]["no optimisation"]["fits"]
    assert rows["1"]["adacc auto"]["fits"]
    _run("bench_max_batch.py", "--quick", *TINY, "--budget-at", "1", "--cap", "4",
         "--out", str(tmp_path / "m.json"), "--publish", "", "--figure", str(tmp_path / "m.png"))
    data = json.loads((tmp_path / "m.json").read_text())
    methods = data["results"]["budget@1"]["methods"]
    assert methods["no optimisation"]["max_micro_batch"] == 1
    assert methods["adacc auto"]["max_micro_batch"] >= methods["megatron full recompute"][
        "max_micro_batch"]
    assert (tmp_path / "t.png").exists() and (tmp_path / "m.png").exists()


def test_results_page_from_published_json(tmp_path):
    out = tmp_path / "results.md"
    _run("make_results_page.py", "--out", str(out))
    assert "# Evaluation results" in out.read_text()


def test_accuracy_two_steps(tmp_path):
    _run("bench_accuracy.py", "--quick", "--iters", "2", "--seeds", "1", "--budget-fractions", "0.5",
         "--workdir", str(tmp_path / "work"), "--out", str(tmp_path / "a.json"), "--publish", "",
         "--figure", str(tmp_path / "a.png"))
    data = json.loads((tmp_path / "a.json").read_text())
    ran = {r["tag"]: r for r in data["runs"]}
    assert {"none", "auto@0.5", "codecs", "quantize"} <= set(ran)
    assert not any(r.get("failed") for r in ran.values())
    assert ran["none"]["gap_pct"] == 0 and "auto@0.5" in data["gaps_pct"]
    assert (tmp_path / "a.png").exists()


def test_codecs_quick(tmp_path):
    _run("bench_codecs.py", "--quick", "--backends", "native", "--out", str(tmp_path / "c.json"))
    data = json.loads((tmp_path / "c.json").read_text())
    assert {r["memory"] for r in data["results"]} == {"fresh", "recycled"}
    # Sizes and errors do not depend on the machine: those targets hold even on tiny inputs.
    size_and_error = [t for t in data["targets"] if "round trip" not in t["target"]]
    assert size_and_error and all(t["met"] for t in size_and_error), size_and_error
    speed = [t for t in data["targets"] if "round trip" in t["target"]]
    assert len(speed) == 6 and all("recycled memory" in t["target"] and t["value"] > 0 for t in speed)
