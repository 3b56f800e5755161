"""``ModelCosts`` of a shape on a named accelerator: memory exact, time on a roofline.

- A site's rebuild time is the forward's ops from its segment's start up to its save. Matmuls
  run at the accelerator's ``matmul_efficiency`` of peak FLOP/s; other ops at
  ``BANDWIDTH_EFFICIENCY`` of peak bandwidth for the bytes they move. An operator-rebuilt site
  costs its operator instead.
- Codec payloads are the codecs' own counts; codec time is the bytes a codec moves at
  ``CODEC_EFFICIENCY`` of peak bandwidth.
- Static memory and the optimizer step's bytes follow from the parameter count, precision
  and ZeRO stage.
- ``pipeline_costs`` cuts the model into 1F1B stages.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from megatron_adacc import codecs
from megatron_adacc.common import sites as site_table
from megatron_adacc.common.costs import CodecCost, ModelCosts, Operator, SiteCost
from megatron_adacc.planning.analytic.accelerators import (BANDWIDTH_EFFICIENCY, CODEC_EFFICIENCY,
                                                           OUTLIER_CHANNEL_FRACTION, Accelerator,
                                                           get_accelerator)
from megatron_adacc.planning.analytic.shape import ModelShape
from megatron_adacc.planning.analytic.sites import (dims_of, layer_sites,
                                                    backward_workspace_bytes,
                                                    embedding_activation_bytes,
                                                    output_activation_bytes,
                                                    shared_activation_bytes)
from megatron_adacc.planning.pipeline import StageMemory, stage_costs, stage_layer_counts


# --- static memory ------------------------------------------------------------------------
# Bytes per parameter of weights, gradients and Adam(W) states, as megatron's engine holds
# them (model_static_bytes): fp16 keeps 16-bit weights and gradients and fp32 master weights,
# m and v (2 + 2 + 12 = 16, as in the paper); bf16 the same but for fp32 gradients, which
# Megatron-LM always accumulates and reduces bf16 in (2 + 4 + 12); fp32 keeps 4 + 4 + 8.
_STATE_BYTES = {"fp16": (2, 2, 12), "bf16": (2, 4, 12), "fp32": (4, 4, 8)}


def _parameters_held(num_parameters: int, zero_stage: int, data_parallel_size: int,
                     sharded_from: int) -> int:
    """How many of ``num_parameters`` a rank holds of a part ZeRO shards from stage
    ``sharded_from`` on: ceil(N / D) once sharded (megatron pads its buffers to a multiple of
    D and gives each rank an equal range), all N before."""
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {zero_stage}")
    if data_parallel_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {data_parallel_size}")
    if zero_stage >= sharded_from:
        return -(-num_parameters // data_parallel_size)
    return num_parameters


def static_bytes(num_parameters: int, precision: str, zero_stage: int = 0,
                 data_parallel_size: int = 1) -> int:
    """Weights + gradients + optimizer states one rank holds for ``num_parameters``.

    ZeRO stage 1 (Megatron's ``--use-distributed-optimizer``) shards the optimizer states
    over the data-parallel group, stage 2 the gradients too, stage 3 the weights too.
    """
    weights, grads, optimizer = _STATE_BYTES[precision]
    return sum(per_parameter * _parameters_held(num_parameters, zero_stage,
                                                data_parallel_size, stage)
               for per_parameter, stage in ((weights, 3), (grads, 2), (optimizer, 1)))


def step_bytes(num_parameters: int, precision: str, zero_stage: int = 0,
               data_parallel_size: int = 1, foreach_adam: bool = False) -> int:
    """What the optimizer step adds for ``num_parameters`` (ModelCosts.optimizer_step_bytes).

    - with fp16, an fp32 copy of the gradient of each main parameter the rank steps (sharded
      with the optimizer states); Megatron-LM accumulates bf16 gradients in fp32, no copy;
    - with ``foreach_adam`` (torch's AdamW on a GPU), its workspace: fp32 like each of those
      main parameters (``engine_memory.adam_workspace_bytes``)."""
    stepped = _parameters_held(num_parameters, zero_stage, data_parallel_size, 1)
    return 4 * stepped * ((precision == "fp16") + foreach_adam)


# torch's Adam(W) state per stepped tensor: exp_avg and exp_avg_sq like the tensor, and a


# --- codecs ----------------------------------------------------------------------------------
def outlier_capacity(codec: str, channels: int) -> int | None:
    """The exact channels the analytic model gives an outlier-separating codec
    (``OUTLIER_CHANNEL_FRACTION`` of the channels); None for the other codecs."""
    return (int(round(channels * OUTLIER_CHANNEL_FRACTION)) if codecs.get(codec).separates_outliers
            else None)


def codec_payload_bytes(codec: str, elements: int, dtype: str, channels: int) -> int:
    """Bytes a codec keeps for a tensor of `elements` elements of `dtype` (a torch dtype
    name) in rows of `channels`, as the codec itself counts them; the outlier codec at its
    capacity ``outlier_capacity``."""
    return codecs.get(codec).payload_bytes((elements // channels, channels), getattr(torch, dtype),
                                           outlier_capacity(codec, channels) or 0)


def codec_cost(codec: str, full: int, payload: int, bandwidth: float,
                capacity: int | None = None) -> CodecCost:
    rate = bandwidth * CODEC_EFFICIENCY
    # Encode reads the tensor and writes the payload; a codec that separates outliers first
    # reads it once more for the per-channel sums. Decode reads the payload and writes the
    # tensor.
    extra_pass = full if codecs.get(codec).separates_outliers else 0
    return CodecCost(codec=codec, payload_bytes=payload,
                     encode_s=(full + payload + extra_pass) / rate,
                     decode_s=(payload + full) / rate, capacity=capacity)


def analytic_costs(shape: ModelShape, micro_batch_size: int, accelerator: str | Accelerator,
                   zero_stage: int = 0, data_parallel_size: int = 1) -> ModelCosts:
    """``ModelCosts`` for ``shape`` at ``micro_batch_size`` on a named accelerator, the whole
    model on one stage."""
    return pipeline_costs(shape, micro_batch_size, accelerator, 1, 1, zero_stage,
                          data_parallel_size)[0]


def pipeline_costs(shape: ModelShape, micro_batch_size: int, accelerator: str | Accelerator,
                   pipeline_size: int, num_micro_batches: int, zero_stage: int = 0,
                   data_parallel_size: int = 1) -> list[ModelCosts]:
    """``ModelCosts`` of each of ``pipeline_size`` stages under 1F1B, ``num_micro_batches`` a step.

    Every stage holds its share of the layers and their parameters. The first holds the
    embedding (parameters and activations), the last the output layer and loss. Optimizer states
    are sharded by ``zero_stage`` over ``data_parallel_size`` ranks. ``planning.stage_costs``
    cuts the stages from one layer's costs and what each stage holds besides, as for a
    profile."""
    device = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    if shape.precision == "bf16" and not device.supports_bf16:
        raise ValueError(f"{device.name} has no bfloat16; plan with fp16")
    pipelined = pipeline_size > 1
    counts = stage_layer_counts(shape.num_layers, pipeline_size)
    parameters = [layers * shape.layer_parameters
                  + (shape.embedding_parameters if stage == 0 else 0)
                  + (shape.output_parameters(pipelined) if stage == pipeline_size - 1 else 0)
                  for stage, layers in enumerate(counts)]
    shared = shared_activation_bytes(shape, micro_batch_size)
    memory = [StageMemory(
        static_bytes=static_bytes(count, shape.precision, zero_stage, data_parallel_size),
        optimizer_step_bytes=step_bytes(count, shape.precision, zero_stage, data_parallel_size,
                                        shape.foreach_adam),
        embedding_bytes=embedding_activation_bytes(shape, micro_batch_size) if stage == 0 else 0,
        non_layer_bytes=shared + (output_activation_bytes(shape, micro_batch_size)
                                  if stage == pipeline_size - 1 else 0),
        held_non_layer_bytes=shared)
        for stage, count in enumerate(parameters)]
    sites, operators = _site_costs(shape, micro_batch_size, device)
    layer_costs = ModelCosts(
        sites=sites,
        operators=operators,
        num_layers=shape.num_layers,
        static_bytes=0,  # each stage's: StageMemory
        non_layer_bytes=0,
        backward_workspace_bytes=backward_workspace_bytes(shape, micro_batch_size),
        micro_batch_size=micro_batch_size,
        # The runtime's hooks are host code, a few hundred microseconds a layer (profiled on
        # a CPU), run while the accelerator works through the layer's kernels: hidden, as
        # the roofline has the host hidden everywhere else.
        hooked_layer_s=0.0,
        meta={
            "source": "analytic",
            "accelerator": device.name,
            "capacity_bytes": device.capacity_bytes,
            "shape": {k: v for k, v in shape.__dict__.items()},
            "zero_stage": zero_stage,
            "data_parallel_size": data_parallel_size,
            "matmul_efficiency": device.matmul_efficiency,
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
            "codec_efficiency": CODEC_EFFICIENCY,
        },
    )
    stages = stage_costs(layer_costs, memory, shape.num_layers, num_micro_batches)
    return [replace(costs, meta={**costs.meta, "num_parameters": count})
            for costs, count in zip(stages, parameters)]


def _site_costs(shape: ModelShape, micro_batch_size: int, device: Accelerator
                ) -> tuple[list[SiteCost], tuple[Operator, ...]]:
    """Every site of one layer (its bytes, rebuild time and codec cost on ``device``) and the
    operators that rebuild some of them."""
    d = dims_of(shape, micro_batch_size)
    flop_rate = device.matmul_flops(shape.activation_bytes) * device.matmul_efficiency
    byte_rate = device.memory_bandwidth * BANDWIDTH_EFFICIENCY
    formulas = layer_sites(shape)
    # the forward's time from the previous save to each one
    step_s = {name: formula.flops(d) / flop_rate + formula.bytes_moved(d) / byte_rate
              for name, formula in formulas.items()}
    order = list(formulas)
    operators = []
    for edge in site_table.REBUILDS:
        if edge.used_by(formulas):
            sources = edge.sources_in(formulas)
            # A mask is drawn inside the op its edge replays (the dropout, whose mask the
            # edge reads where forward wrote it): the edge runs from its other sources.
            after = max(order.index(source) for source in sources
                        if not site_table.get(source).is_mask) + 1
            operators.append(Operator(edge.call, sources, sum(
                step_s[name] for name in order[after:order.index(edge.output) + 1])))
    operator_names = {operator.name for operator in operators}
    sites = []
    since_start: dict[str, float] = {}   # segment -> forward time up to the last save so far
    for name, formula in formulas.items():
        known = site_table.get(name)
        rebuild_s = 0.0
        if known.segment is not None:
            rebuild_s = since_start.get(known.segment, 0.0) + step_s[name]
            since_start[known.segment] = rebuild_s
        if known.shared:  # non-layer memory (shared_activation_bytes); its forward time
            continue      # counts toward the sites after it
        full, dtype = formula.bytes(d), formula.dtype(d)
        site_codecs = ()
        if known.default_codec is not None:
            encoded = formula.encoded_elements(d)
            payload = codec_payload_bytes(known.default_codec, encoded, dtype,
                                          formula.channels(d))
            site_codecs = (codec_cost(known.default_codec, encoded * formula.element_bytes(d),
                                  payload, device.memory_bandwidth,
                                  outlier_capacity(known.default_codec, formula.channels(d))),)
        edge = site_table.REBUILT_BY.get(name)
        operator = edge.call if edge is not None and edge.call in operator_names else None
        sites.append(SiteCost(
            name=name,
            bytes=full,
            dtype=dtype,
            rebuild_s=0.0 if operator else rebuild_s,
            segment=None if operator else known.segment,
            codecs=site_codecs,
            operator=operator,
        ))
    return sites, tuple(operators)
