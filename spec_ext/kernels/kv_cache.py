"""compact_kv in Triton: one launch per call, one program per (tensor, row, head, column
block) of the stacked [N,B,H,S,D] caches; all moved rows are loaded before any is stored,
so overlapping moves are safe."""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import wrap_triton


@triton.jit
def _compact_kv_kernel(cache_ptr, src_ptr, dst_ptr, tensor_stride, B, H, S, D, M,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    slab = tl.program_id(0).to(tl.int64)  # n * B * H + b * H + h
    n = slab // (B * H)
    b = (slab // H) % B
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    src = tl.load(src_ptr + b * M + j, mask=j < M, other=-1)
    # rows after the first -1 are padding
    valid = tl.cumsum((src < 0).to(tl.int32), 0) == 0
    start = tl.load(dst_ptr + b)
    base = cache_ptr + n * tensor_stride + (slab % (B * H)) * S * D
    io = valid[:, None] & (cols[None, :] < D)
    rows = tl.load(base + tl.where(valid, src, 0)[:, None] * D + cols[None, :], mask=io)
    tl.debug_barrier()
    moved = io & (src != start + j)[:, None]
    tl.store(base + (start + j)[:, None] * D + cols[None, :], rows, mask=moved)


@triton_op("spec_ext_triton::compact_kv", mutates_args={"caches"})
def compact_kv(caches: torch.Tensor, src: torch.Tensor, dst_start: torch.Tensor) -> None:
    if caches.numel() == 0 or src.numel() == 0:
        return
    B, M = src.shape
    N, _, H, S, D = caches.shape
    BLOCK_D = min(triton.next_power_of_2(D), 128)
    wrap_triton(_compact_kv_kernel)[(N * B * H, triton.cdiv(D, BLOCK_D))](
        caches, src.contiguous(), dst_start.contiguous(), caches.stride(0), B, H, S, D, M,
        BLOCK_M=triton.next_power_of_2(M), BLOCK_D=BLOCK_D)
