"""What megatron-core's engine holds after a run: its optimizers, main parameters, bytes."""
import torch


def inner_optimizers(optimizer) -> list:
    """Megatron's optimizers under a (possibly chained) optimizer."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def main_params(optimizer) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Each model parameter's fp32 main parameter in megatron's mixed-precision optimizer."""
    pairs = {}
    for inner in inner_optimizers(optimizer):
        for models, mains in zip(inner.float16_groups, inner.fp32_from_float16_groups):
            pairs.update(zip(models, mains))
    return pairs


def held_bytes(session) -> int:
    """Bytes of the distinct storages the engine of a run holds after it: parameters,
    buffers, DDP's buffers, the optimizer's main parameters, their gradients and state."""
    (chunk,), storages = session.ddp_models, {}
    tensors = [*chunk.module.parameters(), *chunk.module.buffers()]
    for buffer in chunk.buffers:
        tensors += [buffer.grad_data] + ([buffer.param_data] if buffer.param_data is not None
                                         else [])
    for inner in inner_optimizers(session.optimizer):
        mains = [p for group in inner.optimizer.param_groups for p in group["params"]]
        tensors += mains + [p.grad for p in mains if p.grad is not None]
        tensors += [t for state in inner.optimizer.state.values() for t in state.values()
                    if torch.is_tensor(t)]
    for tensor in tensors:
        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())
