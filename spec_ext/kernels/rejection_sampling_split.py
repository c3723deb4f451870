"""Chain and greedy verification split over the vocabulary, in two launches and no host sync.

The one-program-per-row kernel of ``rejection_sampling.py`` keeps a few SMs busy at small
batch. Here each row's vocabulary is cut into ``splits`` chunks:

1. ``_argmax_partials`` (greedy; one program per (row, position) x chunk) writes each
   chunk's max and its first index; ``_mass_partials`` (sampling; one program per row x
   chunk) finds the row's first rejected position from scalar loads (every program of the
   row finds the same one) and writes each chunk's float64 sum and last positive index of
   the residual there, and of p (the fallback when the residual is all zero).
2. ``_finish`` (one program per row) combines the chunks: the argmax at each position in
   order (ties: the first index) until a draft differs; or the chunk where the cumulative
   mass passes ``u * total`` and then the token inside it, as the reference's inverse CDF
   does over the whole row (same tokens for the same uniforms, up to float64 rounding of
   the sums' order).

Greedy tree verification takes the same argmax partials for every node at once, then one
program per row walks the tree. Tree rejection sampling stays one program per row (each
rejected sibling's residual needs the sum over the whole vocabulary of the last one) but
keeps no float64 [B,V] workspace: a rejection reads p and q once for its sums, and the
residual is recomputed from the rejections' scalars where needed. Backend
``"triton_split"`` of ``chain_rejection_sample``, ``greedy_verify``,
``tree_rejection_sample`` and ``tree_greedy_verify``; it has not run on a GPU yet, so
``auto`` never picks it.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import resident_per_sm, sm_count, wrap_triton
from spec_ext.kernels.rejection_sampling import (_mass, clear_tree_row,  # _mass(..., end, kind): 0 outside
                                                  inverse_cdf_step)

# Triton emits 128-bit loads only where a block holds at least 4 float32 a thread (spec_ext/kernels/aot.py):
# 128 entries a warp. The partials kernels take a warp per 128 entries of their block (up to 4),
# and the planned splits read no fewer than one warp's 128 entries of a row.
ENTRIES_PER_WARP = 128
MIN_CHUNK = ENTRIES_PER_WARP
# larger blocks spill registers (4 warps; spec_ext/kernels/aot.py): _tree_sample_kernel's fp64 tiles at
# 4096 on sm_80 and sm_90, _finish's scan at 1024 on sm_80
TREE_SAMPLE_BLOCK_V = 2048
FINISH_BLOCK_V = 512


@triton.jit
def _argmax_partials(P, PVAL, PIDX, V, chunk, splits, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * (K + 1) + position
    s = tl.program_id(1)
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    best_val = float("-inf")
    best_idx = start.to(tl.int64)
    for off in range(start, end, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        x = tl.load(P + row * V + offs, mask=offs < end, other=float("-inf"))
        block_max = tl.max(x, 0)
        take = block_max > best_val
        best_idx = tl.where(take, off + tl.argmax(x, 0), best_idx)
        best_val = tl.where(take, block_max, best_val)
    tl.store(PVAL + row * splits + s, best_val)
    tl.store(PIDX + row * splits + s, best_idx)


@triton.jit
def _combined_argmax(PVAL, PIDX, row, splits, V, BLOCK_S: tl.constexpr):
    """Row's argmax from its chunks' maxima and first indices (ties: the first index; an
    all-NaN row: 0)."""
    ss = tl.arange(0, BLOCK_S)
    in_split = ss < splits
    values = tl.load(PVAL + row * splits + ss, mask=in_split, other=float("-inf"))
    best = tl.max(values, 0)
    first = tl.min(tl.where(in_split & (values == best),
                            tl.load(PIDX + row * splits + ss, mask=in_split, other=0), V), 0)
    return tl.where(first == V, 0, first).to(tl.int64)


@triton.jit
def _first_rejection(P, X, Q, N, U, b, K, V, HAS_Q: tl.constexpr):
    """(position, kind, token) of row b's first rejected position: kind 0 samples from p
    (no draft there), 1 from p without the draft's token (one-hot q), 2 from relu(p - q)."""
    K1 = K + 1
    n = tl.load(N + b)
    position = tl.zeros([], tl.int64) + K
    kind = tl.zeros([], tl.int32)
    token = tl.zeros([], tl.int64)
    done = 0
    for i in range(0, K1):
        if done == 0:
            has_draft = (i < K) & (i < n)
            x = tl.load(X + b * K + i, mask=has_draft, other=-1)
            valid = (x >= 0) & (x < V)
            safe_x = tl.where(valid, x, 0)
            px = tl.load(P + (b * K1 + i) * V + safe_x).to(tl.float64)
            qx = 1.0
            kind_here = tl.where(valid, 1, 0)
            if HAS_Q:
                qx = tl.load(Q + (b * K + i) * V + safe_x, mask=valid, other=0.0).to(tl.float64)
                kind_here = tl.where(valid, 2, 0)
            u = tl.load(U + b * K1 + i)
            if not (valid & (qx > 0) & (u * qx < px)):
                position = tl.zeros([], tl.int64) + i
                kind = kind_here
                token = safe_x
                done = 1
    return position, kind, token


@triton.jit
def _mass_partials(P, X, Q, N, U, PART, LAST, K, V, chunk, splits, HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    position, kind, x = _first_rejection(P, X, Q, N, U, b, K, V, HAS_Q)
    p_row = P + (b * (K + 1) + position) * V
    q_row = Q + (b * K + position) * V  # read only when kind == 2, i.e. position < K
    start = s * chunk
    end = tl.minimum(start + chunk, V)
    residual_sum = tl.zeros([], tl.float64)
    p_sum = tl.zeros([], tl.float64)
    residual_last = tl.full([], -1, tl.int64)
    p_last = tl.full([], -1, tl.int64)
    for off in range(start, end, BLOCK_V):
        offs = off + tl.arange(0, BLOCK_V)
        m = _mass(p_row, q_row, x, offs, end, kind, HAS_Q)
        p = tl.load(p_row + offs, mask=offs < end, other=0.0).to(tl.float64)
        residual_sum += tl.sum(m, 0)
        p_sum += tl.sum(p, 0)
        residual_last = tl.maximum(residual_last, tl.max(tl.where(m > 0, offs, -1), 0).to(tl.int64))
        p_last = tl.maximum(p_last, tl.max(tl.where(p > 0, offs, -1), 0).to(tl.int64))
    tl.store(PART + (2 * b) * splits + s, residual_sum)
    tl.store(PART + (2 * b + 1) * splits + s, p_sum)
    tl.store(LAST + (2 * b) * splits + s, residual_last)
    tl.store(LAST + (2 * b + 1) * splits + s, p_last)


@triton.jit
def _finish(P, X, Q, N, U, PART, LAST, PVAL, PIDX, OUT, ACC, K, V, chunk, splits, GREEDY: tl.constexpr,
            HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    K1 = K + 1
    ss = tl.arange(0, BLOCK_S)
    in_split = ss < splits
    if GREEDY:
        n = tl.load(N + b)
        position = tl.zeros([], tl.int64) + K
        token = tl.zeros([], tl.int64)
        done = 0
        for i in range(0, K1):
            if done == 0:
                argmax = _combined_argmax(PVAL, PIDX, b * K1 + i, splits, V, BLOCK_S)
                x = tl.load(X + b * K + i, mask=(i < K) & (i < n), other=-1)
                if x != argmax:
                    position = tl.zeros([], tl.int64) + i
                    token = argmax
                    done = 1
    else:
        position, kind, x = _first_rejection(P, X, Q, N, U, b, K, V, HAS_Q)
        residual = tl.load(PART + (2 * b) * splits + ss, mask=in_split, other=0.0)
        use_residual = tl.sum(residual, 0) > 0
        which = tl.where(use_residual, 0, 1)
        part = tl.load(PART + (2 * b + which) * splits + ss, mask=in_split, other=0.0)
        total = tl.sum(part, 0)
        threshold = tl.load(U + b * K1 + K) * total
        c = tl.min(tl.where(in_split & (tl.cumsum(part, 0) > threshold), ss, BLOCK_S), 0)
        token = tl.max(tl.load(LAST + (2 * b + which) * splits + ss, mask=in_split, other=-1), 0).to(tl.int64)
        if c < splits:
            kind = tl.where(use_residual, kind, 0)
            p_row = P + (b * K1 + position) * V
            q_row = Q + (b * K + position) * V
            acc = tl.sum(tl.where(ss < c, part, 0.0), 0)
            start = c * chunk
            end = tl.minimum(start + chunk, V)
            found = tl.zeros([], tl.int64) + V
            for off in range(start, end, BLOCK_V):
                offs = off + tl.arange(0, BLOCK_V)
                m = _mass(p_row, q_row, x, offs, end, kind, HAS_Q)
                hit = (m > 0) & (acc + tl.cumsum(m, 0) > threshold)
                found = tl.minimum(found, tl.min(tl.where(hit, offs, V), 0).to(tl.int64))
                acc += tl.sum(m, 0)
            # rounding between the chunk sums and this scan: the chunk's last positive entry
            token = tl.where(found == V, tl.load(LAST + (2 * b + which) * splits + c), found)
        token = tl.where(total > 0, token, 0)
    ks = tl.arange(0, BLOCK_K)
    drafts = tl.load(X + b * K + ks, mask=ks < position, other=-1)
    tl.store(OUT + b * K1 + ks, tl.where(ks < position, drafts, tl.where(ks == position, token, -1)), mask=ks < K1)
    tl.store(ACC + b, position)


@triton.jit
def _tree_greedy_finish(X, PAR, PVAL, PIDX, PATH, TOK, ACC, T, V, splits, BLOCK_S: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    """From the root, follow the first child (in id order) whose token is its node's argmax."""
    b = tl.program_id(0).to(tl.int64)
    clear_tree_row(PATH, TOK, b, T, BLOCK_T)
    tl.debug_barrier()
    ts = tl.arange(0, BLOCK_T)
    parents = tl.load(PAR + b * T + ts, mask=ts < T, other=-2)
    tokens = tl.load(X + b * T + ts, mask=ts < T, other=-1)
    node = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    done = 0
    for _level in range(0, T):
        if done == 0:
            argmax = _combined_argmax(PVAL, PIDX, b * T + node, splits, V, BLOCK_S)
            match = (ts > node) & (parents == node) & (tokens == argmax)
            child = tl.min(tl.where(match, ts, BLOCK_T), 0).to(tl.int64)
            if child < T:
                depth += 1
                tl.store(PATH + b * T + depth, child)
                tl.store(TOK + b * T + depth - 1, argmax)
                node = child
            else:
                tl.store(TOK + b * T + depth, argmax)
                tl.store(ACC + b, depth)
                done = 1


@triton.jit
def _residual(p_row, q_row, offs, inside, k, xs, zs, ss, HAS_Q: tl.constexpr, WITHOUT_REPLACEMENT: tl.constexpr):
    """A node's residual and sibling q at offs after its first k rejected siblings, from p
    and q and each rejection's (token xs[j], residual sum zs[j], q sum ss[j]), in the
    reference's order: rest = relu(r - q) (or r without the token), r = rest / its sum,
    then q loses the token and is renormalised (without replacement)."""
    r = tl.load(p_row + offs, mask=inside, other=0.0).to(tl.float64)
    qv = tl.zeros_like(r)
    if HAS_Q:
        qv = tl.load(q_row + offs, mask=inside, other=0.0).to(tl.float64)
    for j in range(0, k):
        x = tl.load(xs + j)
        z = tl.load(zs + j)
        if HAS_Q:
            rest = tl.maximum(r - qv, 0.0)
        else:
            rest = tl.where(offs == x, 0.0, r)
        r = tl.where(z > 0, rest / z, r)
        if HAS_Q and WITHOUT_REPLACEMENT:
            total = tl.load(ss + j)
            qv = tl.where(offs == x, 0.0, qv)
            qv = tl.where(total > 0, qv / total, qv)
    return r, qv


@triton.jit
def _tree_sample_kernel(P, X, PAR, Q, U, XS, ZS, SS, PATH, TOK, ACC, T, V, HAS_Q: tl.constexpr,
                        WITHOUT_REPLACEMENT: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_T: tl.constexpr):
    """Multi-draft recursive rejection sampling down one row's tree with no workspace: a
    rejected sibling costs one read of p and q (its residual's sums); the residual itself
    is recomputed from the rejections' scalars wherever it is needed."""
    b = tl.program_id(0).to(tl.int64)
    clear_tree_row(PATH, TOK, b, T, BLOCK_T)
    tl.debug_barrier()
    xs, zs, ss = XS + b * T, ZS + b * T, SS + b * T
    u_final = tl.load(U + b * (T + 1) + T)
    node = tl.zeros([], tl.int64)
    depth = tl.zeros([], tl.int64)
    done = 0
    for _level in range(0, T):
        if done == 0:
            p_row = P + (b * T + node) * V
            q_row = Q + (b * T + node) * V
            k = tl.zeros([], tl.int32)  # rejected siblings so far at this node
            accepted = tl.full([], -1, tl.int64)
            for child in range(1, T):
                if accepted < 0:
                    parent = tl.load(PAR + b * T + child)
                    x = tl.load(X + b * T + child)
                    if (parent == node) & (x >= 0) & (x < V):
                        # the token (and a masked neighbour); names apart from the [BLOCK_V] r, qv
                        # below, as a loop-carried variable keeps its shape
                        at = x + tl.arange(0, 2)
                        r_at, q_at = _residual(p_row, q_row, at, at == x, k, xs, zs, ss, HAS_Q, WITHOUT_REPLACEMENT)
                        rx = tl.sum(tl.where(at == x, r_at, 0.0), 0)
                        qx = 1.0
                        if HAS_Q:
                            qx = tl.sum(tl.where(at == x, q_at, 0.0), 0)
                        u = tl.load(U + b * (T + 1) + child)
                        if (qx > 0) & (u * qx < rx):
                            accepted = tl.zeros([], tl.int64) + child
                        else:
                            rest_sum = tl.zeros([], tl.float64)
                            q_sum = tl.zeros([], tl.float64)
                            for start in range(0, V, BLOCK_V):
                                offs = start + tl.arange(0, BLOCK_V)
                                r, qv = _residual(p_row, q_row, offs, offs < V, k, xs, zs, ss, HAS_Q,
                                                  WITHOUT_REPLACEMENT)
                                if HAS_Q:
                                    rest_sum += tl.sum(tl.maximum(r - qv, 0.0), 0)
                                else:
                                    rest_sum += tl.sum(tl.where(offs == x, 0.0, r), 0)
                                q_sum += tl.sum(tl.where(offs == x, 0.0, qv), 0)
                            tl.store(xs + k, x)
                            tl.store(zs + k, rest_sum)
                            tl.store(ss + k, q_sum)
                            tl.debug_barrier()
                            k += 1
            if accepted < 0:  # inverse CDF on the residual (the reference's _sample(r, r, u))
                total = tl.zeros([], tl.float64)
                for start in range(0, V, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    r, _ = _residual(p_row, q_row, offs, offs < V, k, xs, zs, ss, HAS_Q, WITHOUT_REPLACEMENT)
                    total += tl.sum(r, 0)
                threshold = u_final * total
                acc = tl.zeros([], tl.float64)
                token = tl.zeros([], tl.int64) + V
                last = tl.full([], -1, tl.int64)
                for start in range(0, V, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    r, _ = _residual(p_row, q_row, offs, offs < V, k, xs, zs, ss, HAS_Q, WITHOUT_REPLACEMENT)
                    token, last, acc = inverse_cdf_step(r, offs, V, threshold, acc, token, last)
                token = tl.where(token == V, last, token)
                tl.store(TOK + b * T + depth, tl.where(total > 0, tl.maximum(token, 0), 0))
                tl.store(ACC + b, depth)
                done = 1
            else:
                depth += 1
                tl.store(PATH + b * T + depth, accepted)
                tl.store(TOK + b * T + depth - 1, tl.load(X + b * T + accepted))
                node = accepted


# Programs resident per SM, by compute capability: the fewest over the kernel's launch
# configurations, from the compile's registers and shared memory against the SM's limits
# (spec_ext/kernels/aot.py; tests/test_triton_compile.py checks them). A GPU not listed: 1.
ARGMAX_RESIDENT = {80: 16, 90: 16}
MASS_RESIDENT = {80: 8, 90: 7}


def split_count(rows: int, V: int, resident: int, device: torch.device) -> int:
    """Chunks per row: enough for one full wave of ``resident`` programs per SM over the
    GPU, as far as MIN_CHUNK allows (no chunk under it)."""
    return max(1, min(V // MIN_CHUNK, triton.cdiv(resident * sm_count(device), rows)))


def chunking(V: int, splits: int) -> tuple[int, int, int]:
    """(chunk, splits, BLOCK_V) for at least ``splits`` chunks of a row of V where blocks of 16
    allow: each chunk whole blocks of BLOCK_V >= 16 entries, so every chunk starts 16-entry
    aligned (the compiler can emit 128-bit loads), rounded down so that the grid is not
    smaller than asked (at most twice as many), and no chunk is empty."""
    wanted = max(1, V // splits)
    block = max(16, min(1024, 1 << (wanted.bit_length() - 1)))  # the power of two <= wanted
    chunk = max(1, wanted // block) * block
    return chunk, triton.cdiv(V, chunk), block


def partial_warps(block: int) -> int:
    """num_warps of a partials kernel over blocks of ``block`` entries: 4 entries (16 bytes of
    float32) a thread at least, so that its loads stay 128-bit; at most 4 warps."""
    return max(1, min(4, block // ENTRIES_PER_WARP))


def split_chain_verify(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       num_draft: torch.Tensor, uniforms: torch.Tensor | None, greedy: bool,
                       num_splits: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The launcher; ``num_splits`` replaces :func:`split_count`'s choice, then :func:`chunking`
    rounds it (tests force chunk boundaries)."""
    B, K1, V = target.shape
    device = target.device
    tokens = torch.empty(B, K1, dtype=torch.int64, device=device)
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return tokens, num_accepted
    rows = B * K1 if greedy else B
    resident = resident_per_sm(ARGMAX_RESIDENT if greedy else MASS_RESIDENT, device)
    chunk, splits, BLOCK_V = chunking(V, num_splits or split_count(rows, V, resident, device))
    target, draft_tokens, num_draft = target.contiguous(), draft_tokens.contiguous(), num_draft.contiguous()
    q = target if draft_probs is None else draft_probs.contiguous()
    u = target if uniforms is None else uniforms.contiguous()
    part = last = pval = pidx = target  # unused pointers
    if greedy:
        pval = torch.empty(rows, splits, dtype=torch.float32, device=device)
        pidx = torch.empty(rows, splits, dtype=torch.int64, device=device)
        wrap_triton(_argmax_partials)[(rows, splits)](target, pval, pidx, V, chunk, splits, BLOCK_V=BLOCK_V,
                                                      num_warps=partial_warps(BLOCK_V))
    else:
        part = torch.empty(B, 2, splits, dtype=torch.float64, device=device)
        last = torch.empty(B, 2, splits, dtype=torch.int64, device=device)
        wrap_triton(_mass_partials)[(B, splits)](target, draft_tokens, q, num_draft, u, part, last, K1 - 1, V, chunk,
                                                 splits, HAS_Q=draft_probs is not None, BLOCK_V=BLOCK_V,
                                                 num_warps=partial_warps(BLOCK_V))
    wrap_triton(_finish)[(B,)](target, draft_tokens, q, num_draft, u, part, last, pval, pidx, tokens, num_accepted,
                               K1 - 1, V, chunk, splits, GREEDY=greedy, HAS_Q=draft_probs is not None,
                               BLOCK_V=min(BLOCK_V, FINISH_BLOCK_V), BLOCK_S=max(2, triton.next_power_of_2(splits)),
                               BLOCK_K=triton.next_power_of_2(K1))
    return tokens, num_accepted


@triton_op("spec_ext_triton::chain_verify_split", mutates_args=())
def chain_verify_split(target: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                       num_draft: torch.Tensor, uniforms: torch.Tensor | None, greedy: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    return split_chain_verify(target, draft_tokens, draft_probs, num_draft, uniforms, greedy)


def split_tree_verify(target: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor,
                      draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None, greedy: bool,
                      without_replacement: bool, num_splits: int | None = None, block_v: int | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy: every node's argmax split over the vocabulary at once, then one program per
    row walks the tree. Sampling: one program per row (its siblings' residuals chain
    through whole-vocabulary sums), without a workspace: see _tree_sample_kernel.
    ``num_splits`` (rounded by :func:`chunking`) and ``block_v`` override the chunking
    (tests force boundaries)."""
    B, T, V = target.shape
    device = target.device
    path = torch.empty(B, T, dtype=torch.int64, device=device)
    tokens = torch.empty(B, T, dtype=torch.int64, device=device)
    num_accepted = torch.empty(B, dtype=torch.int64, device=device)
    if B == 0:
        return path, tokens, num_accepted
    if not greedy:
        steps = torch.empty(B, T, dtype=torch.int64, device=device)
        sums = torch.empty(2, B, T, dtype=torch.float64, device=device)
        wrap_triton(_tree_sample_kernel)[(B,)](
            target.contiguous(), tree_tokens.contiguous(), parents.contiguous(),
            target if draft_probs is None else draft_probs.contiguous(), uniforms.contiguous(), steps, sums[0],
            sums[1], path, tokens, num_accepted, T, V, HAS_Q=draft_probs is not None,
            WITHOUT_REPLACEMENT=without_replacement,
            BLOCK_V=block_v or min(TREE_SAMPLE_BLOCK_V, triton.next_power_of_2(V)),
            BLOCK_T=triton.next_power_of_2(T))
        return path, tokens, num_accepted
    resident = resident_per_sm(ARGMAX_RESIDENT, device)
    chunk, splits, BLOCK_V = chunking(V, num_splits or split_count(B * T, V, resident, device))
    pval = torch.empty(B * T, splits, dtype=torch.float32, device=device)
    pidx = torch.empty(B * T, splits, dtype=torch.int64, device=device)
    wrap_triton(_argmax_partials)[(B * T, splits)](target.contiguous(), pval, pidx, V, chunk, splits,
                                                   BLOCK_V=BLOCK_V, num_warps=partial_warps(BLOCK_V))
    wrap_triton(_tree_greedy_finish)[(B,)](tree_tokens.contiguous(), parents.contiguous(), pval, pidx, path, tokens,
                                           num_accepted, T, V, splits, BLOCK_S=max(2, triton.next_power_of_2(splits)),
                                           BLOCK_T=triton.next_power_of_2(T))
    return path, tokens, num_accepted


@triton_op("spec_ext_triton::tree_verify_split", mutates_args=())
def tree_verify_split(target: torch.Tensor, tree_tokens: torch.Tensor, parents: torch.Tensor,
                      draft_probs: torch.Tensor | None, uniforms: torch.Tensor | None, greedy: bool,
                      without_replacement: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return split_tree_verify(target, tree_tokens, parents, draft_probs, uniforms, greedy, without_replacement)
