"""examples/custom_loop.py: a plain megatron-core loop adopting Adacc through its public entry
point trains, plans a mix of actions under a tight budget, and measures what it predicted."""
import json
import os

from megatron_adacc.common.sites import ACTIONS, SITE_NAMES

from helpers import ROOT, forked


def test_custom_loop_trains_under_a_budget_with_a_mixed_plan(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # The default shape needs 6.5 MiB with no optimisation; its smallest feasible budget is
    # 3.6 MiB (payload sizes, not timings, decide that), so 4 MiB forces compression and
    # leaves the planner choosing between actions.
    done = forked.run(
        [os.path.join(ROOT, "examples", "custom_loop.py"), "--memory-budget", "4MiB",
         "--iters", "20", "--metrics-file", metrics, "--profile-db", tmp_path / "profiles.sqlite"],
        cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    # The plan table's rows (a swap's lines, indented under it, name sites too)
    table = [line.split() for line in done.stdout.splitlines()
             if line.split() and not line[0].isspace() and line.split()[0] in SITE_NAMES]
    actions = {row[2] for row in table}
    assert actions <= set(ACTIONS) and len(actions) >= 2 and "compress" in actions, table

    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["iteration"] for r in records] == list(range(1, 21))
    assert records[-1]["loss"] < 0.7 * records[0]["loss"]
    first = records[0]
    assert first["budget_bytes"] == 4 * (1 << 20)
    # The profile measures one layer; outlier channel counts differ a little between layers
    # (one channel of one site here: 1,028 B), so the prediction is exact up to that.
    assert abs(first["activation_bytes"] - first["predicted_activation_bytes"]) \
        <= 0.01 * first["predicted_activation_bytes"]
