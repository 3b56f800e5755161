"""An analytic cost model of a named accelerator, so a GPU run can be planned on a laptop.

Given a GPT shape, a micro-batch and an accelerator's peak matmul rate and memory bandwidth,
produce the same ``ModelCosts`` the profiler measures:

- bytes per site from the megatron-core local layer (``_LAYER_SITES``: the one place these
  formulas live; with 16-bit activations and dropout on they add up to 34sbh + 5as^2b);
- rebuild time of a site = the ops the forward runs from its segment's start (sites.SEGMENTS)
  up to its save, each on a roofline: matmuls are FLOP-bound at ``MATMUL_EFFICIENCY`` of
  peak, elementwise / norm / softmax / RNG ops are bound by the bytes they move at
  ``BANDWIDTH_EFFICIENCY`` of peak bandwidth; an op that does both pays both. A site an
  operator rebuilds (sites.REBUILDS) instead costs that operator: the ops the forward runs
  from its last source's save (a mask's excepted) to the operator's output;
- codec payloads from the codecs themselves (``Codec.payload_bytes``: the exact size of a
  finite input's payload) and codec time = bytes the codec moves at ``CODEC_EFFICIENCY`` of
  peak bandwidth;
- static memory from the parameter count, precision and optimizer (``static_bytes``), or
  from a model and megatron's engine around it (``model_static_bytes``,
  ``engine_static_bytes``);
- per pipeline stage (``pipeline_costs``): its layers and parameters, the embedding on the
  first stage, the output layer and loss on the last, its 1F1B in-flight micro-batches.

Every efficiency factor is an assumption, named here so it can be checked against a profile.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch

from megatron_adacc import codecs, models, planning
from megatron_adacc.common import sites as site_table
from megatron_adacc.models.attention import resolve_backend
from megatron_adacc.common.costs import CodecCost, ModelCosts, Operator, SiteCost
from megatron_adacc.training.tokenizers import TOKENIZER_TYPES, build_tokenizer

GiB = 1024**3

# Fraction of the spec-sheet peak a well-shaped GEMM reaches in Megatron-sized layers.
MATMUL_EFFICIENCY = 0.6
# Fraction of peak DRAM bandwidth a streaming elementwise kernel reaches.
BANDWIDTH_EFFICIENCY = 0.8
# Fused int4 codec kernels do a little arithmetic per byte and a reduction for the scales; on
# this repository's CPU the fused codecs reach 27% of a copy (DESIGN.md). We assume GPU Triton
# kernels reach half the bandwidth of a copy.
CODEC_EFFICIENCY = 0.4
# Fraction of channels the outlier codec keeps exact (z-score > 3 over channel |sum|; a few
# channels in GPT activations). Each costs its values at full width plus a 4-byte index.
OUTLIER_CHANNEL_FRACTION = 0.01
# Memory a process cannot give to tensors: CUDA context, cuBLAS workspace, allocator slack.
DEFAULT_RESERVED_BYTES = 1 * GiB


@dataclass(frozen=True)
class Accelerator:
    name: str
    matmul_flops_16bit: float   # dense fp16/bf16 tensor-core peak, FLOP/s
    matmul_flops_fp32: float    # dense fp32 peak (no TF32), FLOP/s
    memory_bandwidth: float     # bytes/s
    capacity_bytes: int
    supports_bf16: bool = True

    def matmul_flops(self, activation_bytes: int) -> float:
        return self.matmul_flops_16bit if activation_bytes == 2 else self.matmul_flops_fp32


ACCELERATORS: dict[str, Accelerator] = {
    "v100-32gb": Accelerator("NVIDIA V100 SXM2 32GB", 125e12, 15.7e12, 900e9, 32 * GiB,
                             supports_bf16=False),
    "a100-80gb": Accelerator("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 2039e9, 80 * GiB),
    "h100-80gb": Accelerator("NVIDIA H100 SXM5 80GB", 989e12, 67e12, 3350e9, 80 * GiB),
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}"
        ) from None


# --- model shape -------------------------------------------------------------------------
_PRECISION_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}
_DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int
    ffn_hidden_size: int | None = None          # default 4 * hidden_size
    max_position_embeddings: int | None = None  # default seq_length
    precision: str = "fp16"                     # fp16 | bf16 (mixed precision) | fp32
    attention_dropout: float = 0.1
    hidden_dropout: float = 0.1
    # Megatron-LM's flag defaults to False; megatron-core's TransformerConfig to True. With it
    # the softmax backward saves fp32 probabilities (4as^2b instead of 2as^2b).
    softmax_in_fp32: bool = False
    make_vocab_size_divisible_by: int = 128
    # Megatron ties the output layer to the word embedding unless told otherwise.
    untie_embeddings_and_output_weights: bool = False
    # "unfused" (megatron-core's local attention: the s^2 sites) or "flash" (SDPA's flash or
    # memory-efficient kernel: Q, K, V, output, log-sum-exp). The dataclass default is the
    # local spec's; from_flags follows Megatron-LM's --attention-backend auto.
    attention_backend: str = "unfused"
    # The layer variant (models/: GPT's defaults) and tensor / sequence parallelism: a
    # site's bytes are one tensor-parallel rank's.
    normalization: str = "LayerNorm"
    swiglu: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_percent: float = 1.0
    num_query_groups: int | None = None      # default: one per head (no grouping)
    add_bias_linear: bool = True
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if self.precision not in _PRECISION_BYTES:
            raise ValueError(f"precision must be one of {sorted(_PRECISION_BYTES)}, "
                             f"got {self.precision!r}")
        if self.attention_backend not in ("unfused", "flash"):
            raise ValueError(f"attention backend must be unfused or flash, got "
                             f"{self.attention_backend!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(f"hidden size {self.hidden_size} is not divisible by "
                             f"{self.num_attention_heads} attention heads")
        t = self.tensor_model_parallel_size
        if self.num_attention_heads % self.groups or self.groups % t:
            raise ValueError(f"--num-query-groups {self.groups} must divide "
                             f"--num-attention-heads {self.num_attention_heads} and be "
                             f"divisible by --tensor-model-parallel-size {t}")
        if self.sequence_parallel and (t == 1 or self.seq_length % t):
            raise ValueError("--sequence-parallel needs --tensor-model-parallel-size > 1 "
                             "dividing --seq-length")
        if self.ffn % t:
            raise ValueError(f"ffn hidden size {self.ffn} is not divisible by "
                             f"--tensor-model-parallel-size {t}")

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        # Megatron-LM's SwiGLU width (arguments.py)
        return int(4 * self.hidden_size * 2 / 3 / 64) * 64 if self.swiglu else 4 * self.hidden_size

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope(self) -> bool:
        return self.position_embedding_type == "rope"

    @property
    def norm_parameters(self) -> int:
        return (2 if self.normalization == "LayerNorm" else 1) * self.hidden_size

    @property
    def activation_bytes(self) -> int:
        return _PRECISION_BYTES[self.precision]

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    @property
    def layer_parameters(self) -> int:
        """One transformer layer on one tensor-parallel rank: its shards of QKV (K and V at
        the query groups), the projection, fc1 (twice as wide with SwiGLU) and fc2, the
        column-parallel biases' shards, the row-parallel biases and the two norms whole."""
        h, f, t = self.hidden_size, self.ffn, self.tensor_model_parallel_size
        qkv = (self.num_attention_heads + 2 * self.groups) * self.head_dim
        fc1 = (2 if self.swiglu else 1) * f
        sharded = h * qkv + self.num_attention_heads * self.head_dim * h + h * fc1 + f * h
        replicated = 2 * self.norm_parameters
        if self.add_bias_linear:
            sharded += qkv + fc1
            replicated += 2 * h
        return sharded // t + replicated

    @property
    def embedding_parameters(self) -> int:
        """The word embedding's shard and the learned position embeddings (the first
        pipeline stage's)."""
        positions = 0 if self.rope else (self.max_position_embeddings or self.seq_length)
        return (self.padded_vocab_size // self.tensor_model_parallel_size + positions) \
            * self.hidden_size

    def output_parameters(self, pipelined: bool) -> int:
        """The final norm and the output layer's shard (the last pipeline stage's). A tied
        output layer is the word embedding: on one stage it adds nothing; with more than one
        stage megatron keeps a copy of it on the last stage (kept equal by an all-reduce of
        their gradients). An untied one is its own weight."""
        own = pipelined or self.untie_embeddings_and_output_weights
        vocab = self.padded_vocab_size // self.tensor_model_parallel_size
        return self.norm_parameters + (vocab * self.hidden_size if own else 0)

    @property
    def num_parameters(self) -> int:
        """One tensor-parallel rank's parameters, counting a tied output layer once."""
        return (self.num_layers * self.layer_parameters + self.embedding_parameters
                + self.output_parameters(pipelined=False))

    @classmethod
    def from_flags(cls, flags: Mapping[str, Any]) -> "ModelShape":
        """From Megatron-style flag names (``num-layers`` or ``num_layers``), as in a YAML
        config. Raises ValueError naming a missing flag."""
        norm = {str(k).replace("_", "-"): v for k, v in flags.items() if v is not None}

        def need(key: str) -> Any:
            if key not in norm:
                raise ValueError(f"model shape needs --{key} (in the config or as a flag)")
            return norm[key]

        vocab = norm.get("vocab-size")
        if vocab is None and "tokenizer-type" in norm:  # the trainer's tokenizer's own size
            vocab = build_tokenizer(str(norm["tokenizer-type"]), norm.get("vocab-file"),
                                    norm.get("merge-file")).vocab_size
        if vocab is None:
            raise ValueError("model shape needs --vocab-size (or a --tokenizer-type: "
                             f"{', '.join(TOKENIZER_TYPES)})")
        precision = "bf16" if norm.get("bf16") else "fp16" if norm.get("fp16") else "fp32"
        groups = (int(norm.get("num-query-groups", 1)) if norm.get("group-query-attention")
                  else None)
        seq = int(norm.get("seq-length") or need("max-position-embeddings"))
        attention_dropout = float(norm.get("attention-dropout", 0.1))
        # An accelerator here is a CUDA GPU: SDPA runs flash or memory-efficient kernels
        # there at any dropout, so auto (Megatron-LM's default) means flash.
        backend = resolve_backend(str(norm.get("attention-backend", "auto")),
                                  attention_dropout, cuda=True)
        return cls(
            num_layers=int(need("num-layers")),
            hidden_size=int(need("hidden-size")),
            num_attention_heads=int(need("num-attention-heads")),
            seq_length=seq,
            vocab_size=int(vocab),
            ffn_hidden_size=int(norm["ffn-hidden-size"]) if "ffn-hidden-size" in norm else None,
            max_position_embeddings=int(norm.get("max-position-embeddings", seq)),
            precision=precision,
            attention_dropout=attention_dropout,
            attention_backend=backend,
            hidden_dropout=float(norm.get("hidden-dropout", 0.1)),
            softmax_in_fp32=bool(norm.get("attention-softmax-in-fp32", False)),
            make_vocab_size_divisible_by=int(norm.get("make-vocab-size-divisible-by", 128)),
            untie_embeddings_and_output_weights=bool(
                norm.get("untie-embeddings-and-output-weights", False)),
            normalization=str(norm.get("normalization", "LayerNorm")),
            swiglu=bool(norm.get("swiglu", False)),
            position_embedding_type=str(norm.get("position-embedding-type",
                                                 "learned_absolute")),
            rotary_percent=float(norm.get("rotary-percent", 1.0)),
            num_query_groups=groups,
            add_bias_linear=not norm.get("disable-bias-linear", False),
            tensor_model_parallel_size=int(norm.get("tensor-model-parallel-size", 1)),
            sequence_parallel=bool(norm.get("sequence-parallel", False)),
        )


# --- static memory ------------------------------------------------------------------------
# Bytes per parameter of weights, gradients and Adam(W) states: mixed precision (fp16/bf16)
# keeps 16-bit weights and gradients and fp32 master weights, m and v (2 + 2 + 12 = 16, as in
# the paper); fp32 keeps 4 + 4 + 8 (m, v).
_STATE_BYTES = {"fp16": (2, 2, 12), "bf16": (2, 2, 12), "fp32": (4, 4, 8)}


def static_bytes(num_parameters: int, precision: str, zero_stage: int = 0,
                 data_parallel_size: int = 1) -> int:
    """Weights + gradients + optimizer states one rank holds for ``num_parameters``.

    ZeRO stage 1 (Megatron's ``--use-distributed-optimizer``) shards the optimizer states
    over the data-parallel group, stage 2 the gradients too, stage 3 the weights too. A
    sharded part is ceil(N / D) parameters' worth (megatron pads its buffers to a multiple
    of D and gives each rank an equal range).
    """
    if zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero stage must be 0, 1, 2 or 3, got {zero_stage}")
    if data_parallel_size < 1:
        raise ValueError(f"data-parallel size must be >= 1, got {data_parallel_size}")
    shard = -(-num_parameters // data_parallel_size)
    weights, grads, optimizer = _STATE_BYTES[precision]
    return sum(per_parameter * (shard if zero_stage >= stage else num_parameters)
               for per_parameter, stage in ((weights, 3), (grads, 2), (optimizer, 1)))


# torch's Adam(W) state per stepped tensor: exp_avg and exp_avg_sq like the tensor, and a
# 0-dim fp32 step count.
_ADAM_MOMENTS = 2
_ADAM_STEP_BYTES = 4


def _adam_state_bytes(main_param: torch.Tensor) -> int:
    return _ADAM_MOMENTS * main_param.numel() * main_param.element_size() + _ADAM_STEP_BYTES


def model_static_bytes(model: torch.nn.Module, grad_dtype: torch.dtype | None = None) -> int:
    """What megatron's engine holds for ``model`` on one data-parallel rank without the
    distributed optimizer: parameters and buffers, a gradient buffer of ``grad_dtype``
    (default: fp32 for fp32 and bf16 models, as Megatron-LM accumulates bf16 in fp32;
    the parameter's dtype for fp16), fp32 main parameters for a 16-bit model with an fp32
    copy of each 16-bit gradient, and Adam's state. Equal to ``engine_static_bytes`` of
    that engine; for a model before it is wrapped (profiling, the Python API)."""
    held = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    total = held
    for param in model.parameters():
        if not param.requires_grad:
            continue
        dtype = grad_dtype or (param.dtype if param.dtype == torch.float16 else torch.float32)
        total += param.numel() * dtype.itemsize
        if param.dtype != torch.float32:
            total += param.numel() * 4                       # the fp32 main parameter
        if param.dtype != torch.float32 and dtype != torch.float32:
            total += param.numel() * 4                       # its fp32 gradient
        total += _ADAM_MOMENTS * param.numel() * 4 + _ADAM_STEP_BYTES
    return total


def engine_static_bytes(model_chunks, optimizer) -> int:
    """What megatron's engine holds on this rank for the whole run, read off the engine
    before its first step: the distinct storages of the parameters and buffers, of
    DistributedDataParallel's gradient (and, under the distributed optimizer, parameter)
    buffers and of the optimizer's main parameters, the fp32 gradients a 16-bit gradient
    buffer is copied into each step, and Adam's state, which torch allocates at the first
    step: two moments like each main parameter (its shard, under the distributed
    optimizer) and a step count."""
    storages: dict[int, int] = {}

    def hold(tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    for chunk in model_chunks:
        for tensor in (*chunk.module.parameters(), *chunk.module.buffers()):
            hold(tensor)
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers):
            hold(buffer.grad_data)
            if buffer.param_data is not None:
                hold(buffer.param_data)
    state = copied_grads = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        stepped = [p for group in inner.optimizer.param_groups for p in group["params"]]
        for main_param in stepped:
            hold(main_param)
            held_state = inner.optimizer.state.get(main_param)
            state += (sum(t.untyped_storage().nbytes() for t in held_state.values()
                          if torch.is_tensor(t)) if held_state else _adam_state_bytes(main_param))
        for model_param, main_param in _main_params_of(inner):
            if model_param.main_grad.dtype != torch.float32:
                copied_grads += main_param.numel() * 4
    return sum(storages.values()) + state + copied_grads


def _main_params_of(inner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, fp32 main parameter) pairs of a mixed-precision optimizer."""
    if hasattr(inner, "model_float16_groups") and hasattr(inner, "shard_fp32_from_float16_groups"):
        pairs = zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups)
    elif hasattr(inner, "float16_groups"):
        pairs = zip(inner.float16_groups, inner.fp32_from_float16_groups)
    else:
        return []
    return [(model, main) for models, mains in pairs for model, main in zip(models, mains)]


# --- the layer's sites ----------------------------------------------------------------------
@dataclass(frozen=True)
class _Dims:
    """One tensor-parallel rank's dimensions."""
    s: int          # sequence (attention and the MLP see all of it)
    sr: int         # rows of the residual stream: s / t under sequence parallelism
    b: int
    h: int          # hidden size (the residual stream's width)
    a: int          # attention heads on this rank
    g: int          # query groups on this rank
    hd: int         # head dimension
    f: int          # ffn hidden size on this rank
    act: int        # activation bytes per element
    softmax: int    # bytes per element of the saved softmax output
    norm_in: int    # bytes per element of a norm's saved input (RMSNorm: fp32 in 16-bit)
    rot: int        # RoPE's rotary dimension
    mask: int = 1   # a dropout mask is bool on GPU

    @property
    def aw(self) -> int:
        """Attention width on this rank: its heads x head dimension."""
        return self.a * self.hd


@dataclass(frozen=True)
class _SiteFormula:
    """How big a site is and what the forward runs between the previous save of its segment
    and this one (its rebuild time is the sum along the segment), as functions of the dims."""

    elements: Callable[[_Dims], int]
    element_bytes: Callable[[_Dims], int]
    dtype: str
    flops: Callable[[_Dims], float]          # matmul FLOPs since the previous save
    bytes_moved: Callable[[_Dims], float]    # DRAM traffic of the non-matmul ops since then
    channels: Callable[[_Dims], int]         # channel count, for per-channel codec scales
    when: Callable[["ModelShape"], bool] = lambda shape: True


def _act(d: _Dims) -> int:
    return d.act


def _stream(d: _Dims) -> int:
    return d.sr * d.b * d.h


def _norm_moved(d: _Dims) -> float:
    return 2 * _stream(d) * d.act       # read input, write output


def _rng_moved_stream(d: _Dims) -> float:
    return _stream(d) * d.mask


def _rng_moved_attn(d: _Dims) -> float:
    return d.a * d.s * d.s * d.b * d.mask


def _hidden_channels(d: _Dims) -> int:
    return d.h


_NO_FLOPS: Callable[[_Dims], float] = lambda d: 0.0
_FP32: Callable[[_Dims], int] = lambda d: 4   # norm statistics, RMSNorm's x * rstd


def _attention_dropout(shape: ModelShape) -> bool:
    return shape.attention_dropout > 0


def _probabilities_copied(shape: ModelShape) -> bool:
    # The matmul with V saves probabilities of their own: the dropout's output, or the
    # 16-bit cast of an fp32 softmax output.
    return shape.attention_dropout > 0 or (shape.softmax_in_fp32 and shape.activation_bytes == 2)


def _hidden_dropout(shape: ModelShape) -> bool:
    return shape.hidden_dropout > 0


def _qkv_flops(d: _Dims) -> float:
    return 2 * d.s * d.b * d.h * (d.a + 2 * d.g) * d.hd


def _norm_sites(shape: ModelShape, prefix: str, input_site: str) -> dict[str, _SiteFormula]:
    """A norm's saves: its input, its statistics (LayerNorm: mean and rstd; RMSNorm: rstd)
    and RMSNorm's x * rstd in fp32; then the next linear saves its output."""
    norm = models.NORMS[shape.normalization]
    statistics = norm.statistics_per_row
    table = {
        input_site: _SiteFormula(_stream, lambda d: d.norm_in, "norm_in", _NO_FLOPS,
                                 lambda d: 0.0, _hidden_channels),
        f"{prefix}_stats": _SiteFormula(lambda d: statistics * d.sr * d.b, _FP32, "float32",
                                        _NO_FLOPS, _norm_moved, lambda d: statistics),
    }
    if norm.saves_normed:
        table[f"{prefix}_normed"] = _SiteFormula(_stream, _FP32, "float32", _NO_FLOPS,
                                                 lambda d: 0.0, _hidden_channels)
    table[f"{prefix}_out"] = _SiteFormula(_stream, _act, "act", _NO_FLOPS, lambda d: 0.0,
                                          _hidden_channels)
    return table


def _qkv_sites(shape: ModelShape) -> dict[str, _SiteFormula]:
    """Q, K and V as core attention saves them, and RoPE's cos and sin before them. Under
    sequence parallelism linear_qkv gathers the sequence first: from here on every tensor
    has the whole sequence and this rank's heads."""
    if shape.attention_backend == "flash":
        # SDPA keeps K and V at the groups; V is its own copy beside RoPE's Q and K
        heads = lambda d: d.a + 2 * d.g
    elif shape.rope and shape.groups == shape.num_attention_heads:
        # megatron's unfused attention: RoPE's Q and K, and V a view of the fused output
        heads = lambda d: 2 * d.a + (d.a + 2 * d.g)
    else:  # views of the fused output, or grouped K and V repeated to the heads
        heads = lambda d: 3 * d.a
    table = {}
    qkv_flops = _qkv_flops
    if shape.rope:
        table["rope_cos_sin"] = _SiteFormula(lambda d: 4 * d.s * d.rot, _act, "act",
                                             _qkv_flops, lambda d: 4 * d.s * d.rot * d.act,
                                             lambda d: d.rot)
        qkv_flops = _NO_FLOPS
    table["qkv"] = _SiteFormula(lambda d: heads(d) * d.s * d.b * d.hd, _act, "act", qkv_flops,
                                lambda d: (d.a + 2 * d.g) * d.s * d.b * d.hd * d.act,
                                lambda d: heads(d) * d.hd)
    return table


def _unfused_core_sites(shape: ModelShape) -> dict[str, _SiteFormula]:
    attn = lambda d: d.a * d.s * d.s * d.b
    return {
        # Q K^T, scale and mask, softmax: scores written and read in 16 bit, probs written.
        "softmax_out": _SiteFormula(attn, lambda d: d.softmax, "softmax",
                                    lambda d: 2 * d.b * d.s * d.s * d.aw,
                                    lambda d: attn(d) * (2 * d.act + d.softmax),
                                    lambda d: d.s),
        "attn_dropout_mask": _SiteFormula(attn, lambda d: d.mask, "bool", _NO_FLOPS,
                                          _rng_moved_attn, lambda d: d.s,
                                          when=_attention_dropout),
        "attn_probs": _SiteFormula(attn, _act, "act", _NO_FLOPS,
                                   lambda d: attn(d) * (d.softmax + d.mask + d.act),
                                   lambda d: d.s, when=_probabilities_copied),
        # The probabilities times V; linear_proj saves the context on entry.
        "context": _SiteFormula(lambda d: d.s * d.b * d.aw, _act, "act",
                                lambda d: 2 * d.b * d.s * d.s * d.aw,
                                lambda d: 2 * d.s * d.b * d.aw * d.act, lambda d: d.aw),
    }


def _flash_core_sites(shape: ModelShape) -> dict[str, _SiteFormula]:
    """What SDPA's flash (or memory-efficient) kernel saves after Q, K and V, in save order.
    The kernel computes Q K^T, softmax and the product with V in on-chip tiles: no s^2 tensor
    reaches memory, and causal masking skips the blocks above the diagonal (half the FLOPs of
    the unfused matmuls). Its output is the storage linear_proj saves (the context)."""
    return {
        "attn_lse": _SiteFormula(lambda d: d.a * d.s * d.b, _FP32, "float32",
                                 lambda d: 2 * d.b * d.s * d.s * d.aw,
                                 lambda d: 4 * d.s * d.b * d.aw * d.act + 4 * d.a * d.s * d.b,
                                 lambda d: d.a),
        # CUDA's philox seed and offset: two int64 scalars, with dropout on.
        "attn_rng_state": _SiteFormula(lambda d: 2, lambda d: 8, "int64", _NO_FLOPS,
                                       lambda d: 0.0, lambda d: 1, when=_attention_dropout),
        "context": _SiteFormula(lambda d: d.s * d.b * d.aw, _act, "act", _NO_FLOPS,
                                lambda d: 0.0, lambda d: d.aw),
    }


def _mlp_sites(shape: ModelShape) -> dict[str, _SiteFormula]:
    """fc1 (twice as wide with SwiGLU) and the activation's saves; linear_fc2 saves its
    output."""
    sbf = lambda d: d.s * d.b * d.f
    mlp = models.MLPS[shape.swiglu]
    if not mlp.gated:
        return {
            mlp.fc1_out: _SiteFormula(sbf, _act, "act", lambda d: 2 * d.s * d.b * d.h * d.f,
                                      lambda d: 2 * sbf(d) * d.act, lambda d: d.f),
            mlp.fc2_in: _SiteFormula(sbf, _act, "act", _NO_FLOPS, lambda d: 2 * sbf(d) * d.act,
                                     lambda d: d.f),
        }
    # fc1 writes both halves; the SiLU of the gate half runs first, then the up half plus the
    # offset (a copy), and the product saves both; linear_fc2 saves the product.
    up, act = (mlp.activation_saves[node] for node in ("AddBackward0", "SiluBackward0"))
    return {
        mlp.fc1_out: _SiteFormula(lambda d: 2 * sbf(d), _act, "act",
                                  lambda d: 2 * d.s * d.b * d.h * 2 * d.f,
                                  lambda d: 2 * sbf(d) * d.act, lambda d: 2 * d.f),
        act: _SiteFormula(sbf, _act, "act", _NO_FLOPS, lambda d: 2 * sbf(d) * d.act,
                          lambda d: d.f),
        up: _SiteFormula(sbf, _act, "act", _NO_FLOPS, lambda d: 2 * sbf(d) * d.act,
                         lambda d: d.f),
        mlp.fc2_in: _SiteFormula(sbf, _act, "act", _NO_FLOPS, lambda d: 3 * sbf(d) * d.act,
                                 lambda d: d.f),
    }


def _layer_sites(shape: ModelShape) -> dict[str, _SiteFormula]:
    """The sites of one megatron-core local-spec layer on one tensor-parallel rank, for the
    shape's layer variant (models/) and attention backend, in the order forward saves them;
    each formula's op costs are those of the ops since the previous save."""
    proj_flops = lambda d: 2 * d.s * d.b * d.aw * d.h
    # Without the bias-dropout-add mask, the next save after the context is ln2_in: the
    # output projection runs before it.
    ln2_in_flops = _NO_FLOPS if _hidden_dropout(shape) else proj_flops
    core = (_flash_core_sites if shape.attention_backend == "flash" else _unfused_core_sites)
    table = {
        **_norm_sites(shape, "ln1", "layer_in"),
        **_qkv_sites(shape),
        **core(shape),
        "bda1_mask": _SiteFormula(_stream, lambda d: d.mask, "bool", proj_flops,
                                  _rng_moved_stream, _hidden_channels, when=_hidden_dropout),
    }
    mlp_norm = _norm_sites(shape, "ln2", "ln2_in")
    # The bias-dropout-add; pre_mlp_layernorm saves its input on entry.
    mlp_norm["ln2_in"] = replace(mlp_norm["ln2_in"], flops=ln2_in_flops,
                                 bytes_moved=lambda d: 3 * _stream(d) * d.act + _stream(d) * d.mask)
    table.update(mlp_norm)
    table.update(_mlp_sites(shape))
    # fc2, then the dropout of the second bias-dropout-add draws its mask.
    table["bda2_mask"] = _SiteFormula(_stream, lambda d: d.mask, "bool",
                                      lambda d: 2 * d.s * d.b * d.f * d.h,
                                      lambda d: _stream(d) * d.act + _rng_moved_stream(d),
                                      _hidden_channels, when=_hidden_dropout)
    return {name: formula for name, formula in table.items() if formula.when(shape)}


def _dims(shape: ModelShape, micro_batch_size: int) -> _Dims:
    act = shape.activation_bytes
    t = shape.tensor_model_parallel_size
    # torch's RMSNorm computes in fp32: a 16-bit model's norms save an fp32 copy of the input
    rms_upcasts = models.NORMS[shape.normalization].saves_normed and act == 2
    return _Dims(s=shape.seq_length, sr=shape.seq_length // t if shape.sequence_parallel
                 else shape.seq_length, b=micro_batch_size, h=shape.hidden_size,
                 a=shape.num_attention_heads // t, g=shape.groups // t, hd=shape.head_dim,
                 f=shape.ffn // t, act=act, softmax=4 if shape.softmax_in_fp32 else act,
                 norm_in=4 if rms_upcasts else act,
                 rot=int(shape.head_dim * shape.rotary_percent))


def site_bytes(shape: ModelShape, micro_batch_size: int) -> dict[str, int]:
    """Full size of every site of one layer."""
    d = _dims(shape, micro_batch_size)
    return {name: f.elements(d) * f.element_bytes(d) for name, f in _layer_sites(shape).items()}


# --- codecs ----------------------------------------------------------------------------------
def codec_payload_bytes(codec: str, elements: int, dtype: str, channels: int) -> int:
    """Bytes a codec keeps for a finite tensor of `elements` elements of `dtype` (a torch
    dtype name) in rows of `channels`, as the codec itself counts them; the outlier codec
    keeps ``OUTLIER_CHANNEL_FRACTION`` of the channels exact."""
    selected = codecs.get(codec)
    outliers = int(round(channels * OUTLIER_CHANNEL_FRACTION)) if selected.separates_outliers else 0
    return selected.payload_bytes((elements // channels, channels), getattr(torch, dtype), outliers)


def _codec_cost(codec: str, full: int, payload: int, bandwidth: float) -> CodecCost:
    rate = bandwidth * CODEC_EFFICIENCY
    # Encode reads the tensor and writes the payload; the outlier codec first reads it once
    # more for the per-channel sums. Decode reads the payload and writes the tensor.
    extra_pass = full if codec == "outlier_int4" else 0
    return CodecCost(codec=codec, payload_bytes=payload,
                     encode_s=(full + payload + extra_pass) / rate,
                     decode_s=(payload + full) / rate)


# --- the costs --------------------------------------------------------------------------------
def embedding_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations the embedding saves for its backward (the first stage's): its dropout's
    mask. They live until the embedding backprops, after every layer."""
    d = _dims(shape, micro_batch_size)
    return _stream(d) if shape.hidden_dropout > 0 else 0


def output_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations of the final LayerNorm, the output layer and the loss (the last stage's),
    alive at the end of forward and freed by the loss backward before any layer backprops.

    The final norm saves what a layer's norm saves and the output layer saves the norm's
    output; the logits exist in 16 bit while the cross-entropy works on an fp32 copy whose
    softmax it saves (2 + 4 bytes per logit; 4 in fp32). At GPT-2's vocabulary the logits
    dominate. Under tensor parallelism each rank holds its vocabulary shard's logits.
    """
    d = _dims(shape, micro_batch_size)
    norm = _norm_sites(shape, "final", "final_in")
    norms = sum(f.elements(d) * f.element_bytes(d) for f in norm.values())
    # In fp32 the cross-entropy needs no copy: it works in place on the logits.
    per_logit = 4 if d.act == 4 else d.act + 4
    logits = d.s * d.b * shape.padded_vocab_size // shape.tensor_model_parallel_size * per_logit
    return norms + logits


def backward_workspace_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Gradients alive while one layer backprops, whatever the plan: the gradient of the
    residual stream plus the largest op's output and input gradients (the attention
    probabilities' in the attention block, the fc1/GELU pair in the MLP)."""
    d = _dims(shape, micro_batch_size)
    residual = _stream(d) * d.act
    attention_pair = 2 * d.a * d.s * d.s * d.b * max(d.act, d.softmax)
    if shape.attention_backend == "flash":  # no s^2 gradient: dQ, dK, dV and the output's
        attention_pair = 2 * d.s * d.b * (d.a + d.g) * d.hd * d.act
    mlp_pair = (3 if shape.swiglu else 2) * d.s * d.b * d.f * d.act
    return residual + max(attention_pair, mlp_pair)


def analytic_costs(shape: ModelShape, micro_batch_size: int, accelerator: str | Accelerator,
                   zero_stage: int = 0, data_parallel_size: int = 1) -> ModelCosts:
    """``ModelCosts`` for ``shape`` at ``micro_batch_size`` on a named accelerator, the whole
    model on one stage."""
    return pipeline_costs(shape, micro_batch_size, accelerator, 1, 1, zero_stage,
                          data_parallel_size)[0]


def pipeline_costs(shape: ModelShape, micro_batch_size: int, accelerator: str | Accelerator,
                   pipeline_size: int, num_micro_batches: int, zero_stage: int = 0,
                   data_parallel_size: int = 1) -> list[ModelCosts]:
    """``ModelCosts`` of each of ``pipeline_size`` stages under 1F1B with
    ``num_micro_batches`` per step: every stage its share of the layers and their
    parameters; the first the embedding (parameters and activations), the last the output
    layer and loss; optimizer states sharded by ``zero_stage`` over ``data_parallel_size``
    ranks. ``planning.stage_costs`` cuts the stages from one layer's costs and what each
    stage holds besides its layers, as it does for a profile."""
    device = get_accelerator(accelerator) if isinstance(accelerator, str) else accelerator
    if shape.precision == "bf16" and not device.supports_bf16:
        raise ValueError(f"{device.name} has no bfloat16; plan with fp16")
    pipelined = pipeline_size > 1
    counts = planning.stage_layer_counts(shape.num_layers, pipeline_size)
    parameters = [layers * shape.layer_parameters
                  + (shape.embedding_parameters if stage == 0 else 0)
                  + (shape.output_parameters(pipelined) if stage == pipeline_size - 1 else 0)
                  for stage, layers in enumerate(counts)]
    memory = [planning.StageMemory(
        static_bytes=static_bytes(count, shape.precision, zero_stage, data_parallel_size),
        embedding_bytes=embedding_activation_bytes(shape, micro_batch_size) if stage == 0 else 0,
        non_layer_bytes=(output_activation_bytes(shape, micro_batch_size)
                         if stage == pipeline_size - 1 else 0))
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
        meta={
            "source": "analytic",
            "accelerator": device.name,
            "capacity_bytes": device.capacity_bytes,
            "shape": {k: v for k, v in shape.__dict__.items()},
            "zero_stage": zero_stage,
            "data_parallel_size": data_parallel_size,
            "matmul_efficiency": MATMUL_EFFICIENCY,
            "bandwidth_efficiency": BANDWIDTH_EFFICIENCY,
            "codec_efficiency": CODEC_EFFICIENCY,
        },
    )
    stages = planning.stage_costs(layer_costs, memory, shape.num_layers, num_micro_batches)
    return [replace(costs, meta={**costs.meta, "num_parameters": count})
            for costs, count in zip(stages, parameters)]


def _site_costs(shape: ModelShape, micro_batch_size: int, device: Accelerator
                ) -> tuple[list[SiteCost], tuple[Operator, ...]]:
    """Every site of one layer (its bytes, rebuild time and codec cost on ``device``) and the
    operators that rebuild some of them."""
    d = _dims(shape, micro_batch_size)
    flop_rate = device.matmul_flops(shape.activation_bytes) * MATMUL_EFFICIENCY
    byte_rate = device.memory_bandwidth * BANDWIDTH_EFFICIENCY
    dtype_names = {"act": _DTYPE_NAMES[shape.precision],
                   "softmax": "float32" if d.softmax == 4 else _DTYPE_NAMES[shape.precision],
                   "norm_in": "float32" if d.norm_in == 4 else _DTYPE_NAMES[shape.precision]}
    formulas = _layer_sites(shape)
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
                        if source not in site_table.MASK_SITES) + 1
            operators.append(Operator(edge.call, sources, sum(
                step_s[name] for name in order[after:order.index(edge.output) + 1])))
    operator_names = {operator.name for operator in operators}
    sites = []
    since_start: dict[str, float] = {}   # segment -> forward time up to the last save so far
    for name, formula in formulas.items():
        elements, element_bytes = formula.elements(d), formula.element_bytes(d)
        full = elements * element_bytes
        known = site_table.get(name)
        dtype = dtype_names.get(formula.dtype, formula.dtype)
        codecs = ()
        if known.default_codec is not None:
            payload = codec_payload_bytes(known.default_codec, elements, dtype,
                                          formula.channels(d))
            codecs = (_codec_cost(known.default_codec, full, payload, device.memory_bandwidth),)
        rebuild_s = 0.0
        if known.segment is not None:
            rebuild_s = since_start.get(known.segment, 0.0) + step_s[name]
            since_start[known.segment] = rebuild_s
        edge = site_table.REBUILT_BY.get(name)
        operator = edge.call if edge is not None and edge.call in operator_names else None
        sites.append(SiteCost(
            name=name,
            bytes=full,
            dtype=dtype,
            rebuild_s=0.0 if operator else rebuild_s,
            segment=None if operator else known.segment,
            codecs=codecs,
            operator=operator,
        ))
    return sites, tuple(operators)
