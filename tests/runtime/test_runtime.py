"""Retain and recompute through the Adacc layer are bitwise identical to the stock
megatron-core layer; attribution covers every saved tensor (strict mode)."""
import pytest
import torch
from megatron.core import tensor_parallel

from megatron_adacc.common.plan import Plan, PlanError
from megatron_adacc.models import build as model_lib
from megatron_adacc.runtime import (
    AdaccTransformerLayer,
    UnknownSiteError,
    adacc_layers,
    apply_plan,
    measure_step,
)
from megatron_adacc.common.sites import SHARED_SITES, SITE_NAMES
from megatron_adacc.runtime.accounting import NON_LAYER
from megatron_adacc.runtime.storage import is_parameter

from helpers.runtime import PLANS, RECOMPUTABLE, assert_same_training, build, loss_of, train



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_retain_and_recompute_match_stock_layer_bitwise(distributed, dtype, dropout, bias):
    stock = train(build(False, dtype, dropout, bias), steps=3)
    for name, plan in PLANS.items():
        model = build(True, dtype, dropout, bias)
        apply_plan(model, plan, strict=True)
        try:
            assert_same_training(stock, train(model, steps=3))
        except AssertionError as exc:
            raise AssertionError(f"plan {name}: {exc}") from None


def test_plans_swap_between_steps_without_changing_the_result(distributed):
    plans = list(PLANS.values())
    stock = train(build(False, dropout=0.1), steps=4)
    swapped = train(build(True, dropout=0.1), steps=4, plan_for_step=lambda s: plans[s])
    assert_same_training(stock, swapped)


def test_each_site_recomputed_alone_is_exact_and_saves_its_bytes(distributed):
    stock = build(False, dropout=0.1)
    torch.manual_seed(5)
    stock_loss, stock_report = measure_step(stock, lambda: loss_of(stock), strict=True)
    reference = {n: p.grad for n, p in stock.named_parameters()}
    for site in RECOMPUTABLE:
        model = build(True, dropout=0.1)
        apply_plan(model, Plan.uniform({site: "recompute"}))
        torch.manual_seed(5)
        loss, report = measure_step(model, lambda: loss_of(model), strict=True)
        assert torch.equal(loss, stock_loss), site
        for name, param in model.named_parameters():
            assert torch.equal(param.grad, reference[name]), f"{site}: {name}"
        for layer in (0, 1):
            assert (layer, site) not in report.by_site or site == "attn_mask"
        assert report.after_forward_bytes < stock_report.after_forward_bytes, site


def test_every_saved_tensor_is_attributed_to_a_known_site(distributed):
    for dtype, dropout in [(torch.float32, 0.1), (torch.bfloat16, 0.0)]:
        model = build(True, dtype, dropout)
        _, report = measure_step(model, lambda: loss_of(model), strict=True)
        layer_sites = {site for (layer, site) in report.by_site if layer >= 0}
        assert layer_sites <= set(SITE_NAMES)
        assert {"layer_in", "qkv", "softmax_out", "gelu_in", "gelu_out"} <= layer_sites
        assert ("attn_dropout_mask" in layer_sites) == (dropout > 0)


def _save_an_unknown_tensor(layer):
    # A layer-level op whose saved input needs a gradient: no site rule covers it.
    original = layer.self_attn_bda

    def patched(training, fused):
        bda = original(training, fused)
        return lambda out_bias, residual, p: bda((out_bias[0] * out_bias[0], out_bias[1]),
                                                 residual, p)

    layer.self_attn_bda = patched


def test_strict_mode_raises_on_an_unknown_saved_tensor(distributed):
    model = build(True)
    _save_an_unknown_tensor(adacc_layers(model)[0])
    # All-retain runs hook-free, so only a ruler attributes its saves, with the layer's
    # strictness; a layer with decisions attributes them itself.
    loss_of(model).backward()
    with pytest.raises(UnknownSiteError, match="layer 0"):
        measure_step(model, lambda: loss_of(model), strict=False)
    apply_plan(model, Plan.uniform({"gelu_in": "recompute"}))
    with pytest.raises(UnknownSiteError, match="layer 0"):
        loss_of(model)


def test_unknown_sites_are_retained_outside_strict_mode(distributed):
    stock, model = build(False), build(True)
    _save_an_unknown_tensor(stock.decoder.layers[0])
    _save_an_unknown_tensor(adacc_layers(model)[0])
    apply_plan(model, Plan.uniform({s: "recompute" for s in RECOMPUTABLE}), strict=False)
    assert_same_training(train(stock, 2), train(model, 2))


def test_adacc_spec_builds_adacc_layers_and_apply_plan_sets_per_layer_decisions(distributed):
    model = build(True)
    layers = adacc_layers(model)
    assert [type(layer) for layer in layers] == [AdaccTransformerLayer] * 2
    apply_plan(model, PLANS["mixed"])
    assert layers[0].actions["softmax_out"][0] == "recompute"
    assert "softmax_out" not in layers[1].actions and "context" in layers[1].actions
    apply_plan(model, None)
    assert all(not layer.actions for layer in layers)


def test_apply_plan_rejects_layers_outside_the_model_and_stock_models(distributed):
    with pytest.raises(PlanError, match="outside the model's 2 layers"):
        apply_plan(build(True),
                   Plan.from_dict({"layers": {"2-3": {"sites": {"qkv": "recompute"}}}}))
    with pytest.raises(PlanError, match="no Adacc layers"):
        apply_plan(build(False), Plan())


@pytest.mark.parametrize("attention_backend", ["unfused", "flash"])
def test_a_layer_run_under_its_hooks_with_nothing_to_act_on_trains_as_the_stock_layer(
        distributed, monkeypatch, attention_backend):
    """What the profiler times as the hooks' own cost (costs.hooked_layer_s): every layer
    forward enters the runtime's saved-tensor hooks, and training is the stock model's bit
    for bit."""
    entered = []
    hooks = torch.autograd.graph.saved_tensors_hooks

    def counted(pack, unpack):
        entered.append(pack)
        return hooks(pack, unpack)

    dropout = 0.0 if attention_backend == "flash" else 0.1
    stock = train(build(False, dropout=dropout, attention_backend=attention_backend), steps=3)
    model = build(True, dropout=dropout, attention_backend=attention_backend)
    for layer in adacc_layers(model):
        layer.force_hooks = True
    monkeypatch.setattr(torch.autograd.graph, "saved_tensors_hooks", counted)
    assert_same_training(stock, train(model, steps=3))
    assert len(entered) == 3 * len(adacc_layers(model))


def _counting_checkpoints(monkeypatch) -> list:
    """The calls of megatron-core's checkpoint function from now on: one per layer forward."""
    calls = []
    original = tensor_parallel.random.CheckpointFunction.apply
    monkeypatch.setattr(tensor_parallel.random.CheckpointFunction, "apply",
                        lambda *args: calls.append(args) or original(*args))
    return calls


def test_a_layer_recomputing_all_it_saves_runs_as_megatrons_full_recompute(distributed,
                                                                           monkeypatch):
    """After one forward under its hooks has shown what the layer saves: megatron-core's
    checkpoint keeps the layer's input, the same bytes at the same peak, and no hook runs.
    One site retained keeps the layer under its hooks."""
    checkpoints = _counting_checkpoints(monkeypatch)
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS["recompute_all"], strict=True)
    hooked = measure_step(model, lambda: loss_of(model), strict=True)[1]
    assert not checkpoints
    checkpointed = measure_step(model, lambda: loss_of(model), strict=True)[1]
    assert len(checkpoints) == 2
    own = {key: nbytes for key, nbytes in checkpointed.by_site.items()
           if key[0] != NON_LAYER and key[1] not in SHARED_SITES}
    assert own == {(0, "layer_in"): 16384, (1, "layer_in"): 16384}
    assert own == {key: nbytes for key, nbytes in hooked.by_site.items()
                   if key[0] != NON_LAYER and key[1] not in SHARED_SITES}
    assert checkpointed.peak_bytes == hooked.peak_bytes
    apply_plan(model, Plan.uniform({s: "recompute" for s in RECOMPUTABLE if s != "gelu_out"}))
    report = measure_step(model, lambda: loss_of(model), strict=True)[1]
    assert len(checkpoints) == 2
    assert {site for layer, site in report.by_site
            if layer == 0 and site not in SHARED_SITES} == {"layer_in", "gelu_out"}


def test_micro_batches_in_flight_under_the_hooks_and_the_checkpoint_train_as_stock(
        distributed, monkeypatch):
    """The first micro-batch's forward runs under the hooks and the second's under the
    checkpoint, before either backward (a pipeline's 1F1B warm-up)."""
    def gradients(model):
        model_lib.set_seed(3)
        losses = [loss_of(model, seed) for seed in (0, 1)]
        for loss in reversed(losses):
            loss.backward()
        return {name: param.grad for name, param in model.named_parameters()}

    checkpoints = _counting_checkpoints(monkeypatch)
    expected = gradients(build(False, dropout=0.1))
    model = build(True, dropout=0.1)
    apply_plan(model, PLANS["recompute_all"], strict=True)
    got = gradients(model)
    assert len(checkpoints) == 2
    for name, grad in expected.items():
        assert torch.equal(got[name], grad), name


def test_the_saves_parameter_check_is_isinstances():
    class Buffer(torch.nn.Parameter):
        pass

    marked = torch.ones(2)
    marked._is_param = True  # how torch.func marks a plain tensor as a parameter
    for tensor in (torch.ones(2), torch.nn.Parameter(torch.ones(2)), Buffer(torch.ones(2)),
                   marked, torch.ones(2, requires_grad=True)[1:]):
        assert is_parameter(tensor) == isinstance(tensor, torch.nn.Parameter)
