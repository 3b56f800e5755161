"""What a model family is: a small declarative unit, so the next family is added by
substitution rather than by conditionals spread across modules.

A family names the layer variant it trains (`LayerVariant`: its normalisation, its MLP, its
positions, grouped-query attention, biases, tied embeddings) as Megatron-LM's flags
(`ModelFamily.flags`), and each part of the variant says what the layer saves:

- `MlpPart`: the sites of what the MLP saves (attribution asks it, `runtime/attribution.py`);
- `NormPart`: whether the norm saves its normalised input besides its input and statistics;
- the analytic accelerator model (`hardware.py`) composes its site table per part and
  takes the parts' site names and statistics from here.

The layer is megatron-core's local spec in every family (WrappedTorchNorm reads
`config.normalization`, the MLP `config.gated_linear_unit`), so megatron's forward is never
copied; the recompute segments are megatron's two (sites.SEGMENTS) in both
families. `mlp_part(config)` reads a built TransformerConfig's MLP, in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


@dataclass(frozen=True)
class NormPart:
    """A normalisation (megatron's ``config.normalization``) and what it saves: always its
    input (in 16-bit models torch's RMSNorm saves an fp32 copy instead) and one statistic per
    row; RMSNorm also its normalised input x * rstd, in fp32."""
    name: str
    saves_normed: bool
    statistics_per_row: int  # LayerNorm: mean and rstd; RMSNorm: rstd


@dataclass(frozen=True)
class MlpPart:
    """An MLP's activation and the sites of what it saves.

    ``fc1_out``: the site of linear_fc1's output, which the activation saves (for a gated
    unit, as the gate half: a view pinning the whole [s, b, 2 x ffn] output);
    ``activation_saves``: what else the activation saves, by the autograd node that made the
    tensor (a gated unit saves the SiLU's output and the up half plus its offset, a copy);
    ``fc2_in``: the site of what linear_fc2 saves (the activation's output)."""
    name: str
    gated: bool
    fc1_out: str
    fc2_in: str
    activation_saves: Mapping[str, str] = field(default_factory=dict)

    def activation_site(self, tensor) -> str | None:
        """The site of a tensor the activation saves: a view is of fc1's output (the gate
        half); anything else is named by the node that made it (GELU saves nothing but its
        input)."""
        if tensor._base is not None or not self.activation_saves:
            return self.fc1_out
        node = tensor.grad_fn
        return self.activation_saves.get(type(node).__name__) if node is not None else None


@dataclass(frozen=True)
class LayerVariant:
    norm: NormPart
    mlp: MlpPart
    rope: bool


@dataclass(frozen=True)
class ModelFamily:
    """A named family: its layer variant and the Megatron-LM flags that build it (beside the
    shape flags: layers, hidden, heads, ffn, sequence)."""
    name: str
    description: str
    variant: LayerVariant
    flags: Mapping[str, Any]

    def transformer_config_options(self, num_query_groups: int | None = None,
                                   ffn_hidden_size: int | None = None) -> dict[str, Any]:
        """The TransformerConfig fields of this family's flags (a benchmark's model, built
        without the flag parser): its parts, grouped-query attention at
        ``num_query_groups``, biases, dropouts, and the ffn (default: Megatron-LM's for the
        MLP)."""
        import types

        flags = {key.replace("-", "_"): value for key, value in self.flags.items()}
        args = types.SimpleNamespace(
            normalization=self.variant.norm.name, norm_epsilon=1e-5, sequence_parallel=False,
            swiglu=self.variant.mlp.gated,
            group_query_attention=(bool(flags.get("group_query_attention"))
                                   and bool(num_query_groups)),
            num_query_groups=num_query_groups)
        options = transformer_config_options(args)
        options["add_bias_linear"] = not flags.get("disable_bias_linear", False)
        if ffn_hidden_size is not None:
            options["ffn_hidden_size"] = ffn_hidden_size
        for dropout in ("hidden_dropout", "attention_dropout"):
            if dropout in flags:
                options[dropout] = flags[dropout]
        return options

    def argv(self, num_query_groups: int | None = None) -> list[str]:
        """The family's flags on a pretrain_gpt.py command line (grouped-query attention at
        ``num_query_groups``)."""
        argv = []
        for flag, value in self.flags.items():
            if value is True:
                argv.append(f"--{flag}")
                if flag == "group-query-attention":
                    argv += ["--num-query-groups", str(num_query_groups or 1)]
            elif value is not False:
                argv += [f"--{flag}", str(value)]
        return argv

    def embedding_options(self) -> "EmbeddingOptions":
        flags = {key.replace("-", "_"): value for key, value in self.flags.items()}
        return EmbeddingOptions(
            position_embedding_type="rope" if self.variant.rope else "learned_absolute",
            untie_embeddings_and_output_weights=bool(
                flags.get("untie_embeddings_and_output_weights", False)))

    @property
    def sites(self) -> tuple[str, ...]:
        """The per-layer sites this family's layer can save (with either attention, with or
        without dropout), in forward order: the sites every layer shares, and its parts'."""
        from megatron_adacc.common import sites as site_table

        others = set().union(*(_part_sites(family.variant) for family in FAMILIES.values()))
        own = _part_sites(self.variant)
        return tuple(name for name in site_table.SITE_NAMES
                     if (name in own or name not in others)
                     and name not in site_table.SHARED_SITES)


def _part_sites(variant: LayerVariant) -> set[str]:
    mlp = variant.mlp
    return ({mlp.fc1_out, mlp.fc2_in, *mlp.activation_saves.values()}
            | (set(NORMED_SITES) if variant.norm.saves_normed else set()))


# Sites of the parts (names in sites.py).
NORMED_SITES = ("ln1_normed", "ln2_normed")

NORMS: dict[str, NormPart] = {}
MLPS: dict[bool, MlpPart] = {}    # by gated
FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    FAMILIES[family.name] = family
    NORMS.setdefault(family.variant.norm.name, family.variant.norm)
    MLPS.setdefault(family.variant.mlp.gated, family.variant.mlp)
    return family


def get(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def mlp_part(config) -> MlpPart:
    """The MLP part a TransformerConfig builds."""
    return MLPS[bool(config.gated_linear_unit)]


# --- from Megatron-LM's flags to megatron-core's arguments ------------------------------------
def transformer_config_options(args) -> dict[str, Any]:
    """The TransformerConfig fields the layer-variant flags set."""
    import torch.nn.functional as F

    options: dict[str, Any] = dict(normalization=args.normalization,
                                   layernorm_epsilon=args.norm_epsilon,
                                   sequence_parallel=args.sequence_parallel)
    if args.swiglu:
        options.update(gated_linear_unit=True, activation_func=F.silu)
    if args.group_query_attention:
        options.update(num_query_groups=args.num_query_groups)
    return options


@dataclass(frozen=True)
class EmbeddingOptions:
    """The GPTModel arguments of the positions and the output layer (megatron-core keeps them
    out of TransformerConfig)."""
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    untie_embeddings_and_output_weights: bool = False

    @classmethod
    def from_args(cls, args) -> "EmbeddingOptions":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def gpt_model_kwargs(self) -> dict[str, Any]:
        return dict(position_embedding_type=self.position_embedding_type,
                    rotary_base=self.rotary_base, rotary_percent=self.rotary_percent,
                    share_embeddings_and_output_weights=
                    not self.untie_embeddings_and_output_weights)


class SequenceParallelNorm:
    """megatron's WrappedTorchNorm (LayerNorm or RMSNorm from the config) under sequence
    parallelism. WrappedTorchNorm asserts under sequence parallelism, yet a norm computes
    row by row, so it runs unchanged on a sequence shard: it is built from the config without
    the flag, and its parameters are marked ``sequence_parallel`` so megatron's
    ``finalize_model_grads`` all-reduces their gradients over the tensor-parallel group
    (each rank saw only its shard of the rows)."""

    def __new__(cls, config, *args, **kwargs):
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        norm = WrappedTorchNorm(dataclasses.replace(config, sequence_parallel=False),
                                *args, **kwargs)
        for parameter in norm.parameters():
            parameter.sequence_parallel = True
        return norm
