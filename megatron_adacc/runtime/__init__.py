"""The policy runtime: it applies a Plan in every transformer layer and measures what it keeps.

    spec = get_adacc_layer_spec()                  # build the GPTModel with it
    apply_plan(model, Plan.load("plan.yaml"))      # between steps, any time
    with ActivationRuler(model) as ruler: ...      # or measure_step(model, loss_fn)
"""
from megatron_adacc.runtime.accounting import (
    ActivationReport,
    ActivationRuler,
    measure_step,
)
from megatron_adacc.runtime.attribution import UnknownSiteError
from megatron_adacc.runtime.layer import AdaccTransformerLayer, get_adacc_layer_spec
from megatron_adacc.runtime.policy import adacc_layers, apply_plan

__all__ = [
    "ActivationReport",
    "ActivationRuler",
    "AdaccTransformerLayer",
    "UnknownSiteError",
    "adacc_layers",
    "apply_plan",
    "get_adacc_layer_spec",
    "measure_step",
]
