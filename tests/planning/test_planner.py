"""Planner: optimal against exhaustive enumeration (with the runtime's rebuild time, a
maximum along each re-run segment), monotone in the budget, exact infeasible minimum that is
itself feasible, per-layer <= uniform, exactness option, Q/K/V one unit."""
import itertools
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from megatron_adacc import planning as planner, policies
from megatron_adacc.planning import analytic
from megatron_adacc.common.costs import CodecCost, ModelCosts, Operator, SiteCost
from megatron_adacc.common.plan import Decision
from megatron_adacc.common.sites import COMPRESS, RECOMPUTE, RETAIN
from megatron_adacc.common.sites import get as get_site

# Real site names (the planner only recomputes / compresses sites the site table knows), in
# the megatron segments: layer_in starts the attention re-run, ln2_in (its last save) the
# MLP's. A LayerNorm's input and statistics are decoded together (sites.DECODED_TOGETHER),
# so the decoded term is a group's sum, not one site's size. A drawn site may also be left
# out of its segment (never rebuilt), or be rebuilt by an operator instead: an operator reads
# one or two sites, and a site may be the product of an operator declared before the first
# one that reads it (chains: op_b reads what op_a may rebuild, op_c what op_r may), several
# sites of one; the MLP's start may be an operator's product (op_r, ln2_in's edge, reading
# the layer input and the attention segment's dropout mask). Each site's codec is its
# designated one: the mask's is lossless (a rebuild reading it stays exact), the others not.
SEGMENT_OF = {"layer_in": None, "bda1_mask": "attention", "ln2_in": "attention",
              "ln2_stats": "mlp"}
OPERATOR_SOURCES = {"op_a": ("layer_in",), "op_r": ("layer_in", "bda1_mask"),
                    "op_c": ("ln2_in",), "op_b": ("bda1_mask",)}
OPERATORS_OF = {"bda1_mask": ("op_a",), "ln2_in": ("op_r",),
                "ln2_stats": ("op_a", "op_b", "op_c")}


@st.composite
def small_costs(draw):
    count = draw(st.integers(2, 4))
    sites = []
    for name in list(SEGMENT_OF)[:count]:
        size = draw(st.integers(1, 60))
        segment = SEGMENT_OF[name] if draw(st.integers(0, 4)) else None
        operator = None
        if segment is not None and OPERATORS_OF[name] and draw(st.booleans()):
            segment, operator = None, draw(st.sampled_from(OPERATORS_OF[name]))
        codecs = (CodecCost(get_site(name).default_codec, draw(st.integers(0, size)),
                            draw(st.floats(0, 1)), draw(st.floats(0, 1))),
                  ) if draw(st.booleans()) else ()
        rebuild_s = draw(st.floats(0, 2))
        if name == "ln2_in" and segment is not None:
            # the MLP's start, when the attention re-run rebuilds it, is its last save
            rebuild_s += max((site.rebuild_s for site in sites if site.segment == segment),
                             default=0.0)
        sites.append(SiteCost(name, size, "float16", rebuild_s, segment, codecs,
                              operator=operator))
    operators = tuple(Operator(name, sources, draw(st.floats(0, 2)))
                      for name, sources in OPERATOR_SOURCES.items())
    # A pipeline stage: up to 3 micro-batches in flight, embedding activations held
    # through backward (1 and 0: the whole model on one stage).
    non_layer = draw(st.integers(0, 80))
    return ModelCosts(sites=sites, num_layers=draw(st.integers(1, 3)), operators=operators,
                      static_bytes=draw(st.integers(0, 50)),
                      non_layer_bytes=non_layer,
                      held_non_layer_bytes=draw(st.integers(0, non_layer)),
                      backward_workspace_bytes=draw(st.integers(0, 30)), micro_batch_size=1,
                      in_flight_micro_batches=draw(st.integers(1, 3)),
                      embedding_bytes=draw(st.integers(0, 20)),
                      # fp16's gradient copies: none, or up to more than a plan keeps
                      optimizer_step_bytes=draw(st.sampled_from([0, 40, 400])),
                      hooked_layer_s=draw(st.sampled_from([0.0, 0.3, 1.5])))


def all_layer_policies(costs, allow_lossy):
    per_site = []
    for site in costs.sites:
        options = [Decision(RETAIN)]
        if site.can_compress:
            options += [Decision(COMPRESS, codec.codec) for codec in site.codecs]
        if site.can_recompute:
            options.append(Decision(RECOMPUTE))
        per_site.append(options)
    for combo in itertools.product(*per_site):
        decisions = {s.name: d for s, d in zip(costs.sites, combo)}
        if allow_lossy or planner.is_exact(costs, decisions):
            yield planner.evaluate_layer(costs, decisions)


def brute_force(costs, budget, per_layer, allow_lossy):
    """(least time of a plan that fits, least peak of any plan) by listing every plan."""
    policies = list(all_layer_policies(costs, allow_lossy))
    if per_layer:
        plans = itertools.product(policies, repeat=costs.num_layers)
    else:
        plans = ([p] * costs.num_layers for p in policies)
    best, least_peak = None, None
    for layers in plans:
        peak = planner.peak_bytes(costs, layers)
        least_peak = peak if least_peak is None else min(least_peak, peak)
        if peak <= budget:
            total = sum(p.time_s for p in layers)
            best = total if best is None else min(best, total)
    return best, least_peak


def _residual_edge_costs(ln2_in_codec_bytes=None, mask_codec_bytes=None):
    """Three layers whose ln2_in an operator rebuilds from the layer input and the dropout
    mask (op_r, ln2_in's edge); ln2_stats in the MLP segment, whose re-run starts at ln2_in."""
    def codecs(name, payload):
        return () if payload is None else (
            CodecCost(get_site(name).default_codec, payload, 0.0, 0.0),)

    return ModelCosts(
        sites=[SiteCost("layer_in", 10, "float16"),
               SiteCost("bda1_mask", 40, "float16", codecs=codecs("bda1_mask", mask_codec_bytes)),
               SiteCost("ln2_in", 40, "float16", codecs=codecs("ln2_in", ln2_in_codec_bytes),
                        operator="op_r"),
               SiteCost("ln2_stats", 40, "float16", 1.0, "mlp")],
        num_layers=3, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
        micro_batch_size=1,
        operators=(Operator("op_r", ("layer_in", "bda1_mask"), 5.0),))


# An exact plan reads the bitmask-compressed mask to rebuild ln2_in (lossless: held, exact).
LOSSLESS_SOURCE = _residual_edge_costs(mask_codec_bytes=1)
# A compressed ln2_in, though an operator's product, starts the MLP's re-run: lossy.
COMPRESSED_PRODUCT_START = _residual_edge_costs(ln2_in_codec_bytes=1)


# The mask and ln2_stats recomputed, ln2_in kept: the attention re-runs only to the mask
# (1.0, not its 7.0 to ln2_in) and the MLP from the kept ln2_in, the fastest plan at 80 B.
SPLIT_RERUNS = ModelCosts(
    sites=[SiteCost("layer_in", 10, "float16"),
           SiteCost("bda1_mask", 10, "float16", 1.0, "attention"),
           SiteCost("ln2_in", 10, "float16", 7.0, "attention"),
           SiteCost("ln2_stats", 10, "float16", 0.5, "mlp")],
    num_layers=3, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
    micro_batch_size=1)


@settings(max_examples=80, deadline=None)
@given(small_costs(), st.integers(0, 1500), st.booleans(), st.booleans())
@example(SPLIT_RERUNS, 80, True, False)
@example(LOSSLESS_SOURCE, 200, False, False)
@example(LOSSLESS_SOURCE, 220, True, False)
@example(COMPRESSED_PRODUCT_START, 240, False, False)
def test_optimal_against_exhaustive_enumeration(costs, budget, per_layer, allow_lossy):
    best, least_peak = brute_force(costs, budget, per_layer, allow_lossy)
    if best is None:
        with pytest.raises(planner.InfeasibleBudget) as info:
            planner.plan(costs, budget, per_layer=per_layer, allow_lossy_sources=allow_lossy)
        assert info.value.minimum_budget == least_peak
        assert str(least_peak) in str(info.value)
        return
    result = planner.plan(costs, budget, per_layer=per_layer, allow_lossy_sources=allow_lossy)
    assert result.added_time_s == pytest.approx(best, abs=1e-9)
    assert result.peak_bytes <= budget
    assert result.minimum_feasible_budget == least_peak
    # The table's activations are the forward and backward's; the step may set the peak.
    assert result.peak_bytes == costs.static_bytes + max(
        result.activation_bytes, costs.optimizer_step_bytes + costs.held_non_layer_bytes)
    # Every layer with an action runs under the hooks, but one that recomputes all of its own
    # sites it can and compresses none: megatron's checkpoint runs it.
    whole = {site.name for site in costs.sites
             if site.can_recompute and not get_site(site.name).shared}
    hooked = []
    for layer, decisions in enumerate(result.layer_decisions):
        actions = {decision.action for decision in decisions.values()}
        recomputed = {name for name, decision in decisions.items()
                      if decision.action == RECOMPUTE}
        if actions - {RETAIN} and not (whole and COMPRESS not in actions
                                       and whole <= recomputed):
            hooked.append(layer)
    assert result.hooks_time_s == pytest.approx(len(hooked) * costs.hooked_layer_s)
    assert (sum(row.time_added_s for row in result.rows) + result.hooks_time_s
            == pytest.approx(result.added_time_s))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(0, 1100), st.sampled_from([2, 30, 10**6]),
       st.booleans())
def test_pareto_indices_keeps_the_rows_no_earlier_row_weakly_dominates(seed, n, spread,
                                                                        one_transient):
    """Against the definition, over one block and several (the staircase), with ties."""
    rng = np.random.default_rng(seed)
    points = rng.integers(0, spread, (n, 3)).astype(float)
    if one_transient:
        points[:, 2] = 7.0
    order = np.lexsort((points[:, 2], points[:, 1], points[:, 0]))
    ranked = points[order]
    weakly_below = ((ranked[None, :, 1] <= ranked[:, None, 1])
                    & (ranked[None, :, 2] <= ranked[:, None, 2]))
    kept = ~(weakly_below & np.tri(n, k=-1, dtype=bool)).any(axis=1)
    assert np.array_equal(planner.pareto_indices(points), order[kept])


@settings(max_examples=150, deadline=None)
@given(small_costs(), st.booleans())
def test_every_frontier_policy_costs_what_the_model_says(costs, allow_lossy):
    # The frontier carries the rebuild time and the held sources in its state, site by
    # site; each policy it keeps must cost what the model's definitions say.
    frontier = planner.layer_frontier(costs, allow_lossy)
    for k in range(len(frontier)):
        policy = frontier.policy(k)
        evaluated = planner.evaluate_layer(costs, policy.decisions)
        assert (evaluated.stored_bytes, evaluated.transient_bytes) == (
            policy.stored_bytes, policy.transient_bytes)
        assert evaluated.time_s == pytest.approx(policy.time_s, abs=1e-12)
        assert allow_lossy or planner.is_exact(costs, policy.decisions)


# CBC returned 1.25 s as optimal for these costs (at 484 B with bytes counted in MiB, at
# 451 B from its cuts); 1.0 s fits both.
TINY_BYTES = ModelCosts(
    sites=[SiteCost("layer_in", 39, "float16"),
           SiteCost("ln1_out", 10, "float16", 1.25, "attention",
                    (CodecCost("outlier_int4", 0, 0.0, 1.0),)),
           SiteCost("ln2_in", 48, "float16", 1.25, "attention"),
           SiteCost("gelu_in", 56, "float16", 2.0, "mlp",
                    (CodecCost("outlier_int4", 34, 0.0, 0.0),))],
    num_layers=3, static_bytes=0, non_layer_bytes=37, backward_workspace_bytes=0,
    micro_batch_size=1)


@settings(max_examples=12, deadline=None)
@given(small_costs(), st.integers(0, 700), st.booleans(), st.booleans())
@example(SPLIT_RERUNS, 80, True, False)
@example(TINY_BYTES, 451, True, False)
@example(replace(TINY_BYTES, static_bytes=41, non_layer_bytes=29), 484, True, False)
@example(LOSSLESS_SOURCE, 220, True, False)
@example(COMPRESSED_PRODUCT_START, 240, False, False)
def test_direct_milp_against_exhaustive_enumeration(costs, budget, per_layer, allow_lossy):
    best, _ = brute_force(costs, budget, per_layer, allow_lossy)
    if best is None:
        with pytest.raises(planner.InfeasibleBudget):
            planner.plan(costs, budget, per_layer, allow_lossy, method="milp")
        return
    result = planner.plan(costs, budget, per_layer, allow_lossy, method="milp")
    assert result.added_time_s == pytest.approx(best, abs=1e-6)


@settings(max_examples=40, deadline=None)
@given(small_costs(), st.booleans(), st.booleans(), st.integers(1, 40))
def test_the_minimum_budget_is_feasible(costs, per_layer, allow_lossy, resolution):
    # A coarse search grid (rounding stored bytes up) must not make the named minimum fail.
    minimum = planner.minimum_budget(costs, per_layer, allow_lossy)
    result = planner.plan(costs, minimum, per_layer, allow_lossy, resolution_bytes=resolution)
    assert result.peak_bytes == minimum == result.minimum_feasible_budget
    with pytest.raises(planner.InfeasibleBudget) as info:
        planner.plan(costs, minimum - 1, per_layer, allow_lossy, resolution_bytes=resolution)
    assert info.value.minimum_budget == minimum


def test_the_minimum_budget_is_feasible_at_gpt345m_scale():
    shape = analytic.ModelShape(24, 1024, 16, 1024, 50257)
    costs = analytic.analytic_costs(shape, 8, "v100-32gb")
    for lossy in (True, False):
        minimum = planner.minimum_budget(costs, allow_lossy_sources=lossy)
        assert planner.plan(costs, minimum, allow_lossy_sources=lossy).peak_bytes <= minimum


def test_rebuild_time_is_the_runtimes_rerun():
    """A layer's rebuild time: the deepest recomputed site of a lone segment (a maximum, not a
    sum); with sites in both segments, the attention up to its deepest and the MLP from the
    ln2_in it keeps, or, ln2_in recomputed as well, the attention whole and the MLP on from
    it."""
    costs = ModelCosts(
        sites=[SiteCost("layer_in", 10, "float16"),
               SiteCost("ln1_out", 10, "float16", 1.0, "attention"),
               SiteCost("qkv", 30, "float16", 3.0, "attention"),
               SiteCost("ln2_in", 10, "float16", 7.0, "attention"),
               SiteCost("ln2_out", 10, "float16", 0.5, "mlp"),
               SiteCost("gelu_in", 40, "float16", 2.0, "mlp")],
        num_layers=1, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
        micro_batch_size=1)

    def seconds(*names):
        return planner.evaluate_layer(costs, {n: Decision(RECOMPUTE) for n in names}).time_s

    assert seconds("ln1_out", "qkv") == seconds("qkv") == 3.0
    assert seconds("ln2_out", "gelu_in") == 2.0
    assert seconds("ln1_out", "gelu_in") == 1.0 + 2.0      # two re-runs
    assert seconds("ln1_out", "ln2_in", "gelu_in") == 7.0 + 2.0    # attention runs whole
    assert seconds("ln2_in", "ln2_out") == 7.0 + 0.5
    assert planner.rerun_chains(costs, {"qkv", "gelu_in"}) == [[0], [1]]
    assert planner.rerun_chains(costs, {"qkv", "ln2_in", "gelu_in"}) == [[0, 1]]
    assert planner.rebuild_charges(costs, {"ln1_out", "qkv", "gelu_in"}) == {
        "qkv": 3.0, "gelu_in": 2.0}
    assert planner.rebuild_charges(costs, {"ln1_out", "qkv", "ln2_in", "gelu_in"}) == {
        "ln2_in": 7.0, "gelu_in": 2.0}
    # Each re-run reads the start of its first segment: the MLP's reads ln2_in unless ln2_in
    # is rebuilt by the attention's re-run.
    compressed_ln2_in = {"ln2_in": Decision(COMPRESS), "gelu_in": Decision(RECOMPUTE)}
    assert not planner.is_exact(costs, compressed_ln2_in)
    assert not planner.is_exact(costs, {**compressed_ln2_in, "qkv": Decision(RECOMPUTE)})
    compressed_input = {"layer_in": Decision(COMPRESS), "gelu_in": Decision(RECOMPUTE)}
    assert planner.is_exact(costs, compressed_input)
    assert not planner.is_exact(costs, {**compressed_input, "qkv": Decision(RECOMPUTE)})
    assert not planner.is_exact(costs, {**compressed_input, "ln2_in": Decision(RECOMPUTE)})
    # The plan table names each re-run's own start.
    layers = [planner.evaluate_layer(costs, {"qkv": Decision(RECOMPUTE),
                                             "gelu_in": Decision(RECOMPUTE)})]
    result = planner.PlanResult.from_layers(
        costs, layers, budget_bytes=planner.peak_bytes(costs, layers), solve_time_s=0.0,
        minimum_feasible_budget=0, per_layer=False, allow_lossy_sources=False,
        method="frontier")
    assert {row.site: row.rebuilt_from for row in result.rows if row.action == RECOMPUTE} == {
        "qkv": "layer_in", "gelu_in": "ln2_in"}


@settings(max_examples=25, deadline=None)
@given(small_costs(), st.booleans())
def test_larger_budget_never_slower_and_per_layer_beats_uniform(costs, allow_lossy):
    previous = None
    for budget in range(0, 700, 25):
        try:
            per_layer = planner.plan(costs, budget, allow_lossy_sources=allow_lossy)
        except planner.InfeasibleBudget:
            assert previous is None
            continue
        if previous is not None:
            assert per_layer.added_time_s <= previous + 1e-12
        previous = per_layer.added_time_s
        try:
            uniform = planner.plan(costs, budget, per_layer=False, allow_lossy_sources=allow_lossy)
        except planner.InfeasibleBudget:
            continue
        assert per_layer.added_time_s <= uniform.added_time_s + 1e-12


def chain_costs():
    """Compressing layer_in is cheap and rebuilding the attention segment from it is cheap:
    the lossy plan."""
    return ModelCosts(
        sites=[SiteCost("layer_in", 100, "float16",
                        codecs=(CodecCost("outlier_int4", 10, 0.1, 0.1),)),
               SiteCost("ln1_out", 100, "float16", 0.4, "attention",
                        (CodecCost("outlier_int4", 10, 2.0, 2.0),)),
               SiteCost("qkv", 300, "float16", 0.5, "attention",
                        (CodecCost("channel_int4", 80, 3.0, 3.0),))],
        num_layers=4, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
        micro_batch_size=1)


def test_lossy_source_constraint_respected():
    costs = chain_costs()
    budget = 1050
    lossy = planner.plan(costs, budget, allow_lossy_sources=True)
    assert any(not planner.is_exact(costs, layer) for layer in lossy.layer_decisions)
    exact = planner.plan(costs, budget, allow_lossy_sources=False)
    assert all(planner.is_exact(costs, layer) for layer in exact.layer_decisions)
    assert exact.added_time_s > lossy.added_time_s


def test_a_partial_views_payload_never_feeds_a_rebuild():
    """A compressed swiglu_in holds the gate half alone (sites.VIEW_PAYLOADS) while the
    SwiGLU's edge reads fc1's whole output: even with lossy sources, neither method rebuilds
    from it compressed. Here that rebuild is in the fastest plan at 1000 B and in every plan
    at 850 B."""
    costs = ModelCosts(
        sites=[SiteCost("swiglu_in", 100, "float16",
                        codecs=(CodecCost("outlier_int4", 10, 0.1, 0.1),)),
               SiteCost("swiglu_out", 500, "float16", operator="mlp",
                        codecs=(CodecCost("outlier_int4", 10, 2.0, 2.0),))],
        num_layers=20, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
        micro_batch_size=1, operators=(Operator("mlp", ("swiglu_in",), 0.01),))
    for method in ("frontier", "milp"):
        with pytest.raises(planner.InfeasibleBudget):
            planner.plan(costs, 850, allow_lossy_sources=True, method=method)
        result = planner.plan(costs, 1000, allow_lossy_sources=True, method=method)
        assert not any(layer["swiglu_in"].action == COMPRESS
                       and layer["swiglu_out"].action == RECOMPUTE
                       for layer in result.layer_decisions), method
        assert result.added_time_s == pytest.approx(19 * 4.2), method


def test_layer_in_never_recomputed_and_qkv_one_unit():
    costs = chain_costs()
    result = planner.plan(costs, planner.minimum_budget(costs))
    for layer in result.layer_decisions:
        assert layer["layer_in"].action != RECOMPUTE
        assert set(layer) == {"layer_in", "ln1_out", "qkv"}   # one decision for Q, K and V
    assert not {"q", "k", "v"} & set(result.plan.to_dict()["sites"])


def test_unknown_site_is_retained():
    costs = chain_costs()
    costs.sites.append(SiteCost("mystery", 1000, "float16", 0.0, "attention",
                                (CodecCost("outlier_int4", 1, 0.0, 0.0),)))
    costs.validate()
    result = planner.plan(costs, 10**6)
    assert all(layer["mystery"].action == RETAIN for layer in result.layer_decisions)
    with pytest.raises(planner.InfeasibleBudget):
        planner.plan(costs, 4 * 1000)


def test_larger_transients_go_to_lower_layers():
    costs = chain_costs()
    result = planner.plan(costs, planner.minimum_budget(costs) + 150)
    transients = [planner.evaluate_layer(costs, d).transient_bytes
                  for d in result.layer_decisions]
    assert transients == sorted(transients, reverse=True)


def test_direct_milp_agrees_with_frontier():
    costs = chain_costs()
    for budget in (600, 900, 1400, 2000):
        for per_layer in (True, False):
            for lossy in (True, False):
                try:
                    fast = planner.plan(costs, budget, per_layer, lossy)
                except planner.InfeasibleBudget:
                    with pytest.raises(planner.InfeasibleBudget):
                        planner.plan(costs, budget, per_layer, lossy, method="milp")
                    continue
                milp = planner.plan(costs, budget, per_layer, lossy, method="milp")
                assert milp.added_time_s == pytest.approx(fast.added_time_s, abs=1e-9)


def test_a_budget_that_is_not_a_whole_number_of_bytes_is_refused():
    costs = analytic.analytic_costs(analytic.ModelShape(2, 256, 4, 128, 1000), 1, "v100-32gb")
    with pytest.raises(TypeError, match="whole number of bytes"):
        planner.plan(costs, 20.5 * 2**30)
    assert planner.plan(costs, np.int64(20 * 2**30)).budget_bytes == 20 * 2**30


# --- pipeline stages -----------------------------------------------------------------------
def simulate_1f1b(costs, layers, stage, pipeline_size, num_micro_batches):
    """The stage's peak by walking megatron-core's 1F1B order event by event: warm-up
    forwards, then one forward before each backward, then the cool-down backwards. A forward
    adds the embedding's and every layer's stored bytes and, at its end, the output layer's
    and loss's (freed by the loss backward), and on a stage after the first, when a backward
    came before it, the input the last backward's micro-batch received (its graph holds it
    until this forward returns); a backward walks the layers top down, layer l holding its
    transient and the workspace while the layers below it are still stored. The part of the
    non-layer bytes a cached tensor holds (the causal mask) is allocated by the first forward
    and never freed. The optimizer step comes last, its gradient copies over what is left."""
    warmup = min(pipeline_size - stage - 1, num_micro_batches)
    order = ["F"] * warmup + ["F", "B"] * (num_micro_batches - warmup) + ["B"] * warmup
    received = costs.site("layer_in").bytes if stage > 0 else 0
    live = peak = costs.static_bytes
    cached = costs.held_non_layer_bytes
    for index, step in enumerate(order):
        if step == "F":
            live += costs.embedding_bytes + sum(layer.stored_bytes for layer in layers)
            live += cached if index == 0 else 0
            previous_received = received if "B" in order[:index] else 0
            peak = max(peak, live + costs.non_layer_bytes - cached + previous_received)
        else:
            for layer in reversed(layers):
                peak = max(peak, live + layer.transient_bytes + costs.backward_workspace_bytes)
                live -= layer.stored_bytes
            live -= costs.embedding_bytes
    assert live == costs.static_bytes + cached
    return max(peak, live + costs.optimizer_step_bytes)


@st.composite
def tiny_pipelines(draw):
    """Tiny layer costs cut into P stages by planning.stage_costs: the embedding's
    activations on the first stage, the output layer's on the last."""
    costs = draw(small_costs())
    pipeline_size, num_micro_batches = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    embedding, output = draw(st.integers(0, 20)), draw(st.integers(0, 80))
    mask = draw(st.integers(0, 10))   # a cached tensor on every stage, never freed
    memory = [planner.StageMemory(draw(st.integers(0, 50)), embedding if stage == 0 else 0,
                                  (output if stage == pipeline_size - 1 else 0) + mask, mask,
                                  draw(st.sampled_from([0, 40, 400])))
              for stage in range(pipeline_size)]
    layers = pipeline_size * draw(st.integers(1, 2))
    return planner.stage_costs(costs, memory, layers, num_micro_batches), num_micro_batches


@settings(max_examples=60, deadline=None)
@given(tiny_pipelines(), st.data())
def test_stage_peak_is_the_1f1b_schedules_peak(pipeline, data):
    """peak_bytes of a stage equals the peak of the schedule walked event by event, for every
    per-layer policy mix: the k - 1 other in-flight micro-batches whole, the oldest one's
    layers 0..l and layer l's transient."""
    stages, num_micro_batches = pipeline
    for index, costs in enumerate(stages):
        policies = list(all_layer_policies(costs, True))
        layers = [data.draw(st.sampled_from(policies)) for _ in range(costs.num_layers)]
        assert planner.peak_bytes(costs, layers) == simulate_1f1b(
            costs, layers, index, len(stages), num_micro_batches)


def test_the_first_stages_hold_more_micro_batches():
    assert [planner.in_flight_micro_batches(s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [planner.in_flight_micro_batches(s, 4, 2) for s in range(4)] == [2, 2, 2, 1]
    assert planner.stage_layer_counts(24, 4) == [6] * 4
    with pytest.raises(ValueError, match="evenly"):
        planner.stage_layer_counts(22, 4)


@settings(max_examples=40, deadline=None)
@given(tiny_pipelines(), st.integers(0, 1500), st.booleans())
def test_each_stage_gets_its_fastest_plan_against_exhaustive_enumeration(pipeline, budget,
                                                                         allow_lossy):
    stages, _ = pipeline
    expected = [brute_force(costs, budget, True, allow_lossy) for costs in stages]
    infeasible = [index for index, (best, _) in enumerate(expected) if best is None]
    if infeasible:
        with pytest.raises(planner.InfeasibleBudget) as info:
            planner.plan_stages(stages, budget, allow_lossy_sources=allow_lossy)
        stage = infeasible[0]
        assert info.value.minimum_budget == expected[stage][1]
        if len(stages) == 1:          # no pipeline: no stage to name
            assert info.value.stage is None and "stage" not in str(info.value)
        else:
            assert info.value.stage == stage
            assert str(info.value).startswith(f"pipeline stage {stage}: memory budget")
        assert f"({expected[stage][1]} B" in str(info.value)
        return
    plans = planner.plan_stages(stages, budget, allow_lossy_sources=allow_lossy)
    first_layer = 0
    for index, (costs, stage_plan, (best, least_peak)) in enumerate(zip(stages, plans,
                                                                        expected)):
        assert (stage_plan.stage, stage_plan.first_layer) == (index, first_layer)
        assert stage_plan.in_flight_micro_batches == costs.in_flight_micro_batches
        assert stage_plan.result.added_time_s == pytest.approx(best, abs=1e-9)
        assert stage_plan.result.peak_bytes <= budget
        assert stage_plan.result.minimum_feasible_budget == least_peak
        first_layer += costs.num_layers


@pytest.mark.parametrize("method", ["frontier", "milp"])
def test_the_hooks_are_charged_once_per_layer_with_any_action(method):
    """Two layers must shed 10 bytes between them: compressing ln2_out in one layer (1.0 s) or
    gelu_in in both (0.4 s each). Every layer with an action runs under the runtime's hooks;
    at 0.5 s a layer, touching one layer is the faster plan."""
    def costs(hooked_layer_s):
        return ModelCosts(
            sites=[SiteCost("ln2_out", 10, "float32",
                            codecs=(CodecCost(get_site("ln2_out").default_codec, 0, 1.0, 0.0),)),
                   SiteCost("gelu_in", 10, "float32",
                            codecs=(CodecCost(get_site("gelu_in").default_codec, 5, 0.4, 0.0),))],
            num_layers=2, static_bytes=0, non_layer_bytes=50, backward_workspace_bytes=0,
            micro_batch_size=1, hooked_layer_s=hooked_layer_s)

    def touched(result):
        return [[name for name, decision in layer.items() if decision.action != RETAIN]
                for layer in result.layer_decisions]

    free = planner.plan(costs(0.0), 80, method=method)
    assert touched(free) == [["gelu_in"], ["gelu_in"]]
    assert free.added_time_s == pytest.approx(0.8)
    hooked = planner.plan(costs(0.5), 80, method=method)
    assert sorted(touched(hooked)) == [[], ["ln2_out"]]
    assert hooked.added_time_s == pytest.approx(1.5)
    assert hooked.hooks_time_s == pytest.approx(0.5)
    assert "(runtime hooks)" in planner.format_plan(hooked)
    # Nothing to shed: no layer is hooked, and nothing is charged.
    assert planner.plan(costs(0.5), 90, method=method).added_time_s == 0.0


@pytest.mark.parametrize("method", ["frontier", "milp"])
def test_a_layer_recomputed_whole_is_charged_no_hooks(method):
    """Two layers must shed 10 bytes: compress softmax_out in one (0.7 s) or recompute one
    whole (1.0 s). The whole layer runs under megatron's checkpoint, without the hooks: at
    0.5 s a hooked layer, it is the faster plan; with one site left out it would be hooked."""
    def costs(hooked_layer_s):
        return ModelCosts(
            sites=[SiteCost("layer_in", 10, "float32"),
                   SiteCost("qkv", 10, "float32", 1.0, "attention"),
                   SiteCost("softmax_out", 10, "float32", 1.0, "attention",
                            codecs=(CodecCost(get_site("softmax_out").default_codec, 0, 0.7,
                                              0.0),))],
            num_layers=2, static_bytes=0, non_layer_bytes=0, backward_workspace_bytes=0,
            micro_batch_size=1, hooked_layer_s=hooked_layer_s)

    def touched(result):
        return sorted([name for name, decision in layer.items() if decision.action != RETAIN]
                      for layer in result.layer_decisions)

    free = planner.plan(costs(0.0), 50, method=method)
    assert touched(free) == [[], ["softmax_out"]]
    assert free.added_time_s == pytest.approx(0.7)
    hooked = planner.plan(costs(0.5), 50, method=method)
    assert touched(hooked) == [[], ["qkv", "softmax_out"]]
    assert hooked.added_time_s == pytest.approx(1.0)
    assert hooked.hooks_time_s == 0.0 and hooked.hooked_layers == ""
    # The full-recompute policy's plan also names sites this layer does not save.
    full = policies.full_recompute_plan().for_layer(0)
    assert planner.evaluate_layer(costs(0.5), full).time_s == pytest.approx(1.0)
