"""The named sites: kinds of tensor a transformer layer saves for backward.

A site is the unit of every decision (retain, compress, recompute). This module is the one
vocabulary of the runtime, the costs, the profiler, the planner, the policies, the rectifier and the
analytic accelerator model. The runtime discovers what a layer really saves; this table says what
each discovered site *is*:
- which codec suits it, and whether it can be rebuilt;
- what rebuilds it: an operator from upstream sites (``REBUILDS``), or else a re-run of its forward
  segment;
- whether it is one storage shared by every layer.
Adding a layer variant starts here: its sites, and the operator-level rebuild edges its layer
offers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Collection

RETAIN = "retain"
COMPRESS = "compress"
RECOMPUTE = "recompute"
ACTIONS = (RETAIN, COMPRESS, RECOMPUTE)

# A recomputed site without an operator-level rebuild (REBUILDS below) is rebuilt by
# re-running the megatron forward segment that saves it from the segment's start (name ->
# start site, in forward order): _forward_attention from the layer input, _forward_mlp from
# the residual stream after attention.
LAYER_INPUT = "layer_in"  # a layer's input: on a pipeline stage's first layer, the received input
SEGMENTS = {"attention": LAYER_INPUT, "mlp": "ln2_in"}
SEGMENT_NAMES: tuple[str, ...] = tuple(SEGMENTS)
# start site -> index of the segment it starts, in forward order
SEGMENT_ANCHORS: dict[str, int] = {start: index for index, start in enumerate(SEGMENTS.values())}
MLP_SEGMENT = SEGMENT_NAMES.index("mlp")


def chain_reruns(rebuilt: Collection[int],
                 passes_through: Callable[[int], bool]) -> list[list[int]]:
    """The forward re-runs that rebuild the segments ``rebuilt`` (indices into SEGMENTS).

    Each re-run is the indices of the segments it runs, in forward order. This is the one rule of
    the planner's charges and the runtime's re-runs.

    A rebuilt segment continues the re-run before it when that re-run passes through the start of
    every segment after its last, up to this one. ``passes_through(index)`` says so: the start is
    recomputed, so the segments between run whole and each start is their output. Otherwise it
    re-runs from its own start, retained or decoded. Going on through a kept start would run the
    rest of the earlier segment for nothing (the attention's core and linear_proj, when only
    Q/K/V is recomputed)."""
    chains: list[list[int]] = []
    for index in sorted(rebuilt):
        if chains and all(passes_through(between)
                          for between in range(chains[-1][-1] + 1, index + 1)):
            chains[-1].extend(range(chains[-1][-1] + 1, index + 1))
        else:
            chains.append([index])
    return chains

# Codec roles. Each site has a designated codec (Site.default_codec); these name the roles
# the policies and the rectifier refer to.
OUTLIER_CODEC = "outlier_int4"   # outputs of Linear, LayerNorm, GELU: outlier separation
MASK_CODEC = "bitmask"           # dropout masks: lossless
# Codecs whose decoded value is the encoded one bit for bit: a rebuild reading a site held by
# one of them is as exact as one reading it retained.
LOSSLESS_CODECS = frozenset({MASK_CODEC})
# The paper's "Quantization" baseline, and auto's last resort: per-token int4 keeps no
# outliers, so its payload is the smallest of the int4 codecs, and a budget the designated
# codecs cannot meet may still fit it (Site.last_resort_codec).
QUANTIZE_CODEC = "naive_int4"
# The paper's ablation "Adacc w/o outlier": plain group-wise int4 where outliers would be
# separated. The profiler measures it beside the designated codec.
ABLATION_CODECS = {OUTLIER_CODEC: "sym_int4"}


@dataclass(frozen=True)
class Site:
    name: str
    description: str
    default_codec: str | None  # None: never compressed (retain or recompute)
    # The forward segment that saves it, whose re-run rebuilds it unless an edge of REBUILDS
    # does; None: never rebuilt.
    segment: str | None
    recomputable: bool = True
    # One storage saved by every layer (megatron's cached causal mask, RoPE's cos and sin):
    # counted once as non-layer memory, never decided per layer (compressing or rebuilding
    # it per layer would cost memory).
    shared: bool = False
    # Its saved tensor is a view of a larger one whose rest nothing saved reads (SwiGLU's gate
    # half of fc1's output): retained, it pins the whole; compressed, the view is encoded
    # alone, unless the layer rebuilds from it by an edge that reads the whole
    # (Rebuild.between), which a plan may then not take compressed (VIEW_PAYLOADS).
    partial_view: bool = False

    @property
    def last_resort_codec(self) -> str | None:
        """The quantize baseline's codec for this site: per-token int4 on every floating-point site.

        Auto adds it to its options only when no plan with the designated codecs fits. None for
        dropout masks (bit-packed already: lossless and smaller than int4) and for sites never
        compressed."""
        if self.default_codec is None or self.is_mask:
            return None
        return QUANTIZE_CODEC

    @property
    def is_mask(self) -> bool:
        """A dropout or attention mask, the bitmask codec's: drawn, never computed from values.

        Its values are bool, or CPU dropout's 0 and 1/(1-p)."""
        return self.default_codec == MASK_CODEC

    def takes(self, codec: str) -> bool:
        """Whether ``codec`` can hold this site's tensor.

        The bitmask codec holds a mask's two values only; a floating-point value sent to it would
        be silently binarised wherever it happens to hold two. The int4 codecs quantise
        floating-point values only. plan.check_decision applies this to plan files and to the
        runtime's layers."""
        return (self.default_codec is not None
                and (codec == MASK_CODEC) == self.is_mask)

    @property
    def candidate_codecs(self) -> tuple[str, ...]:
        """The codecs the profiler measures: designated, ablation and last resort, once each."""
        roles = (self.default_codec, ABLATION_CODECS.get(self.default_codec),
                 self.last_resort_codec)
        return tuple(dict.fromkeys(codec for codec in roles if codec is not None))


_SITE_LIST = (
    Site(LAYER_INPUT, "layer input, the checkpoint everything else is rebuilt from",
         "outlier_int4", None, recomputable=False),
    Site("ln1_out", "input layernorm output, saved by linear_qkv", "outlier_int4", "attention"),
    # RMSNorm (torch's) saves x * rstd in fp32 besides its input and rstd.
    Site("ln1_normed", "input RMSNorm's normalised input x * rstd (fp32), saved by its weight "
         "multiply", "outlier_int4", "attention"),
    # RoPE's cos and sin, [s, 1, 1, rotary dim], saved by the two products with Q and K. They
    # are the same values in every layer; megatron-core 0.19.2 computes them per call (new
    # storages), and the runtime keeps one storage of each (runtime/shared.py). Every gradient
    # through RoPE reads them: never compressed, never rebuilt.
    Site("rope_cos_sin", "RoPE's cos and sin, saved by the rotation of Q and K (the runtime "
         "keeps one storage of each for every layer)", None, "attention", recomputable=False,
         shared=True),
    Site("qkv", "query, key and value as core attention takes them: views of linear_qkv's "
         "output, or (RoPE) the rotated Q and K and (grouped-query unfused attention) the "
         "repeated K and V; decided as one unit", "channel_int4", "attention"),
    Site("attn_mask", "attention mask: the causal mask the masked fill saves (megatron caches "
         "it, one storage for every layer), or the mask type megatron's core-attention "
         "checkpoint saves", "bitmask", "attention", shared=True),
    Site("softmax_out", "attention probabilities saved by the softmax backward", "asym_int4",
         "attention"),
    Site("attn_dropout_mask", "attention dropout mask", "bitmask", "attention"),
    Site("attn_probs", "probabilities after dropout, saved by the matmul with V", "asym_int4",
         "attention"),
    # On the flash layer (flash_attention.py) SDPA saves its output, and linear_proj saves a view
    # of that same storage: one site.
    Site("context", "attention output, saved by linear_proj (and by SDPA on the flash layer)",
         "outlier_int4", "attention"),
    # The flash layer's own sites (SDPA's flash / memory-efficient kernels). The log-sum-exp
    # is small (4 bytes per head and token) and every attention gradient is exponentiated
    # through it: an int4 error there is not worth its bytes, so it is never compressed.
    Site("attn_lse", "log-sum-exp of the attention scores, saved by SDPA's flash backward "
         "(fp32)", None, "attention"),
    Site("attn_rng_state", "philox seed and offset of SDPA's CUDA dropout (flash layer, CUDA, "
         "attention dropout on)", None, "attention"),
    Site("bda1_mask", "dropout mask of the attention bias-dropout-add", "bitmask",
         "attention"),
    # Saved by the MLP segment's first op, but its value is the attention segment's output:
    # an edge of REBUILDS rebuilds it from the attention output and the layer input.
    Site("ln2_in", "residual stream after attention, saved by pre_mlp_layernorm",
         "outlier_int4", "attention"),
    Site("ln2_out", "pre-MLP layernorm output, saved by linear_fc1", "outlier_int4", "mlp"),
    Site("ln2_normed", "pre-MLP RMSNorm's normalised input x * rstd (fp32)", "outlier_int4",
         "mlp"),
    Site("gelu_in", "fc1 output, saved by the activation function", "outlier_int4", "mlp"),
    Site("gelu_out", "activation output, saved by linear_fc2", "outlier_int4", "mlp"),
    # The gated MLP (SwiGLU, models/llama.py): silu(gate) * up.
    Site("swiglu_in", "fc1 output [s, b, 2 x ffn], pinned by the gate half the SiLU saves",
         "outlier_int4", "mlp", partial_view=True),
    Site("swiglu_up", "the up half of fc1's output plus megatron's offset (a copy), saved by "
         "the product", "outlier_int4", "mlp"),
    Site("swiglu_act", "SiLU of the gate half, saved by the product", "outlier_int4", "mlp"),
    Site("swiglu_out", "SwiGLU output silu(gate) * up, saved by linear_fc2", "outlier_int4",
         "mlp"),
    Site("bda2_mask", "dropout mask of the MLP bias-dropout-add", "bitmask", "mlp"),
    Site("ln1_stats", "input layernorm mean and rstd", "outlier_int4", "attention"),
    Site("ln2_stats", "pre-MLP layernorm mean and rstd", "outlier_int4", "mlp"),
)

# Sites whose decoded values are alive together while a layer backprops. The runtime decodes a
# compressed value when backward first reads it and frees it once its last view is read, so
# two decoded values meet only where one backward node reads both, or where a value read by
# two nodes is held across the nodes between them. A group applies to a layer that saves
# every site in it; a site in no group applying to its layer is decoded alone.
DECODED_TOGETHER: tuple[frozenset[str], ...] = (
    # Unfused attention: Q, K and V are views of one storage. The matmul with V decodes it
    # together with the dropped probabilities (or, without dropout, the softmax output); the
    # score matmul reads Q and K last, so it is held across the dropout's and the softmax's
    # backward, each reading one s^2 value.
    frozenset({"attn_probs", "qkv"}),
    frozenset({"attn_dropout_mask", "qkv"}),
    frozenset({"softmax_out", "qkv"}),
    # The flash layer: linear_proj's backward decodes the context (SDPA's own output), and
    # SDPA's backward reads it again with Q, K, V and the log-sum-exp.
    frozenset({"context", "qkv", "attn_lse"}),
    # LayerNorm's backward reads its input and its statistics together.
    frozenset({"layer_in", "ln1_stats"}),
    frozenset({"ln2_in", "ln2_stats"}),
    # SwiGLU: the product's backward reads the SiLU output and the up half together.
    frozenset({"swiglu_act", "swiglu_up"}),
)



@dataclass(frozen=True)
class Rebuild:
    """An operator-level rebuild edge: in backward, the runtime calls ``call`` on ``sources``.

    Fields:
        call: a dotted path from the transformer layer to one of megatron's own submodules or
            functions, e.g. ``mlp.activation_func``.
        sources: the sites passed positionally, each retained, decoded or itself rebuilt (chains).
        output: the site the call's return value rebuilds.
        saves: the sites the call saves for backward on the way (a norm's statistics, RMSNorm's x *
            rstd). They are captured as it runs, its sources requiring grad as in forward, so it
            saves what forward saved.
        between: (enter, exit) runs a module's forward between two of its megatron linear layers. It
            serves operators no submodule or function holds (the gated MLP's ``glu``, a closure in
            ``MLP.forward``). Submodule ``enter`` stands in, returning the source's whole value and
            no bias. The whole is the tensor the source's saved view is a view of (SwiGLU's gate
            half pins fc1's whole output). The call stops at submodule ``exit``, whose input is
            ``output``; neither linear layer runs.
        optional: sources a layer may not save (a dropout's mask where the layer has no dropout).
            The call takes None in their place.

    A layer uses an edge when it saves its output and every other source. A recomputed site named
    here is always rebuilt this way, never by its segment's re-run. The call draws no random
    numbers. The operators run once per layer backward each, in the order of this table, which must
    put an edge after every edge that rebuilds one of its sources.
    """

    call: str
    sources: tuple[str, ...]
    output: str
    saves: tuple[str, ...] = ()
    between: tuple[str, str] | None = None
    optional: tuple[str, ...] = ()

    @property
    def products(self) -> tuple[str, ...]:
        return (self.output, *self.saves)

    def used_by(self, saved: Collection[str]) -> bool:
        """Whether a layer that saves the sites ``saved`` uses this edge."""
        return self.output in saved and all(
            source in saved for source in self.sources if source not in self.optional)

    def sources_in(self, saved: Collection[str]) -> tuple[str, ...]:
        """The sources a layer that saves ``saved`` gives this edge."""
        return tuple(source for source in self.sources if source in saved)


# The edges megatron-core's local layer offers, GPT's and Llama's (models/), in forward
# order; a layer uses the edges whose output and (non-optional) sources it saves. Q/K/V,
# the attention output and the masks are left to the segment re-runs, and so are RoPE's
# rotated Q and K: their unrotated inputs are views of linear_qkv's output that nothing
# saves, so only the attention re-run (linear_qkv's matmul) reaches them.
REBUILDS: tuple[Rebuild, ...] = (
    # LayerNorm saves its statistics; torch's RMSNorm its rstd and x * rstd (fp32).
    Rebuild("input_layernorm", (LAYER_INPUT,), "ln1_out", ("ln1_stats", "ln1_normed")),
    # The residual stream after attention: megatron's linear_proj on the attention output,
    # then its self_attn_bda onto the layer input, the dropout applying the kept mask
    # instead of drawing one (runtime/layer.py `AdaccTransformerLayer.attention_residual`):
    # one matmul, where the attention re-run costs linear_qkv's, the attention and this.
    Rebuild("attention_residual", (LAYER_INPUT, "context", "bda1_mask"), "ln2_in",
            optional=("bda1_mask",)),
    Rebuild("pre_mlp_layernorm", ("ln2_in",), "ln2_out", ("ln2_stats", "ln2_normed")),
    Rebuild("mlp.activation_func", ("gelu_in",), "gelu_out"),
    # SwiGLU: megatron's MLP forward between fc1 and fc2 runs its `glu` (chunk, SiLU of the
    # gate half, the up half plus the offset: a copy, their product) on fc1's whole output,
    # which the saved gate half pins.
    Rebuild("mlp", ("swiglu_in",), "swiglu_out", ("swiglu_act", "swiglu_up"),
            between=("linear_fc1", "linear_fc2")),
)
# product site -> the edge that rebuilds it
REBUILT_BY: dict[str, Rebuild] = {product: edge for edge in REBUILDS
                                  for product in edge.products}
# The sites a rebuild may read: the segments' starts and the edges' sources.
REBUILD_SOURCES = frozenset(SEGMENTS.values()) | {source for edge in REBUILDS
                                                  for source in edge.sources}

SITES: dict[str, Site] = {site.name: site for site in _SITE_LIST}
SITE_NAMES: tuple[str, ...] = tuple(SITES)
SHARED_SITES = frozenset(site.name for site in _SITE_LIST if site.shared)
# Sites whose payload holds their saved view only (Site.partial_view) though an edge reads
# them whole: an edge may read them retained, never compressed (the runtime would encode the
# whole for it, which their profiled payloads do not charge).
VIEW_PAYLOADS = frozenset(source for edge in REBUILDS if edge.between for source in edge.sources
                          if SITES[source].partial_view)
# The sites a plan decides for, per layer.
DECIDED_SITES: tuple[Site, ...] = tuple(site for site in _SITE_LIST if not site.shared)


def get(name: str) -> Site:
    try:
        return SITES[name]
    except KeyError:
        raise KeyError(
            f"unknown site {name!r}; valid sites: {', '.join(SITE_NAMES)}"
        ) from None
