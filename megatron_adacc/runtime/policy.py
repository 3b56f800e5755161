"""Applying a Plan to a whole model: each Adacc layer gets its own row of the plan."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from megatron_adacc.common.plan import Plan, PlanError
from megatron_adacc.common.sites import COMPRESS
from megatron_adacc.runtime.layer import AdaccTransformerLayer

# Wraps each codec apply_plan installs; None in training. Tests set it (wrapped_codecs) to
# make codecs behave otherwise, e.g. slower, everywhere the runtime and the profiler run them.
_codec_wrapper: Callable[[object], object] | None = None


@contextlib.contextmanager
def wrapped_codecs(wrap: Callable[[object], object]) -> Iterator[None]:
    """For tests: every codec ``apply_plan`` installs inside the block is ``wrap(codec)``.

    A wrapper has the codec's ``encode``/``decode``. Plans applied before the block keep theirs."""
    global _codec_wrapper
    before, _codec_wrapper = _codec_wrapper, wrap
    try:
        yield
    finally:
        _codec_wrapper = before


def adacc_layers(model: torch.nn.Module) -> list[AdaccTransformerLayer]:
    return [m for m in model.modules() if isinstance(m, AdaccTransformerLayer)]


def apply_plan(model: torch.nn.Module, plan: Plan | None, strict: bool | None = None,
               codec_backend: str | None = None) -> None:
    """Give every AdaccTransformerLayer its decisions from ``plan`` (None: retain everything).

    Call it between training steps, never between a forward and its backward.

    Args:
        strict: an unattributed saved tensor is an error instead of a retained "other".
        codec_backend: picks the codec kernels (see codecs.BACKENDS).
    None leaves either as it was.
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
        if _codec_wrapper is not None:
            layer.actions = {site: (action, _codec_wrapper(codec) if action == COMPRESS
                                    else codec)
                             for site, (action, codec) in layer.actions.items()}
