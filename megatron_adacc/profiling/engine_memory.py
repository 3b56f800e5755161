"""What megatron's engine holds for a model: parameters, gradients, main parameters, Adam's state.

Read off a model before it is wrapped (``model_*``: profiling, the Python API), or off
megatron's DistributedDataParallel and optimizer (``engine_*``: Megatron-LM's loop).
"""
from __future__ import annotations

import torch

from megatron_adacc.profiling import allocator

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
    """What megatron's engine holds for ``model`` in a step: one rank, no distributed optimizer.

    That is parameters and buffers, a gradient buffer (``_gradient_dtype``), fp32 main
    parameters for a 16-bit model, and Adam's state. It equals ``engine_static_bytes`` of that
    engine, for a model before it is wrapped (profiling, the Python API)."""
    total = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    for param in model.parameters():
        if not param.requires_grad:
            continue
        total += param.numel() * _gradient_dtype(param, grad_dtype).itemsize
        if param.dtype != torch.float32:
            total += param.numel() * 4                       # the fp32 main parameter
        total += _ADAM_MOMENTS * param.numel() * 4 + _ADAM_STEP_BYTES
    return total


def storage_bytes(tensors, device: torch.device | None = None) -> int:
    """The bytes of the distinct storages among ``tensors`` (those on ``device``, if given)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors
                if torch.is_tensor(t) and (device is None or t.device == device)}
    return sum(storages.values())


def held_beside(device: torch.device, held: int, batch) -> int:
    """What is allocated on ``device`` beyond ``held`` bytes and the batch's storages; 0 on a CPU.

    Another model's cuBLAS workspaces or a user's tensors stay through every step: on the H200,
    uncounted, they put every plan 64-69 MiB over its prediction in a process that had trained
    before."""
    return max(0, allocator.allocated(device) - held - storage_bytes(batch, device))


def model_held_bytes(model: torch.nn.Module, device: torch.device) -> int:
    """The distinct storages a model's parameters, buffers and gradients hold on ``device`` now."""
    params = list(model.parameters())
    return storage_bytes([*params, *model.buffers(), *(p.grad for p in params)], device)


def model_step_bytes(model: torch.nn.Module, grad_dtype: torch.dtype | None = None) -> int:
    """What that engine's optimizer step adds (ModelCosts.optimizer_step_bytes).

    That is an fp32 copy of each 16-bit gradient, and torch Adam's foreach workspace where
    megatron steps with it (``foreach_adam``), as if every parameter were in one group. So it
    equals ``engine_step_bytes`` on a CPU. On a GPU it exceeds it by the no-weight-decay group
    (biases, norms), which megatron steps after the rest."""
    trainable = [param for param in model.parameters() if param.requires_grad]
    copies = sum(param.numel() * 4 for param in trainable
                 if param.dtype != torch.float32
                 and _gradient_dtype(param, grad_dtype) != torch.float32)
    workspace = (sum(param.numel() * 4 for param in trainable)  # like the fp32 main params
                 if trainable and foreach_adam(trainable) else 0)
    return copies + workspace


def foreach_adam(params: list[torch.Tensor]) -> bool:
    """Whether megatron-core steps ``params`` with torch's AdamW on its foreach path.

    It does without Transformer Engine and Apex (whose fused Adam makes no workspace), on
    the devices torch has foreach kernels for (a GPU's, not a CPU's)."""
    return steps_with_torch_adam() and _default_foreach(params)


def steps_with_torch_adam() -> bool:
    """Whether megatron-core's Adam is torch's AdamW here: neither Transformer Engine nor Apex."""
    from megatron.core import optimizer

    return optimizer.USING_PYTORCH_OPTIMIZER


def _default_foreach(params: list[torch.Tensor]) -> bool:
    from torch.optim.optimizer import _default_to_fused_or_foreach

    return _default_to_fused_or_foreach(params, differentiable=False, use_fused=False)[1]


def adam_workspace_bytes(optimizer: torch.optim.Optimizer) -> int:
    """The workspace torch's Adam(W) step makes on its foreach path: its largest group's size.

    It is ``_foreach_sqrt`` of a group's second moments, like each of its parameters. Groups step
    one after another. The fused path makes none, the single-tensor one (a CPU's) one or two
    parameters' worth, left out."""
    if not isinstance(optimizer, torch.optim.Adam):
        return 0
    largest = 0
    for group in optimizer.param_groups:
        params = group["params"]  # megatron's fp32 main parameters require no grad: all step
        if params and _runs_foreach(group, params):
            largest = max(largest, sum(param.numel() * param.element_size() for param in params))
    return largest


def _runs_foreach(group: dict, params: list[torch.Tensor]) -> bool:
    """torch.optim.adam.adam's choice of path for ``group``."""
    if group.get("fused") or group.get("differentiable"):
        return False
    if group.get("foreach") is not None:
        return bool(group["foreach"])
    # torch leaves foreach off for a tensor learning rate that is not capturable
    return (_default_foreach(params)
            and not (torch.is_tensor(group["lr"]) and not group.get("capturable")))


def engine_static_bytes(model_chunks, optimizer) -> int:
    """What megatron's engine holds on this rank through every step, read before its first one.

    It is both parts of ``engine_bytes``."""
    return sum(engine_bytes(model_chunks, optimizer))


def engine_bytes(model_chunks, optimizer) -> tuple[int, int]:
    """What megatron's engine holds on this rank: (allocated now, allocated by the first step).

    - the distinct storages of the parameters and buffers;
    - DistributedDataParallel's gradient buffers (and parameter buffers, under the distributed
      optimizer) and the optimizer's main parameters. An FSDP wrapper's own buffers are not
      read: under one only policy none runs (megatron_lm.check_args);
    - Adam's state, which torch allocates at the first step: two moments like each main
      parameter (its shard, under the distributed optimizer) and a step count."""
    from megatron.core.distributed import DistributedDataParallel

    held: list[torch.Tensor] = []
    for chunk in model_chunks:
        held += [*chunk.module.parameters(), *chunk.module.buffers()]
        if not isinstance(chunk, DistributedDataParallel):
            continue
        for buffer in (*chunk.buffers, *chunk.expert_parallel_buffers):
            held += [buffer.grad_data, buffer.param_data]  # param_data: None, or a buffer
    state, to_come = 0, 0
    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        stepped = [p for group in inner.optimizer.param_groups for p in group["params"]]
        held += stepped
        for main_param in stepped:
            held_state = inner.optimizer.state.get(main_param)
            if held_state:
                state += sum(t.untyped_storage().nbytes() for t in held_state.values()
                             if torch.is_tensor(t))
            else:
                to_come += _adam_state_bytes(main_param)
    return storage_bytes(held) + state, to_come


def engine_step_bytes(optimizer) -> int:
    """What megatron's optimizer step adds on this rank (ModelCosts.optimizer_step_bytes).

    - the fp32 gradient of each main parameter (its shard) whose 16-bit gradient buffer the
      step copies (``main_grad.float()``), dropped again by the next step's zero_grad;
    - the largest workspace an inner optimizer's step makes (``adam_workspace_bytes``)."""
    inners = getattr(optimizer, "chained_optimizers", [optimizer])
    copies = sum(main_param.numel() * 4 for inner in inners
                 for model_param, main_param in _main_params_of(inner)
                 if model_param.main_grad.dtype != torch.float32)
    return copies + max(adam_workspace_bytes(inner.optimizer) for inner in inners)


def _main_params_of(inner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(model parameter, fp32 main parameter) pairs of a mixed-precision optimizer."""
    if hasattr(inner, "model_float16_groups") and hasattr(inner, "shard_fp32_from_float16_groups"):
        pairs = zip(inner.model_float16_groups, inner.shard_fp32_from_float16_groups)
    elif hasattr(inner, "float16_groups"):
        pairs = zip(inner.float16_groups, inner.fp32_from_float16_groups)
    else:
        return []
    return [(model, main) for models, mains in pairs for model, main in zip(models, mains)]
