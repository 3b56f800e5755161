"""Synthetic costs and a rectifier planned tight on them, for decisions without a model."""
from megatron_adacc import planning
from megatron_adacc.common.costs import CodecCost, ModelCosts, SiteCost
from megatron_adacc.common.sites import COMPRESS
from megatron_adacc.rectifier import Rectifier

# Layers, a site's bytes, its outlier_int4 payload's bytes.
LAYERS, FULL, PAYLOAD = 8, 4000, 600


def synthetic_costs() -> ModelCosts:
    """Eight layers of two outlier-separated sites: compressing gelu_in is cheaper than
    recomputing it, gelu_out is cheap to recompute."""
    def site(name, rebuild_s, codec_s):
        return SiteCost(name, FULL, "float32", rebuild_s, "mlp",
                        codecs=(CodecCost("outlier_int4", PAYLOAD, codec_s, codec_s),))
    return ModelCosts(sites=[site("gelu_in", 4e-3, 5e-4), site("gelu_out", 1e-3, 1e-3)],
                      num_layers=LAYERS, static_bytes=0, non_layer_bytes=0,
                      backward_workspace_bytes=0, micro_batch_size=1)


def tight_rectifier(slack_per_layer: int, costs: ModelCosts | None = None) -> Rectifier:
    """A rectifier on a budget that just compresses gelu_in, plus ``slack_per_layer`` a layer."""
    costs = synthetic_costs() if costs is None else costs
    for budget in range(LAYERS * FULL, 0, -LAYERS * 100):   # tighten until gelu_in compresses
        first = planning.plan(costs, budget)
        if any(d["gelu_in"].action == COMPRESS for d in first.layer_decisions):
            break
    budget = first.peak_bytes + LAYERS * slack_per_layer
    return Rectifier(costs, planning.plan(costs, budget), budget)
