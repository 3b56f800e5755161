"""The analytic accelerator model: a GPT's ``ModelCosts`` on a named GPU, so it plans on a laptop.

- ``accelerators``: the GPU table and the efficiency assumptions;
- ``shape``: ``ModelShape``, a GPT as Megatron-LM's flags describe it;
- ``sites``: one layer's sites as formulas of the shape;
- ``costs``: sites, codecs, static memory and pipeline stages priced on an accelerator.
"""
from megatron_adacc.planning.analytic.accelerators import (ACCELERATORS, BANDWIDTH_EFFICIENCY,
                                                           CODEC_EFFICIENCY,
                                                           DEFAULT_RESERVED_BYTES,
                                                           MATMUL_EFFICIENCY,
                                                           OUTLIER_CHANNEL_FRACTION, Accelerator,
                                                           get_accelerator)
from megatron_adacc.planning.analytic.costs import (analytic_costs, codec_cost,
                                                    codec_payload_bytes, outlier_capacity,
                                                    pipeline_costs, static_bytes, step_bytes)
from megatron_adacc.planning.analytic.shape import ModelShape
from megatron_adacc.planning.analytic.sites import (backward_workspace_bytes,
                                                    embedding_activation_bytes,
                                                    output_activation_bytes,
                                                    shared_activation_bytes, site_bytes)

__all__ = ["ACCELERATORS", "BANDWIDTH_EFFICIENCY", "CODEC_EFFICIENCY", "DEFAULT_RESERVED_BYTES",
           "MATMUL_EFFICIENCY", "OUTLIER_CHANNEL_FRACTION", "Accelerator", "ModelShape",
           "analytic_costs", "backward_workspace_bytes", "codec_cost", "codec_payload_bytes",
           "embedding_activation_bytes", "get_accelerator", "outlier_capacity",
           "output_activation_bytes", "pipeline_costs", "shared_activation_bytes", "site_bytes",
           "static_bytes", "step_bytes"]
