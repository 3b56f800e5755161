"""The named sites: kinds of tensor a transformer layer saves for backward.

A site is the unit of every decision (retain, compress, recompute). This table is the
vocabulary shared by the runtime (which attributes saved tensors to sites), the profiler
(which measures them) and the planner (which decides for them). The runtime discovers what a
layer really saves; this table says what each discovered site *is*: which codec suits it and
whether it can be rebuilt.
"""
from __future__ import annotations

from dataclasses import dataclass

RETAIN = "retain"
COMPRESS = "compress"
RECOMPUTE = "recompute"
ACTIONS = (RETAIN, COMPRESS, RECOMPUTE)


@dataclass(frozen=True)
class Site:
    name: str
    description: str
    default_codec: str
    recomputable: bool = True


_SITE_LIST = (
    Site("layer_in", "layer input, the checkpoint everything else is rebuilt from",
         "outlier_int4", recomputable=False),
    Site("ln1_out", "input layernorm output, saved by linear_qkv", "outlier_int4"),
    Site("qkv", "query, key and value: views of one storage, decided as one unit", "channel_int4"),
    Site("attn_mask", "attention mask: the causal mask the masked fill saves (megatron caches "
         "it, one storage for every layer), or the mask type megatron's core-attention "
         "checkpoint saves", "bitmask"),
    Site("softmax_out", "attention probabilities saved by the softmax backward", "asym_int4"),
    Site("attn_dropout_mask", "attention dropout mask", "bitmask"),
    Site("attn_probs", "probabilities after dropout, saved by the matmul with V", "asym_int4"),
    Site("context", "attention output, saved by linear_proj", "outlier_int4"),
    Site("bda1_mask", "dropout mask of the attention bias-dropout-add", "bitmask"),
    Site("ln2_in", "residual stream after attention, saved by pre_mlp_layernorm", "outlier_int4"),
    Site("ln2_out", "pre-MLP layernorm output, saved by linear_fc1", "outlier_int4"),
    Site("gelu_in", "fc1 output, saved by the activation function", "outlier_int4"),
    Site("gelu_out", "activation output, saved by linear_fc2", "outlier_int4"),
    Site("bda2_mask", "dropout mask of the MLP bias-dropout-add", "bitmask"),
    Site("ln1_stats", "input layernorm mean and rstd", "outlier_int4"),
    Site("ln2_stats", "pre-MLP layernorm mean and rstd", "outlier_int4"),
)

SITES: dict[str, Site] = {site.name: site for site in _SITE_LIST}
SITE_NAMES: tuple[str, ...] = tuple(SITES)


def get(name: str) -> Site:
    try:
        return SITES[name]
    except KeyError:
        raise KeyError(
            f"unknown site {name!r}; valid sites: {', '.join(SITE_NAMES)}"
        ) from None
