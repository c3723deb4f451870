"""build_tree's mask and depth in Triton: one program per tree, nodes in order."""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import wrap_triton


@triton.jit
def _tree_mask_kernel(parents_ptr, depth_ptr, mask_ptr, T, W, BLOCK_W: tl.constexpr):
    b = tl.program_id(0)
    words = tl.arange(0, BLOCK_W)
    in_row = words < W
    for i in range(0, T):
        parent = tl.load(parents_ptr + b * T + i)
        has_parent = parent >= 0
        safe_parent = tl.where(has_parent, parent, 0)
        inherited = tl.load(mask_ptr + (b * T + safe_parent) * W + words, mask=in_row & has_parent, other=0)
        one = tl.full([BLOCK_W], 1, tl.uint32)
        own = tl.where(words == i // 32, one << (i % 32), 0).to(tl.uint32)
        bits = inherited.to(tl.uint32) | own
        tl.store(mask_ptr + (b * T + i) * W + words, bits.to(tl.int32), mask=in_row)
        parent_depth = tl.load(depth_ptr + b * T + safe_parent, mask=has_parent, other=-1)
        tl.store(depth_ptr + b * T + i, parent_depth + 1)
        tl.debug_barrier()


@triton_op("spec_ext_triton::tree_mask", mutates_args=())
def tree_mask(parents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    B, T = parents.shape
    W = (T + 31) // 32
    depth = torch.empty(B, T, dtype=torch.int64, device=parents.device)
    mask = torch.empty(B, T, W, dtype=torch.int32, device=parents.device)
    if B and T:
        wrap_triton(_tree_mask_kernel)[(B,)](parents.contiguous(), depth, mask, T, W,
                                             BLOCK_W=triton.next_power_of_2(W))
    return depth, mask
