"""NaN/Inf detection for training (Megatron-LM's --check-for-nan-in-loss-and-grad).

Every test is collective: each rank contributes its own numbers and all ranks learn whether
any of them saw a NaN or Inf, so they stop (or, under fp16 loss scaling, skip a step)
together instead of some waiting forever in the next collective.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist


class NonFiniteError(RuntimeError):
    """Training produced NaN or Inf; the message names the iteration or the tensor."""


def agree(ok: bool, group=None) -> bool:
    """True when ``ok`` holds on every rank of ``group`` (the world by default)."""
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def all_finite(*values: float, group=None) -> bool:
    """True when every value is finite on every rank. A loss scaler calls this to decide
    whether to skip an overflowed step."""
    return agree(all(math.isfinite(v) for v in values), group)


def check_step(iteration: int, loss: float, grad_norm: float, group=None) -> None:
    """Raise NonFiniteError unless this step's loss and gradient norm are finite on every
    rank. Called before the optimizer step, so the weights never take a non-finite update."""
    if not all_finite(loss, grad_norm, group=group):
        raise NonFiniteError(
            f"iteration {iteration}: loss {loss:g}, gradient norm {grad_norm:g} on this rank: "
            f"not finite on some rank; stopped before the optimizer step, nothing saved "
            f"(lower --lr, or --load the last checkpoint)"
        )


def first_non_finite(tree: Any, name: str = "") -> str | None:
    """The dotted name of the first floating tensor holding NaN or Inf in a nest of dicts,
    lists and tuples, or None."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and not bool(torch.isfinite(tree).all()):
            return name
        return None
    items = (tree.items() if isinstance(tree, dict)
             else enumerate(tree) if isinstance(tree, (list, tuple)) else ())
    for key, value in items:
        found = first_non_finite(value, f"{name}.{key}" if name else str(key))
        if found is not None:
            return found
    return None


def json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """``record`` with NaN and Inf floats as None, for strict JSON (null)."""
    return {key: None if isinstance(value, float) and not math.isfinite(value) else value
            for key, value in record.items()}
