"""The rectifier: tracking schedule, swap decisions on synthetic costs and statistics, the
accuracy guard with the real codec, and tracking through Megatron-LM's loop without touching
the loss."""
from dataclasses import replace

import pytest
import torch

from megatron_adacc import codecs, planning
from megatron_adacc.profiling import profiler
from megatron_adacc.megatron_lm import ConfigError
from megatron_adacc.common.costs import CodecCost, ModelCosts, SiteCost
from megatron_adacc.rectifier import (
    DEFAULT_GUARD_THRESHOLD,
    Rectifier,
    SiteStats,
    TrackingSchedule,
    added_time_s,
    site_stats,
)
from megatron_adacc.common.sites import COMPRESS
from helpers.pretrain import parse, pretrain
from helpers.rectifier import FULL, LAYERS, PAYLOAD, synthetic_costs, tight_rectifier


def tracked(schedule: TrackingSchedule, iterations, resets=()) -> list[int]:
    seen = []
    for iteration in iterations:
        if schedule.is_tracking(iteration):
            seen.append(iteration)
            schedule.tracked(iteration)
            if iteration in resets:
                schedule.reset(iteration)
    return seen


def test_backoff_doubles_up_to_the_cap_and_a_reset_starts_over():
    assert tracked(TrackingSchedule(8), range(1, 41)) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert tracked(TrackingSchedule(256), range(1, 600)) == [1, 2, 4, 8, 16, 32, 64, 128,
                                                             256, 512]
    assert tracked(TrackingSchedule(8), range(1, 30), resets={8}) == [1, 2, 4, 8, 9, 10, 12,
                                                                       16, 24]
    with pytest.raises(ValueError):
        TrackingSchedule(0)


# --- decisions on synthetic costs ---------------------------------------------------------
def stats(payload=PAYLOAD, outliers=2, error=0.09) -> dict[str, SiteStats]:
    return {"gelu_in": SiteStats("outlier_int4", payload, payload / FULL, outliers, 1024, error)}


def test_a_swap_happens_when_the_statistics_change_the_optimal_plan_and_not_otherwise():
    rect = tight_rectifier(slack_per_layer=50)
    start = rect.result.plan.plan_id
    # More outliers that still fit the slack: the plan stays optimal.
    outcome = rect.update(1, stats(payload=PAYLOAD + 40, outliers=3))
    assert outcome.swap is None and rect.result.plan.plan_id == start
    # Enough outliers that the payload breaks the budget: forced swap, slower.
    outcome = rect.update(2, stats(payload=2 * PAYLOAD, outliers=40))
    assert outcome.swap is not None and outcome.swap.reason == "over budget"
    assert outcome.swap.predicted_gain_s <= 0
    assert outcome.swap.changed and all(c["from"] != c["to"] for c in outcome.swap.changed)
    assert outcome.jumped == ["gelu_in"]            # 3 -> 40 outliers: backoff reset
    assert rect.schedule.next_iteration == 3
    record = outcome.to_record()
    assert record["plan_swap"]["from"] == start and record["plan_swap"]["to"] != start
    # The outliers settle again: the first plan fits and is faster, so it comes back.
    outcome = rect.update(3, stats())
    assert outcome.swap is not None and outcome.swap.reason == "faster"
    assert outcome.swap.predicted_gain_s > 0 and rect.result.plan.plan_id == start
    assert rect.swaps == 2
    # The same statistics again: nothing to do.
    assert rect.update(4, stats()).swap is None


def test_a_swap_after_a_retiming_prices_both_plans_on_the_retimed_costs():
    rect = tight_rectifier(slack_per_layer=0)
    old = rect.result
    # The step watch's re-timing found the codec ten times slower than profiled.
    rect.costs = replace(rect.costs, sites=[
        replace(site, codecs=tuple(replace(codec, encode_s=10 * codec.encode_s,
                                           decode_s=10 * codec.decode_s)
                                   for codec in site.codecs))
        for site in rect.costs.sites])
    new = planning.plan(rect.costs, rect.budget_bytes)
    assert new.added_time_s > old.added_time_s      # slower than the old plan's stale price
    swap = rect.take(new, "retimed")
    assert swap.predicted_gain_s == pytest.approx(added_time_s(rect.costs, old)
                                                  - new.added_time_s)
    assert swap.predicted_gain_s > 0


def test_tracking_after_a_retiming_takes_the_plan_faster_on_the_retimed_costs():
    rect = tight_rectifier(slack_per_layer=400)
    start = rect.result
    assert any(d["gelu_in"].action == COMPRESS for d in start.layer_decisions)
    # The step watch re-timed the codec a hundred times slower, and kept the plan.
    rect.costs = replace(rect.costs, sites=[
        replace(site, codecs=tuple(replace(codec, encode_s=100 * codec.encode_s,
                                           decode_s=100 * codec.decode_s)
                                   for codec in site.codecs))
        for site in rect.costs.sites])
    outcome = rect.update(1, stats())
    assert outcome.swap is not None and outcome.swap.reason == "faster", outcome.note
    assert outcome.swap.predicted_gain_s == pytest.approx(
        added_time_s(rect.costs, start) - rect.result.added_time_s)


def test_a_swap_is_told_a_line_a_changed_site_with_its_layer_ranges():
    rect = tight_rectifier(slack_per_layer=50)
    swap = rect.update(2, stats(payload=2 * PAYLOAD, outliers=40)).swap
    head, *rows = swap.describe(7, micro_batches=2).splitlines()
    gain = 2 * swap.predicted_gain_s * 1e3
    assert head == (f"adacc: iteration 7: plan {swap.old.plan.plan_id} -> "
                    f"{swap.new.plan.plan_id} (over budget; predicted {abs(gain):.3f} ms a step "
                    f"slower)")
    assert rows and len(rows) == len(swap.changed)
    for row, change in zip(rows, swap.changed):
        assert row.split() == [change["site"], "layers",
                               planning.layer_ranges(change["layers"]), change["from"], "->",
                               change["to"]]
    assert "faster)" in swap.describe(7, measured_gain_s=0.002).splitlines()[0]
    assert "measured 2.000 ms" in swap.describe(7, measured_gain_s=0.002)


def test_a_rectifier_restored_from_its_state_decides_as_the_saved_one():
    import json

    rect = tight_rectifier(slack_per_layer=50)
    rect.update(1, stats(outliers=40, payload=int(PAYLOAD * 1.8)))   # a swap, a backoff reset
    state = json.loads(json.dumps(rect.state_dict()))                # as a checkpoint keeps it
    restored = tight_rectifier(slack_per_layer=50)
    restored.load_state_dict(state)
    assert restored.result.plan.plan_id == rect.result.plan.plan_id != tight_rectifier(
        slack_per_layer=50).result.plan.plan_id
    assert restored.result.to_dict() | {"solve_time_s": 0} == rect.result.to_dict() | {
        "solve_time_s": 0}
    for iteration, now in ((2, stats()), (4, stats(error=0.5))):  # back to the first; guard
        ours, theirs = rect.update(iteration, now), restored.update(iteration, now)
        assert ours.to_record() == theirs.to_record()
    assert restored.state_dict() == rect.state_dict()


def test_a_state_of_another_model_or_budget_is_refused():
    rect = tight_rectifier(slack_per_layer=50)
    state = rect.state_dict()
    other = tight_rectifier(slack_per_layer=50)
    state["costs"]["num_layers"] += 1
    with pytest.raises(ValueError, match="another model's"):
        other.load_state_dict(state)
    state = rect.state_dict()
    state["budget_bytes"] += 1      # a resumed run given another --adacc-memory-budget
    with pytest.raises(ValueError, match="planned for budget"):
        other.load_state_dict(state)
    assert other.result.plan.plan_id == rect.result.plan.plan_id  # left as it was


def test_backoff_resets_on_a_jump_in_compression_rate_not_in_outlier_count():
    rect = tight_rectifier(slack_per_layer=50)
    rect.update(1, stats(outliers=2))
    # Many more outlier channels, payload up by a fifth: the plan's input barely moved.
    assert rect.update(2, stats(payload=int(PAYLOAD * 1.2), outliers=17)).jumped == []
    assert rect.schedule.next_iteration == 2 + 2
    # The payload up by half: tracking starts over.
    assert rect.update(4, stats(payload=int(PAYLOAD * 1.8), outliers=17)).jumped == ["gelu_in"]
    assert rect.schedule.next_iteration == 5


def test_when_payloads_outgrow_the_budget_the_least_peak_plan_runs():
    # One site that only compression can shrink: at its minimum + 3400 B the plan retains
    # it in three layers; when its payload doubles, no plan fits any more.
    costs = ModelCosts(sites=[SiteCost("layer_in", FULL, "float32", 0.0, None, codecs=(
        CodecCost("outlier_int4", PAYLOAD, 1e-4, 1e-4),))], num_layers=LAYERS, static_bytes=0,
        non_layer_bytes=0, backward_workspace_bytes=0, micro_batch_size=1)
    budget = planning.minimum_budget(costs) + FULL - PAYLOAD
    rect = Rectifier(costs, planning.plan(costs, budget), budget)
    grown = {"layer_in": SiteStats("outlier_int4", 2 * PAYLOAD, 2 * PAYLOAD / FULL, 2, 1024, 0.09)}
    outcome = rect.update(1, grown)
    assert "no plan fits the budget any more" in outcome.infeasible
    assert outcome.swap is not None and outcome.swap.reason == "over budget"
    least = planning.plan(rect.costs, planning.minimum_budget(rect.costs))
    assert rect.result.plan.plan_id == least.plan.plan_id
    assert outcome.to_record()["budget_infeasible"] == outcome.infeasible
    # Still infeasible, already the plan that overruns least: nothing to swap.
    assert rect.update(2, grown).swap is None


def test_the_guard_forbids_compressing_a_bad_site_for_good():
    rect = tight_rectifier(slack_per_layer=50)
    outcome = rect.update(1, stats(error=0.5))
    assert outcome.guarded == ["gelu_in"] and outcome.swap.reason == "guard"
    assert all(d["gelu_in"].action != COMPRESS for d in rect.result.layer_decisions)
    outcome = rect.update(2, stats(error=0.01))      # a guarded site stays guarded
    assert outcome.swap is None and outcome.guarded == []
    assert all(d["gelu_in"].action != COMPRESS for d in rect.result.layer_decisions)


def test_the_guard_threshold_separates_bell_shaped_tensors_from_spiky_ones():
    """Measured with the real codec: ~0.09 for a Gaussian tensor; one 10-sigma spike per
    group of 64 (spread evenly over channels, so no channel z-score separates it) stretches
    each group's scale and rounds the rest of the group coarsely (~0.22)."""
    gen = torch.Generator().manual_seed(0)
    codec = codecs.get("outlier_int4")
    good = torch.randn(512, 128, generator=gen)
    spiky = torch.randn(512, 128, generator=gen)
    groups = spiky.view(-1, 64)
    spread = torch.arange(len(groups))      # every channel gets the same number of spikes
    groups[spread, (spread * 5) % 64] = 10.0

    def measured(tensor):
        sample = profiler.SiteSample(codec, [tensor], codec.encode(tensor).nbytes)
        return site_stats(sample, tensor.numel() * tensor.element_size())

    good_stats, spiky_stats = measured(good), measured(spiky)
    assert spiky_stats.outlier_channels == 0        # invisible to the outlier separation
    assert good_stats.error < DEFAULT_GUARD_THRESHOLD < spiky_stats.error
    rect = tight_rectifier(slack_per_layer=50)
    assert rect.update(1, {"gelu_in": spiky_stats}).guarded == ["gelu_in"]


def test_tracking_counts_every_outlier_and_raises_the_capacity_to_hold_them():
    # More outlier channels than the capacity holds: the capacity rises to the count (never
    # falls), and the payload is the one at the new capacity, byte for byte.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 128, generator=gen)
    x[:, [3, 20, 50, 70, 100]] *= 100
    codec = codecs.get("outlier_int4", backend="torch")      # its default capacity: 2 of 128
    sample = profiler.SiteSample(codec, [x], codec.encode(x).nbytes)
    full = x.numel() * x.element_size()
    for capacity, expected in ((2, 5), (5, 5), (8, 8), (None, 5)):
        now = site_stats(sample, full, capacity)
        assert (now.outlier_channels, now.capacity) == (5, expected)
        assert now.payload_bytes == codecs.get("outlier_int4", capacity=expected).encode(x).nbytes
    assert site_stats(profiler.SiteSample(codecs.get("sym_int4"), [x], 1), full).capacity is None


def test_a_plan_below_the_needed_capacity_is_swapped_for_one_that_holds_it():
    costs = synthetic_costs()
    costs = replace(costs, sites=[replace(site, codecs=tuple(replace(c, capacity=2)
                                                             for c in site.codecs))
                                  for site in costs.sites])
    rect = tight_rectifier(slack_per_layer=50, costs=costs)
    compressed = [d["gelu_in"] for d in rect.result.layer_decisions
                  if d["gelu_in"].action == COMPRESS]
    # the costs' capacity, in the plan
    assert compressed and all(d.capacity == 2 for d in compressed)
    more = {"gelu_in": SiteStats("outlier_int4", PAYLOAD + 40, (PAYLOAD + 40) / FULL, 5, 1024, 0.09,
                                 capacity=5)}
    outcome = rect.update(1, more)
    assert outcome.swap is not None and outcome.swap.reason == "capacity"
    assert all(d["gelu_in"].capacity == 5 for d in rect.result.layer_decisions
               if d["gelu_in"].action == COMPRESS)
    assert any("@2" in c["from"] and "@5" in c["to"] for c in outcome.swap.changed)
    assert outcome.to_record()["outlier_capacity"] == {"gelu_in": 5}
    assert rect.update(2, more).swap is None     # held now


# --- through Megatron-LM's loop ---------------------------------------------------------------
def run(tmp_path, *flags, adjust=None):
    """The records of 4 iterations; ``adjust(adacc)`` runs once its plan is set up, before
    the first step's forward."""
    from megatron_adacc import Adacc

    real_setup = Adacc.setup

    def setup(adacc, *args, **kwargs):
        result = real_setup(adacc, *args, **kwargs)
        if adjust is not None:
            adjust(adacc)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Adacc, "setup", setup)
        return pretrain("--train-iters", "4", "--adacc-policy", "auto", "--adacc-profile-db",
                        str(tmp_path / "profiles.sqlite"), "--adacc-profile-repeats", "1",
                        *flags).records


def test_tracking_never_changes_the_loss_of_the_iteration_it_runs_in(tmp_path):
    budget = ["--adacc-memory-budget", "1GiB"]
    off = run(tmp_path, *budget, "--adacc-tracking", "off")
    assert not any("tracking" in r for r in off)

    def never_swap(adacc):
        adacc.rectifier._compare = lambda current, new: (None, "test")

    kept = run(tmp_path, *budget, adjust=never_swap)
    assert kept[0]["tracking"] and kept[1]["tracking"]       # iterations 1 and 2 track
    assert [r["loss"] for r in kept] == [r["loss"] for r in off]           # bitwise
    assert all(r["tracking_time_s_total"] > 0 for r in kept)
    assert set(kept[0]["outlier_channels"]) >= {"ln1_out", "ln2_out", "gelu_in", "gelu_out"}

    def tighten(adacc):
        # A budget the all-retain plan breaks: the first tracking iteration must swap.
        adacc.rectifier.budget_bytes = adacc.result.minimum_feasible_budget

    swapped = run(tmp_path, *budget, adjust=tighten)
    first = swapped[0]
    assert first["plan_swap"]["reason"] == "over budget"
    assert first["loss"] == off[0]["loss"]                                  # bitwise
    assert swapped[1]["plan_id"] == first["plan_swap"]["to"] != first["plan_id"]


def test_tracking_flags():
    auto = ["--adacc-policy", "auto", "--adacc-memory-budget", "1GiB"]
    assert parse(*auto).adacc_tracking == "backoff"
    assert parse().adacc_tracking == "off"
    with pytest.raises(ConfigError, match="needs --adacc-policy auto"):
        parse("--adacc-tracking", "backoff")
    with pytest.raises(ConfigError, match="unknown gelu"):
        parse(*auto, "--adacc-tracking-sites", "gelu")


def test_a_plan_close_to_the_budget_is_not_taken_back_just_for_speed(monkeypatch):
    # The demo flapped: over budget at one tracking iteration, back for speed at the next.
    # Here the first plan leaves 50 bytes a layer; demand more headroom than that.
    import megatron_adacc.rectifier as rectifier_module

    rect = tight_rectifier(slack_per_layer=50)
    start = rect.result.plan.plan_id
    monkeypatch.setattr(rectifier_module, "FASTER_SWAP_HEADROOM",
                        2 * LAYERS * 50 / rect.budget_bytes)
    assert rect.update(1, stats(payload=2 * PAYLOAD, outliers=40)).swap.reason == "over budget"
    outcome = rect.update(2, stats())
    assert outcome.swap is None and rect.result.plan.plan_id != start
    assert "too close to the budget" in outcome.note
