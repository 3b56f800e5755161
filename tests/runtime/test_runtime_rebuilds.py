"""Operator-level rebuilds (sites.REBUILDS): a recomputed norm output, norm statistics,
activation output (GPT's GELU, Llama's SiLU and SwiGLU product) or residual stream after
attention (linear_proj and the bias-dropout-add on the kept mask) is rebuilt by its own
megatron submodules or functions from its upstream sites, and only those run (no segment
re-run); chains through a rebuilt source are exact; a plan that recomputes from exact
sources trains bit for bit like the stock layer, in fp32 and bf16, on both attentions, with
dropout where the attention allows it, in both model families. The residual's dropout
applies the kept mask to its one call on the rebuild's thread, torch's function untouched."""
import re
import threading

import pytest
import torch

from megatron_adacc import models, planning
from megatron_adacc.common.plan import Decision, Plan
from megatron_adacc.profiling.profiler import profile
from megatron_adacc.runtime import adacc_layers, apply_plan, measure_step
from megatron_adacc.common.sites import COMPRESS, REBUILDS, REBUILT_BY, RECOMPUTE

from helpers.runtime import (BATCH, SEQ, assert_gradients_close, assert_same_training, batch,
                             build, loss_of, train)
from helpers.llama import build_llama, train_steps


def _family_products(family: str) -> list[str]:
    """The products of the edges a family's layer offers (its sites hold output and
    sources), each once."""
    own = set(models.get(family).sites)
    return list(dict.fromkeys(
        product for edge in REBUILDS if edge.used_by(own)
        for product in edge.products if product in own))


PRODUCTS = _family_products("gpt")
LLAMA_PRODUCTS = _family_products("llama")
# The modules a segment re-run would call again in backward; an operator calls none of them
# but its own (the norms' operators their norm; ln2_in's edge linear_proj, no attention).
MATMULS = ("self_attention.linear_qkv", "self_attention.core_attention",
           "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
OWN_MODULES = {"input_layernorm": ("input_layernorm",),
               "pre_mlp_layernorm": ("pre_mlp_layernorm",),
               "attention_residual": ("self_attention.linear_proj",)}
RESIDUAL_CHAINS = {
    # the residual's edge rebuilds ln2_in, then the pre-MLP norm runs on it
    "norm_from_rebuilt_residual": {"ln2_in": "recompute", "ln2_out": "recompute",
                                   "ln2_stats": "recompute", "ln2_normed": "recompute"},
    # the MLP re-run starts from the ln2_in its edge rebuilt
    "mlp_rerun_from_rebuilt_residual": {"ln2_in": "recompute", "gelu_in": "recompute",
                                        "swiglu_in": "recompute"},
    # the attention re-run rebuilds the context (and the mask), then the residual's edge
    "residual_from_rerun": {"context": "recompute", "bda1_mask": "recompute",
                            "ln2_in": "recompute", "ln2_out": "recompute"},
    # the bitmask codec is lossless: the edge reads the decoded mask, exactly
    "residual_from_bitmask": {"bda1_mask": {"action": "compress", "codec": "bitmask"},
                              "ln2_in": "recompute"},
    # ln2_in kept: the attention re-runs to Q/K/V, the MLP from the kept ln2_in
    "reruns_around_kept_residual": {"qkv": "recompute", "gelu_in": "recompute",
                                    "swiglu_in": "recompute"},
}


def _in(family: str, plan: dict) -> dict:
    """``plan`` restricted to the sites the family's layer saves."""
    own = set(models.get(family).sites)
    return {site: decision for site, decision in plan.items() if site in own}


CHAINS = {
    **{name: _in("gpt", plan) for name, plan in RESIDUAL_CHAINS.items()},
    # the MLP re-run rebuilds the activation's input, then the activation runs on it
    "activation_from_rerun": {"gelu_in": "recompute", "gelu_out": "recompute"},
    # every operator, each from a retained source
    "every_operator": {name: "recompute" for name in PRODUCTS},
    # everything the layer can rebuild: re-runs and operators together
    "everything": {name: "recompute" for name in PRODUCTS + ["qkv", "context", "ln2_in",
                                                             "gelu_in"]},
}
# (attention, dropout): flash has no attention dropout on a CPU, the hidden dropout only
BACKENDS = [("unfused", 0.1), ("flash", 0.0), ("flash", 0.1)]
BACKEND_IDS = [f"{backend}-{dropout}" for backend, dropout in BACKENDS]


def _model(adacc, backend, dtype, dropout):
    return build(adacc, dtype, dropout=dropout, attention_backend=backend,
                 attention_dropout=0.0 if backend == "flash" else dropout)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend,dropout", BACKENDS, ids=BACKEND_IDS)
def test_every_edge_and_chain_trains_bit_for_bit(distributed, dtype, backend, dropout):
    stock = train(_model(False, backend, dtype, dropout), steps=2)
    plans = {**{product: {product: "recompute"} for product in PRODUCTS}, **CHAINS}
    if not dropout:  # no mask is saved
        plans = {name: sites for name, sites in plans.items() if "bda1_mask" not in sites}
    for name, sites in plans.items():
        model = _model(True, backend, dtype, dropout)
        apply_plan(model, Plan.uniform(sites), strict=True)
        try:
            assert_same_training(stock, train(model, steps=2))
        except AssertionError as exc:
            raise AssertionError(f"{backend} {dtype}, plan {name}: {exc}") from None


def _calls_in_backward(model, names):
    """Runs one step; the forward calls of the named submodules (of every layer) during its
    backward."""
    calls = {name: 0 for name in names}
    backward = [False]
    handles = []
    for layer in adacc_layers(model):
        for name in names:
            module = layer.get_submodule(name)

            def count(module, args, output, name=name):
                calls[name] += backward[0]

            handles.append(module.register_forward_hook(count))
    try:
        loss = loss_of(model)
        backward[0] = True
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return calls


@pytest.mark.parametrize("product", PRODUCTS)
def test_an_operator_rebuild_runs_only_its_operator(distributed, product):
    edge = REBUILT_BY[product]
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform({product: "recompute"}), strict=True)
    own = OWN_MODULES.get(edge.call, ())
    calls = _calls_in_backward(model, MATMULS + ("input_layernorm", "pre_mlp_layernorm"))
    # one call of its own modules per layer, nothing else: the residual's edge runs
    # linear_proj but neither linear_qkv nor the attention
    assert calls == {name: (2 if name in own else 0) for name in calls}, product



def test_a_segment_rebuild_still_reruns_its_segment(distributed):
    # The control for the test above: gelu_in has no operator, so the MLP re-runs to it.
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform({"gelu_in": "recompute"}), strict=True)
    calls = _calls_in_backward(model, MATMULS + ("pre_mlp_layernorm",))
    assert calls["mlp.linear_fc1"] == 2 and calls["pre_mlp_layernorm"] == 2
    assert calls["mlp.linear_fc2"] == calls["self_attention.linear_qkv"] == 0


def test_a_rerun_through_both_segments_takes_ln2_in_from_the_attention_it_ran(distributed):
    # The attention re-run goes on into the MLP, so it ran linear_proj and the add: its
    # output is ln2_in, and the residual's edge does not run them once more.
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform(CHAINS["everything"]), strict=True)
    calls = _calls_in_backward(model, MATMULS)
    # once per layer (two layers); the MLP re-run ends at gelu_in, before fc2
    assert calls == {name: 0 if name == "mlp.linear_fc2" else 2 for name in MATMULS}


@pytest.mark.parametrize("backend", ["unfused", "flash"])
def test_a_kept_residual_splits_the_rerun_in_two(distributed, backend):
    # ln2_in kept: the attention's re-run stops at Q/K/V, before the attention itself and
    # linear_proj, and the MLP's starts from ln2_in (its norm and fc1 run, not fc2).
    model = _model(True, backend, torch.float32, 0.1)
    apply_plan(model, Plan.uniform(CHAINS["reruns_around_kept_residual"]), strict=True)
    calls = _calls_in_backward(model, MATMULS + ("pre_mlp_layernorm",))
    assert calls == {"self_attention.linear_qkv": 2, "self_attention.core_attention": 0,
                     "self_attention.linear_proj": 0, "mlp.linear_fc1": 2,
                     "mlp.linear_fc2": 0, "pre_mlp_layernorm": 2}


def _generator_state_reads(model, monkeypatch) -> int:
    """One step; how often it read the CPU generator's state (what capturing or forking the
    RNG states for a segment re-run does)."""
    read = torch.get_rng_state
    reads = [0]

    def counted():
        reads[0] += 1
        return read()

    monkeypatch.setattr(torch, "get_rng_state", counted)
    loss_of(model).backward()
    monkeypatch.setattr(torch, "get_rng_state", read)
    return reads[0]


def test_only_a_segment_rerun_saves_and_forks_the_rng_states(distributed, monkeypatch):
    # No operator draws random numbers, so a plan of operators alone neither captures the
    # RNG states in forward nor forks them in backward: it reads the generator as often as
    # the all-retain layer (whose dropouts read it themselves, through megatron's tracker).
    model = build(True, dropout=0.1)
    retained = _generator_state_reads(model, monkeypatch)
    apply_plan(model, Plan.uniform(CHAINS["every_operator"]), strict=True)
    assert _generator_state_reads(model, monkeypatch) == retained
    # The control: a segment re-run (gelu_in's, the MLP's) captures its states in forward
    # and forks them around its rebuild.
    apply_plan(model, Plan.uniform({"gelu_in": "recompute", "gelu_out": "recompute"}),
               strict=True)
    assert _generator_state_reads(model, monkeypatch) > retained


def test_operator_products_keep_no_bytes_and_free_their_rebuild(distributed):
    stock = build(True, dropout=0.1)
    _, kept = measure_step(stock, lambda: loss_of(stock), strict=True)
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform(CHAINS["every_operator"]), strict=True)
    _, report = measure_step(model, lambda: loss_of(model), strict=True)
    for layer in (0, 1):
        for product in PRODUCTS:
            assert (layer, product) not in report.by_site
    assert kept.after_forward_bytes - report.after_forward_bytes == sum(
        nbytes for (layer, site), nbytes in kept.by_site.items()
        if layer >= 0 and site in PRODUCTS)
    for layer in adacc_layers(model):
        assert layer._call is None


def test_the_plan_table_rebuilds_ln2_in_from_its_edges_sources(distributed):
    # Profiled through the runtime: the edge is timed alone, reads the layer input, the
    # attention output and the mask, and a mask the bitmask codec holds keeps it exact.
    model = build(True, dropout=0.1)
    costs = profile(model, batch(0), repeats=1, strict=True)
    edge = costs.operator("attention_residual")
    assert edge.sources == ("layer_in", "context", "bda1_mask") and edge.rebuild_s > 0
    decisions = {"ln2_in": Decision(RECOMPUTE), "bda1_mask": Decision(COMPRESS)}
    assert planning.is_exact(costs, decisions)
    assert planning.rebuild_charges(costs, {"ln2_in"}) == {"ln2_in": edge.rebuild_s}
    layers = [planning.evaluate_layer(costs, decisions)] * costs.num_layers
    result = planning.PlanResult.from_layers(
        costs, layers, budget_bytes=planning.peak_bytes(costs, layers), solve_time_s=0.0,
        minimum_feasible_budget=0, per_layer=False, allow_lossy_sources=False,
        method="frontier")
    row = next(row for row in result.rows if row.site == "ln2_in")
    assert row.rebuilt_from == "layer_in+context+bda1_mask"
    assert "layer_in+context+bda1_mask" in planning.format_plan(result)


def test_an_operator_reads_a_compressed_source_decoded(distributed):
    # A lossy plan: the activation runs on the decoded fc1 output, so its output carries the
    # codec's error; the forward (the loss) is untouched and the gradients stay close.
    reference = build(True, dropout=0.0)
    torch.manual_seed(3)
    loss_of(reference).backward()
    model = build(True, dropout=0.0)
    apply_plan(model, Plan.uniform({"gelu_in": {"action": "compress", "codec": "sym_int4"},
                                    "gelu_out": "recompute"}), strict=True)
    torch.manual_seed(3)
    loss = loss_of(model)
    assert torch.equal(loss, loss_of(reference))
    loss.backward()
    assert_gradients_close(model, reference, 0.1)


# --- ln2_in's dropout: the kept mask, applied on the rebuild's thread to its one call ---------
DROPOUT = torch.nn.functional.dropout  # torch's own, as imported
HIDDEN = 64  # helpers.runtime's tiny GPT


def _kept_mask(dtype=torch.float32, shape=(SEQ, BATCH, HIDDEN), p=0.1):
    """A mask as CPU dropout saves it: the keep-mask divided by 1 - p."""
    return torch.empty(shape).bernoulli_(1 - p, generator=torch.Generator().manual_seed(7)) \
        .div_(1 - p).to(dtype)


def _drawn_elsewhere(value):
    """torch's dropout of ``value`` on a thread of its own, from a fixed seed."""
    drawn = {}

    def draw():
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(5)
            drawn["function"] = torch.nn.functional.dropout
            drawn["value"] = torch.nn.functional.dropout(value, 0.5, training=True)

    thread = threading.Thread(target=draw)
    thread.start()
    thread.join()
    return drawn


def test_the_rebuild_applies_the_mask_on_its_own_thread_only(distributed):
    # While ln2_in's edge runs megatron's bias-dropout-add, torch's dropout is still torch's
    # own function, on the rebuild's thread and on any other, and another thread's dropout
    # draws as it would without the rebuild.
    model = build(True, dropout=0.1)
    apply_plan(model, Plan.uniform({"ln2_in": "recompute"}), strict=True)
    layer = adacc_layers(model)[0]
    bias_dropout_add = layer.self_attn_bda
    in_backward, seen = [False], []

    def watched(training, fused):
        run = bias_dropout_add(training, fused)

        def watched_run(x_with_bias, residual, p):
            if in_backward[0]:
                seen.append((torch.nn.functional.dropout, _drawn_elsewhere(residual.detach()),
                             residual.detach()))
            return run(x_with_bias, residual, p)
        return watched_run

    layer.self_attn_bda = watched
    loss = loss_of(model)
    in_backward[0] = True
    loss.backward()
    assert len(seen) == 1  # the edge ran once, in backward
    here, elsewhere, residual = seen[0]
    assert here is DROPOUT and elsewhere["function"] is DROPOUT
    assert torch.equal(elsewhere["value"], _drawn_elsewhere(residual)["value"])


def _attention_residual_inputs(dtype=torch.float32):
    """The layer input and attention output attention_residual reads, [s, b, h]."""
    generator = torch.Generator().manual_seed(11)
    residual, context = (torch.randn(SEQ, BATCH, HIDDEN, generator=generator).to(dtype)
                         for _ in range(2))
    return residual, context


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_attention_residual_applies_the_mask_and_passes_the_rest_through(distributed, dtype):
    # The adds around the dropout run as torch runs them outside the rebuild; the dropout
    # applies the mask, and in eval (nothing drawn) returns its input.
    layer = adacc_layers(build(True, dtype, dropout=0.1))[0]
    residual, context = _attention_residual_inputs(dtype)
    mask = _kept_mask(dtype)
    with torch.no_grad():
        projected, bias = layer.self_attention.linear_proj(context)
        assert torch.equal(layer.attention_residual(residual, context, mask),
                           torch.add(residual, (projected + bias) * mask))
        layer.eval()
        assert torch.equal(layer.attention_residual(residual, context, mask),
                           torch.add(residual, projected + bias))


def test_only_the_first_dropout_of_the_rebuild_applies_the_mask(distributed):
    # A second dropout in the bias-dropout-add draws, as megatron's would.
    layer = adacc_layers(build(True, dropout=0.1))[0]
    residual, context = _attention_residual_inputs()
    mask = _kept_mask()

    def twice(training, fused):
        return lambda x_with_bias, residual, p: (
            torch.nn.functional.dropout(x_with_bias[0], p, training),
            torch.nn.functional.dropout(x_with_bias[0], p, training))

    layer.self_attn_bda = twice
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        projected, _ = layer.self_attention.linear_proj(context)
        torch.manual_seed(5)
        applied, drawn = layer.attention_residual(residual, context, mask)
        torch.manual_seed(5)
        assert torch.equal(drawn, DROPOUT(projected, 0.1, training=True))
    assert torch.equal(applied, projected * mask)


def test_a_mask_of_another_shape_is_refused(distributed):
    # [s, 1, h] would broadcast over the batch: refused, not applied.
    layer = adacc_layers(build(True, dropout=0.1))[0]
    residual, context = _attention_residual_inputs()
    with pytest.raises(RuntimeError, match=re.escape(
            f"the kept dropout mask has shape ({SEQ}, 1, {HIDDEN}), the input it should "
            f"apply to ({SEQ}, {BATCH}, {HIDDEN}): not the mask of this dropout")):
        layer.attention_residual(residual, context, _kept_mask(shape=(SEQ, 1, HIDDEN)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_fused_bias_dropout_add_rebuilds_ln2_in_bit_for_bit(distributed, dtype):
    # With bias_dropout_fusion megatron's bias-dropout-add is torch.compile'd; the rebuild's
    # call is compiled through the mask-applying mode as the forward's was (an eager
    # fallback would round the add differently), the mask retained or bitmask-held.
    stock = train(build(False, dtype, dropout=0.1, bias_dropout_fusion=True), steps=2)
    for mask in ("retain", {"action": "compress", "codec": "bitmask"}):
        model = build(True, dtype, dropout=0.1, bias_dropout_fusion=True)
        apply_plan(model, Plan.uniform({"ln2_in": "recompute", "bda1_mask": mask}),
                   strict=True)
        assert_same_training(stock, train(model, steps=2))


# --- the Llama layer's edges: RMSNorm (output, rstd, x * rstd), SwiGLU's SiLU and product ----
LLAMA_CHAINS = {
    # the MLP re-run rebuilds fc1's output (the saved gate half), then glu runs on it whole
    "glu_from_rerun": {"swiglu_in": "recompute", "swiglu_up": "recompute",
                       "swiglu_out": "recompute"},
    **{name: _in("llama", plan) for name, plan in RESIDUAL_CHAINS.items()
       if "bda1_mask" not in plan},   # no hidden dropout: no mask
    "every_operator": {name: "recompute" for name in LLAMA_PRODUCTS},
    "everything": {name: "recompute" for name in LLAMA_PRODUCTS + [
        "qkv", "context", "ln2_in", "swiglu_in"]},
}


def test_the_llama_layer_offers_its_norm_and_swiglu_edges():
    assert set(LLAMA_PRODUCTS) == {"ln1_out", "ln1_stats", "ln1_normed", "ln2_in", "ln2_out",
                                   "ln2_stats", "ln2_normed", "swiglu_act", "swiglu_up",
                                   "swiglu_out"}
    assert set(PRODUCTS) == {"ln1_out", "ln1_stats", "ln2_in", "ln2_out", "ln2_stats",
                             "gelu_out"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["unfused", "flash"])
def test_every_llama_edge_and_chain_trains_bit_for_bit(distributed, dtype, backend):
    stock = train_steps(build_llama(False, dtype, backend), steps=2)
    plans = {**{product: {product: "recompute"} for product in LLAMA_PRODUCTS},
             **LLAMA_CHAINS}
    for name, sites in plans.items():
        model = build_llama(True, dtype, backend)
        try:
            assert_same_training(stock, train_steps(model, steps=2, plan=Plan.uniform(sites)))
        except AssertionError as exc:
            raise AssertionError(f"{backend} {dtype}, plan {name}: {exc}") from None


@pytest.mark.parametrize("product", LLAMA_PRODUCTS)
def test_a_llama_operator_rebuild_runs_only_its_operator(distributed, product):
    edge = REBUILT_BY[product]
    model = build_llama(True, torch.bfloat16)
    apply_plan(model, Plan.uniform({product: "recompute"}), strict=True)
    own = OWN_MODULES.get(edge.call, ())
    calls = _calls_in_backward(model, MATMULS + ("input_layernorm", "pre_mlp_layernorm"))
    assert calls == {name: (2 if name in own else 0) for name in calls}, product


def test_llama_operator_products_keep_no_bytes(distributed):
    stock = build_llama(True)
    _, kept = measure_step(stock, lambda: loss_of(stock), strict=True)
    model = build_llama(True)
    apply_plan(model, Plan.uniform(LLAMA_CHAINS["every_operator"]), strict=True)
    _, report = measure_step(model, lambda: loss_of(model), strict=True)
    assert not {site for (_, site) in report.by_site} & set(LLAMA_PRODUCTS)
    assert kept.after_forward_bytes - report.after_forward_bytes == sum(
        nbytes for (layer, site), nbytes in kept.by_site.items()
        if layer >= 0 and site in LLAMA_PRODUCTS)


def test_glu_reads_a_compressed_fc1_output_whole(distributed):
    # A lossy plan: the SwiGLU's three products are rebuilt from the decoded fc1 output, both
    # halves of it (the up half is not the saved view); the forward is untouched and the
    # gradients stay close. fc2's weight gradient reads the rebuilt product, which carries
    # both halves' int4 error (measured 0.136; reading the gate half as the up half is off by
    # far more).
    reference = build_llama(True)
    torch.manual_seed(3)
    loss_of(reference).backward()
    model = build_llama(True)
    apply_plan(model, Plan.uniform({
        "swiglu_in": {"action": "compress", "codec": "sym_int4"},
        **{name: "recompute" for name in ("swiglu_act", "swiglu_up", "swiglu_out")}}),
        strict=True)
    torch.manual_seed(3)
    loss = loss_of(model)
    assert torch.equal(loss, loss_of(reference))
    loss.backward()
    assert_gradients_close(model, reference, 0.2)
    # the linear layers stood aside only for the rebuild
    assert [type(module).__name__ for module in (model.decoder.layers[0].mlp.linear_fc1,
                                                 model.decoder.layers[0].mlp.linear_fc2)] \
        == ["ColumnParallelLinear", "RowParallelLinear"]
