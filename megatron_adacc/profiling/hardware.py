"""An analytic cost model of a named accelerator, so a GPU run can be planned on a laptop.

Given a GPT shape, a micro-batch and an accelerator's peak matmul rate and memory bandwidth,
produce the same ``ModelCosts`` the profiler measures:

- bytes per site from the megatron-core local layer (``_layer_sites``): the terms of the
  parts every family shares (core attention, the bias-dropout-adds) are here, the norm's,
  positions' and MLP's are declared by the parts the shape's flags select (models/: GPT's
  and Llama's; with 16-bit activations and dropout on GPT's add up to 34sbh + 5as^2b);
- rebuild time of a site = the ops the forward runs from its segment's start (sites.SEGMENTS)
  up to its save, each on a roofline: matmuls are FLOP-bound at ``MATMUL_EFFICIENCY`` of
  peak, elementwise / norm / softmax / RNG ops are bound by the bytes they move at
  ``BANDWIDTH_EFFICIENCY`` of peak bandwidth; an op that does both pays both. A site an
  operator rebuilds (sites.REBUILDS) instead costs that operator: the ops the forward runs
  from its last source's save (a mask's excepted) to the operator's output;
- codec payloads from the codecs themselves (``Codec.payload_bytes``: the exact size of a
  finite input's payload) and codec time = bytes the codec moves at ``CODEC_EFFICIENCY`` of
  peak bandwidth;
- static memory and what the optimizer step adds to it from the parameter count, precision
  and optimizer (``static_bytes``, ``step_bytes``), or from a model and megatron's engine
  around it (``model_static_bytes``, ``model_step_bytes``, ``engine_static_bytes``,
  ``engine_step_bytes``);
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
from megatron_adacc.models.attention_backend import resolve_backend
from megatron_adacc.models.terms import (INPUT_NORM, PRE_MLP_NORM, Dims, SiteTerm, act, fp32,
                                         hidden_channels, no_bytes, no_flops, stream)
from megatron_adacc.common.costs import CodecCost, ModelCosts, Operator, SiteCost

GiB = 1024**3

# Fraction of the spec-sheet peak a well-shaped GEMM reaches in Megatron-sized layers.
MATMUL_EFFICIENCY = 0.6
# Fraction of peak DRAM bandwidth a streaming elementwise kernel reaches.
BANDWIDTH_EFFICIENCY = 0.8
# Fused int4 codec kernels do a little arithmetic per byte and a reduction for the scales (CPU
# figures: docs/results.md section 6). We assume GPU Triton kernels reach half the bandwidth
# of a copy.
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
    # The H100's processor with 141 GB of HBM3e at 4.8 TB/s (datasheet); CUDA reports about
    # 140 GiB of it (143,771 MiB by nvidia-smi on this project's lent machine).
    "h200-141gb": Accelerator("NVIDIA H200 SXM 141GB", 989e12, 67e12, 4800e9, 140 * GiB),
}


def get_accelerator(name: str) -> Accelerator:
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}"
        ) from None


# --- model shape -------------------------------------------------------------------------
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
        self.variant  # noqa: B018  (a ValueError naming an unknown part's flag)
        if self.precision not in _DTYPE_NAMES:
            raise ValueError(f"precision must be one of {sorted(_DTYPE_NAMES)}, "
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
        return self.variant.mlp.default_ffn(self.hidden_size)

    @property
    def groups(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def variant(self) -> models.LayerVariant:
        """The layer's parts its flags select: each declares its terms (models/)."""
        return models.layer_variant(self.normalization, self.swiglu,
                                    self.position_embedding_type)

    @property
    def norm_parameters(self) -> int:
        return self.variant.norm.parameters_per_channel * self.hidden_size

    @property
    def activation_bytes(self) -> int:
        return getattr(torch, _DTYPE_NAMES[self.precision]).itemsize

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
        fc1 = self.variant.mlp.fc1_width * f
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
        positions = self.variant.positions.table_rows(self.max_position_embeddings
                                                      or self.seq_length)
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

        # A tokenizer's vocabulary is the caller's to resolve (cli.py for adacc plan).
        vocab = need("vocab-size")
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
               data_parallel_size: int = 1) -> int:
    """What the optimizer step adds for ``num_parameters`` (ModelCosts.optimizer_step_bytes):
    with fp16, an fp32 copy of the gradient of each main parameter the rank steps (sharded
    with the optimizer states); Megatron-LM accumulates bf16 gradients in fp32, no copy."""
    if precision != "fp16":
        return 0
    return 4 * _parameters_held(num_parameters, zero_stage, data_parallel_size, 1)


# torch's Adam(W) state per stepped tensor: exp_avg and exp_avg_sq like the tensor, and a
# 0-dim fp32 step count.
_ADAM_MOMENTS = 2
_ADAM_STEP_BYTES = 4


def _adam_state_bytes(main_param: torch.Tensor) -> int:
    return _ADAM_MOMENTS * main_param.numel() * main_param.element_size() + _ADAM_STEP_BYTES


def _gradient_dtype(param: torch.Tensor, grad_dtype: torch.dtype | None) -> torch.dtype:
    """megatron's gradient buffer dtype for ``param``: ``grad_dtype``, by default fp32 for
    fp32 and bf16 models (Megatron-LM accumulates bf16 in fp32), the parameter's for fp16."""
    return grad_dtype or (param.dtype if param.dtype == torch.float16 else torch.float32)


def model_static_bytes(model: torch.nn.Module, grad_dtype: torch.dtype | None = None) -> int:
    """What megatron's engine holds for ``model`` through a step on one data-parallel rank
    without the distributed optimizer: parameters and buffers, a gradient buffer
    (``_gradient_dtype``), fp32 main parameters for a 16-bit model, and Adam's state. Equal
    to ``engine_static_bytes`` of that engine; for a model before it is wrapped (profiling,
    the Python API)."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for param in model.parameters():
        if not param.requires_grad:
            continue
        total += param.numel() * _gradient_dtype(param, grad_dtype).itemsize
        if param.dtype != torch.float32:
            total += param.numel() * 4                       # the fp32 main parameter
        total += _ADAM_MOMENTS * param.numel() * 4 + _ADAM_STEP_BYTES
    return total


def model_step_bytes(model: torch.nn.Module, grad_dtype: torch.dtype | None = None) -> int:
    """What that engine's optimizer step adds (ModelCosts.optimizer_step_bytes): an fp32
    copy of each 16-bit gradient. Equal to ``engine_step_bytes``."""
    return sum(param.numel() * 4 for param in model.parameters()
               if param.requires_grad and param.dtype != torch.float32
               and _gradient_dtype(param, grad_dtype) != torch.float32)


def engine_static_bytes(model_chunks, optimizer) -> int:
    """What megatron's engine holds on this rank through every forward and backward, read
    off the engine before its first step: the distinct storages of the parameters and
    buffers, of DistributedDataParallel's gradient (and, under the distributed optimizer,
    parameter) buffers and of the optimizer's main parameters, and Adam's state, which
    torch allocates at the first step: two moments like each main parameter (its shard,
    under the distributed optimizer) and a step count."""
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
    state = 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        stepped = [p for group in inner.optimizer.param_groups for p in group["params"]]
        for main_param in stepped:
            hold(main_param)
            held_state = inner.optimizer.state.get(main_param)
            state += (sum(t.untyped_storage().nbytes() for t in held_state.values()
                          if torch.is_tensor(t)) if held_state else _adam_state_bytes(main_param))
    return sum(storages.values()) + state


def engine_step_bytes(optimizer) -> int:
    """What megatron's optimizer step adds on this rank (ModelCosts.optimizer_step_bytes):
    the fp32 gradient of each main parameter (its shard) whose 16-bit gradient buffer the
    step copies (``main_grad.float()``), dropped again by the next step's zero_grad."""
    return sum(main_param.numel() * 4
               for inner in getattr(optimizer, "chained_optimizers", [optimizer])
               for model_param, main_param in _main_params_of(inner)
               if model_param.main_grad.dtype != torch.float32)


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
# The terms of the parts every family shares: core attention and the bias-dropout-adds. The
# families' parts declare theirs (models/: the norm, positions and MLP).
def _rng_moved_stream(d: Dims) -> float:
    return stream(d) * d.mask


def _rng_moved_attn(d: Dims) -> float:
    return d.a * d.s * d.s * d.b * d.mask


def _softmax(d: Dims) -> str:
    return "float32" if d.softmax == 4 else d.act_dtype


def _int64(d: Dims) -> str:
    return "int64"


def _bool(d: Dims) -> str:
    return "bool"


def _attention_dropout(shape: ModelShape) -> bool:
    return shape.attention_dropout > 0


def _probabilities_copied(shape: ModelShape) -> bool:
    # The matmul with V saves probabilities of their own: the dropout's output, or the
    # 16-bit cast of an fp32 softmax output.
    return shape.attention_dropout > 0 or (shape.softmax_in_fp32 and shape.activation_bytes == 2)


def _hidden_dropout(shape: ModelShape) -> bool:
    return shape.hidden_dropout > 0


def _qkv_flops(d: Dims) -> float:
    return 2 * d.s * d.b * d.h * (d.a + 2 * d.g) * d.hd


def _ahead(flops: Callable[[Dims], float], table: dict[str, SiteTerm]) -> dict[str, SiteTerm]:
    """``table`` with a linear layer's matmul ``flops`` run before its first save."""
    first = next(iter(table))
    return {**table, first: table[first].after(flops)}


def _qkv_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """What the positions save after linear_qkv, then Q, K and V as core attention saves
    them. Under sequence parallelism linear_qkv gathers the sequence first: from here on
    every tensor has the whole sequence and this rank's heads."""
    positions = shape.variant.positions
    if shape.attention_backend == "flash":
        # SDPA keeps K and V at the groups; V is its own copy beside RoPE's Q and K
        def heads(d):
            return d.a + 2 * d.g
    else:
        heads = positions.unfused_qkv_heads
    qkv = SiteTerm(lambda d: heads(d) * d.s * d.b * d.hd, act, no_flops,
                   lambda d: (d.a + 2 * d.g) * d.s * d.b * d.hd * d.act,
                   lambda d: heads(d) * d.hd)
    return _ahead(_qkv_flops, {**positions.site_terms, "qkv": qkv})


def _unfused_core_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    def attn(d):
        return d.a * d.s * d.s * d.b

    return {
        # Q K^T, scale and mask, softmax: scores written and read in 16 bit, probs written.
        "softmax_out": SiteTerm(attn, _softmax, lambda d: 2 * d.b * d.s * d.s * d.aw,
                                lambda d: attn(d) * (2 * d.act + d.softmax),
                                lambda d: d.s),
        "attn_dropout_mask": SiteTerm(attn, _bool, no_flops, _rng_moved_attn, lambda d: d.s,
                                      when=_attention_dropout),
        "attn_probs": SiteTerm(attn, act, no_flops,
                               lambda d: attn(d) * (d.softmax + d.mask + d.act),
                               lambda d: d.s, when=_probabilities_copied),
        # The probabilities times V; linear_proj saves the context on entry.
        "context": SiteTerm(lambda d: d.s * d.b * d.aw, act,
                            lambda d: 2 * d.b * d.s * d.s * d.aw,
                            lambda d: 2 * d.s * d.b * d.aw * d.act, lambda d: d.aw),
    }


def _flash_core_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """What SDPA's flash (or memory-efficient) kernel saves after Q, K and V, in save order.
    The kernel computes Q K^T, softmax and the product with V in on-chip tiles: no s^2 tensor
    reaches memory, and causal masking skips the blocks above the diagonal (half the FLOPs of
    the unfused matmuls). Its output is the storage linear_proj saves (the context)."""
    return {
        "attn_lse": SiteTerm(lambda d: d.a * d.s * d.b, fp32,
                             lambda d: 2 * d.b * d.s * d.s * d.aw,
                             lambda d: 4 * d.s * d.b * d.aw * d.act + 4 * d.a * d.s * d.b,
                             lambda d: d.a),
        # CUDA's philox seed and offset: two int64 scalars, with dropout on.
        "attn_rng_state": SiteTerm(lambda d: 2, _int64, no_flops, no_bytes, lambda d: 1,
                                   when=_attention_dropout),
        "context": SiteTerm(lambda d: d.s * d.b * d.aw, act, no_flops, no_bytes,
                            lambda d: d.aw),
    }


def _mlp_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """linear_fc1's matmul (``fc1_width`` ffn widths: SwiGLU's two of its three matmuls),
    then what the MLP part saves; linear_fc2 saves its output."""
    mlp = shape.variant.mlp
    return _ahead(lambda d: 2 * d.s * d.b * d.h * (mlp.fc1_width * d.f), dict(mlp.site_terms))


def _layer_sites(shape: ModelShape) -> dict[str, SiteTerm]:
    """The sites of one megatron-core local-spec layer on one tensor-parallel rank, for the
    shape's layer variant (its parts' terms, models/) and attention backend, in the order
    forward saves them; each term's op costs are those of the ops since the previous save."""
    norm = shape.variant.norm
    def proj_flops(d):
        return 2 * d.s * d.b * d.aw * d.h

    # Without the bias-dropout-add mask, the next save after the context is ln2_in: the
    # output projection runs before it.
    ln2_in_flops = no_flops if _hidden_dropout(shape) else proj_flops
    core = (_flash_core_sites if shape.attention_backend == "flash" else _unfused_core_sites)
    table = {
        **norm.site_terms(*INPUT_NORM),
        **_qkv_sites(shape),
        **core(shape),
        "bda1_mask": SiteTerm(stream, _bool, proj_flops, _rng_moved_stream, hidden_channels,
                              when=_hidden_dropout),
    }
    mlp_norm = norm.site_terms(*PRE_MLP_NORM)
    # The bias-dropout-add; pre_mlp_layernorm saves its input on entry.
    mlp_norm["ln2_in"] = replace(mlp_norm["ln2_in"], flops=ln2_in_flops,
                                 bytes_moved=lambda d: 3 * stream(d) * d.act + stream(d) * d.mask)
    table.update(mlp_norm)
    table.update(_mlp_sites(shape))
    # fc2, then the dropout of the second bias-dropout-add draws its mask.
    table["bda2_mask"] = SiteTerm(stream, _bool, lambda d: 2 * d.s * d.b * d.f * d.h,
                                  lambda d: stream(d) * d.act + _rng_moved_stream(d),
                                  hidden_channels, when=_hidden_dropout)
    return {name: term for name, term in table.items() if term.when(shape)}


def _dims(shape: ModelShape, micro_batch_size: int) -> Dims:
    act_bytes = shape.activation_bytes
    t = shape.tensor_model_parallel_size
    return Dims(s=shape.seq_length, sr=shape.seq_length // t if shape.sequence_parallel
                else shape.seq_length, b=micro_batch_size, h=shape.hidden_size,
                a=shape.num_attention_heads // t, g=shape.groups // t, hd=shape.head_dim,
                f=shape.ffn // t, act=act_bytes, act_dtype=_DTYPE_NAMES[shape.precision],
                softmax=4 if shape.softmax_in_fp32 else act_bytes,
                rot=int(shape.head_dim * shape.rotary_percent))


def _full_bytes(shape: ModelShape, micro_batch_size: int, shared: bool) -> dict[str, int]:
    d = _dims(shape, micro_batch_size)
    return {name: term.bytes(d) for name, term in _layer_sites(shape).items()
            if site_table.get(name).shared == shared}


def site_bytes(shape: ModelShape, micro_batch_size: int) -> dict[str, int]:
    """Full size of every site of one layer (the sites it decides for)."""
    return _full_bytes(shape, micro_batch_size, shared=False)


def shared_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """The shared sites' one storage for every layer of a stage (RoPE's cos and sin): non-layer
    bytes that live until the stage's first layer backprops."""
    return sum(_full_bytes(shape, micro_batch_size, shared=True).values())


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


def _codec_cost(codec: str, full: int, payload: int, bandwidth: float,
                capacity: int | None = None) -> CodecCost:
    rate = bandwidth * CODEC_EFFICIENCY
    # Encode reads the tensor and writes the payload; a codec that separates outliers first
    # reads it once more for the per-channel sums. Decode reads the payload and writes the
    # tensor.
    extra_pass = full if codecs.get(codec).separates_outliers else 0
    return CodecCost(codec=codec, payload_bytes=payload,
                     encode_s=(full + payload + extra_pass) / rate,
                     decode_s=(payload + full) / rate, capacity=capacity)


# --- the costs --------------------------------------------------------------------------------
def embedding_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations the embedding saves for its backward (the first stage's): its dropout's
    mask. They live until the embedding backprops, after every layer."""
    d = _dims(shape, micro_batch_size)
    return stream(d) if shape.hidden_dropout > 0 else 0


def output_activation_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Activations of the final norm, the output layer and the loss (the last stage's),
    alive at the end of forward and freed by the loss backward before any layer backprops.

    The final norm saves what a layer's norm saves and the output layer saves the norm's
    output; the logits exist in 16 bit while the cross-entropy works on an fp32 copy whose
    softmax it saves (2 + 4 bytes per logit; 4 in fp32). At GPT-2's vocabulary the logits
    dominate. Under tensor parallelism each rank holds its vocabulary shard's logits.
    """
    d = _dims(shape, micro_batch_size)
    norms = sum(term.bytes(d)
                for term in shape.variant.norm.site_terms("final", "final_in").values())
    # In fp32 the cross-entropy needs no copy: it works in place on the logits.
    per_logit = 4 if d.act == 4 else d.act + 4
    logits = d.s * d.b * shape.padded_vocab_size // shape.tensor_model_parallel_size * per_logit
    return norms + logits


def backward_workspace_bytes(shape: ModelShape, micro_batch_size: int) -> int:
    """Gradients alive while one layer backprops, whatever the plan: the gradient of the
    residual stream plus the largest op's output and input gradients (the attention
    probabilities' in the attention block, the fc1/GELU pair in the MLP)."""
    d = _dims(shape, micro_batch_size)
    residual = stream(d) * d.act
    attention_pair = 2 * d.a * d.s * d.s * d.b * max(d.act, d.softmax)
    if shape.attention_backend == "flash":  # no s^2 gradient: dQ, dK, dV and the output's
        attention_pair = 2 * d.s * d.b * (d.a + d.g) * d.hd * d.act
    # the activation's input gradient (fc1's output) and its output gradient
    mlp_pair = (shape.variant.mlp.fc1_width + 1) * d.s * d.b * d.f * d.act
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
    shared = shared_activation_bytes(shape, micro_batch_size)
    memory = [planning.StageMemory(
        static_bytes=static_bytes(count, shape.precision, zero_stage, data_parallel_size),
        optimizer_step_bytes=step_bytes(count, shape.precision, zero_stage, data_parallel_size),
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
            site_codecs = (_codec_cost(known.default_codec, encoded * formula.element_bytes(d),
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
