"""Chain and tree verification in Triton: one program per row, one launch per call.

Acceptance tests are scalar loads; only a final residual/bonus draw (inverse CDF in
float64 over vocabulary blocks) or a greedy argmax sweeps the vocabulary. Tree rows keep
their running residual and sibling q in a [3,B,V] float64 workspace.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import capability, wrap_triton

@triton.jit
def _argmax(row_ptr, V, BLOCK_V: tl.constexpr):
    best_val = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf"))
        block_max = tl.max(x, 0)
        block_idx = start + tl.argmax(x, 0)
        take = block_max > best_val
        best_idx = tl.where(take, block_idx, best_idx)
        best_val = tl.where(take, block_max, best_val)
    return best_idx


@triton.jit
def _mass(p_row, q_row, x, offs, V, kind, HAS_Q: tl.constexpr):
    # kind 0: p; 1: p with token x removed (one-hot q); 2: relu(p - q)
    inside = offs < V
    p = tl.load(p_row + offs, mask=inside, other=0.0).to(tl.float64)
    m = p
    if HAS_Q:
        q = tl.load(q_row + offs, mask=inside & (kind == 2), other=0.0).to(tl.float64)
        m = tl.where(kind == 2, tl.maximum(p - q, 0.0), m)
    m = tl.where((kind == 1) & (offs == x), 0.0, m)
    return m


@triton.jit
def inverse_cdf_step(m, offs, V, threshold, acc, token, last):
    """One block of an inverse-CDF scan over the mass m at offs: (the smallest index whose
    cumulative mass passes threshold, or V; the last positive index; the mass so far)."""
    positive = m > 0
    m = tl.where(positive, m, 0.0)
    hit = positive & (acc + tl.cumsum(m, 0) > threshold)
    token = tl.minimum(token, tl.min(tl.where(hit, offs, V), 0).to(tl.int64))
    last = tl.maximum(last, tl.max(tl.where(positive, offs, -1), 0).to(tl.int64))
    return token, last, acc + tl.sum(m, 0)


@triton.jit
def _inverse_cdf(p_row, q_row, x, u, V, kind, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Smallest j with cumsum(mass)[j] > u * sum(mass); the last positive index if rounding
    leaves none; -1 if the mass is not positive."""
    total = tl.zeros([], tl.float64)
    for start in range(0, V, BLOCK_V):
        total += tl.sum(_mass(p_row, q_row, x, start + tl.arange(0, BLOCK_V), V, kind, HAS_Q), 0)
    threshold = u * total
    acc = tl.zeros([], tl.float64)
    token = tl.zeros([], tl.int64) + V
    last = tl.full([], -1, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        m = _mass(p_row, q_row, x, offs, V, kind, HAS_Q)
        token, last, acc = inverse_cdf_step(m, offs, V, threshold, acc, token, last)
    token = tl.where(token == V, last, token)
    return tl.where(total > 0, token, -1)


@triton.jit
def _sample(p_row, q_row, x, u, V, kind, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    token = _inverse_cdf(p_row, q_row, x, u, V, kind, HAS_Q, BLOCK_V)
    if token < 0:
        token = _inverse_cdf(p_row, q_row, x, u, V, 0, HAS_Q, BLOCK_V)
    return tl.maximum(token, 0)


@triton.jit
def clear_tree_row(PATH, TOK, b, T, BLOCK_T: tl.constexpr):
    """Row b's path [T] = (0, -1, ...) (the root), its tokens [T] all -1."""
    ts = tl.arange(0, BLOCK_T)
    tl.store(PATH + b * T + ts, tl.where(ts == 0, 0, -1).to(tl.int64), mask=ts < T)
    tl.store(TOK + b * T + ts, tl.full([BLOCK_T], -1, tl.int64), mask=ts < T)


@triton.jit
def _chain_verify_kernel(P, X, Q, N, U, OUT, ACC, K, V, GREEDY: tl.constexpr, HAS_Q: tl.constexpr,
                         BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    K1 = K + 1
    ks = tl.arange(0, BLOCK_K)
    tl.store(OUT + b * K1 + ks, tl.full([BLOCK_K], -1, tl.int64), mask=ks < K1)
    tl.debug_barrier()
    n = tl.load(N + b)
    u_final = 0.0
    if not GREEDY:
        u_final = tl.load(U + b * K1 + K)
    done = 0
    for i in range(0, K1):
        if done == 0:
            p_row = P + (b * K1 + i) * V
            q_row = Q + (b * K + i) * V
            has_draft = (i < K) & (i < n)
            x = tl.load(X + b * K + i, mask=has_draft, other=-1)
            if GREEDY:
                token = _argmax(p_row, V, BLOCK_V).to(tl.int64)
                accept = x == token
            else:
                valid = (x >= 0) & (x < V)
                safe_x = tl.where(valid, x, 0)
                px = tl.load(p_row + safe_x).to(tl.float64)
                qx = 1.0
                kind = tl.where(valid, 1, 0)
                if HAS_Q:
                    qx = tl.load(q_row + safe_x, mask=valid, other=0.0).to(tl.float64)
                    kind = tl.where(valid, 2, 0)
                u = tl.load(U + b * K1 + i)
                accept = valid & (qx > 0) & (u * qx < px)
                token = x
                if not accept:
                    token = _sample(p_row, q_row, safe_x, u_final, V, kind, HAS_Q, BLOCK_V)
            tl.store(OUT + b * K1 + i, tl.where(accept, x, token))
            if not accept:
                tl.store(ACC + b, tl.zeros([], tl.int64) + i)
                done = 1


@triton.jit
def _tree_verify_kernel(P, X, PAR, Q, U, WORK, PATH, TOK, ACC, B, T, V, GREEDY: tl.constexpr,
                        HAS_Q: tl.constexpr, WITHOUT_REPLACEMENT: tl.constexpr,
                        BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    residual = WORK + b * V
    rest = WORK + (B + b) * V
    qs = WORK + (2 * B + b) * V
    clear_tree_row(PATH, TOK, b, T, BLOCK_T)
    u_final = 0.0
    if not GREEDY:
        u_final = tl.load(U + b * (T + 1) + T)
    node = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    done = 0
    for _level in range(0, T):
        if done == 0:
            p_row = P + (b * T + node) * V
            for start in range(0, V, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                tl.store(residual + offs, tl.load(p_row + offs, mask=offs < V).to(tl.float64), mask=offs < V)
                if HAS_Q:
                    q = tl.load(Q + (b * T + node) * V + offs, mask=offs < V).to(tl.float64)
                    tl.store(qs + offs, q, mask=offs < V)
            tl.debug_barrier()
            best = tl.zeros([], tl.int64)
            if GREEDY:
                best = _argmax(p_row, V, BLOCK_V).to(tl.int64)
            accepted = tl.full([], -1, tl.int64)
            for child in range(1, T):
                if accepted < 0:
                    parent = tl.load(PAR + b * T + child)
                    x = tl.load(X + b * T + child)
                    if (parent == node) & (x >= 0) & (x < V):
                        if GREEDY:
                            if x == best:
                                accepted = tl.zeros([], tl.int64) + child
                        else:
                            qx = 1.0
                            if HAS_Q:
                                qx = tl.load(qs + x)
                            rx = tl.load(residual + x)
                            u = tl.load(U + b * (T + 1) + child)
                            if (qx > 0) & (u * qx < rx):
                                accepted = tl.zeros([], tl.int64) + child
                            else:
                                total = tl.zeros([], tl.float64)
                                for start in range(0, V, BLOCK_V):
                                    offs = start + tl.arange(0, BLOCK_V)
                                    r = tl.load(residual + offs, mask=offs < V, other=0.0)
                                    if HAS_Q:
                                        q = tl.load(qs + offs, mask=offs < V, other=0.0)
                                        m = tl.maximum(r - q, 0.0)
                                    else:
                                        m = tl.where(offs == x, 0.0, r)
                                    tl.store(rest + offs, m, mask=offs < V)
                                    total += tl.sum(m, 0)
                                tl.debug_barrier()
                                if total > 0:
                                    for start in range(0, V, BLOCK_V):
                                        offs = start + tl.arange(0, BLOCK_V)
                                        m = tl.load(rest + offs, mask=offs < V, other=0.0)
                                        tl.store(residual + offs, m / total, mask=offs < V)
                                if HAS_Q and WITHOUT_REPLACEMENT:
                                    tl.debug_barrier()
                                    tl.store(qs + x, 0.0)
                                    tl.debug_barrier()
                                    qsum = tl.zeros([], tl.float64)
                                    for start in range(0, V, BLOCK_V):
                                        offs = start + tl.arange(0, BLOCK_V)
                                        qsum += tl.sum(tl.load(qs + offs, mask=offs < V, other=0.0), 0)
                                    tl.debug_barrier()
                                    if qsum > 0:
                                        for start in range(0, V, BLOCK_V):
                                            offs = start + tl.arange(0, BLOCK_V)
                                            q = tl.load(qs + offs, mask=offs < V, other=0.0)
                                            tl.store(qs + offs, q / qsum, mask=offs < V)
                                tl.debug_barrier()
            if accepted < 0:
                token = best
                if not GREEDY:
                    token = _sample(residual, residual, 0, u_final, V, 0, False, BLOCK_V)
                tl.store(TOK + b * T + depth, token)
                tl.store(ACC + b, depth)
                done = 1
            else:
                depth += 1
                tl.store(PATH + b * T + depth, accepted)
                tl.store(TOK + b * T + depth - 1, tl.load(X + b * T + accepted))
                node = accepted


def _block_v(V: int, largest: int = 4096) -> int:
    return min(largest, triton.next_power_of_2(V))


@triton_op("spec_ext_triton::chain_verify", mutates_args=())
def chain_verify(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                 num_draft: torch.Tensor, uniforms: torch.Tensor | None, greedy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    B, K1, V = target.shape
    tokens = torch.empty(B, K1, dtype=torch.int64, device=target.device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=target.device)
    if B:
        q = target if draft_probs is None else draft_probs.contiguous()
        u = target if uniforms is None else uniforms.contiguous()
        wrap_triton(_chain_verify_kernel)[(B,)](
            target.contiguous(), draft_tokens.contiguous(), q, num_draft.contiguous(), u, tokens, num_accepted,
            K1 - 1, V, GREEDY=greedy, HAS_Q=draft_probs is not None, BLOCK_V=_block_v(V),
            BLOCK_K=triton.next_power_of_2(K1))
    return tokens, num_accepted


# _tree_verify_kernel's vocabulary block by compute capability: 4096 spills registers on
# sm_80, 2048 on sm_90 (ptxas's choices; spec_ext/kernels/aot.py)
TREE_BLOCK_V = {90: 4096}


@triton_op("spec_ext_triton::tree_verify", mutates_args=())
def tree_verify(target: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor,
                draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None, greedy: bool,
                without_replacement: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, V = target.shape
    path = torch.empty(B, T, dtype=torch.int64, device=target.device)
    tokens = torch.empty(B, T, dtype=torch.int64, device=target.device)
    num_accepted = torch.zeros(B, dtype=torch.int64, device=target.device)
    if B:
        work = torch.empty(3, B, V, dtype=torch.float64, device=target.device)
        q = target if draft_probs is None else draft_probs.contiguous()
        u = target if uniforms is None else uniforms.contiguous()
        wrap_triton(_tree_verify_kernel)[(B,)](
            target.contiguous(), tree_tokens.contiguous(), parents.contiguous(), q, u, work, path, tokens,
            num_accepted, B, T, V, GREEDY=greedy, HAS_Q=draft_probs is not None,
            WITHOUT_REPLACEMENT=without_replacement,
            BLOCK_V=_block_v(V, TREE_BLOCK_V.get(capability(target.device), 2048)), BLOCK_T=triton.next_power_of_2(T))
    return path, tokens, num_accepted
