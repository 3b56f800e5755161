"""Building megatron-core GPT models and the process groups they live in.

One place for the steps every entry point repeats (the trainer, the profiler, tests,
benchmarks): CPU shims, the gloo/NCCL process group, model-parallel state, seeds, and a
``GPTModel`` built from megatron-core's local layer spec (or an Adacc subclass of it).
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc import megatron_compat
from megatron_adacc.attention import DEFAULT_SPEC_BACKEND, local_layer_spec


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(tensor_model_parallel_size: int = 1) -> None:
    """Join (or, for a plain ``python`` run, create) the process group and set up
    megatron-core's model-parallel groups. gloo on CPU, NCCL on GPU. Idempotent."""
    megatron_compat.apply()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        timeout = datetime.timedelta(minutes=10)
        if "RANK" in os.environ:  # launched by torchrun
            dist.init_process_group(backend, timeout=timeout)
        else:
            # A world of one on a private port, passed explicitly rather than through
            # os.environ: child processes must not inherit a rank and a port in use.
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{_free_port()}",
                                    rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % tensor_model_parallel_size:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size} does not divide the "
            f"world size {world}; launch a multiple of it with torchrun --nproc_per_node"
        )
    if parallel_state.model_parallel_is_initialized():
        if parallel_state.get_tensor_model_parallel_world_size() == tensor_model_parallel_size:
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, 1)


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: NCCL reduces only CUDA
    tensors (megatron puts its scalars on torch.cuda.current_device()), gloo host ones."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def set_seed(seed: int) -> None:
    """Seed every generator the model draws from (the tensor-parallel tracker included)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build_transformer_config(**overrides: Any):
    """A TransformerConfig for the local (non-TE) spec with CPU-friendly defaults."""
    from megatron.core.transformer import TransformerConfig

    on_gpu = torch.cuda.is_available()
    params: dict[str, Any] = dict(
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        apply_rope_fusion=False,
    )
    params.update(overrides)
    return TransformerConfig(**params)


def build_gpt_model(config, vocab_size: int, max_sequence_length: int, layer_spec=None,
                    attention_backend: str = DEFAULT_SPEC_BACKEND):
    """megatron-core GPTModel with learned absolute positions (GPT-2 style), built from
    `layer_spec`, by default megatron-core's local spec with `attention_backend`'s core
    attention (see attention.py)."""
    from megatron.core.models.gpt import GPTModel

    spec = layer_spec if layer_spec is not None else local_layer_spec(attention_backend)
    model = GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        share_embeddings_and_output_weights=True,
        position_embedding_type="learned_absolute",
    )
    if config.bf16 or config.fp16:
        # megatron's Float16Module does the same: every parameter (position embedding and
        # layernorms included) in 16 bits, so activations stay 16-bit from the embedding on.
        model = model.bfloat16() if config.bf16 else model.half()
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def gpt_loss(model, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor):
    """Mean token loss of one micro-batch (tokens/labels/loss_mask: [batch, seq])."""
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device).unsqueeze(0).expand_as(tokens)
    per_token = model(tokens, position_ids, None, labels=labels)
    mask = loss_mask.float()
    return (per_token.float() * mask).sum() / mask.sum().clamp(min=1)
