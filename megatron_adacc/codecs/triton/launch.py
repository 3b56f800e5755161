"""Launch geometry and output views shared by the Triton codec wrappers."""
import torch
import triton

# Elements per program instance: large, because each instance costs milliseconds under the
# CPU interpreter, and still a sensible tile on a GPU.
BLOCK_ELEMENTS = 8192
# Encoders compute x * (1 / scale) + bias with two roundings, as the reference does; a fused
# multiply-add would round once and change codes at ties.
FP_FUSION = False


def row_blocks(rows: int, cols: int):
    """(grid, rows per program, pairs per row padded to a power of two) for row kernels."""
    block_pairs = triton.next_power_of_2(max(cols // 2, 1))
    block_rows = max(1, BLOCK_ELEMENTS // (2 * block_pairs))
    return (triton.cdiv(rows, block_rows),), block_rows, block_pairs


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """bf16 tensors go to the kernels as their int16 bit patterns (see numerics.to_output and
    numerics.load_float)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def tl_dtype(dtype: torch.dtype):
    """Triton element type a kernel writes for `dtype` (bf16 as int16 bits, see bits_view)."""
    import triton.language as tl

    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.int16}[dtype]
