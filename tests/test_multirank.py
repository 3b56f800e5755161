"""Multi-process runs agree with a single process: one plan on every rank, same losses."""
import json
import os
import subprocess
import sys
from pathlib import Path

from test_trainer import TINY

HERE = Path(__file__).resolve().parent
# One thread per process in both runs: the ProfileDB key names the device with its thread
# count, and the comparison needs both runs to read the same stored profile.
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_two_processes_run_one_plan_and_match_a_single_process(tmp_path):
    db = str(tmp_path / "profiles.sqlite")
    common = [*TINY, "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--adacc-policy", "auto", "--adacc-memory-budget", "2.5MiB",
              "--adacc-profile-db", db, "--adacc-tracking", "off"]
    # The single process profiles and stores the costs; the two-process run reads the same
    # profile, so any difference in plan or loss comes from the distribution, not timing.
    single = subprocess.run([sys.executable, str(HERE.parent / "pretrain_gpt.py"), *common,
                             "--metrics-file", str(tmp_path / "single.jsonl")],
                            capture_output=True, text=True, timeout=600, env=ENV)
    assert single.returncode == 0, single.stderr[-3000:]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(HERE / "multirank_plan.py"), *common,
           "--metrics-file", str(tmp_path / "dp2.jsonl")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(set(verdict["plan_ids"])) == 1 and len(set(verdict["plans"])) == 1
    one = _records(tmp_path / "single.jsonl")
    assert verdict["plan_ids"][0] == one[0]["plan_id"] != "none"
    assert "recompute" in verdict["plans"][0] or "compress" in verdict["plans"][0]
    two = _records(tmp_path / "dp2.jsonl")
    assert len(two) == len(one) == 4
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(two, one)) < 1e-4


def test_two_processes_watching_different_step_times_decide_alike(tmp_path):
    """The step watch decides on rank 0's times: ranks whose clocks disagree (3x and 30x)
    re-time, re-plan and swap together, at the same iterations, to the same plans."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(HERE / "multirank_watch.py"), *TINY, "--train-iters", "10",
           "--adacc-policy", "auto", "--adacc-memory-budget", "2.5MiB",
           "--adacc-profile-db", str(tmp_path / "profiles.sqlite")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    verdict = json.loads(done.stdout.strip().splitlines()[-1])
    assert verdict["plans"][0] == verdict["plans"][1]
    # Each rank's decision records alike, but for how long it took there.
    local = [[{k: v for k, v in r.items() if k != "time_s"} if r else r for r in records]
             for records in verdict["watch"]]
    assert local[0] == local[1]
    decisions = [record for record in verdict["watch"][0] if record is not None]
    assert decisions and decisions[0]["retimed"]        # 3x over its prediction: re-timed
