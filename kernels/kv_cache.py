"""compact_kv in Triton: one program per (row, head, column block) of one cache tensor;
all moved rows are loaded before any is stored, so overlapping moves are safe."""
import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _compact_kv_kernel(cache_ptr, src_ptr, dst_ptr, H, S, D, M,
                       BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    slab = tl.program_id(0)
    b = slab // H
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, BLOCK_M)
    src = tl.load(src_ptr + b * M + j, mask=j < M, other=-1)
    # rows after the first -1 are padding
    valid = tl.cumsum((src < 0).to(tl.int32), 0) == 0
    start = tl.load(dst_ptr + b)
    base = cache_ptr + slab.to(tl.int64) * S * D
    io = valid[:, None] & (cols[None, :] < D)
    rows = tl.load(base + tl.where(valid, src, 0)[:, None] * D + cols[None, :], mask=io)
    tl.debug_barrier()
    moved = io & (src != start + j)[:, None]
    tl.store(base + (start + j)[:, None] * D + cols[None, :], rows, mask=moved)


@triton_op("spec_ext_triton::compact_kv", mutates_args={"caches"})
def compact_kv(caches: list[torch.Tensor], src: torch.Tensor, dst_start: torch.Tensor) -> None:
    if not caches or src.numel() == 0:
        return
    B, M = src.shape
    _, H, S, D = caches[0].shape
    BLOCK_D = min(triton.next_power_of_2(D), 128)
    grid = (B * H, triton.cdiv(D, BLOCK_D))
    for cache in caches:
        wrap_triton(_compact_kv_kernel)[grid](cache, src.contiguous(), dst_start.contiguous(), H, S, D, M,
                                              BLOCK_M=triton.next_power_of_2(M), BLOCK_D=BLOCK_D)
