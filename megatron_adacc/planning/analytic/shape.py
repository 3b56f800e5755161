"""A GPT's shape as Megatron-LM's flags give it, and its parameter counts on one rank."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from megatron_adacc import models
from megatron_adacc.models.attention_backend import resolve_backend

DTYPE_NAMES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


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
    # What the layer's kernels save: CUDA's (torch's fused RMSNorm; megatron's bias-SwiGLU
    # fusion where --bias-swiglu-fusion is on) or, by default, a CPU's, as this machine
    # measures them. from_flags prices a CUDA GPU.
    cuda_kernels: bool = False
    bias_swiglu_fusion: bool = True
    # Whether the GPU steps with torch's foreach AdamW (no Transformer Engine or Apex
    # installed), whose workspace is like every main parameter.
    foreach_adam: bool = False

    def __post_init__(self) -> None:
        self.variant  # noqa: B018  (a ValueError naming an unknown part's flag)
        if self.precision not in DTYPE_NAMES:
            raise ValueError(f"precision must be one of {sorted(DTYPE_NAMES)}, "
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
        return getattr(torch, DTYPE_NAMES[self.precision]).itemsize

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
    def from_flags(cls, flags: Mapping[str, Any], foreach_adam: bool = False) -> "ModelShape":
        """From Megatron-style flag names (``num-layers`` or ``num_layers``), as in a YAML
        config. Raises ValueError naming a missing flag.

        ``foreach_adam``: what the install steps with (engine_memory.steps_with_torch_adam)."""
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
            cuda_kernels=True,
            foreach_adam=foreach_adam,
            bias_swiglu_fusion=(bool(norm.get("bias-swiglu-fusion", True))
                                and not norm.get("no-bias-swiglu-fusion", False)),
        )
