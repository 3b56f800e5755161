"""Building megatron-core GPT models and the process groups they live in.

One place for the steps every entry point repeats (the trainer, the profiler, tests, benchmarks):
CPU shims, the gloo/NCCL process group, model-parallel state, seeds, and a ``GPTModel``. The model
is built from megatron-core's local layer spec, or an Adacc subclass.
"""
from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from megatron_adacc import megatron_compat
from megatron_adacc.models.attention import DEFAULT_SPEC_BACKEND, local_layer_spec
from megatron_adacc.models import EmbeddingOptions, TorchNorm


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_distributed(tensor_model_parallel_size: int = 1,
                     pipeline_model_parallel_size: int = 1) -> None:
    """Join or create the process group, and set up megatron-core's model-parallel groups.

    A plain ``python`` run creates the group: gloo on CPU, NCCL on GPU. The model-parallel groups
    are tensor, pipeline and the embedding group that ties the first and last stages' word
    embeddings. Calling it again does nothing."""
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
    model_parallel = tensor_model_parallel_size * pipeline_model_parallel_size
    if world % model_parallel:
        raise ValueError(
            f"--tensor-model-parallel-size {tensor_model_parallel_size} x "
            f"--pipeline-model-parallel-size {pipeline_model_parallel_size} does not divide "
            f"the world size {world}; launch a multiple of {model_parallel} processes with "
            f"torchrun --nproc_per_node"
        )
    if parallel_state.model_parallel_is_initialized():
        if (parallel_state.get_tensor_model_parallel_world_size() == tensor_model_parallel_size
                and parallel_state.get_pipeline_model_parallel_world_size()
                == pipeline_model_parallel_size):
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size,
                                             pipeline_model_parallel_size)


def shutdown_distributed() -> None:
    """Undo ``init_distributed``: megatron-core's model-parallel groups, then the process group.

    It skips what was never set up. Entry points call it on every exit. A process group left for
    the interpreter's exit to tear down can abort the process once training has finished
    (``terminate called without an active exception``)."""
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def collective_device(group=None) -> torch.device:
    """Where a tensor for a collective on ``group`` must live: CUDA for NCCL, the host for gloo.

    NCCL reduces only CUDA tensors; megatron puts its scalars on torch.cuda.current_device()."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def max_over(values: list[int], group=None) -> list[int]:
    """Each of ``values``' largest over ``group``'s ranks, reduced on its collective device."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(values)
    box = torch.tensor(values, dtype=torch.int64, device=collective_device(group))
    dist.all_reduce(box, op=dist.ReduceOp.MAX, group=group)
    return box.tolist()


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
                    attention_backend: str = DEFAULT_SPEC_BACKEND,
                    embedding: EmbeddingOptions = EmbeddingOptions()):
    """megatron-core GPTModel built from ``layer_spec``; one whole model, not a pipeline stage.

    - ``layer_spec`` defaults to megatron-core's local spec with ``attention_backend``'s core
      attention (see attention.py).
    - Positions and output layer are ``embedding``'s; the default is GPT-2's (learned absolute
      positions, tied output layer).
    - Under sequence parallelism or zero-centred gamma the norms are ``TorchNorm``s, since
      megatron's torch norm asserts there.
    Megatron-LM's model provider (pretrain_gpt.py) builds pipeline stages."""
    if config.pipeline_model_parallel_size > 1:
        raise ValueError("build_gpt_model builds a whole model; train pipeline stages with "
                         "pretrain_gpt.py, whose model provider builds each rank's stage")
    spec = layer_spec if layer_spec is not None else local_layer_spec(attention_backend)
    if config.sequence_parallel or config.layernorm_zero_centered_gamma:
        spec = torch_norm_block(config, spec)
    model = _gpt_model(config, spec, vocab_size, max_sequence_length, embedding)
    if config.bf16 or config.fp16:
        # megatron's Float16Module does the same: every parameter (position embedding and
        # layernorms included) in 16 bits, so activations stay 16-bit from the embedding on.
        model = model.bfloat16() if config.bf16 else model.half()
    if torch.cuda.is_available():
        model = model.cuda()
    return model


def torch_norm_block(config, spec, vp_stage: int | None = None):
    """The block spec of ``spec``'s layers, every megatron torch norm a TorchNorm.

    ``spec`` is a layer's spec or a block's. That covers the layers' norms and the final one."""
    import dataclasses

    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    def torch_norms(layer_spec):
        submodules = layer_spec.submodules
        norms = {name: TorchNorm for name in ("input_layernorm", "pre_mlp_layernorm")
                 if getattr(submodules, name) is WrappedTorchNorm}
        return dataclasses.replace(layer_spec,
                                   submodules=dataclasses.replace(submodules, **norms))

    if isinstance(spec, TransformerBlockSubmodules):
        return dataclasses.replace(spec, layer_specs=list(map(torch_norms, spec.layer_specs)),
                                   layer_norm=TorchNorm)
    return TransformerBlockSubmodules(
        layer_specs=[torch_norms(spec)] * get_num_layers_to_build(config, vp_stage=vp_stage),
        layer_norm=TorchNorm)


def _gpt_model(config, spec, vocab_size: int, max_sequence_length: int,
               embedding: EmbeddingOptions):
    from megatron.core.models.gpt import GPTModel

    return GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        **embedding.gpt_model_kwargs(),
    )


def gpt_loss(model, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor):
    """Mean token loss of one micro-batch (tokens/labels/loss_mask: [batch, seq])."""
    loss_sum, num_tokens = masked_loss_sum(gpt_forward(model, tokens, labels), loss_mask)
    return loss_sum / num_tokens.clamp(min=1)


def gpt_forward(model, tokens: torch.Tensor | None, labels: torch.Tensor | None):
    """The model's output for one micro-batch: per-token loss on the last stage, else hidden states.

    The loss is [batch, seq], given labels; other stages return hidden states for the next. A
    stage after the first takes its input from megatron's set_input_tensor, not ``tokens``."""
    position_ids = None
    if tokens is not None:
        position_ids = (torch.arange(tokens.shape[1], device=tokens.device)
                        .unsqueeze(0).expand_as(tokens))
    return model(tokens, position_ids, None, labels=labels)


def masked_loss_sum(per_token: torch.Tensor, loss_mask: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the per-token losses the mask keeps, in fp32; the number of tokens kept)."""
    mask = loss_mask.float()
    return (per_token.float() * mask).sum(), mask.sum()
