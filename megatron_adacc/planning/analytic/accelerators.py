"""The accelerator table: each GPU's peak rates, and how much of them Megatron-sized work reaches.

Every efficiency factor is an assumption, named here so it can be checked against a profile.
"""
from __future__ import annotations

from dataclasses import dataclass

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
# Hopper's (H100, H200): gpu_check's fit to the added time of Megatron's eight recompute methods
# on Llama-1B (bf16, flash attention, micro-batch 2, seq 4096; 89% of the step in kernels) in the
# H200 lease of 2026-11-28 (docs/results/gpu_check_h200_all_methods.json). RMS error 20.9 ms at
# MATMUL_EFFICIENCY, 8.0 ms at this.
HOPPER_MATMUL_EFFICIENCY = 0.27
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
    # MATMUL_EFFICIENCY unless a lease measured this device (scripts/gpu_check.py's
    # calibration).
    matmul_efficiency: float = MATMUL_EFFICIENCY

    def matmul_flops(self, activation_bytes: int) -> float:
        return self.matmul_flops_16bit if activation_bytes == 2 else self.matmul_flops_fp32


ACCELERATORS: dict[str, Accelerator] = {
    "v100-32gb": Accelerator("NVIDIA V100 SXM2 32GB", 125e12, 15.7e12, 900e9, 32 * GiB,
                             supports_bf16=False),
    "a100-80gb": Accelerator("NVIDIA A100 SXM4 80GB", 312e12, 19.5e12, 2039e9, 80 * GiB),
    "h100-80gb": Accelerator("NVIDIA H100 SXM5 80GB", 989e12, 67e12, 3350e9, 80 * GiB,
                             matmul_efficiency=HOPPER_MATMUL_EFFICIENCY),
    # The H100's processor with 141 GB of HBM3e at 4.8 TB/s (datasheet); CUDA reports about
    # 140 GiB of it (143,771 MiB by nvidia-smi on this project's lent machine).
    "h200-141gb": Accelerator("NVIDIA H200 SXM 141GB", 989e12, 67e12, 4800e9, 140 * GiB,
                              matmul_efficiency=HOPPER_MATMUL_EFFICIENCY),
}


def get_accelerator(name: str | Accelerator) -> Accelerator:
    """The table's accelerator of that name; an Accelerator is its own."""
    if isinstance(name, Accelerator):
        return name
    try:
        return ACCELERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown accelerator {name!r}; known: {', '.join(ACCELERATORS)}"
        ) from None
