"""The step watch: decisions on synthetic step times (threshold, median, never a slower plan,
the recompute-only candidate), the profiler's in-step clock, and Adacc leaving codecs made
slow after set-up for the recompute-only plan's speed."""
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_adacc import Adacc, AdaccConfig, policies, step_watch
from megatron_adacc.common.plan import Decision
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE
from megatron_adacc.models import build as model_lib
from megatron_adacc.profiling import allocator, clock, profiler
from megatron_adacc.runtime import apply_plan
from megatron_adacc.runtime.policy import wrapped_codecs
from megatron_adacc.step_watch import MEASURED_SLOWER, RETIMED, StepWatch

from helpers.runtime import adacc_batch, adacc_model, batch, build
from helpers.rectifier import synthetic_costs, tight_rectifier


# --- decisions on synthetic step times -------------------------------------------------------
def result(plan_id: str):
    """A stand-in planner result: the watch reads only its plan id."""
    return SimpleNamespace(plan=SimpleNamespace(plan_id=plan_id))


def ran(watch: StepWatch, plan, *seconds) -> None:
    for value in seconds:
        watch.record(plan.plan.plan_id, value)


def decide(watch, current, predicted, fit=lambda r: True, candidates=(), refreshed=None,
           regardless=()):
    """``refreshed``: the predictions re-timing gives (default: the current plan's then
    explains its whole median, no work outside the layers). ``regardless``: candidates re-timing
    offers whatever their prediction (the recompute-only plan)."""
    retimed = []

    def retime():
        retimed.append(current.plan.plan_id)
        predicted.update(refreshed if refreshed is not None
                         else {current.plan.plan_id: watch.median(current.plan.plan_id)})
        return step_watch.Candidates(list(candidates), list(regardless))

    decision = watch.decide(current, lambda r: predicted.get(r.plan.plan_id), fit, retime)
    return decision, retimed


def test_a_decision_comes_every_window_steps_of_the_current_plan():
    watch, a, b = StepWatch(window=3, warmup=0), result("a"), result("b")
    watch.begin(a)
    ran(watch, a, 1.0, 1.0)
    ran(watch, b, 1.0, 1.0, 1.0)            # another plan's late readings do not count
    assert not watch.due
    ran(watch, a, 1.0)
    assert watch.due
    decide(watch, a, {"a": 1.0})
    assert not watch.due


def test_only_a_median_more_than_ten_percent_over_the_prediction_retimes():
    a = result("a")
    for seconds, retimes in (((1.09, 1.09, 1.09), False), ((1.11, 1.11, 1.11), True),
                             ((1.0, 5.0, 1.0), False),      # one noisy step is no median
                             ((5.0, 1.2, 5.0), True)):
        watch = StepWatch(window=3, warmup=0)
        watch.begin(a)
        ran(watch, a, *seconds)
        decision, retimed = decide(watch, a, {"a": 1.0})
        assert decision.retimed == retimes == bool(retimed), seconds
        assert decision.median_s == statistics.median(seconds)
    # Re-timed once per plan: still over its prediction later, it is not re-timed again.
    ran(watch, a, 5.0, 5.0, 5.0)
    assert decide(watch, a, {"a": 1.0})[1] == []


def test_candidates_are_measured_in_turn_and_the_fastest_measured_is_kept():
    watch, a, new, bare = StepWatch(window=3, warmup=0), result("a"), result("new"), result("bare")
    predicted = {"a": 1.0, "new": 1.1, "bare": 1.3}
    watch.begin(a)
    ran(watch, a, 2.0, 2.0, 2.0)
    decision, retimed = decide(watch, a, predicted, candidates=[new], regardless=[bare])
    assert retimed == ["a"] and (decision.swap_to, decision.reason) == (new, RETIMED)
    watch.begin(new)
    ran(watch, new, 1.6, 1.6, 1.6)         # mispredicted too: re-timed, nothing new to try
    decision, retimed = decide(watch, new, predicted)
    assert retimed == ["new"] and (decision.swap_to, decision.reason) == (bare, RETIMED)
    watch.begin(bare)
    ran(watch, bare, 1.4, 1.4, 1.4)
    decision, _ = decide(watch, bare, predicted)
    assert decision.swap_to is None         # the fastest measured: kept
    # It slows down later: the next fastest measured one takes over.
    ran(watch, bare, 1.9, 1.9, 1.9)
    decision, _ = decide(watch, bare, predicted)
    assert (decision.swap_to, decision.reason) == (new, MEASURED_SLOWER)


def test_what_a_retimed_plan_still_misses_is_overhead_and_retimes_no_other_plan():
    # Re-timed, plan a still runs 0.5 s over its prediction: work outside the layers, which
    # the watch adds to every prediction from then on.
    watch, a, b, c = StepWatch(window=3, warmup=0), result("a"), result("b"), result("c")
    predicted = {"a": 1.0, "b": 0.9, "c": 2.0}
    watch.begin(a)
    ran(watch, a, 1.5, 1.5, 1.5)
    decision, retimed = decide(watch, a, predicted, candidates=[b, c], refreshed={})
    assert retimed == ["a"] and watch.overhead_s == pytest.approx(0.5)
    assert (decision.swap_to, decision.reason) == (b, RETIMED)  # c: 2.5 is no faster than 1.5
    watch.begin(b)
    ran(watch, b, 1.45, 1.45, 1.45)         # 0.9 + 0.5, within 10%: not re-timed
    decision, retimed = decide(watch, b, predicted)
    assert retimed == [] and decision.swap_to is None
    ran(watch, b, 1.8, 1.8, 1.8)            # over 0.9 + 0.5 by more than 10%: re-timed
    assert decide(watch, b, predicted)[1] == ["b"]


def test_the_first_timed_steps_are_left_out():
    # Slow warm-up steps would make the first plan look slower than any measured after it.
    watch, a = StepWatch(window=3, warmup=2), result("a")
    watch.begin(a)
    ran(watch, a, 9.0, 9.0, 1.0, 1.0)
    assert not watch.due and watch.median("a") is None
    ran(watch, a, 1.0)
    assert watch.due and watch.median("a") == 1.0


def test_the_overhead_follows_a_retimed_plans_later_steps():
    # Re-timed on slow warm-up steps, plan a then runs 0.1 s over its prediction: the overhead
    # is measured again at each decision, down as well as up, and nothing is re-timed again.
    watch, a = StepWatch(window=3, warmup=0), result("a")
    predicted = {"a": 1.0}
    watch.begin(a)
    ran(watch, a, 1.6, 1.5, 1.5)
    assert decide(watch, a, predicted, refreshed={})[1] == ["a"]
    assert watch.overhead_s == pytest.approx(0.5)
    ran(watch, a, 1.1, 1.1, 1.1)
    decision, retimed = decide(watch, a, predicted)
    assert retimed == [] and decision.swap_to is None
    assert watch.overhead_s == pytest.approx(0.1)
    ran(watch, a, 0.9, 0.9, 0.9)            # faster than predicted: no overhead, not negative
    decide(watch, a, predicted)
    assert watch.overhead_s == 0.0


def test_a_plan_measured_faster_replaces_a_slower_one_only_if_it_fits_and_beats_the_margin():
    a, b = result("a"), result("b")
    for b_seconds, a_fits, swaps in ((1.5, True, True), (1.5, False, False),
                                     (1.02, True, False)):   # within the 3% margin: kept
        watch = StepWatch(window=3, warmup=0)
        watch.begin(a)
        ran(watch, a, 1.0, 1.0, 1.0)
        watch.begin(b)
        ran(watch, b, b_seconds, b_seconds, b_seconds)
        decision, _ = decide(watch, b, {"a": 1.0, "b": 2.0},
                             fit=lambda r: a_fits or r.plan.plan_id != "a")
        assert (decision.swap_to is a) == swaps, (b_seconds, a_fits)
        assert watch.faster_than("b", lambda r: a_fits or r is not a) == (a if swaps else None)


def test_candidates_predicted_no_faster_than_measured_are_not_tried():
    watch, a, slow = StepWatch(window=3, warmup=0), result("a"), result("slow")
    watch.begin(a)
    ran(watch, a, 2.0, 2.0, 2.0)
    decision, retimed = decide(watch, a, {"a": 1.0, "slow": 2.5}, candidates=[slow])
    assert retimed == ["a"] and decision.swap_to is None


def test_the_recompute_only_plan_is_measured_after_a_retime_whatever_its_prediction():
    # On the H200 the profile priced GPT-345M's full recompute 60% over Megatron's measured one:
    # after a re-time no price rules it out. Measured slower, it is left again.
    for bare_seconds, kept in ((1.5, True), (2.5, False)):
        watch, a, bare = StepWatch(window=3, warmup=0), result("a"), result("bare")
        predicted = {"a": 1.0, "bare": 3.0}
        watch.begin(a)
        ran(watch, a, 2.0, 2.0, 2.0)
        decision, retimed = decide(watch, a, predicted, regardless=[bare])
        assert retimed == ["a"] and (decision.swap_to, decision.reason) == (bare, RETIMED)
        watch.begin(bare)
        ran(watch, bare, *[bare_seconds] * 3)
        decision, _ = decide(watch, bare, predicted)
        assert decision.swap_to is (None if kept else a), bare_seconds
        if not kept:
            assert decision.reason == MEASURED_SLOWER


def test_the_recompute_only_candidate_uses_no_codec_and_fits_the_budget():
    rect = tight_rectifier(slack_per_layer=50)
    costs, budget = rect.costs, rect.budget_bytes
    assert any(d["gelu_in"].action == COMPRESS for d in rect.result.layer_decisions)
    bare = step_watch.recompute_only("auto", costs, budget)
    assert bare is not None and step_watch.fits(costs, bare, budget)
    assert all(d.action != COMPRESS for layer in bare.layer_decisions for d in layer.values())
    assert bare.added_time_s >= rect.result.added_time_s
    # Below what recompute alone fits: no such candidate.
    assert step_watch.recompute_only("auto", costs, bare.minimum_feasible_budget - 1) is None
    assert not step_watch.fits(costs, rect.result, rect.result.peak_bytes - 1)


def test_a_plan_below_the_raised_capacity_no_longer_fits():
    """Once tracking raises a site's outlier capacity, the plans of the old capacity are no
    candidates: measured faster or not, the watch does not go back to them."""
    rect = tight_rectifier(slack_per_layer=50)
    old = rect.result
    assert step_watch.fits(rect.costs, old, rect.budget_bytes)
    raised = replace(rect.costs, sites=[
        replace(site, codecs=tuple(replace(c, capacity=(c.capacity or 0) + 1)
                                   for c in site.codecs)) if site.name == "gelu_in" else site
        for site in rect.costs.sites])
    assert not step_watch.fits(raised, old, 10 * rect.budget_bytes)


def test_the_predicted_step_is_the_profiled_step_plus_the_added_time_per_micro_batch():
    rect = tight_rectifier(slack_per_layer=50)
    assert step_watch.predicted_step_s(rect.costs, rect.result) is None   # nothing profiled
    costs = replace(rect.costs, meta={"step_s": 0.25})
    assert step_watch.predicted_step_s(costs, rect.result, 4) == pytest.approx(
        4 * (0.25 + rect.result.added_time_s))


def test_retiming_goes_on_until_the_plan_uses_retimed_actions_only():
    costs = synthetic_costs()
    first = {"gelu_in": Decision(COMPRESS), "gelu_out": Decision(RECOMPUTE)}
    second = {"gelu_in": Decision(RECOMPUTE), "gelu_out": Decision(COMPRESS)}
    # the same action at gelu_out with another codec: that codec was never re-timed
    third = {"gelu_in": Decision(RECOMPUTE), "gelu_out": Decision(COMPRESS, "naive_int4")}
    plans = iter([SimpleNamespace(layer_decisions=[second]),
                  SimpleNamespace(layer_decisions=[third]),
                  SimpleNamespace(layer_decisions=[third])])
    refreshed = []

    def refresh(costs, decisions, step):
        refreshed.append((sorted((site, d.action, d.codec_for(site)) for layer in decisions
                                 for site, d in layer.items()), step))
        return costs

    _, last = step_watch.retime(costs, [first], refresh, lambda costs: next(plans))
    assert refreshed == [
        ([("gelu_in", COMPRESS, "outlier_int4"), ("gelu_out", RECOMPUTE, None)], True),
        ([("gelu_in", RECOMPUTE, None), ("gelu_out", COMPRESS, "outlier_int4")], False),
        ([("gelu_out", COMPRESS, "naive_int4")], False)]
    assert last.layer_decisions == [third]


# --- the profiler's clock ------------------------------------------------------------------
class CountingDeviceClock:
    """A device clock in the manner of CUDA events: a mark is ready once the host waited for
    it or a later one; counts the waits and the marks made while a profiling step runs."""

    deferred = True

    def __init__(self):
        self.waits, self.marks, self.unready = 0, 0, []
        self.in_step = False
        self.waits_in_step = 0

    def mark(self):
        self.marks += 1
        mark = {"at": time.perf_counter(), "ready": False}
        self.unready.append(mark)
        return mark

    def ready(self, mark) -> bool:
        return mark["ready"]

    def seconds(self, start, end) -> float:
        if not end["ready"]:
            self.waits += 1
            self.waits_in_step += self.in_step
            for mark in self.unready:       # the stream ran everything recorded before
                mark["ready"] = True
            self.unready.clear()
        return end["at"] - start["at"]


def test_the_profiler_reads_a_steps_events_once_after_it(distributed, monkeypatch):
    """On a device every codec call and rebuild of a step is timed by events recorded in the
    step; the host waits once per timed step, after it, never between its calls."""
    fake = CountingDeviceClock()
    monkeypatch.setattr(clock, "for_device", lambda device: fake)
    step = profiler._Profiling.step

    def spied_step(self, *args, **kwargs):
        fake.in_step = True
        try:
            return step(self, *args, **kwargs)
        finally:
            fake.in_step = False

    reads = []
    read = clock.Spans.read
    monkeypatch.setattr(clock.Spans, "read", lambda spans: reads.append(
        len(spans._marks)) or read(spans))
    monkeypatch.setattr(profiler._Profiling, "step", spied_step)
    costs = profiler.profile(build(True, dropout=0.1), batch(0), repeats=2, strict=True)
    assert fake.waits_in_step == 0
    assert fake.waits == len(reads) and max(reads) > 1     # several calls, one wait
    assert fake.marks == 2 * sum(reads)
    assert all(codec.encode_s > 0 and codec.decode_s > 0
               for site in costs.sites for codec in site.codecs)
    assert costs.meta["step_s"] > 0


def test_on_a_device_each_step_is_read_a_step_later_without_waiting_inside_one(
        distributed, monkeypatch):
    """Adacc times every step inside measure(); on a device (deferred clock) it reads a
    step's events only after the next step ran, so the host never waits on the step it
    just launched, and the record names the plan that step ran."""
    fake = CountingDeviceClock()
    monkeypatch.setattr(clock, "for_device", lambda device: fake)
    adacc = Adacc(AdaccConfig(policy="full-recompute"))
    model = adacc_model(adacc)
    adacc.setup(model, adacc_batch(), verbose=False)
    records = []
    for iteration in range(1, 4):
        with adacc.measure(iteration == 1):
            fake.in_step = True
            model_lib.gpt_loss(model, *adacc_batch()).backward()
            fake.in_step = False
        records.append(adacc.metrics())
    assert fake.waits_in_step == 0 and fake.marks == 2 * 3
    assert "measured_step_time_s" not in records[0]
    assert [r["measured_plan_id"] for r in records[1:]] == [adacc.plan_id] * 2
    assert all(r["measured_step_time_s"] > 0 for r in records[1:])
    assert "predicted_step_time_s" not in records[-1]     # a fixed plan has no prediction


def test_retiming_a_plan_remeasures_only_the_actions_it_uses(distributed):
    model = build(True, dropout=0.1)
    costs = profiler.profile(model, batch(0), repeats=1, strict=True)
    used = {"gelu_out": Decision(COMPRESS), "context": Decision(RECOMPUTE),
            "ln1_out": Decision(RECOMPUTE)}
    fresh = profiler.refresh_action_costs(costs, model, batch(3), [used, {}], repeats=1,
                                          strict=True)
    for old, new in zip(costs.sites, fresh.sites):
        if old.name == "gelu_out":     # its codec's new timings; payloads and capacities kept
            assert [(c.codec, c.payload_bytes, c.capacity) for c in new.codecs] == [
                (c.codec, c.payload_bytes, c.capacity) for c in old.codecs]
            assert [new_c == old_c for new_c, old_c in zip(new.codecs, old.codecs)] == [
                c.codec != used["gelu_out"].codec_for("gelu_out") for c in old.codecs]
        elif old.segment != "attention":
            assert new == old, old.name
        else:   # the attention's rebuild times, fitted again around the context's
            assert new.codecs == old.codecs
    prefix = fresh.meta["rebuild_prefix_s"]
    assert prefix["context"] != costs.meta["rebuild_prefix_s"]["context"]
    assert {name: s for name, s in prefix.items() if name != "context"} == {
        name: s for name, s in costs.meta["rebuild_prefix_s"].items() if name != "context"}
    assert [op.name for op in fresh.operators if op not in costs.operators] == [
        "input_layernorm"]
    assert fresh.meta["step_s"] != costs.meta["step_s"]
    assert all(layer.actions == {} for layer in model.decoder.layers)
    again = profiler.refresh_action_costs(fresh, model, batch(4), [used], repeats=1,
                                          strict=True, step=False)
    assert again.meta["step_s"] == fresh.meta["step_s"]


# --- through Adacc: codecs made slow after set-up -----------------------------------------------
SLOW_S = 0.05


class SlowCodec:
    """A codec that takes SLOW_S longer per encode and per decode."""

    def __init__(self, codec):
        self.codec = codec

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def encode(self, tensor):
        time.sleep(SLOW_S)
        return self.codec.encode(tensor)

    def decode(self, payload):
        time.sleep(SLOW_S)
        return self.codec.decode(payload)


def uses_codecs(result) -> bool:
    return any(d.action == COMPRESS for layer in result.layer_decisions for d in layer.values())


def step_seconds(model, plan, steps: int) -> list[float]:
    """The thread's CPU seconds of each of ``steps`` steps under ``plan`` (one torch thread).

    Not wall time: on cores other processes share, two runs of one plan differed by half."""
    apply_plan(model, plan)
    times = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        began = time.thread_time()
        model_lib.gpt_loss(model, *adacc_batch()).backward()
        times.append(time.thread_time() - began)
    return times


@pytest.fixture
def one_thread():
    """Steps of a few milliseconds on one thread: two threads on cores other processes share
    wait on each other, and such steps took 30 times as long now and then."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def midway_adacc(tmp_path):
    """Auto Adacc, set up half way from the least recompute alone fits to no optimisation.

    There auto compresses. Returns:
        It, its model, the budget, and that least budget."""
    db = str(tmp_path / "profiles.sqlite")
    probe = Adacc(AdaccConfig(policy="auto", memory_budget="1GiB", tracking="off",
                              profile_db=db))
    probe.setup(adacc_model(probe), adacc_batch(), verbose=False)
    least = step_watch.recompute_only("auto", probe.costs, 1 << 40).minimum_feasible_budget
    budget = (least + probe.result.references["no optimisation"].peak_bytes) // 2
    adacc = Adacc(AdaccConfig(policy="auto", memory_budget=budget, profile_db=db))
    model = adacc_model(adacc)
    adacc.setup(model, adacc_batch(), verbose=False)
    return adacc, model, budget, least


@pytest.mark.serial
def test_codecs_made_slow_after_setup_are_left_for_the_recompute_only_plans_speed(
        distributed, tmp_path, monkeypatch, capsys, one_thread):
    real = profiler.profile

    def cheap_codecs(*args, **kwargs):
        # One repeat, and codecs a thousandth of what they measured: nearly free, so auto
        # compresses wherever it must save memory.
        costs = real(*args, **{**kwargs, "repeats": 1})
        return replace(costs, sites=[replace(site, codecs=tuple(
            replace(codec, encode_s=codec.encode_s / 1000, decode_s=codec.decode_s / 1000)
            for codec in site.codecs)) for site in costs.sites])

    monkeypatch.setattr(profiler, "profile", cheap_codecs)
    monkeypatch.setattr(step_watch, "RETIME_REPEATS", 1)
    adacc, model, budget, _ = midway_adacc(tmp_path)
    assert adacc.step_watch is not None and uses_codecs(adacc.result)
    with wrapped_codecs(SlowCodec):
        apply_plan(model, adacc.plan)       # the plan's codecs, slow from here on
        records = []
        for iteration in range(1, 25):
            model.zero_grad(set_to_none=True)
            with adacc.measure(iteration == 1):
                model_lib.gpt_loss(model, *adacc_batch()).backward()
            records.append({**adacc.metrics(), **adacc.after_step(iteration)})
            if not uses_codecs(adacc.result) and iteration >= 2 * step_watch.WINDOW + 1:
                break
        assert not uses_codecs(adacc.result), [r.get("step_watch") for r in records]
        decisions = [r["step_watch"] for r in records if "step_watch" in r]
        assert decisions[0]["retimed"] and decisions[0]["median_step_time_s"] > (
            1.1 * decisions[0]["predicted_step_time_s"])
        assert decisions[0]["time_s"] > 0 and decisions[0]["to"] != records[0]["plan_id"]
        assert all(r["measured_plan_id"] == r["plan_id"] for r in records)
        assert all(r["predicted_step_time_s"] > 0 and r["measured_step_time_s"] > 0
                   for r in records)
        out = capsys.readouterr().out
        assert "re-timed" in out
        # A candidate is tried only when predicted faster on the re-timed costs, which price
        # the plan it replaces too; one measured faster than the plan it replaces says so.
        swaps = [line for line in out.splitlines()
                 if "(retimed;" in line or "(measured slower;" in line]
        assert swaps and all(line.endswith(" faster)") for line in swaps), swaps
        # The plan kept against the recompute-only plan, steps of each in turn. Neither holds
        # a codec (above), so the slow codecs' sleeps are no part of either's CPU time.
        bare = step_watch.recompute_only("auto", adacc.costs, budget)
        if adacc.plan_id == bare.plan.plan_id:
            return  # the recompute-only plan itself: timing one plan twice measures only noise
        kept, recompute_only = [], []
        for _ in range(21):
            kept += step_seconds(model, adacc.plan, 1)
            recompute_only += step_seconds(model, bare.plan, 1)
    assert statistics.median(kept) <= 1.05 * statistics.median(recompute_only), (
        adacc.plan_id, bare.plan.plan_id)


# --- the allocator's peak ------------------------------------------------------------------
def test_only_a_peak_over_the_prediction_by_more_than_the_tolerance_counts():
    predicted = 10 << 30
    tolerance = int(step_watch.PEAK_TOLERANCE * predicted)
    assert step_watch.peak_excess(predicted + tolerance, predicted) == 0
    assert step_watch.peak_excess(predicted + tolerance + 1, predicted) == tolerance + 1
    assert step_watch.peak_excess(step_watch.PEAK_SLACK_BYTES, 1 << 20) == 0   # rounding
    assert step_watch.peak_excess(None, predicted) == 0      # a CPU: no allocator peak


def test_a_plan_measured_over_its_predicted_peak_is_replanned_with_the_excess(
        distributed, tmp_path, monkeypatch, capsys, one_thread):
    adacc, model, budget, least = midway_adacc(tmp_path)
    profiled, first = adacc.costs, adacc.plan_id
    # The device holds what the model misses in every plan: a third of the headroom between
    # the least that fits and the budget, on top of each plan's profiled peak.
    missed = (budget - least) // 3
    assert budget - policies.predicted_peak_bytes(profiled, adacc.result) < missed
    monkeypatch.setattr(step_watch, "PEAK_SLACK_BYTES", 0)     # a tiny model's megabytes
    monkeypatch.setattr(allocator, "peak", lambda device: (
        policies.predicted_peak_bytes(profiled, adacc.result) + missed))
    records = []
    for iteration in range(1, 4 * step_watch.WINDOW):
        model.zero_grad(set_to_none=True)
        with adacc.measure(iteration == 1):
            model_lib.gpt_loss(model, *adacc_batch()).backward()
        records.append(adacc.after_step(iteration).get("step_watch"))
    corrections = [r for r in records if r and "measured_peak_bytes" in r]
    assert len(corrections) == 1, records       # once corrected, the plans' peaks are right
    # the step watch's timing may swap again later, to plans that fit the corrected model
    assert corrections[0]["plan_id"] == first and corrections[0]["to"] != first
    assert corrections[0]["reason"] == step_watch.OVER_BUDGET
    assert adacc.costs.allocator_overhead_bytes == (
        profiled.allocator_overhead_bytes + corrections[0]["measured_peak_bytes"]
        - corrections[0]["predicted_peak_bytes"])
    assert policies.predicted_peak_bytes(profiled, adacc.result) + missed <= budget
    assert "more in every plan's peak from here on" in capsys.readouterr().out
