"""What a model family is: a small declarative unit, so a new family is a substitution.

No conditionals spread across modules. A family names two things:
- the layer variant it trains (``LayerVariant``: its normalisation, its MLP, its positions);
- the Megatron-LM flags that build it (``ModelFamily.flags``: the variant's, grouped-query
  attention, biases, tied embeddings).
Each part of the variant says what the layer saves and what that costs, in ``terms.py``'s
vocabulary:
- ``NormPart``: what the norm saves besides its input and statistics, its dtype, and its parameters;
- ``MlpPart``: the sites of what the MLP saves (attribution asks it), their terms, fc1's width and
  Megatron-LM's default ffn size;
- ``PositionPart``: what the positions save before core attention, what unfused attention then saves
  of Q, K and V, and the embedding's position table.

The analytic model (``planning/analytic/``) asks the parts the flags select (``layer_variant``)
for their terms; it holds only the parts every family shares. The layer is megatron-core's local
spec in every family, so megatron's forward is never copied: WrappedTorchNorm reads
``config.normalization``, the MLP ``config.gated_linear_unit``. Both families use megatron's two
recompute segments (sites.SEGMENTS) and sites.REBUILDS's edges. ``mlp_part(config)`` reads a built
TransformerConfig's MLP, in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

from megatron_adacc.common import sites as site_table
from megatron_adacc.models.terms import (INPUT_NORM, PRE_MLP_NORM, Dims, SiteTerm, act,
                                         fp32, hidden_channels, no_bytes, no_flops, stream)


@dataclass(frozen=True)
class NormPart:
    """A normalisation (megatron's ``config.normalization``) and what it saves.

    It always saves its input and one statistic per row; the next linear layer saves its output.

    Fields:
        input_dtype: the dtype its input is saved in; None: the activations'.
        saves_normed: it also saves its normalised input x * rstd, in fp32.
        parameters_per_channel: its affine parameters per hidden channel.
        fused_on_cuda: on CUDA one fused kernel runs it, saving its input as given and the
            statistics alone (input_dtype and saves_normed describe a CPU's).
    """
    name: str
    saves_normed: bool
    statistics_per_row: int
    parameters_per_channel: int
    input_dtype: str | None = None
    fused_on_cuda: bool = False

    def site_terms(self, prefix: str, input_site: str, cuda: bool = False
                   ) -> dict[str, SiteTerm]:
        """The norm's saves in forward order, its sites named by ``prefix``, on CUDA or a CPU.

        A layer's two norms use terms.INPUT_NORM and terms.PRE_MLP_NORM."""
        if cuda and self.fused_on_cuda:
            return replace(self, input_dtype=None, saves_normed=False).site_terms(prefix,
                                                                                  input_site)
        statistics = self.statistics_per_row
        input_dtype = act if self.input_dtype is None else (lambda d: self.input_dtype)
        terms = {
            input_site: SiteTerm(stream, input_dtype, no_flops, no_bytes, hidden_channels),
            # read the input, write the output
            f"{prefix}_stats": SiteTerm(lambda d: statistics * d.rows * d.batch, fp32, no_flops,
                                        lambda d: 2 * stream(d) * d.act_bytes,
                                        lambda d: statistics),
        }
        if self.saves_normed:
            terms[f"{prefix}_normed"] = SiteTerm(stream, fp32, no_flops, no_bytes,
                                                 hidden_channels)
        terms[f"{prefix}_out"] = SiteTerm(stream, act, no_flops, no_bytes, hidden_channels)
        return terms


@dataclass(frozen=True)
class MlpPart:
    """An MLP's activation, the sites of what it saves and their terms.

    Fields:
        fc1_out: the site of linear_fc1's output, which the activation saves. For a gated unit it is
            the gate half: a view pinning the whole [s, b, 2 x ffn] output.
        activation_saves: what else the activation saves, by the autograd node that made the tensor.
            A gated unit saves the SiLU's output and the up half plus its offset, a copy.
        fc2_in: the site of what linear_fc2 saves (the activation's output).
        site_terms: each of those sites' terms, in forward order. The analytic model adds fc1's
            matmul ahead of the first and fc2's after the last.
        default_ffn: Megatron-LM's ffn hidden size for a hidden size.
    """
    name: str
    gated: bool
    fc1_out: str
    fc2_in: str
    site_terms: Mapping[str, SiteTerm]
    default_ffn: Callable[[int], int]
    activation_saves: Mapping[str, str] = field(default_factory=dict)
    # megatron fuses the activation on CUDA (--bias-swiglu-fusion), saving fc1's output only.
    fuses: bool = False

    def __post_init__(self) -> None:
        order = list(self.site_terms)
        if (order[0], order[-1]) != (self.fc1_out, self.fc2_in) or set(order) != {
                self.fc1_out, self.fc2_in, *self.activation_saves.values()}:
            raise ValueError(f"MLP {self.name}: its terms must be those of its sites, from "
                             f"fc1's output to fc2's input, got {order}")

    @property
    def fc1_width(self) -> int:
        """linear_fc1's output in ffn widths: a gated unit's holds the gate and the up half."""
        return 2 if self.gated else 1

    def terms(self, fused: bool = False) -> dict[str, SiteTerm]:
        """Its site terms; ``fused`` (megatron's fused activation on CUDA): fc1's output and fc2's
        input alone, the activation's own saves' work counted toward fc2's input."""
        if not fused or not self.fuses:
            return dict(self.site_terms)
        dropped = [self.site_terms[name] for name in self.activation_saves.values()]
        last = self.site_terms[self.fc2_in]
        moved = [last.bytes_moved, *(term.bytes_moved for term in dropped)]
        flops = [last.flops, *(term.flops for term in dropped)]
        return {self.fc1_out: self.site_terms[self.fc1_out],
                self.fc2_in: replace(last, bytes_moved=lambda d: sum(f(d) for f in moved),
                                     flops=lambda d: sum(f(d) for f in flops))}

    def activation_site(self, tensor) -> str | None:
        """The site of a tensor the activation saves.

        A view is of fc1's output (the gate half). Anything else is named by the node that made
        it. GELU saves nothing but its input."""
        if tensor._base is not None or not self.activation_saves:
            return self.fc1_out
        node = tensor.grad_fn
        return self.activation_saves.get(type(node).__name__) if node is not None else None


@dataclass(frozen=True)
class PositionPart:
    """Positions (Megatron-LM's ``--position-embedding-type``, its name) and what they save.

    Fields:
        learned: the positions are a table in the embedding.
        site_terms: what the layer saves for them between linear_qkv and core attention, in forward
            order.
        unfused_qkv_heads: how many [s, b, head dim] tensors megatron's unfused core attention keeps
            alive for its Q, K and V (the site ``qkv``) once these positions are applied.
    """
    name: str
    learned: bool
    site_terms: Mapping[str, SiteTerm]
    unfused_qkv_heads: Callable[[Dims], int]

    def table_rows(self, max_position_embeddings: int) -> int:
        """Rows of the embedding's position table."""
        return max_position_embeddings if self.learned else 0


@dataclass(frozen=True)
class LayerVariant:
    norm: NormPart
    mlp: MlpPart
    positions: PositionPart

    def sites(self) -> set[str]:
        """Every site the parts save in a layer."""
        return {*self.norm.site_terms(*INPUT_NORM), *self.norm.site_terms(*PRE_MLP_NORM),
                *self.positions.site_terms, *self.mlp.site_terms}


@dataclass(frozen=True)
class ModelFamily:
    """A named family: its layer variant and the Megatron-LM flags that build it.

    Those flags come beside the shape flags: layers, hidden, heads, ffn, sequence."""
    name: str
    description: str
    variant: LayerVariant
    flags: Mapping[str, Any]

    def transformer_config_options(self, hidden_size: int, num_query_groups: int | None = None,
                                   ffn_hidden_size: int | None = None) -> dict[str, Any]:
        """The TransformerConfig fields of this family's flags, for a model built without a parser.

        They are its parts, grouped-query attention at ``num_query_groups``, biases, dropouts and
        the ffn. The ffn defaults to Megatron-LM's for the MLP at ``hidden_size``, as the
        trainer's flags give it, not megatron-core's 4h."""
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
        options["ffn_hidden_size"] = (ffn_hidden_size if ffn_hidden_size is not None
                                      else self.variant.mlp.default_ffn(hidden_size))
        for dropout in ("hidden_dropout", "attention_dropout"):
            if dropout in flags:
                options[dropout] = flags[dropout]
        return options

    def argv(self, num_query_groups: int | None = None) -> list[str]:
        """The family's flags on a pretrain_gpt.py command line, with ``num_query_groups``."""
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
            position_embedding_type=self.variant.positions.name,
            untie_embeddings_and_output_weights=bool(
                flags.get("untie_embeddings_and_output_weights", False)))

    @property
    def sites(self) -> tuple[str, ...]:
        """The per-layer sites this family's layer can save, in forward order.

        That covers either attention, with or without dropout: the sites every layer shares, and
        its parts'."""
        others = set().union(*(family.variant.sites() for family in FAMILIES.values()))
        own = self.variant.sites()
        return tuple(name for name in site_table.SITE_NAMES
                     if (name in own or name not in others)
                     and name not in site_table.SHARED_SITES)


NORMS: dict[str, NormPart] = {}
MLPS: dict[bool, MlpPart] = {}    # by gated
POSITIONS: dict[str, PositionPart] = {}
FAMILIES: dict[str, ModelFamily] = {}


def register(family: ModelFamily) -> ModelFamily:
    """Add ``family`` and its parts, each under the flag value that selects it.

    A part that differs from the one a value already selects is refused: it needs a value of its
    own."""
    variant = family.variant
    parts = ((NORMS, variant.norm.name, variant.norm, "--normalization"),
             (MLPS, variant.mlp.gated, variant.mlp, "--swiglu"),
             (POSITIONS, variant.positions.name, variant.positions,
              "--position-embedding-type"))
    for registry, key, part, flag in parts:
        if registry.get(key, part) != part:
            raise ValueError(f"family {family.name}: {flag} {key} already selects another "
                             f"part ({registry[key].name}); name the new part apart")
    FAMILIES[family.name] = family
    for registry, key, part, _ in parts:
        registry.setdefault(key, part)
    return family


def register_positions(part: PositionPart) -> PositionPart:
    """Add positions that ``--position-embedding-type`` selects but no family presets."""
    if POSITIONS.get(part.name, part) != part:
        raise ValueError(f"--position-embedding-type {part.name} already selects another part")
    POSITIONS[part.name] = part
    return part


def layer_variant(normalization: str, swiglu: bool, position_embedding_type: str
                  ) -> LayerVariant:
    """The parts the layer-variant flags select; a ValueError names an unknown one's flag."""
    for flag, registry, key in (("--normalization", NORMS, normalization),
                                ("--position-embedding-type", POSITIONS,
                                 position_embedding_type)):
        if key not in registry:
            raise ValueError(f"{flag} {key}: expected one of {', '.join(registry)}")
    return LayerVariant(NORMS[normalization], MLPS[bool(swiglu)],
                        POSITIONS[position_embedding_type])


def get(name: str) -> ModelFamily:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}") from None


def mlp_part(config) -> MlpPart:
    """The MLP part a TransformerConfig builds."""
    return MLPS[bool(config.gated_linear_unit)]


# --- from Megatron-LM's flags to megatron-core's arguments ------------------------------------
# Megatron-LM's flags (by dest) that build a layer no family describes, each with its value when
# off and what it builds. Adacc's runtime would meet saves it has no site for, and its plan would
# price a layer other than the one trained.
UNMODELLED_LAYER_FLAGS = (
    ("num_experts", None, "a mixture-of-experts MLP"),
    ("qk_layernorm", False, "norms on the queries and keys"),
    ("qk_l2_norm", False, "norms on the queries and keys"),
    ("multi_latent_attention", False, "multi-latent attention"),
    ("experimental_attention_variant", None, "another attention"),
    ("attention_output_gate", False, "a gated attention output"),
    ("softmax_type", "vanilla", "a softmax with an offset"),
    ("window_size", None, "sliding-window attention"),
    ("quick_geglu", False, "another MLP activation"),
    ("activation_func_clamp_value", None, "a clamped MLP activation"),
    ("heterogeneous_layers_config_path", None, "layers of several shapes"),
    ("spec", None, "the layers of its own spec"),
)


def require_modelled_layer(args) -> None:
    """ValueError naming the first flag in ``args`` that builds a layer no family describes."""
    for name, off, builds in UNMODELLED_LAYER_FLAGS:
        value = getattr(args, name, off)
        if value != off:
            flag = "--" + name.replace("_", "-")
            given = flag if value is True else f"{flag} {_flag_text(value)}"
            raise ValueError(f"{given} builds {builds}, and Adacc's layer knows the dense GPT "
                             f"and Llama layers only")


def _flag_text(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


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
    """The GPTModel arguments of the positions and the output layer.

    megatron-core keeps them out of TransformerConfig."""
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


class TorchNorm:
    """megatron's WrappedTorchNorm, with two things it asserts against that a torch norm can do.

    - Zero-centred gamma (``--apply-layernorm-1p``): the weight starts at 0 and the norm scales by
      weight + 1, as Apex's and Transformer Engine's norms do.
    - Sequence parallelism: a norm computes row by row, so it runs unchanged on a sequence shard.
      Its parameters are marked ``sequence_parallel``, so megatron's ``finalize_model_grads``
      all-reduces their gradients over the tensor-parallel group.
    """

    def __new__(cls, config, *args, **kwargs):
        import torch
        from megatron.core.transformer.torch_norm import WrappedTorchNorm

        plain = dataclasses.replace(config, sequence_parallel=False,
                                    layernorm_zero_centered_gamma=False)
        norm = WrappedTorchNorm(plain, *args, **kwargs)
        if config.layernorm_zero_centered_gamma:
            norm.__class__ = _ZERO_CENTERED[type(norm)]
            with torch.no_grad():
                norm.weight.zero_()
        if config.sequence_parallel:
            for parameter in norm.parameters():
                parameter.sequence_parallel = True
        return norm


def _zero_centered_norms() -> dict:
    import torch
    import torch.nn.functional as F

    class ZeroCenteredLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)

    class ZeroCenteredRMSNorm(torch.nn.RMSNorm):
        def forward(self, x):
            return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)

    return {torch.nn.LayerNorm: ZeroCenteredLayerNorm, torch.nn.RMSNorm: ZeroCenteredRMSNorm}


_ZERO_CENTERED = _zero_centered_norms()
