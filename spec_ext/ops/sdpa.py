"""Backend ``sdpa`` of tree_attention: PyTorch's ``scaled_dot_product_attention`` with a
boolean mask built on the device.

The mask covers the keys ``k`` holds, so callers pass only the extent that can be seen
(:meth:`spec_ext.models.cache.SpecCache.update` returns its buffers cut to the longest
row + T, a length the host knows). Every key passed is read: those no query sees (past a
shorter row's prefix + T, below a window) are multiplied by weight 0, so they must be
finite (0 * NaN is NaN; SpecCache's buffers start as zeros), as with the torch reference
(on the cpu, cuda and triton kernels they never reach the output). Nothing here reads a
tensor on the host and every shape follows the inputs' shapes, so CUDA graphs can capture
it. GQA goes to SDPA as ``enable_gqa=True`` (no copy of K/V). Soft-capping and sinks act inside the softmax,
where SDPA has no hook: this backend refuses them (``auto`` sends such calls elsewhere).

Not width-invariant (docs/invariance.md): SDPA picks its kernel (math, flash, memory-efficient)
and that kernel its blocking by the number of queries, so a query's bits depend on T (on CPU,
B=2, Hq=4, D=32, 120 keys, T = 2, 3, 5, 9, 17, 33 against T = 1: float32 differed at every T,
float16 at 5, 17 and 33, bfloat16 at none, which no contract promises); ``tree_attention(...,
invariant=True)`` refuses this backend by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def visible_keys(prefix_lens: Tensor, tree_mask: Tensor | None, T: int, S: int, window: int) -> Tensor:
    """[B,1,T,S] bool, True where query i of row b sees key s: the prefix (s < prefix_lens[b]),
    then node j = s - prefix_lens[b] when bit j of row i is set (tree_mask None: j <= i),
    and with ``window`` > 0 only keys less than ``window`` positions behind the query
    (node positions are prefix + depth; depth = popcount of the node's row - 1)."""
    B = prefix_lens.shape[0]
    device = prefix_lens.device
    node = torch.arange(T, device=device)
    offset = torch.arange(S, device=device) - prefix_lens.view(B, 1, 1)  # [B,1,S]: node index of key s
    if tree_mask is None:  # a chain: node j is the key at offset j, at depth j (few ops: every draft step)
        visible = offset <= node.view(T, 1)
        if window:
            visible &= offset > node.view(T, 1) - window
        return visible.unsqueeze(1)
    bits = ((tree_mask[:, :, node // 32] >> (node % 32)) & 1).bool().expand(B, T, T)
    # column 0: any prefix key; 1..T: node j's bit; T+1: past the new tokens
    table = torch.cat((bits.new_ones(B, T, 1), bits, bits.new_zeros(B, T, 1)), -1)
    visible = torch.gather(table, 2, (offset + 1).clamp(0, T + 1).expand(B, T, S))
    if window:
        depth = bits.sum(-1) - 1  # [B,T]
        key_depth = torch.where(offset < 0, offset, torch.gather(depth, 1, offset.view(B, S).clamp(0, T - 1))[:, None])
        visible &= depth[:, :, None] - key_depth < window
    return visible.unsqueeze(1)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_lens: Tensor, tree_mask: Tensor | None, scale: float,
                   window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """The kernel-level tree_attention (the schema's arguments, see
    :func:`spec_ext.ops.tree_attention`) through SDPA: q [B,Hq,T,D], k [B,Hkv,S,D], v
    [B,Hkv,S,Dv] (Dv may differ from D: MLA) -> [B,Hq,T,Dv] in q's dtype. ``softcap`` must be 0.0 and ``sinks`` None. A query that
    sees no key gets zeros on CPU (PyTorch's safe softmax; not yet checked on a GPU).

    Example:
        >>> q = torch.randn(2, 4, 3, 64); k = v = torch.randn(2, 2, 16, 64)
        >>> tree_attention(q, k, v, torch.tensor([5, 13]), None, 0.125).shape
        torch.Size([2, 4, 3, 64])
    """
    if softcap:
        raise ValueError(f"softcap: backend 'sdpa' has no soft-capping (got {softcap}); use backend='auto', "
                         "which picks one that has it")
    if sinks is not None:
        raise ValueError("sinks: backend 'sdpa' has no attention sinks; use backend='auto', which picks one "
                         "that has them")
    mask = visible_keys(prefix_lens, tree_mask, q.shape[2], k.shape[2], window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
