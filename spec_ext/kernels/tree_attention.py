"""Tree attention in Triton, flash-style: one program per (row, query head, block of tree
nodes); online softmax over key blocks; the packed mask bits are read per (node, key), only
for key blocks that reach the tree's own keys (the prefix needs no mask).

Window, softcap and sinks as spec_ext.reference.tree_attention: a node's depth is the
popcount of its mask row minus one (j on the chain); key blocks wholly below every
query's window are skipped; softcap caps the scaled scores before the mask; a sink is one
more logit in the denominator (-inf: none; a query that sees no key gets zeros). Keys
from prefix + T on, and below every query's window, are never loaded. Compiled ahead of
time for sm_80/sm_90 and tested in the interpreter; the features have not run on a GPU yet."""
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
def key_block(q, k_ptr, v_ptr, kv_base, s, lowest, stop, d, D, scale, IEEE: tl.constexpr):
    """The keys s (lowest <= s < stop) of one block: scores q k^T * scale [rows, keys] and
    values; keys outside are not loaded (read as 0: what the cache holds there may be NaN)."""
    kv_mask = ((s[:, None] >= lowest) & (s[:, None] < stop)) & (d[None, :] < D)
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
def node_depth(mask_ptr, mask_row, nodes, valid, T, W, CAUSAL: tl.constexpr, BLOCK_W: tl.constexpr):
    """[N] int32 depth of tree nodes (number of ancestors): the node for the causal chain,
    else the popcount of its mask row minus one; 0 where not valid."""
    if CAUSAL:
        depth = tl.where(valid, nodes, 0)
    else:
        words = tl.arange(0, BLOCK_W)
        safe = tl.where(valid, nodes, 0)
        x = tl.load(mask_ptr + (mask_row * T + safe[:, None]) * W + words[None, :],
                    mask=valid[:, None] & (words[None, :] < W), other=0).to(tl.uint32, bitcast=True)
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        bits = ((x * 0x01010101) >> 24).to(tl.int32)
        depth = tl.where(valid, tl.sum(bits, 1) - 1, 0)
    return depth


@triton.jit
def soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh from one exp (no libdevice in the interpreter)."""
    x = scores / softcap
    e = tl.exp(-2.0 * tl.abs(x))
    th = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -th, th)


@triton.jit
def lowest_window_key(prefix, query_depth, rows_ok, window, WINDOW: tl.constexpr):
    """The lowest key any of these queries sees (0 without a window): keys at positions
    below prefix + depth - window + 1 are outside every query's window."""
    lowest = 0
    if WINDOW:
        depth = tl.min(tl.where(rows_ok, query_depth, 1 << 30), 0)
        lowest = tl.maximum(prefix + depth - window + 1, 0)
    return lowest


@triton.jit
def window_visible(visible, s, prefix, query_pos, mask_ptr, mask_row, T, W, window, reaches_tree,
                   CAUSAL: tl.constexpr, BLOCK_W: tl.constexpr):
    """visible & (query position - key position < window); a prefix key sits at s, tree
    node j at prefix + depth(j)."""
    key_pos = s
    if reaches_tree:
        j = s - prefix
        in_tree = (j >= 0) & (j < T)
        key_pos = tl.where(in_tree, prefix + node_depth(mask_ptr, mask_row, j, in_tree, T, W, CAUSAL, BLOCK_W), s)
    return visible & ((query_pos[:, None] - key_pos[None, :]) < window)


@triton.jit
def add_sink(m, l, acc, sink):
    """One more logit in the softmax denominator, with no value; a sink of -inf is none (a
    query that sees no key keeps l = 0 and gets zeros, not exp(-inf - -inf) = NaN)."""
    m_new = tl.maximum(m, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    correction = tl.exp(m - m_safe)
    return l * correction + tl.exp(sink - m_safe), acc * correction[:, None]


@triton.jit
def _tree_attention_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, mask_ptr, sinks_ptr, out_ptr, scale, window, softcap,
                           Hq, Hkv, T, S, D, W, mask_rows,
                           CAUSAL: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_W: tl.constexpr, IEEE: tl.constexpr,
                           WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, SINKS: tl.constexpr):
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
    query_depth = tl.zeros([BLOCK_T], tl.int32)
    if WINDOW:
        query_depth = node_depth(mask_ptr, mask_row, t, t < T, T, W, CAUSAL, BLOCK_W)
    lowest = lowest_window_key(prefix, query_depth, t < T, window, WINDOW)
    for start in range(lowest // BLOCK_S * BLOCK_S, limit, BLOCK_S):
        s = start + tl.arange(0, BLOCK_S)
        scores, v = key_block(q, k_ptr, v_ptr, kv_base, s, lowest, limit, d, D, scale, IEEE)
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        visible = (s[None, :] < limit) & (t[:, None] >= 0)  # [rows, keys]
        reaches_tree = start + BLOCK_S > prefix
        if reaches_tree:  # the block reaches the new tokens: their tree bits decide
            j = s[None, :] - prefix
            in_tree = (j >= 0) & (j < T) & (t[:, None] < T)
            visible = visible & ((j < 0) | (in_tree & tree_bits(mask_ptr, mask_row, t, j, in_tree, T, W, CAUSAL)))
        if WINDOW:
            visible = window_visible(visible, s, prefix, prefix + query_depth, mask_ptr, mask_row, T, W, window,
                                     reaches_tree, CAUSAL, BLOCK_W)
        m, l, acc = online_softmax_step(scores, visible, v, m, l, acc, IEEE)
    if SINKS:
        l, acc = add_sink(m, l, acc, tl.load(sinks_ptr + h))
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + ((b * Hq + h) * T).to(tl.int64) * D + t[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=(t[:, None] < T) & (d[None, :] < D))


@triton_op("spec_ext_triton::tree_attention", mutates_args=())
def tree_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                   tree_mask: torch.Tensor | None, scale: float, window: int, softcap: float,
                   sinks: torch.Tensor | None) -> torch.Tensor:
    B, Hq, T, D = q.shape
    if v.shape[3] != D:
        raise ValueError(f"v: the Triton tree attention needs values of the keys' head size D={D}, got "
                         f"Dv={v.shape[3]} (MLA: use the sdpa, cpu or torch backend)")
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    BLOCK_T = max(16, min(64, triton.next_power_of_2(T)))
    BLOCK_D = max(16, triton.next_power_of_2(D))
    causal = tree_mask is None
    mask = q if causal else tree_mask.contiguous()  # unused pointer when causal
    W = 1 if causal else tree_mask.shape[2]
    grid = (B, Hq, triton.cdiv(T, BLOCK_T))
    # 8 warps at D=256 (4 spill registers on sm_80), and 16-key blocks in fp32 there (spec_ext/kernels/aot.py)
    wrap_triton(_tree_attention_kernel)[grid](
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_lens.to(torch.int32).contiguous(), mask,
        q if sinks is None else sinks.float().contiguous(), out, scale, window, softcap, Hq, Hkv, T, S, D, W,
        0 if causal else tree_mask.shape[0], CAUSAL=causal, BLOCK_T=BLOCK_T,
        BLOCK_S=16 if BLOCK_D >= 256 and q.dtype == torch.float32 else 32, BLOCK_D=BLOCK_D,
        BLOCK_W=triton.next_power_of_2(W), IEEE=q.dtype == torch.float32, WINDOW=window > 0, SOFTCAP=softcap > 0,
        SINKS=sinks is not None, num_warps=8 if BLOCK_D >= 256 else 4)
    return out
