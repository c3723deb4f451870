"""Tree attention in Triton, flash-style: one program per (row, query head, block of tree
nodes); online softmax over key blocks; the packed mask bits are read per (node, key), only
for key blocks that reach the tree's own keys (the prefix needs no mask)."""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import wrap_triton


@triton.jit
def tree_bits(mask_ptr, mask_row, t, j, in_tree, T, W, CAUSAL: tl.constexpr):
    """[rows, keys] bool: key j (offset from the prefix) is on query t's root path; None
    mask (CAUSAL): j <= t."""
    if CAUSAL:
        bit = j <= t[:, None]
    else:
        safe_j = tl.where(in_tree, j, 0)
        word = tl.load(mask_ptr + (mask_row * T + t[:, None]) * W + safe_j // 32, mask=in_tree, other=0)
        bit = ((word >> (safe_j % 32)) & 1) != 0
    return bit


@triton.jit
def key_block(q, k_ptr, v_ptr, kv_base, s, stop, d, D, scale, IEEE: tl.constexpr):
    """The keys s (those < stop) of one block: scores q k^T * scale [rows, keys] and values."""
    kv_mask = (s[:, None] < stop) & (d[None, :] < D)
    k = tl.load(k_ptr + kv_base + s[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_base + s[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
    if IEEE:  # fp32: tl.dot would round both operands to TF32 on the GPU
        scores = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        scores = tl.dot(q, tl.trans(k)) * scale
    return scores, v


@triton.jit
def online_softmax_step(scores, visible, v, m, l, acc, IEEE: tl.constexpr):
    """One key block of an online softmax: running max m, sum l and output acc [rows, D]."""
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    correction = tl.exp(m - m_safe)
    l = l * correction + tl.sum(p, 1)
    if IEEE:  # fp32: tl.dot would round both operands to TF32 on the GPU
        acc = acc * correction[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, out_dtype=tl.float32)
    return m_new, l, acc


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, mask_ptr, out_ptr, scale,
                           Hq, Hkv, T, S, D, W, mask_rows,
                           CAUSAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                           BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hkv = h // (Hq // Hkv)
    t = tl.program_id(2) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    prefix = tl.load(prefix_ptr + b)
    limit = tl.minimum(S, prefix + T)
    q_base = q_ptr + ((b * Hq + h) * T).to(tl.int64) * D
    q = tl.load(q_base + t[:, None] * D + d[None, :], mask=(t[:, None] < T) & (d[None, :] < D), other=0.0)
    kv_base = ((b * Hkv + hkv) * S).to(tl.int64) * D
    mask_row = tl.where(mask_rows == 1, 0, b)
    m = tl.full([BLOCK_T], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for start in range(0, limit, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        scores, v = key_block(q, k_ptr, v_ptr, kv_base, s, limit, d, D, scale, IEEE)
        visible = (s[None, :] < limit) & (t[:, None] >= 0)  # [rows, keys]
        if start + BLOCK_S > prefix:  # the block reaches the new tokens: their tree bits decide
            j = s[None, :] - prefix
            in_tree = (j >= 0) & (j < T) & (t[:, None] < T)
            visible = visible & ((j < 0) | (in_tree & tree_bits(mask_ptr, mask_row, t, j, in_tree, T, W, CAUSAL)))
        m, l, acc = online_softmax_step(scores, visible, v, m, l, acc, IEEE)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + ((b * Hq + h) * T).to(tl.int64) * D + t[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(t[:, None] < T) & (d[None, :] < D))


@triton_op("spec_ext_triton::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                   tree_mask: torch.Tensor | None, scale: float, window: int, softcap: float,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    if window or softcap or sinks is not None:
        raise ValueError("window, softcap and sinks are not yet implemented in the Triton kernels "
                         "(backend='torch', 'cpu' or 'cuda' has them)")
    B, Hq, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    BLOCK_T = max(16, min(64, triton.next_power_of_2(T)))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    causal = tree_mask is None
    mask = q if causal else tree_mask.contiguous()  # unused pointer when causal
    grid = (B, Hq, triton.cdiv(T, BLOCK_T))
    wrap_triton(_tree_attention_kernel)[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_lens.to(torch.int32).contiguous(), mask, out,
        scale, Hq, Hkv, T, S, D, 0 if causal else tree_mask.shape[2], 0 if causal else tree_mask.shape[0],
        CAUSAL=causal, BLOCK_T=BLOCK_T, BLOCK_S=32, BLOCK_D=BLOCK_D, IEEE=q.dtype == torch.float32,
        num_warps=8 if BLOCK_D >= 256 else 4)  # 4 warps spill registers at D=256 on sm_80 (kernels/aot.py)
    return out
