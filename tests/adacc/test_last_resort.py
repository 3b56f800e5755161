"""auto's last resort: naive INT4 (the quantize baseline's codec) planned only when the
designated codecs fit no plan, on profiles of a tiny model on both attentions."""
from dataclasses import replace

import pytest

from megatron_adacc import planning, policies
from megatron_adacc.common import sites
from megatron_adacc.profiling.profiler import profile
from megatron_adacc.rectifier import Rectifier
from megatron_adacc.planning import format_plan
from megatron_adacc.runtime import apply_plan, measure_step
from megatron_adacc.common.sites import COMPRESS, QUANTIZE_CODEC
from megatron_adacc.common.units import format_size

from helpers.runtime import batch, build, loss_of


@pytest.fixture(scope="module", params=["flash", "unfused"])
def profiled(request, distributed):
    model = build(True, dropout=0.0, attention_backend=request.param)
    return model, profile(model, batch(0), repeats=1, strict=True)


def _peak_of(costs, plan) -> int:
    return planning.peak_bytes(costs, [planning.evaluate_layer(costs, plan.for_layer(layer))
                                       for layer in range(costs.num_layers)])


def _budgets(costs):
    """(the smallest budget of the designated codecs, the quantize baseline's predicted
    peak, the smallest budget with the last resort)."""
    designated, wider = planning.codec_tiers(costs)
    return (planning.minimum_budget(designated, allow_lossy_sources=False),
            _peak_of(costs, policies.quantize_plan()),
            planning.minimum_budget(wider, allow_lossy_sources=False))


def test_the_profiler_measures_naive_int4_wherever_the_quantize_baseline_uses_it(profiled):
    _, costs = profiled
    quantized = {name for name, decision in policies.quantize_plan().for_layer(0).items()
                 if decision.codec_for(name) == QUANTIZE_CODEC}
    measured = {site.name for site in costs.sites
                if QUANTIZE_CODEC in {codec.codec for codec in site.codecs}}
    assert measured == quantized & {site.name for site in costs.sites} != set()
    assert all(sites.get(name).last_resort_codec == QUANTIZE_CODEC for name in quantized)


def test_below_the_designated_minimum_auto_plans_naive_int4_and_keeps_what_it_predicts(
        profiled):
    model, costs = profiled
    designated_minimum, quantize_peak, wider_minimum = _budgets(costs)
    # The case the issue measured: naive INT4 fits where the designated codecs do not.
    assert wider_minimum <= quantize_peak < designated_minimum
    with pytest.raises(planning.InfeasibleBudget):
        planning.plan(policies.designated_codecs(costs), quantize_peak,
                      allow_lossy_sources=False)
    result = policies.plan("auto", costs, quantize_peak, allow_lossy_sources=False)
    assert planning.last_resort_sites(result) and result.peak_bytes <= quantize_peak
    apply_plan(model, result.plan, strict=True)
    try:
        measured = measure_step(model, lambda: loss_of(model), strict=True)[1]
    finally:
        apply_plan(model, None)
    predicted = policies.predicted_activation_bytes(costs, result)
    # Exactly, outlier_int4 included: its payload holds the planned capacity whatever the
    # data, so a layer with fewer outlier channels keeps as much as the planned one.
    assert measured.after_forward_bytes == predicted


def test_where_the_designated_codecs_fit_the_plan_is_theirs(profiled):
    _, costs = profiled
    designated_minimum, _, _ = _budgets(costs)
    designated = policies.designated_codecs(costs)
    ample = planning.plan(designated, 10 * designated_minimum).references[
        "no optimisation"].peak_bytes
    for budget in (designated_minimum, (designated_minimum + ample) // 2):
        before = planning.plan(designated, budget, allow_lossy_sources=False)
        after = policies.plan("auto", costs, budget, allow_lossy_sources=False)
        assert after.plan.plan_id == before.plan.plan_id
        assert not planning.last_resort_sites(after)
        assert policies.last_resort_warning("auto", after) is None


def test_an_infeasible_budget_names_the_smallest_budget_with_the_last_resort(profiled):
    _, costs = profiled
    _, _, wider_minimum = _budgets(costs)
    with pytest.raises(planning.InfeasibleBudget) as info:
        policies.plan("auto", costs, wider_minimum - 1, allow_lossy_sources=False)
    assert info.value.minimum_budget == wider_minimum
    assert f"({wider_minimum} B;" in str(info.value)
    policies.plan("auto", costs, wider_minimum, allow_lossy_sources=False)   # it does fit


@pytest.mark.parametrize("lossy", [False, True])
def test_table_error_and_minimum_quote_one_smallest_budget_to_the_byte(profiled, lossy):
    # Above the designated codecs' minimum the plan is theirs, yet its table quotes the
    # smallest budget auto fits at all (the last resort's): the figure the error names, and
    # the budget at which a plan (the last resort's) still fits.
    _, costs = profiled
    designated_minimum, _, wider_minimum = _budgets(costs)
    minimum = planning.minimum_feasible_budget(costs, allow_lossy_sources=lossy)
    assert minimum < designated_minimum
    table = policies.plan("auto", costs, 2 * designated_minimum, allow_lossy_sources=lossy)
    assert not planning.last_resort_sites(table)
    assert table.minimum_feasible_budget == minimum
    assert f"smallest feasible budget {format_size(minimum)} ({minimum} B);" in format_plan(table)
    with pytest.raises(planning.InfeasibleBudget) as info:
        policies.plan("auto", costs, minimum - 1, allow_lossy_sources=lossy)
    assert info.value.minimum_budget == minimum and f"({minimum} B;" in str(info.value)
    fits = policies.plan("auto", costs, minimum, allow_lossy_sources=lossy)
    assert fits.peak_bytes <= minimum == fits.minimum_feasible_budget
    if not lossy:
        assert minimum == wider_minimum


def test_costs_without_naive_int4_have_no_last_resort(profiled):
    # E.g. the analytic model's costs, or a profile written by hand: planned as before.
    _, costs = profiled
    designated_minimum, quantize_peak, _ = _budgets(costs)
    stripped = replace(costs, sites=[
        replace(site, codecs=tuple(c for c in site.codecs if c.codec != QUANTIZE_CODEC))
        for site in costs.sites])
    assert len(planning.codec_tiers(stripped)) == 1
    with pytest.raises(planning.InfeasibleBudget) as info:
        policies.plan("auto", stripped, quantize_peak, allow_lossy_sources=False)
    assert info.value.minimum_budget == designated_minimum


def test_naive_int4_is_offered_only_where_it_keeps_fewer_bytes(profiled):
    # Where it keeps as many bytes (a layer input with no outlier channel) it would trade
    # accuracy for time alone.
    _, costs = profiled
    _, wider = planning.codec_tiers(costs)
    offered = {}
    for site in costs.sites:
        payload = {codec.codec: codec.payload_bytes for codec in site.codecs}
        smaller = QUANTIZE_CODEC in payload and \
            payload[QUANTIZE_CODEC] < payload[sites.get(site.name).default_codec]
        offered[site.name] = QUANTIZE_CODEC in {c.codec for c in wider.site(site.name).codecs}
        assert offered[site.name] == smaller, site.name
    assert any(offered.values()) and not all(offered.values())


def test_auto_no_outlier_falls_back_from_its_plain_int4_to_naive_int4(profiled):
    _, costs = profiled
    plain, wider = planning.codec_tiers(costs, separate_outliers=False)
    minimum = planning.minimum_budget(plain, allow_lossy_sources=False)
    wider_minimum = planning.minimum_budget(wider, allow_lossy_sources=False)
    assert wider_minimum < minimum
    result = policies.plan("auto-no-outlier", costs, wider_minimum, allow_lossy_sources=False)
    codecs = {row.codec for row in result.rows if row.action == COMPRESS}
    assert QUANTIZE_CODEC in codecs and sites.OUTLIER_CODEC not in codecs
    assert policies.last_resort_warning("auto-no-outlier", result).startswith(
        "adacc: warning: the budget is below what auto-no-outlier's plain int4 codecs fit: ")


def test_the_plan_table_and_the_warning_name_the_last_resort(profiled):
    _, costs = profiled
    _, quantize_peak, _ = _budgets(costs)
    result = policies.plan("auto", costs, quantize_peak, allow_lossy_sources=False)
    used = planning.last_resort_sites(result)
    assert policies.last_resort_warning("auto", result) == (
        f"adacc: warning: the budget is below what outlier-separating codecs fit: {len(used)} "
        f"{'site uses' if len(used) == 1 else 'sites use'} naive INT4 ({', '.join(used)}); "
        f"expect the accuracy of the quantize "
        f"baseline there")
    marked = [line.split()[0] for line in format_plan(result).splitlines()
              if "naive_int4 (last resort)" in line]
    assert sorted(set(marked)) == used


def test_pipeline_stages_and_the_rectifier_plan_with_the_last_resort(profiled):
    _, costs = profiled
    _, quantize_peak, _ = _budgets(costs)
    [stage] = planning.plan_stages([costs], quantize_peak, allow_lossy_sources=False)
    assert planning.last_resort_sites(stage.result)
    rect = Rectifier(costs, stage.result, quantize_peak)
    outcome = rect.update(1, {})
    assert not outcome.infeasible and outcome.swap is None
    assert planning.last_resort_sites(rect.result)
