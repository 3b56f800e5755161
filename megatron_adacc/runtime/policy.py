"""Applying a Plan to a whole model: each Adacc layer gets its own row of the plan."""
from __future__ import annotations

import torch

from megatron_adacc.common.plan import Plan, PlanError
from megatron_adacc.runtime.layer import AdaccTransformerLayer


def adacc_layers(model: torch.nn.Module) -> list[AdaccTransformerLayer]:
    return [m for m in model.modules() if isinstance(m, AdaccTransformerLayer)]


def apply_plan(model: torch.nn.Module, plan: Plan | None, strict: bool | None = None,
               codec_backend: str | None = None) -> None:
    """Give every AdaccTransformerLayer its decisions from `plan` (None: retain everything).

    Call between training steps, never between a forward and its backward. `strict` makes
    an unattributed saved tensor an error instead of a retained "other"; `codec_backend`
    picks the codec kernels (see codecs.BACKENDS); None leaves either as it was.
    """
    layers = adacc_layers(model)
    if not layers:
        raise PlanError(
            "the model has no Adacc layers; build it with runtime.get_adacc_layer_spec()"
        )
    plan = plan if plan is not None else Plan()
    # Layer indices are the whole model's (megatron's layer_number), on every stage.
    plan.validate_layers(layers[0].config.num_layers)
    for layer in layers:
        if strict is not None:
            layer.strict = strict
        if codec_backend is not None:
            layer.codec_backend = codec_backend
        layer.set_decisions(plan.for_layer(layer.layer_index))
