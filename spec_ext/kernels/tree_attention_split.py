"""Tree attention in Triton, split over the keys (flash-decoding), for GPUs with few rows.

Programs run over (row, KV head, key split, block of packed query rows). Each takes every
query row of its KV head's group (GQA packing: the Hq/Hkv heads x T nodes as one
[Hq/Hkv * T, D] tile, so K and V are read once per group) against one chunk of keys, with
``tl.dot`` for QK^T and PV (tensor cores in bf16/fp16, ``input_precision="ieee"`` in fp32)
and an online softmax; the tree bits are read only for key blocks that reach the T new
tokens (the prefix needs no mask). Each split writes its normalised output and
log-sum-exp; a second kernel merges the splits. The number of splits comes from
B x Hkv against the programs resident per SM that the compile reports, so one row fills
the GPU.

Window and softcap as in spec_ext/kernels/tree_attention.py (splits below every query's window skip
their keys); the merge adds each head's sink to the denominator.

Not yet run on a GPU: this is the opt-in backend ``"triton_split"`` of
:func:`spec_ext.tree_attention`, tested in the Triton interpreter only.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import capability, sm_count as _sm_count, wrap_triton  # a test replaces _sm_count
from spec_ext.kernels.tree_attention import (key_block, lowest_window_key, node_depth, online_softmax_step,
                                             soft_cap, tree_bits, window_visible)

BLOCK_S = 64  # keys per inner step (half at D=256 and in fp32); chunks are whole multiples of it
# fp32 at D=256 with window/softcap: ptxas spills registers at 32 keys with Triton 3.6's
# toolchain and at 16 with 3.8's (sm_80); each version gets the block it compiles cleanly
FP32_D256_BLOCK_S = 16 if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 7) else 32


@triton.jit
def _split_kernel(q_ptr, k_ptr, v_ptr, prefix_ptr, mask_ptr, part_ptr, lse_ptr, scale, window, softcap,
                  Hq, Hkv, T, S, D, W, mask_rows, chunk, num_splits, R,
                  CAUSAL: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_W: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    bh = tl.program_id(0)  # b * Hkv + kv head
    split = tl.program_id(1)
    b = bh // Hkv
    hkv = bh % Hkv
    group = Hq // Hkv
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)  # packed query rows: head-in-group * T + node
    t = r % T
    h = hkv * group + r // T
    row_ok = r < R
    d = tl.arange(0, BLOCK_D)
    prefix = tl.load(prefix_ptr + b)
    limit = tl.minimum(S, prefix + T)
    start = split * chunk
    stop = tl.minimum(start + chunk, limit)
    q = tl.load(q_ptr + ((b * Hq + h) * T + t).to(tl.int64)[:, None] * D + d[None, :],
                mask=row_ok[:, None] & (d[None, :] < D), other=0.0)
    kv_base = ((b * Hkv + hkv) * S).to(tl.int64) * D
    mask_row = tl.where(mask_rows == 1, 0, b)
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    query_depth = tl.zeros([BLOCK_R], tl.int32)
    if WINDOW:
        query_depth = node_depth(mask_ptr, mask_row, t, row_ok, T, W, CAUSAL, BLOCK_W)
    lowest = lowest_window_key(prefix, query_depth, row_ok, window, WINDOW)
    start = tl.maximum(start, lowest // BLOCK_S * BLOCK_S)
    for block in range(start, stop, BLOCK_S):
        s = block + tl.arange(0, BLOCK_S)
        scores, v = key_block(q, k_ptr, v_ptr, kv_base, s, lowest, stop, d, D, scale, IEEE)
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        visible = (s[None, :] < stop) & row_ok[:, None]
        reaches_tree = block + BLOCK_S > prefix
        if reaches_tree:  # the block reaches the new tokens: their tree bits decide
            j = s[None, :] - prefix
            in_tree = (j >= 0) & (j < T) & row_ok[:, None]
            visible = visible & ((j < 0) | (in_tree & tree_bits(mask_ptr, mask_row, t, j, in_tree, T, W, CAUSAL)))
        if WINDOW:
            visible = window_visible(visible, s, prefix, prefix + query_depth, mask_ptr, mask_row, T, W, window,
                                     reaches_tree, CAUSAL, BLOCK_W)
        m, l, acc = online_softmax_step(scores, visible, v, m, l, acc, IEEE)
    seen = l > 0
    out = acc / tl.where(seen, l, 1.0)[:, None]
    lse = tl.where(seen, m + tl.log(tl.where(seen, l, 1.0)), float("-inf"))
    # workspace [B, Hq, T, splits, D] and [B, Hq, T, splits]: the merge reads one row's splits together
    row = ((b * Hq + h) * T + t).to(tl.int64) * num_splits + split
    tl.store(part_ptr + row[:, None] * D + d[None, :], out, mask=row_ok[:, None] & (d[None, :] < D))
    tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, sinks_ptr, out_ptr, num_splits, Hq, T, D, BLOCK_SPLITS: tl.constexpr,
                  BLOCK_D: tl.constexpr, SINKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * T + t
    sp = tl.arange(0, BLOCK_SPLITS)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * num_splits + sp, mask=sp < num_splits, other=float("-inf"))
    top = tl.max(lse, 0)
    sink = float("-inf")
    if SINKS:  # the head's sink: one more logit in the denominator, with no value
        sink = tl.load(sinks_ptr + (row // T) % Hq)
        top = tl.maximum(top, sink)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp(lse - top_safe)  # 0 for splits that saw no key
    part = tl.load(part_ptr + (row * num_splits + sp)[:, None] * D + d[None, :],
                   mask=(sp[:, None] < num_splits) & (d[None, :] < D), other=0.0)
    total = tl.sum(weight, 0) + tl.exp(sink - top_safe)
    out = tl.sum(part * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


# Programs of _split_kernel resident per SM, by (compute capability, BLOCK_R, BLOCK_D,
# bytes per q/k/v element), from the compile's registers and shared memory against the SM's
# limits (spec_ext/kernels/aot.py; tests/test_triton_compile.py checks each entry). Others: 1.
SPLIT_RESIDENT = {(80, 32, 128, 2): 2, (80, 64, 128, 2): 1, (90, 32, 128, 2): 2, (90, 64, 128, 2): 1}


def split_count(B: int, Hkv: int, R_blocks: int, S: int, device: torch.device, resident: int = 1) -> int:
    """Key splits per (row, KV head): about two waves of ``resident`` programs per SM over
    the GPU, at most one per key block."""
    programs = B * Hkv * R_blocks
    return max(1, min(triton.cdiv(S, BLOCK_S), triton.cdiv(2 * resident * _sm_count(device), programs)))


def split_kv_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                       tree_mask: torch.Tensor | None, scale: float, window: int = 0, softcap: float = 0.0,
                       sinks: torch.Tensor | None = None, num_splits: int | None = None) -> torch.Tensor:
    """The launcher; ``num_splits`` overrides :func:`split_count` (tests force boundaries)."""
    B, Hq, T, D = q.shape
    if v.shape[3] != D:
        raise ValueError(f"v: the Triton tree attention needs values of the keys' head size D={D}, got "
                         f"Dv={v.shape[3]} (MLA: use the sdpa, cpu or torch backend)")
    Hkv, S = k.shape[1], k.shape[2]
    out = torch.empty_like(q)
    if q.numel() == 0:
        return out
    R = (Hq // Hkv) * T
    BLOCK_R = max(16, min(64, triton.next_power_of_2(R)))
    R_blocks = triton.cdiv(R, BLOCK_R)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    resident = SPLIT_RESIDENT.get((capability(q.device), BLOCK_R, BLOCK_D, q.element_size()), 1)
    splits = num_splits or split_count(B, Hkv, R_blocks, S, q.device, resident)
    chunk = triton.cdiv(triton.cdiv(S, splits), BLOCK_S) * BLOCK_S  # whole key blocks per split
    splits = triton.cdiv(S, chunk)  # none past S
    part = torch.empty(B, Hq, T, splits, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, Hq, T, splits, dtype=torch.float32, device=q.device)
    causal = tree_mask is None
    mask = q if causal else tree_mask.contiguous()  # an unused pointer when causal
    ieee = q.dtype == torch.float32
    # D=256, fp32 (IEEE dots) and the window/softcap paths spill registers at 64 keys and 4
    # warps (spec_ext/kernels/aot.py)
    if BLOCK_D >= 256 and ieee:
        block_s, warps = FP32_D256_BLOCK_S, 8
    elif BLOCK_D >= 256 or ieee or window or softcap:
        block_s, warps = BLOCK_S // 2, 8
    else:
        block_s, warps = BLOCK_S, 4
    W = 1 if causal else tree_mask.shape[2]
    wrap_triton(_split_kernel)[(B * Hkv, splits, R_blocks)](
        q.contiguous(), k.contiguous(), v.contiguous(), prefix_lens.to(torch.int32).contiguous(), mask, part, lse,
        scale, window, softcap, Hq, Hkv, T, S, D, W, 0 if causal else tree_mask.shape[0], chunk, splits, R,
        CAUSAL=causal, BLOCK_R=BLOCK_R, BLOCK_S=block_s, BLOCK_D=BLOCK_D, BLOCK_W=triton.next_power_of_2(W),
        IEEE=ieee, WINDOW=window > 0, SOFTCAP=softcap > 0, num_warps=warps)
    wrap_triton(_merge_kernel)[(B * Hq * T,)](part, lse, lse if sinks is None else sinks.float().contiguous(), out,
                                              splits, Hq, T, D, BLOCK_SPLITS=max(2, triton.next_power_of_2(splits)),
                                              BLOCK_D=BLOCK_D, SINKS=sinks is not None)
    return out


@triton_op("spec_ext_triton::tree_attention_split", mutates_args=())
def tree_attention_split(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix_lens: torch.Tensor,
                         tree_mask: torch.Tensor | None, scale: float, window: int, softcap: float,
                         sinks: torch.Tensor | None) -> torch.Tensor:
    return split_kv_attention(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks)
