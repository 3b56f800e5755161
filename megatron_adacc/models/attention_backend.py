"""What ``--attention-backend`` means on a device: the backend a layer computes attention with.

``resolve_backend`` decides. Light to import: the flag parser and the analytic model use it. The
core attention modules (attention.py, flash_attention.py) import it, not the other way round.

    --attention-backend unfused   megatron-core's local core attention (the s^2 tensors)
    --attention-backend flash     SDPA: its flash (or memory-efficient) kernel saves Q, K, V,
                                  the output and the log-sum-exp; no s^2 tensor exists
    --attention-backend auto      flash wherever this device's SDPA runs such a kernel with
                                  the configured attention dropout, else unfused

Megatron-LM names the flag the same and defaults to auto. On the CPU, SDPA runs its flash kernel
only without dropout. With dropout it falls back to its math path, which saves the s^2 tensors under
names the flash sites do not have. So auto picks flash there only at attention dropout 0, and an
explicit flash with dropout is refused. On CUDA the flash and memory-efficient kernels draw their
own dropout (their philox seed and offset are saved).
"""
from __future__ import annotations

ATTENTION_BACKENDS = ("auto", "flash", "unfused")


def flash_runs(attention_dropout: float, cuda: bool | None = None) -> bool:
    """Whether SDPA runs a flash or memory-efficient kernel at this attention dropout.

    Such a kernel saves only Q, K, V, the output and the log-sum-exp. ``device`` defaults to CUDA
    if there is one."""
    if cuda is None:
        import torch

        cuda = torch.cuda.is_available()
    return cuda or attention_dropout == 0


def check_backend(backend: str) -> None:
    """A ValueError naming --attention-backend unless ``backend`` is one of its choices."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"--attention-backend {backend}: expected one of "
                         f"{', '.join(ATTENTION_BACKENDS)}")


def resolve_backend(backend: str, attention_dropout: float, cuda: bool | None = None) -> str:
    """"flash" or "unfused" for a configured backend (auto resolved for this device)."""
    check_backend(backend)
    if backend == "auto":
        return "flash" if flash_runs(attention_dropout, cuda) else "unfused"
    if backend == "flash" and not flash_runs(attention_dropout, cuda):
        raise ValueError(
            f"--attention-backend flash with --attention-dropout {attention_dropout}: PyTorch's "
            "scaled_dot_product_attention on the CPU has no flash kernel with dropout (its math "
            "path would save the s^2 tensors); use attention dropout 0, or --attention-backend "
            "unfused or auto")
    return backend
