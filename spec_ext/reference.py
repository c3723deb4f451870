"""Pure-PyTorch reference of every op: the executable specification.

Written for clarity, not speed: loops over rows, float64 where a decision is made.
Every other backend must return what these functions return (for the samplers: the
same tokens for the same uniforms, up to float rounding at inverse-CDF bin edges).
"""
from __future__ import annotations

import heapq
from typing import Sequence

import torch
from torch import Tensor


# ----------------------------------------------------------------------------- trees
def tree_mask(parents: Tensor) -> tuple[Tensor, Tensor]:
    """parents [B,T] int64 (root -1, parents[i] < i) -> depth [B,T] int64,
    mask [B,T,ceil(T/32)] int32 where bit j of mask[b,i] says node i attends node j."""
    B, T = parents.shape
    words = (T + 31) // 32
    depth = torch.zeros(B, T, dtype=torch.int64)
    bits = torch.zeros(B, T, words * 32, dtype=torch.bool)
    for b in range(B):
        for i in range(T):
            p = int(parents[b, i])
            if p >= 0:
                depth[b, i] = depth[b, p] + 1
                bits[b, i] = bits[b, p]
            bits[b, i, i] = True
    weights = torch.tensor([1 << k for k in range(32)], dtype=torch.int64)
    packed = (bits.view(B, T, words, 32).long() * weights).sum(-1)
    mask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return depth.to(parents.device), mask.to(parents.device)


def unpack_mask(mask: Tensor, n: int) -> Tensor:
    """[..., W] int32 bits -> [..., n] bool."""
    shifts = torch.arange(32, device=mask.device, dtype=torch.int32)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(-2)[..., :n].bool()


# ----------------------------------------------------------------------- sampling
def _inverse_cdf(mass: Tensor, u: float) -> int:
    """Smallest j with cumsum(mass)[j] > u * sum(mass); -1 if the mass is not positive."""
    mass = mass.double()
    total = mass.sum()
    if not bool(total > 0):
        return -1
    cdf = mass.cumsum(0)
    j = int(torch.searchsorted(cdf, u * total, right=True))
    positive = torch.nonzero(mass > 0).flatten()
    return min(j, int(positive[-1]))


def _sample(residual: Tensor, fallback: Tensor, u: float) -> int:
    """Inverse CDF on the residual; on p when the residual is all zero; 0 if both are."""
    token = _inverse_cdf(residual, u)
    if token < 0:
        token = _inverse_cdf(fallback, u)
    return max(token, 0)


def chain_verify(target: Tensor, draft_tokens: Tensor, draft_probs: Tensor | None,
                 num_draft: Tensor, uniforms: Tensor | None, greedy: bool) -> tuple[Tensor, Tensor]:
    """target [B,K+1,V] f32 (probabilities, or logits when greedy), draft_tokens [B,K],
    draft_probs [B,K,V] or None (one-hot q), num_draft [B], uniforms [B,K+1] f64
    -> tokens [B,K+1] (-1 padded), num_accepted [B]."""
    B, K1, V = target.shape
    tokens = torch.full((B, K1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        for i in range(K1):
            p = target[b, i].double()
            x = int(draft_tokens[b, i]) if i < K1 - 1 and i < int(num_draft[b]) else -1
            if greedy:
                best = int(target[b, i].argmax())
                if x == best:
                    tokens[b, i] = x
                    continue
                tokens[b, i] = best
            elif 0 <= x < V:
                qx = 1.0 if draft_probs is None else float(draft_probs[b, i, x])
                if qx > 0 and float(uniforms[b, i]) * qx < float(p[x]):
                    tokens[b, i] = x
                    continue
                if draft_probs is None:
                    residual = p.clone()
                    residual[x] = 0
                else:
                    residual = (p - draft_probs[b, i].double()).clamp_min(0)
                tokens[b, i] = _sample(residual, p, float(uniforms[b, -1]))
            else:  # no draft here: a plain sample from p
                tokens[b, i] = _sample(p, p, float(uniforms[b, -1]))
            num_accepted[b] = i
            break
    return tokens.to(target.device), num_accepted.to(target.device)


def tree_verify(target: Tensor, tree_tokens: Tensor, parents: Tensor, draft_probs: Tensor | None,
                uniforms: Tensor | None, greedy: bool, without_replacement: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
    """Multi-draft recursive rejection sampling down a tree.

    target [B,T,V] (p after node i), tree_tokens [B,T] (node 0 is the root; -1 absent),
    parents [B,T], draft_probs [B,T,V] (q that node i's children were drawn from) or
    None (deterministic drafts), uniforms [B,T+1] f64 -> path [B,T] node ids,
    tokens [B,T], num_accepted [B], each -1 padded.
    """
    B, T, V = target.shape
    path = torch.full((B, T), -1, dtype=torch.int64)
    tokens = torch.full((B, T), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        node, depth = 0, 0
        path[b, 0] = 0
        while True:
            residual = target[b, node].double()
            q = None if draft_probs is None else draft_probs[b, node].double().clone()
            best = int(target[b, node].argmax())
            accepted = -1
            for child in range(node + 1, T):
                x = int(tree_tokens[b, child])
                if int(parents[b, child]) != node or not 0 <= x < V:
                    continue
                if greedy:
                    if x == best:
                        accepted = child
                        break
                    continue
                qx = 1.0 if q is None else float(q[x])
                if qx > 0 and float(uniforms[b, child]) * qx < float(residual[x]):
                    accepted = child
                    break
                if q is None:
                    rest = residual.clone()
                    rest[x] = 0
                else:
                    rest = (residual - q).clamp_min(0)
                if rest.sum() > 0:
                    residual = rest / rest.sum()
                if q is not None and without_replacement:
                    q[x] = 0
                    if q.sum() > 0:
                        q = q / q.sum()
            if accepted < 0:
                tokens[b, depth] = best if greedy else _sample(residual, residual, float(uniforms[b, -1]))
                num_accepted[b] = depth
                break
            depth += 1
            path[b, depth] = accepted
            tokens[b, depth - 1] = tree_tokens[b, accepted]
            node = accepted
    dev = target.device
    return path.to(dev), tokens.to(dev), num_accepted.to(dev)


# ----------------------------------------------------------------------- attention
def positions(prefix_lens: Tensor, tree: Tensor, S: int) -> tuple[Tensor, Tensor]:
    """Absolute positions from the unpacked tree [B|1,T,T] bool (row i: node i's ancestors
    and itself): of the queries [B,T] (prefix_lens[b] + depth of node i) and of the keys
    [B,S] (prefix key s at s, tree node j at prefix_lens[b] + depth(j)). A node's depth is
    its number of ancestors, the popcount of its row minus one (node j of the causal chain: j)."""
    B, T = prefix_lens.shape[0], tree.shape[1]
    depth = (tree.sum(-1) - 1).expand(B, T)
    prefix = prefix_lens.long().view(B, 1)
    s = torch.arange(S, device=prefix_lens.device).view(1, S)
    offset = s - prefix
    node_pos = prefix + torch.gather(depth, 1, offset.clamp(0, T - 1))
    return prefix + depth, torch.where(offset >= 0, node_pos, s.expand(B, S))


def visibility(prefix_lens: Tensor, tree_mask: Tensor | None, T: int, S: int, window: int = 0) -> Tensor:
    """[B,T,S] bool: key s is visible to query i of row b (window 0: no sliding window)."""
    B = prefix_lens.shape[0]
    device = prefix_lens.device
    s = torch.arange(S, device=device)
    prefix = prefix_lens.long().view(B, 1, 1)
    if tree_mask is None:
        tree = torch.ones(T, T, dtype=torch.bool, device=device).tril().expand(B, T, T)
    else:
        tree = unpack_mask(tree_mask, T).expand(B, T, T)
    offset = s.view(1, 1, S) - prefix                          # [B,1,S]
    inside = (offset >= 0) & (offset < T)
    tree_bit = torch.gather(tree, 2, offset.clamp(0, T - 1).expand(B, T, S))
    visible = (s.view(1, 1, S) < prefix) | (inside & tree_bit)
    if window and T:
        query_pos, key_pos = positions(prefix_lens, tree, S)
        visible &= query_pos[:, :, None] - key_pos[:, None, :] < window
    return visible


def tree_attention(q: Tensor, k: Tensor, v: Tensor, prefix_lens: Tensor, tree_mask: Tensor | None, scale: float,
                   window: int = 0, softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
    """q [B,Hq,T,D], k [B,Hkv,S,D], v [B,Hkv,S,Dv] (Dv may differ from D: MLA), prefix_lens
    [B], tree_mask [B|1,T,W] int32 or None (causal) -> [B,Hq,T,Dv]; computed with a dense
    mask in float32 (float64 for float64 inputs).

    window > 0: a query at position p sees key position s only if p - s < window (see
    :func:`positions`). softcap > 0: the scaled scores become softcap * tanh(score / softcap)
    before the mask. sinks [Hq] (any float dtype, read in the compute dtype): one extra logit per query head in the softmax's
    denominator, with no value. A query that sees no key returns zeros, whatever its sink
    (a finite sink takes all the weight; -inf, exp(-inf) = 0, is no sink). Not width-invariant:
    PyTorch's matmuls pick their order of summation by the query count (docs/invariance.md)."""
    B, Hq, T, D = q.shape
    S = k.shape[2]
    group = Hq // k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    keys = k.to(dtype).repeat_interleave(group, 1)
    values = v.to(dtype).repeat_interleave(group, 1)
    visible = visibility(prefix_lens, tree_mask, T, S, window).unsqueeze(1)
    scores = (q.to(dtype) @ keys.transpose(-1, -2)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).view(1, Hq, 1, 1).expand(B, Hq, T, 1)
        # a sink of -inf on a query that sees no key: softmax of -infs only, 0/0; no sink, zeros
        weights = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :S].nan_to_num(0.0)
    else:
        weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return (weights @ values).to(q.dtype)


# ------------------------------------------------------------------------ kv cache
def compact_kv(caches: Tensor | list[Tensor], src: Tensor, dst_start: Tensor) -> None:
    """In place, for every [B,H,S,D] tensor of caches (a list, or [N,B,H,S,D]): row b's
    positions src[b,j] (j before the first -1) move to dst_start[b] + j, gathered before
    stored so overlapping ranges are fine."""
    for cache in caches:
        for b in range(src.shape[0]):
            n = int((src[b] >= 0).sum())
            if n:
                moved = cache[b, :, src[b, :n]].clone()
                start = int(dst_start[b])
                cache[b, :, start:start + n] = moved


# ------------------------------------------------------------------------ linear
def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x [..., K], weight [N, K] (x's dtype, or bfloat16 with float32 x), bias [N] or None ->
    x @ weight.T + bias [..., N], summed in float64 and rounded once to x's dtype (the other
    backends sum in float32, in their own order; bfloat16 weights widen exactly)."""
    y = x.double() @ weight.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


# ------------------------------------------------------------------------ policies
def acceptance_head(hidden: Tensor, probs: Tensor, weights: list[Tensor], column: int, eps: float) -> Tensor:
    """SpecDecPP's predicted acceptance [B] float32 of the token drawn from ``probs``.

    hidden [B,H], probs [B,V]: the draft's last hidden state and the distribution it gave.
    Features x = [hidden; log max p; entropy of p; max p - second largest p]; then a
    residual MLP, weights = [inp.weight [D,H+3], inp.bias [D], per block: norm.weight,
    norm.bias [D], up.weight [D,D], up.bias [D], down.weight [D,D], down.bias [D],
    out.weight [O,D], out.bias [O]]: h = inp(x); per block h += down(silu(up(layer_norm(h))));
    result sigmoid(out(h)[:, column]). Computed in float64."""
    w = [t.double() for t in weights]
    p = probs.double()
    top = p.sort(-1, descending=True).values
    entropy = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
    x = torch.cat([hidden.double(), top[:, :1].log(), entropy[:, None], top[:, :1] - top[:, 1:2]], -1)
    h = x @ w[0].T + w[1]
    for norm_w, norm_b, up_w, up_b, down_w, down_b in zip(*[iter(w[2:-2])] * 6):
        centred = h - h.mean(-1, keepdim=True)
        normed = centred / (centred.square().mean(-1, keepdim=True) + eps).sqrt()
        u = (normed * norm_w + norm_b) @ up_w.T + up_b
        h = h + (u * torch.sigmoid(u)) @ down_w.T + down_b
    return torch.sigmoid(h @ w[-2][column] + w[-1][column]).float()


# ----------------------------------------------------------------------------- text lookups
# What the policies' text indexes answer (spec_ext.policies.NGramIndex, SuffixCache), by scans.
def reference_occurrences(history: Sequence[int], n_max: int, n_min: int) -> tuple[int, list[int]]:
    """The plain matcher (a scan of the whole history): ``(n, starts)`` where n is the
    longest suffix length in [n_min, n_max] that occurred earlier, and ``starts`` the
    positions just after each earlier occurrence, most recent first; ``(0, [])`` if none.

    Example:
        >>> reference_occurrences([1, 2, 3, 1, 2, 4, 1, 2], 2, 1)
        (2, [5, 2])
    """
    L = len(history)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = list(history[L - n:])
        starts = [p for p in range(L - 1, n - 1, -1) if list(history[p - n:p]) == suffix]
        if starts:
            return n, starts
    return 0, []


def reference_tree(texts: Sequence[Sequence[int]], history: Sequence[int], depth: int, nodes: int,
                   alpha: float = 1.0, min_prob: float = 0.1, max_match: int = 64
                   ) -> tuple[list[int], list[int], int, float]:
    """What :meth:`SuffixCache.propose` returns, by a plain scan of the stored ``texts``: the
    longest suffix of ``history`` (at most ``max_match`` tokens) that occurs in a text with a
    token after it, then its continuations best first by ``count(x + c) / count(x)`` (counts
    of occurrences over all texts).

    Example:
        >>> reference_tree([[1, 2, 3, 4, 5, 6], [9, 3, 4, 5, 7]], [8, 3, 4], depth=4, nodes=8)
        ([-1, 5, 6], [-1, 0, 1], 2, 1.5)
    """
    def count(x: tuple) -> int:
        return sum(tuple(t[e - len(x):e]) == x for t in texts for e in range(len(x), len(t) + 1))

    def followed(x: tuple) -> bool:
        return any(tuple(t[e - len(x):e]) == x for t in texts for e in range(len(x), len(t)))

    L = len(history)
    n = next((m for m in range(min(max_match, L), 0, -1) if followed(tuple(history[L - m:]))), 0)
    if n == 0:
        return [-1], [-1], 0, 0.0
    vocabulary = sorted({c for t in texts for c in t})
    tokens, parents, score, heap = [-1], [-1], 0.0, []

    def push(path: tuple, prob: float, parent: int) -> None:
        total = count(path)
        for c in vocabulary:
            p = prob * count(path + (c,)) / total
            if p > 0 and p >= min_prob:
                heapq.heappush(heap, (-p, parent, c, path + (c,)))

    push(tuple(history[L - n:]), 1.0, 0)
    while heap and len(tokens) <= min(nodes - 1, int(alpha * n)):
        p, parent, c, path = heapq.heappop(heap)
        tokens.append(c)
        parents.append(parent)
        score -= p
        if len(path) - n < depth:
            push(path, -p, len(tokens) - 1)
    return tokens, parents, n, score
