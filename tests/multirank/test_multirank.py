"""Multi-process runs through Megatron-LM's loop agree with a single process: one plan on
every rank, same losses; ranks whose clocks disagree still decide alike."""
import pytest
import torch

from helpers.pretrain import losses, torchrun, train

COMMON = ["--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
          "--adacc-policy", "auto", "--adacc-memory-budget", "2.5MiB"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    db = str(tmp_path_factory.mktemp("multirank") / "profiles.sqlite")
    # One thread in both runs (torchrun's ranks get OMP_NUM_THREADS=1): the ProfileDB key
    # names the device with its thread count, and the comparison needs both runs to read
    # the same stored profile. The single process profiles and stores the costs; the
    # two-process run reads them, so any difference in plan or loss comes from the
    # distribution, not timing.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(*COMMON, "--adacc-profile-db", db, "--adacc-tracking", "off")
    finally:
        torch.set_num_threads(threads)
    two = torchrun(2, {
        "dp2": [*COMMON, "--adacc-tracking", "off"],
        # The step watch decides on rank 0's times: ranks whose clocks read 3x and 30x what
        # they ran re-time, re-plan and swap together, at the same iterations.
        "watch": {"flags": [*COMMON, "--train-iters", "10"], "stretch": [3.0, 30.0]},
    }, "--adacc-profile-db", db)
    return single, two


def test_two_processes_run_one_plan_and_match_a_single_process(runs):
    single, two = runs
    plan_ids = [[r["plan_id"] for r in rank["records"]] for rank in two["dp2"]]
    plans = [rank["plan"] for rank in two["dp2"]]
    assert plan_ids[0] == plan_ids[1] and plans[0] == plans[1]
    assert plan_ids[0][0] == single[0]["plan_id"] != "none"
    assert "recompute" in plans[0] or "compress" in plans[0]
    one, dp2 = losses(single), losses(two["dp2"][0]["records"])
    assert len(dp2) == len(one) == 4
    # Two micro-batches summed on one rank, or one per rank all-reduced: the same terms in
    # another order.
    assert max(abs(a - b) for a, b in zip(dp2, one)) < 1e-4


def test_two_processes_watching_different_step_times_decide_alike(runs):
    _, two = runs
    records = [rank["records"] for rank in two["watch"]]
    assert [r["plan_id"] for r in records[0]] == [r["plan_id"] for r in records[1]]
    watch = [[r.get("step_watch") for r in rank] for rank in records]
    # Each rank's decision records alike, but for how long it took there.
    local = [[{k: v for k, v in w.items() if k != "time_s"} if w else w for w in rank]
             for rank in watch]
    assert local[0] == local[1]
    decisions = [w for w in watch[0] if w is not None]
    assert decisions and decisions[0]["retimed"]        # 3x over its prediction: re-timed
