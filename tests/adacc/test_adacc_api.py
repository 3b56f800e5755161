"""The public entry point: AdaccConfig checks its plain data, Adacc builds, plans, measures
and reports through public calls only."""
import pytest

from megatron_adacc import Adacc, AdaccConfig
from megatron_adacc.models import build as model_lib
from megatron_adacc.runtime import ActivationRuler, AdaccTransformerLayer
from helpers.runtime import adacc_batch, adacc_model
from helpers.pretrain import parse


@pytest.mark.parametrize("options, message", [
    ({"policy": "fastest"}, "--adacc-policy fastest: not one of none, auto, "
                            "auto-no-outlier, full-recompute, quantize and not a plan file"),
    ({"policy": "missing.yaml"}, "--adacc-policy missing.yaml: plan file not found (or give "
                                 "one of none, auto, auto-no-outlier, full-recompute, quantize)"),
    ({"memory_budget": "1GiB"}, "--adacc-memory-budget 1GiB has no effect with --adacc-policy "
                                "none; drop it, or plan for it with --adacc-policy auto"),
    ({"policy": "quantize", "tracking": "backoff"},
     "--adacc-tracking backoff re-plans, so it needs --adacc-policy auto (got quantize)"),
    ({"policy": "auto", "tracking": "sometimes"},
     "--adacc-tracking sometimes: expected one of backoff, off"),
    ({"policy": "auto", "memory_budget": "12 parsecs"}, "--adacc-memory-budget: "),
    ({"policy": "auto", "tracking_sites": ("gelu",)}, "--adacc-tracking-sites: unknown gelu"),
    ({"policy": "auto", "step_watch": "sometimes"},
     "--adacc-step-watch sometimes: expected one of on, off"),
    ({"policy": "auto", "tracking": "off", "step_watch": "on"},
     "--adacc-step-watch on swaps plans through the rectifier, so it needs --adacc-tracking "
     "backoff"),
    ({"policy": "auto", "guard_threshold": 0.0},
     "--adacc-tracking-reset-fraction and --adacc-guard-threshold must be positive"),
])
def test_config_refuses_bad_values_naming_the_flag(options, message):
    with pytest.raises(ValueError) as info:
        AdaccConfig(**options)
    assert str(info.value).startswith(message)


def test_config_from_flags_keeps_every_adacc_flag():
    args = parse("--adacc-policy", "auto", "--adacc-memory-budget", "3MiB",
                 "--adacc-tracking-sites", "gelu_in", "ln2_out", "--adacc-codec-backend",
                 "torch", "--adacc-strict", "--adacc-step-watch", "off",
                 "--adacc-profile-repeats", "2")
    config = AdaccConfig.from_args(args)
    assert config == AdaccConfig(policy="auto", memory_budget=3 << 20, tracking="backoff",
                                 tracking_sites=("gelu_in", "ln2_out"), codec_backend="torch",
                                 strict=True, step_watch="off", profile_repeats=2)
    assert config.tracks and not AdaccConfig(policy="auto", tracking="off").tracks
    # The step watch is on while tracking unless turned off.
    assert not config.watches and AdaccConfig(policy="auto", memory_budget=1).watches
    assert not AdaccConfig(policy="auto", memory_budget=1, tracking="off").watches
    assert not AdaccConfig(policy="full-recompute").tracks


def test_policy_none_runs_the_stock_layer_and_still_measures(distributed):
    adacc = Adacc(AdaccConfig())
    model = adacc_model(adacc)
    assert not any(isinstance(m, AdaccTransformerLayer) for m in model.modules())
    adacc.setup(model, adacc_batch(), verbose=False)
    with adacc.measure():
        model_lib.gpt_loss(model, *adacc_batch()).backward()
    assert adacc.plan is None and adacc.after_step(1) == {}
    metrics = adacc.metrics()
    assert metrics["plan_id"] == "none" and metrics["static_bytes"] > 0
    assert 0 < metrics["activation_bytes"] <= metrics["activation_peak_bytes"]


@pytest.mark.parametrize("policy", ["full-recompute", "quantize"])
def test_measure_reads_the_end_of_forward_without_being_told(distributed, policy):
    # Rebuilt and decoded values appear once backward starts: a reading taken any later than
    # the first unpack would count them.
    adacc = Adacc(AdaccConfig(policy=policy))
    model = adacc_model(adacc)
    adacc.setup(model, adacc_batch(), verbose=False)
    # Both readings from steps alike: full recompute's first step runs the rebuilds, and its
    # later ones run under megatron's checkpoint, which saves no cached causal mask.
    model_lib.gpt_loss(model, *adacc_batch()).backward()
    with adacc.measure():
        model_lib.gpt_loss(model, *adacc_batch()).backward()
    with ActivationRuler(model) as ruler:
        loss = model_lib.gpt_loss(model, *adacc_batch())
        ruler.forward_done()
        loss.backward()
    assert adacc.activation_bytes == ruler.report().after_forward_bytes > 0
    assert adacc.activation_peak_bytes == ruler.report().peak_bytes


def test_bytes_the_device_holds_beside_the_model_count_as_static(distributed, monkeypatch):
    # What a user loop's device holds beyond the model and the batch when Adacc sets up (an
    # earlier model's cuBLAS workspaces) stays through every step: static, counted once.
    from megatron_adacc.profiling import allocator, engine_memory

    static = {}
    for extra in (0, 64 << 20):
        monkeypatch.setattr(allocator, "allocated", lambda device, extra=extra: (1 << 40) + extra)
        adacc = Adacc(AdaccConfig(policy="full-recompute"))
        model = adacc_model(adacc)
        adacc.setup(model, adacc_batch(), verbose=False)
        static[extra] = adacc.static_bytes
        assert static[extra] > engine_memory.model_static_bytes(model)
    assert static[64 << 20] - static[0] == 64 << 20
