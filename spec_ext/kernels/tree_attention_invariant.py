"""Tree attention in Triton whose every query's output is independent of T (the number of new
tokens in the call): query i of a causal block of T is the same bits as that query alone
(T = 1, prefix + i, the block's earlier tokens in the cache), and a tree node the same bits
in a call of the tree cut after it or of a larger tree.

One program per (row, query head, query): nothing it computes is shared with or shaped by
the other queries. Its keys go by in blocks of BLOCK_S at fixed places in key space
(multiples of BLOCK_S, from the block holding the first key of its own window, or key 0),
never cut by the query count; a block where the query sees no key is skipped, so the blocks
past its own key that a wider call reaches change nothing. Per block: scores q . k by
``tl.sum`` over D (one reduction tree per key, the same for every key), scaled, soft-capped;
then the online softmax (running max m, sum l, output acc, in float32); keys and values the
query does not see are never loaded. At the end, the head's sink joins the denominator and
acc / l is rounded once to q's dtype. No ``tl.dot`` (its instruction, and numpy's matmul in
the interpreter, is picked by tile shape), and T, W and the mask's rows are not specialised
on (Triton would compile another kernel for T = 1), so one compiled kernel serves every T
(tests/test_triton_compile.py checks that the compiles for T = 1 and T = 33 are one kernel).

Not invariant to where the keys sit: a node whose path is compacted (its keys moved to
consecutive positions) falls into other key blocks, so tree verification on this kernel is
not bit-equal to decoding the accepted path one token at a time (the CPU kernel,
spec_ext::tree_attention_invariant, is). Window, softcap and sinks as
spec_ext.reference.tree_attention; values may have another head size than keys (Dv != D).

Opt-in (backend "triton_invariant", and ``spec_ext.tree_attention(..., invariant=True)`` on
a GPU); tested in the Triton interpreter and compiled ahead of time for sm_80/sm_90
(spec_ext/kernels/aot.py), not yet run on a GPU, where it reads K/V once per query (no GQA or
query-block reuse): slower than the flash kernels.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import wrap_triton
from spec_ext.kernels.tree_attention import soft_cap

BLOCK_S = 32


@triton.jit
def _depth(mask_ptr, mask_row, nodes, valid, T, W, CAUSAL: tl.constexpr):
    """[N] int32 depth of tree nodes: the node on the causal chain, else the popcount of its
    mask row minus one; 0 where not valid. The W words go by in a loop (no block of W: a
    constexpr sized from W would compile another kernel for T > 32)."""
    if CAUSAL:
        depth = tl.where(valid, nodes, 0)
    else:
        safe = tl.where(valid, nodes, 0)
        count = tl.zeros(nodes.shape, tl.int32)
        for w in range(0, W):
            x = tl.load(mask_ptr + (mask_row * T + safe) * W + w, mask=valid, other=0).to(tl.uint32, bitcast=True)
            x = x - ((x >> 1) & 0x55555555)
            x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
            x = (x + (x >> 4)) & 0x0F0F0F0F
            count += ((x * 0x01010101) >> 24).to(tl.int32)
        depth = tl.where(valid, count - 1, 0)
    return depth


@triton.jit(do_not_specialize=["T", "W", "mask_rows"])
def _invariant_attention_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, mask_ptr, sinks_ptr, out_ptr, scale, window,
                                softcap, Hq, Hkv, T, S, D, Dv, W, mask_rows,
                                CAUSAL: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                                BLOCK_DV: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
                                SINKS: tl.constexpr):
    row = tl.program_id(0)  # (b * Hq + h) * T + t
    t = row % T
    h = (row // T) % Hq
    b = row // (T * Hq)
    hkv = h // (Hq // Hkv)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    prefix = tl.load(prefix_ptr + b)
    stop = tl.minimum(S, prefix + T)
    mask_row = tl.where(mask_rows == 1, 0, b)
    q = tl.load(q_ptr + row.to(tl.int64) * D + d, mask=d < D, other=0.0).to(tl.float32)
    k_base = k_ptr + ((b * Hkv + hkv) * S).to(tl.int64) * D
    v_base = v_ptr + ((b * Hkv + hkv) * S).to(tl.int64) * Dv
    word_ptr = mask_ptr + (mask_row * T + t) * W  # query t's row of packed bits
    query_depth = t
    lowest = 0
    if WINDOW:
        node = t + tl.zeros([1], tl.int32)
        query_depth = tl.sum(_depth(mask_ptr, mask_row, node, node >= 0, T, W, CAUSAL), 0)
        lowest = tl.maximum(prefix + query_depth - window + 1, 0)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for start in range(lowest // BLOCK_S * BLOCK_S, stop, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        j = s - prefix  # node index of a new token's key
        in_tree = (j >= 0) & (s < stop)
        if CAUSAL:
            seen = j <= t
        else:
            word = tl.load(word_ptr + tl.where(in_tree, j, 0) // 32, mask=in_tree, other=0)
            seen = ((word >> (tl.where(in_tree, j, 0) % 32)) & 1) != 0
        visible = (s >= lowest) & (s < stop) & ((j < 0) | (in_tree & seen))
        if WINDOW:
            key_pos = tl.where(in_tree, prefix + _depth(mask_ptr, mask_row, j, in_tree, T, W, CAUSAL), s)
            visible = visible & (prefix + query_depth - key_pos < window)
        if tl.max(visible.to(tl.int32), 0) > 0:  # a block it sees nothing of changes nothing: skipped
            k = tl.load(k_base + s.to(tl.int64)[:, None] * D + d[None, :], mask=visible[:, None] & (d[None, :] < D),
                        other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], 1) * scale
            if SOFTCAP:
                scores = soft_cap(scores, softcap)
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe)
            correction = tl.exp(m - m_safe)
            v = tl.load(v_base + s.to(tl.int64)[:, None] * Dv + dv[None, :],
                        mask=visible[:, None] & (dv[None, :] < Dv), other=0.0).to(tl.float32)
            l = l * correction + tl.sum(p, 0)
            acc = acc * correction + tl.sum(p[:, None] * v, 0)
            m = m_new
    if SINKS:  # one more logit in the denominator, with no value; -inf is none
        sink = tl.load(sinks_ptr + h)
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        correction = tl.exp(m - m_safe)
        l = l * correction + tl.exp(sink - m_safe)
        acc = acc * correction
    out = acc / tl.where(l > 0, l, 1.0)  # a query that sees no key: zeros
    tl.store(out_ptr + row.to(tl.int64) * Dv + dv, out.to(out_ptr.dtype.element_ty), mask=dv < Dv)


@triton_op("spec_ext_triton::tree_attention_invariant", mutates_args=())
def tree_attention_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                             tree_mask: torch.Tensor | None, scale: float, window: int, softcap: float,
                             sinks: torch.Tensor | None) -> torch.Tensor:
    B, Hq, T, D = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty(B, Hq, T, Dv, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    causal = tree_mask is None
    mask = q if causal else tree_mask.contiguous()  # an unused pointer when causal
    W = 1 if causal else tree_mask.shape[2]
    wrap_triton(_invariant_attention_kernel)[(B * Hq * T,)](
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_lens.to(torch.int32).contiguous(), mask,
        q if sinks is None else sinks.float().contiguous(), out, scale, window, softcap, Hq, Hkv, T, S, D, Dv, W,
        0 if causal else tree_mask.shape[0], CAUSAL=causal, BLOCK_S=BLOCK_S, BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_DV=max(16, triton.next_power_of_2(Dv)), WINDOW=window > 0,
        SOFTCAP=softcap > 0, SINKS=sinks is not None, num_warps=8 if max(D, Dv) > 128 else 4)
    return out
