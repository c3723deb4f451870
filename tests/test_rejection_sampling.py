"""Chain and tree verification.

* Replays: every backend but torch (which *is* ``spec_ext.reference``) against the reference
  for given uniforms, on cases built so that rows accept none, some and all of their drafts
  (the builders say where each row must end, which checks the reference too); 0 mismatched
  rows allowed.
* Statistics: every backend, torch included, against the target distribution (chi-square
  at every chain position and after every tree node).
* Invariants (hypothesis) and bad input.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

import spec_ext
from spec_ext import reference
from helpers import backend_params, device_for, interpreted

CHAIN = backend_params("chain_verify")
TREE = backend_params("tree_verify")
# for tests whose expectation is not the reference (by hand, or the target distribution)
CHAIN_ALL = backend_params("chain_verify", with_torch=True)
TREE_ALL = backend_params("tree_verify", with_torch=True)


def probs(*shape, generator, sharp=1.0, zero_frac=0.0):
    logits = torch.randn(*shape, generator=generator) * sharp
    if zero_frac:
        logits[torch.rand(*shape, generator=generator) < zero_frac] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp_min(0)  # keep every row non-empty
    return torch.softmax(logits, -1)


def chain_case(B, K, V, seed, ragged=True, holes=True, q_zero=True, one_hot=False):
    """Random inputs (most rows reject early): for the invariants and bad input."""
    g = torch.Generator().manual_seed(seed)
    p = probs(B, K + 1, V, generator=g, sharp=3.0, zero_frac=0.3)
    if one_hot:
        p = torch.nn.functional.one_hot(p.argmax(-1), V).float()
    q = probs(B, K, V, generator=g, sharp=3.0)
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    if q_zero:  # a draft the draft distribution gives no mass: must be rejected
        q[0, 0, drafts[0, 0]] = 0
        q[0, 0] /= q[0, 0].sum()
    if holes and K > 1:
        drafts[B // 2, K // 2] = -1
    num_draft = torch.randint(0, K + 1, (B,), generator=g) if ragged else torch.full((B,), K)
    uniforms = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    return p, drafts, q, num_draft, uniforms


# ------------------------------------------------------------ replay cases that accept
class Coins:
    """Tokens and coins that make a draft pass or fail the test u * q(x) < p(x) with a margin."""

    def __init__(self, seed):
        self.rng = np.random.default_rng(seed)

    def pick(self, weights):
        weights = np.asarray(weights, dtype=np.float64)
        return int(self.rng.choice(len(weights), p=weights / weights.sum()))

    def accepted(self, p, q):
        """(token, coin) accepted at p [V] float64 with draft distribution q (None: one-hot at
        the token, which is then p's argmax)."""
        if q is None:
            x = int(np.argmax(p))
            return x, p[x] * self.rng.uniform(0.05, 0.6)
        x = self.pick(q * (p > 0))
        return x, min(1.0, p[x] / q[x]) * self.rng.uniform(0.05, 0.6)

    def rejected(self, p, q, used=()):
        """(token, coin) rejected by its coin: min(1, p/q) < 0.9 at the token, the coin above it."""
        if q is None:
            order = [int(x) for x in np.argsort(-p, kind="stable") if 0 < p[x] < 0.9 and x not in used]
            x = order[0] if order else int(np.argmin(p))
            ratio = p[x]
        else:
            ratio_all = np.where(q > 0, np.minimum(1.0, p / np.where(q > 0, q, 1.0)), 1.0)
            allowed = (ratio_all < 0.9) & ~np.isin(np.arange(len(p)), list(used))
            assert allowed.any(), "no token that the coin can reject"
            x = self.pick(q * allowed)
            ratio = ratio_all[x]
        return x, ratio + (1 - ratio) * self.rng.uniform(0.2, 0.95)

    def telling_apart(self, mass, other):
        """A final coin whose inverse-CDF draw from ``mass`` differs from the one from
        ``other``: a draw from the wrong distribution then shows."""
        for u in self.rng.uniform(0, 1, 64):
            if inverse_cdf(mass, u) != inverse_cdf(other, u):
                return u
        raise AssertionError("none of 64 coins tells the two final distributions apart: the case cannot "
                             "show a draw from the wrong one")


def inverse_cdf(mass, u):
    """The final draw as DESIGN defines it: the smallest j with cumsum(mass)[j] > u * sum(mass)."""
    cdf = np.cumsum(mass)
    return min(int(np.searchsorted(cdf, u * cdf[-1], side="right")), int(np.nonzero(mass > 0)[0][-1]))


CHAIN_ROWS = ("all", "none", "reject_late", "short", "empty", "hole", "q_zero")


def planned_chain_case(B, K, V, seed, with_q):
    """Chain replay inputs whose rows end where planned. Drafts are near p (q = 0.7 p + 0.3
    noise; without q, drafts are p's argmax); a coin below min(1, p/q) accepts, one above
    rejects. Rows 0-6 (where K allows): every draft accepted and the bonus drawn from p[K];
    none accepted; rejected at position min(2, K-1); num_draft = K-1, all accepted (bonus
    from p[K-1]); no drafts; the -1 hole at K//2 reached; q == 0 at the draft after an
    accepted prefix (its residual coin tells relu(p - q) from p). The rest random.
    Returns p, drafts, q, num_draft, uniforms and the planned accepted counts."""
    g = torch.Generator().manual_seed(seed)
    coins = Coins(seed)
    p = probs(B, K + 1, V, generator=g, sharp=2.0, zero_frac=0.3)
    q = (0.7 * p[:, :K] + 0.3 * probs(B, K, V, generator=g, sharp=2.0)) if with_q else None
    drafts = torch.randint(0, V, (B, K), generator=g)
    uniforms = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    num_draft = torch.full((B,), K)
    planned = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        kind = CHAIN_ROWS[b] if b < len(CHAIN_ROWS) else "random"
        n, hole, q_zero = K, None, None
        if kind == "all":
            a = K
        elif kind == "none":
            a = 0
        elif kind == "reject_late":
            a = min(2, K - 1)
        elif kind == "short":
            n = a = K - 1
        elif kind == "empty":
            n = a = 0
        elif kind == "hole" and K >= 2:
            hole = a = K // 2
        elif kind == "q_zero" and K >= 2 and with_q:
            q_zero = a = min(2, K - 1)
        else:
            n = int(coins.rng.integers(0, K + 1))
            a = int(coins.rng.integers(0, n + 1))
        num_draft[b], planned[b] = n, a
        pd = p[b].double().numpy()
        qd = None if q is None else q[b].double().numpy()
        for i in range(a):
            drafts[b, i], uniforms[b, i] = coins.accepted(pd[i], None if qd is None else qd[i])
        if hole is not None:
            drafts[b, hole] = -1
        elif q_zero is not None:
            x = coins.pick(pd[a] * qd[a])
            drafts[b, a] = x
            q[b, a, x] = 0
            q[b, a] /= q[b, a].sum()
            residual = np.maximum(pd[a] - q[b, a].double().numpy(), 0)
            uniforms[b, K] = coins.telling_apart(residual, pd[a])
        elif a < n:
            drafts[b, a], uniforms[b, a] = coins.rejected(pd[a], None if qd is None else qd[a])
        if a == n and n > 0:  # the bonus: from p[n], not p[n - 1]
            uniforms[b, K] = coins.telling_apart(pd[n], pd[n - 1])
    return p, drafts, q, num_draft, uniforms, planned


def check_chain_case_accepts(ref, drafts, num_draft, K, with_q, p):
    """The replay case is not vacuous: the reference accepted none, some and all drafts,
    drew bonus tokens after full and short chains, reached the hole, rejected late."""
    accepted = ref[1]
    assert (accepted == 0).any()
    assert ((accepted > 0) & (accepted == num_draft) & (num_draft == K)).any(), "no row reached the bonus at K"
    if K >= 2:
        assert ((accepted > 0) & (accepted < num_draft)).any(), "no row accepted some drafts only"
        assert ((accepted > 0) & (accepted == num_draft) & (num_draft < K)).any(), "no bonus after a short chain"
        hole = drafts == -1
        assert hole[torch.arange(len(accepted)), accepted.clamp_max(K - 1)].any(), "the -1 hole is never reached"
    if K >= 3:
        assert ((accepted >= 2) & (accepted < num_draft)).any(), "no rejection at position >= 2"
    if not with_q:
        for b in range(len(accepted)):
            assert drafts[b, :accepted[b]].tolist() == p[b, :accepted[b]].argmax(-1).tolist()


CHAIN_SHAPES = [(9, 1, 7), (12, 5, 64), (10, 8, 8193), (16, 3, 100)]


@pytest.mark.parametrize("backend", CHAIN)
@pytest.mark.parametrize("B,K,V", CHAIN_SHAPES)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one-hot q"])
def test_chain_replays_reference(backend, B, K, V, with_q):
    if interpreted(backend) and V > 1000:
        V = 1001  # the interpreter is slow; odd V still
    p, drafts, q, num_draft, uniforms, planned = planned_chain_case(B, K, V, B * 100 + K * 10 + V, with_q)
    ref = reference.chain_verify(p, drafts, q, num_draft, uniforms, greedy=False)
    assert ref[1].tolist() == planned.tolist(), "the reference ends a row where its coins do not say"
    check_chain_case_accepts(ref, drafts, num_draft, K, with_q, p)
    dev = device_for(backend)
    move = lambda t: None if t is None else t.to(dev)
    out = spec_ext.chain_rejection_sample(move(p), move(drafts), move(q), move(num_draft), move(uniforms),
                                          backend=backend)
    assert torch.equal(out.tokens.cpu(), ref[0]), (out.tokens, ref[0])
    assert torch.equal(out.num_accepted.cpu(), ref[1])


def test_reference_chain_q_zero_and_hole_rows():
    """By hand, on the rows planned_chain_case builds: the q == 0 draft is rejected after
    its accepted prefix and the token comes from relu(p - q); at the hole, from p."""
    B, K, V = 12, 5, 64
    p, drafts, q, num_draft, uniforms, _ = planned_chain_case(B, K, V, 7, with_q=True)
    tokens, accepted = reference.chain_verify(p, drafts, q, num_draft, uniforms, greedy=False)
    for kind in ("q_zero", "hole"):
        b = CHAIN_ROWS.index(kind)
        a = int(accepted[b])
        assert a == 2 and tokens[b, :a].tolist() == drafts[b, :a].tolist() and (tokens[b, a + 1:] == -1).all()
        mass = p[b, a].double().numpy()
        if kind == "q_zero":
            assert q[b, a, drafts[b, a]] == 0
            mass = np.maximum(mass - q[b, a].double().numpy(), 0)
        else:
            assert drafts[b, a] == -1
        assert int(tokens[b, a]) == inverse_cdf(mass, float(uniforms[b, K])), kind


@pytest.mark.parametrize("backend", CHAIN_ALL)
def test_chain_edge_cases(backend):
    dev = device_for(backend)
    p = torch.nn.functional.one_hot(torch.tensor([[2, 3, 1]]), 5).float()
    drafts = torch.tensor([[2, 4]])
    out = spec_ext.chain_rejection_sample(p.to(dev), drafts.to(dev), backend=backend)
    assert out.tokens.tolist() == [[2, 3, -1]] and out.num_accepted.tolist() == [1]
    # q == 0 at the draft token: always rejected, and the replacement is drawn from p
    q = torch.full((1, 2, 5), 0.2)
    q[0, 0] = torch.tensor([0.25, 0.25, 0.0, 0.25, 0.25])
    out = spec_ext.chain_rejection_sample(p.to(dev), drafts.to(dev), q.to(dev), backend=backend)
    assert out.num_accepted.tolist() == [0] and out.tokens.tolist() == [[2, -1, -1]]
    # p == q: the residual is all zero, the sample falls back to p
    same = torch.full((1, 2, 5), 0.2)
    u = torch.tensor([[0.999999, 0.5, 0.7]], dtype=torch.float64)
    out = spec_ext.chain_rejection_sample(same[:, [0, 0, 1]].contiguous().to(dev), torch.tensor([[1, 1]]).to(dev),
                                          same.to(dev), uniforms=u.to(dev), backend=backend)
    assert out.num_accepted.tolist() == [2] and out.tokens[0, 2].item() == 3


@pytest.mark.parametrize("backend", CHAIN)
def test_greedy_verify_matches_reference(backend):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 5, 300, generator=g)
    drafts = logits[:, :4].argmax(-1)
    drafts[1, 2] = (drafts[1, 2] + 1) % 300
    drafts[2, 0] = -1
    num_draft = torch.tensor([4, 4, 4, 2, 0, 3])
    dev = device_for(backend)
    out = spec_ext.greedy_verify(logits.to(dev), drafts.to(dev), num_draft.to(dev), backend=backend)
    ref = reference.chain_verify(logits, drafts, None, num_draft, None, greedy=True)
    assert torch.equal(out.tokens.cpu(), ref[0]) and torch.equal(out.num_accepted.cpu(), ref[1])
    assert out.num_accepted.tolist() == [4, 2, 0, 2, 0, 3]


@pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("mode", ["q", "one-hot q", "greedy", "greedy ties"])
def test_vocabulary_split_verification_replays_reference_at_every_split(splits, mode):
    """triton_split cuts each row's vocabulary into chunks: chunk boundaries (odd V, more
    chunks than BLOCK_V tiles, a chunk per 2 entries) never change a token; ties in
    greedy go to the first index across chunks."""
    from spec_ext.kernels.rejection_sampling_split import split_chain_verify
    B, K, V = 6, 4, 83
    p, drafts, q, num_draft, uniforms = chain_case(B, K, V, seed=splits)
    dev = device_for("triton")
    move = lambda t: None if t is None else t.to(dev)
    if mode.startswith("greedy"):
        target = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(splits))
        if mode == "greedy ties":  # the max at indices 5 and 80: different chunks unless one chunk
            target[:, :, 5] = target[:, :, 80] = target.max() + 1
        drafts = target[:, :K].argmax(-1)
        drafts[0, 1] = (drafts[0, 1] + 1) % V
        out = split_chain_verify(move(target), move(drafts), None, move(num_draft), None, True, num_splits=splits)
        ref = reference.chain_verify(target, drafts, None, num_draft, None, greedy=True)
    else:
        q = q if mode == "q" else None
        out = split_chain_verify(move(p), move(drafts), move(q), move(num_draft), move(uniforms), False,
                                 num_splits=splits)
        ref = reference.chain_verify(p, drafts, q, num_draft, uniforms, greedy=False)
    assert torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])


# ----------------------------------------------------------------------------- trees
TREES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, 0, 0, 0, 0],
    "binary": [-1, 0, 0, 1, 1, 2, 2],
    "deep": [-1, 0, 0, 1, 3, 3, 4, 2],
}


def sample_tree_tokens(parents, q, without_replacement, generator):
    """Draw children of every node from q[node] (without replacement or iid), per row."""
    B, T, V = q.shape
    tokens = torch.full((B, T), -1, dtype=torch.int64)
    tokens[:, 0] = 0
    for node in range(T):
        kids = [i for i in range(T) if parents[i] == node]
        if kids:
            draws = torch.multinomial(q[:, node], len(kids), replacement=not without_replacement, generator=generator)
            tokens[:, kids] = draws
    return tokens


def planned_tree_case(parents, B, V, seed, mode):
    """Tree replay inputs whose rows take planned paths. At every node the plan says which
    child to accept (or none); the children before it get tokens and coins that reject them,
    that child one that accepts it, following the residual and sibling q as multi-draft
    recursive rejection sampling updates them. Row 0 accepts the first child down to a leaf
    (its bonus from the leaf's p), row 1 rejects every child of the root, row 2 accepts each
    node's last child after rejecting its siblings, row 3 stops after one accepted node; the
    rest random. q = 0.7 p + 0.3 noise; deterministic drafts: the residual's argmax when
    accepted. Returns p, tokens, q (None for deterministic and greedy), uniforms, the planned
    paths and, per row, whether a sibling was rejected before an accepted one."""
    T = len(parents)
    children = [[i for i in range(T) if parents[i] == node] for node in range(T)]
    g = torch.Generator().manual_seed(seed)
    coins = Coins(seed)
    p = probs(B, T, V, generator=g, sharp=2.0, zero_frac=0.2)
    q = 0.7 * p + 0.3 * probs(B, T, V, generator=g, sharp=2.0)
    tokens = sample_tree_tokens(parents, q, mode != "iid", g)
    tokens[B - 1, T - 1] = -1  # an absent node
    uniforms = torch.rand(B, T + 1, generator=g, dtype=torch.float64)
    with_q = mode in ("without_replacement", "iid")
    paths, sibling_rejected = [], []
    for b in range(B):
        node, path, rejected_then_accepted = 0, [0], False
        while True:
            kids = [c for c in children[node] if tokens[b, c] >= 0]
            plan = {0: 0, 1: None if node == 0 else 0, 2: len(kids) - 1, 3: 0 if node == 0 else None}.get(b)
            if b > 3 and kids:
                plan = None if coins.rng.random() < 0.25 else int(coins.rng.integers(0, len(kids)))
            residual = p[b, node].double().numpy().copy()
            qn = q[b, node].double().numpy().copy() if with_q else None
            used, accepted = [], None
            for index, child in enumerate(kids):
                if mode == "greedy":
                    best = int(p[b, node].argmax())
                    x = best if index == plan else int((best + 1 + coins.rng.integers(0, V - 1)) % V)
                elif index == plan:
                    x, uniforms[b, child] = coins.accepted(residual, qn)
                else:
                    x, uniforms[b, child] = coins.rejected(residual, qn, used if mode != "iid" else ())
                tokens[b, child] = x
                if index == plan:
                    accepted = child
                    break
                used.append(x)
                if mode == "greedy":
                    continue
                rest = np.maximum(residual - qn, 0) if with_q else np.where(np.arange(V) == x, 0.0, residual)
                if rest.sum() > 0:
                    residual = rest / rest.sum()
                if mode == "without_replacement":
                    qn[x] = 0
                    qn = qn / qn.sum() if qn.sum() > 0 else qn
            if accepted is None:
                break
            rejected_then_accepted |= plan > 0
            node = accepted
            path.append(node)
        paths.append(path)
        sibling_rejected.append(rejected_then_accepted)
    return p, tokens, q if with_q else None, uniforms, paths, sibling_rejected


@pytest.mark.parametrize("backend", TREE)
@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("mode", ["without_replacement", "iid", "deterministic", "greedy"])
def test_tree_replays_reference(backend, shape, mode):
    parents = torch.tensor(TREES[shape])
    T = len(parents)
    B, V = (6, 33) if interpreted(backend) else (12, 257)
    p, tokens, q, uniforms, paths, sibling_rejected = planned_tree_case(TREES[shape], B, V, T * 10 + B, mode)
    expanded = parents.expand(B, T)
    siblings = "iid" if mode == "iid" else "without_replacement"
    if mode == "greedy":
        ref = reference.tree_verify(p, tokens, expanded, None, None, True, True)
    else:
        ref = reference.tree_verify(p, tokens, expanded, q, uniforms, False, siblings != "iid")
    assert [ref[0][b, :len(path)].tolist() for b, path in enumerate(paths)] == paths, "the reference left a plan"
    depth = ref[2]
    max_depth = int(reference.tree_mask(parents[None])[0].max())
    leaves = [i for i in range(T) if i not in TREES[shape]]
    assert (depth == 0).any() and (depth == max_depth).any()
    assert any(path[-1] in leaves for path in paths), "no row reached a leaf (its bonus token)"
    if max_depth >= 2:
        assert (depth >= 2).any()
    if len(set(TREES[shape][1:])) < T - 1:  # some node has siblings
        assert any(sibling_rejected), "no sibling rejected before an accepted one"
    dev = device_for(backend)
    if mode == "greedy":
        out = spec_ext.tree_greedy_verify(p.to(dev), tokens.to(dev), parents.to(dev), backend=backend)
    else:
        out = spec_ext.tree_rejection_sample(p.to(dev), tokens.to(dev), parents.to(dev),
                                             None if q is None else q.to(dev), siblings, uniforms.to(dev),
                                             backend=backend)
    width = out.path.shape[1]
    assert width == max_depth + 1
    assert torch.equal(out.path.cpu(), ref[0][:, :width])
    assert torch.equal(out.tokens.cpu(), ref[1][:, :width])
    assert torch.equal(out.num_accepted.cpu(), ref[2])


@pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")
@pytest.mark.parametrize("splits", [1, 2, 3, 7, 40])
@pytest.mark.parametrize("shape", list(TREES))
def test_vocabulary_split_greedy_tree_verification_replays_reference(splits, shape):
    from spec_ext.kernels.rejection_sampling_split import split_tree_verify
    parents = torch.tensor(TREES[shape])
    B, T, V = 5, len(parents), 83
    g = torch.Generator().manual_seed(splits * 10 + T)
    logits = torch.randn(B, T, V, generator=g)
    logits[:, :, 5] = logits[:, :, 80] = logits.max() + 1  # ties across chunks: the first index wins
    logits[1:, :, 5] -= 2  # other rows: a unique argmax at 80
    tokens = torch.randint(0, V, (B, T), generator=g)
    for b in range(B):  # accept along a few branches, including a later sibling
        for child in range(1, T):
            if torch.rand(1, generator=g) < 0.6:
                tokens[b, child] = logits[b, parents[child]].argmax()
    tokens[0, -1] = -1
    dev = device_for("triton")
    out = split_tree_verify(logits.to(dev), tokens.to(dev), parents.expand(B, T).contiguous().to(dev), None, None,
                            True, True, num_splits=splits)
    ref = reference.tree_verify(logits, tokens, parents.expand(B, T), None, None, True, True)
    assert all(torch.equal(o.cpu(), r) for o, r in zip(out, ref)), (out, ref)
    assert int(ref[2].max()) >= 1


@pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")
@pytest.mark.parametrize("shape", ["star", "deep"])
@pytest.mark.parametrize("mode", ["without_replacement", "iid", "deterministic"])
def test_split_tree_sampling_replays_reference_across_vocabulary_blocks(shape, mode):
    """triton_split's tree sampler recomputes each residual from the rejections' scalars:
    siblings rejected in a row, over a vocabulary of 5 blocks."""
    from spec_ext.kernels.rejection_sampling_split import split_tree_verify
    parents = torch.tensor(TREES[shape])
    B, T, V = 8, len(parents), 257
    g = torch.Generator().manual_seed(T)
    p = probs(B, T, V, generator=g, sharp=2.0, zero_frac=0.2)
    q = probs(B, T, V, generator=g, sharp=2.0)
    tokens = sample_tree_tokens(parents.tolist(), q, mode != "iid", g)
    uniforms = torch.rand(B, T + 1, generator=g, dtype=torch.float64)
    q_arg = None if mode == "deterministic" else q
    dev = device_for("triton")
    move = lambda t: None if t is None else t.to(dev)
    out = split_tree_verify(move(p), move(tokens), move(parents.expand(B, T).contiguous()), move(q_arg),
                            move(uniforms), False, mode != "iid", block_v=64)
    ref = reference.tree_verify(p, tokens, parents.expand(B, T), q_arg, uniforms, False, mode != "iid")
    assert all(torch.equal(o.cpu(), r) for o, r in zip(out, ref))


# ----------------------------------------------------------------------- statistics
# rows per statistical test: DESIGN's 1e5 on compiled kernels; the torch backend (the
# reference: Python loops, about 0.3 ms a chain row, 1 ms a tree row) and the Triton
# interpreter (30-150 ms a row) take fewer, so there the test catches only gross errors
# in the distribution (the exact replays above are those backends' close check)
TORCH_ROWS = {"chain": 20_000, "tree": 10_000}
INTERPRETER_ROWS = {"chain": 300, "tree": 200}


def rows(backend: str, test: str) -> int:
    if interpreted(backend):
        return INTERPRETER_ROWS[test]
    return TORCH_ROWS[test] if backend == "torch" else 100_000


def chi_square_p(samples: np.ndarray, p: np.ndarray) -> float:
    """p-value of the samples against p; bins expected below 5 are pooled."""
    support = p > 0
    assert np.all(np.isin(samples, np.nonzero(support)[0])), "a token outside the target's support"
    counts = np.bincount(samples, minlength=len(p))[support].astype(float)
    expected = p[support] / p[support].sum() * len(samples)
    small = expected < 5
    if small.any():
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    assert len(expected) >= 2, "too few samples for a chi-square"
    return chisquare(counts, expected).pvalue


def peaked(shape, generator, masses):
    """Distributions with the given masses (at least) on distinct random tokens each:
    drafts of the top tokens get accepted often enough for every position to be reached."""
    V = shape[-1]
    rows = int(np.prod(shape[:-1]))
    ranked = torch.stack([torch.randperm(V, generator=generator) for _ in range(rows)]).view(*shape[:-1], V)
    out = (1 - sum(masses)) * probs(*shape, generator=generator, sharp=1.5, zero_frac=0.2)
    for rank, mass in enumerate(masses):
        out += mass * torch.nn.functional.one_hot(ranked[..., rank], V).float()
    return out


@pytest.mark.parametrize("backend", CHAIN_ALL)
@pytest.mark.parametrize("with_q", [True, False], ids=["q", "one-hot q"])
def test_chain_output_follows_target(backend, with_q):
    """The token emitted at every position i (0..K) follows p_i, the target after the
    prefix and drafts < i (here the same for every context). Rows: see rows(); every
    position must be reached by an eighth of them."""
    N, K, V = rows(backend, "chain"), 3, 5
    g = torch.Generator().manual_seed(11)
    p1 = peaked((1, K + 1, V), g, (0.6,))
    q1 = 0.6 * p1[:, :K] + 0.4 * probs(1, K, V, generator=g, sharp=1.5)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous()
    if with_q:
        drafts = torch.multinomial(q.view(-1, V), 1, replacement=True, generator=g).view(N, K)
    else:  # deterministic drafts: p's argmax, one-hot q
        drafts, q = p1[:, :K].argmax(-1).expand(N, K).contiguous(), None
    uniforms = torch.rand(N, K + 1, generator=g, dtype=torch.float64)
    dev = device_for(backend)
    out = spec_ext.chain_rejection_sample(p.to(dev), drafts.to(dev), None if q is None else q.to(dev),
                                          uniforms=uniforms.to(dev), backend=backend)
    tokens = out.tokens.cpu().numpy()
    for i in range(K + 1):
        emitted = tokens[:, i][tokens[:, i] >= 0]
        assert len(emitted) >= N // 8, f"position {i}: {len(emitted)} samples of {N} rows"
        assert chi_square_p(emitted, p1[0, i].double().numpy()) > 1e-4, f"position {i}"


STAT_TREES = {"deep": TREES["deep"], "two levels": [-1, 0, 0, 1, 1]}


@pytest.mark.parametrize("backend", TREE_ALL)
@pytest.mark.parametrize("mode", ["without_replacement", "iid", "deterministic"])
def test_tree_output_follows_target(backend, mode):
    """After every node n (depth d), the token the rows whose path went through n emit at
    position d follows p[n]: the root and every depth of the tree. The "deep" tree (depth 4,
    siblings at depths 1 and 3), or in the interpreter "two levels" (5 nodes, siblings at
    both); rows: see rows(); every node must be reached by a 25th of them."""
    parents = STAT_TREES["two levels" if interpreted(backend) else "deep"]
    N, T, V = rows(backend, "tree"), len(parents), 5
    g = torch.Generator().manual_seed(5)
    p1 = peaked((1, T, V), g, (0.5, 0.3))
    q1 = 0.6 * p1 + 0.4 * probs(1, T, V, generator=g, sharp=1.5)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous()
    if mode == "deterministic":  # the target's top tokens (a draft that ranks like the target)
        ranked = p1[0].argsort(-1, descending=True)
        tokens = torch.zeros(1, T, dtype=torch.int64)
        for node in range(T):
            kids = [i for i in range(T) if parents[i] == node]
            tokens[0, kids] = ranked[node, :len(kids)]
        tokens = tokens.expand(N, T).contiguous()
    else:
        tokens = sample_tree_tokens(parents, q, mode == "without_replacement", g)
    uniforms = torch.rand(N, T + 1, generator=g, dtype=torch.float64)
    dev = device_for(backend)
    out = spec_ext.tree_rejection_sample(p.to(dev), tokens.to(dev), torch.tensor(parents).to(dev),
                                         None if mode == "deterministic" else q.to(dev),
                                         "iid" if mode == "iid" else "without_replacement", uniforms.to(dev),
                                         backend=backend)
    path, emitted = out.path.cpu().numpy(), out.tokens.cpu().numpy()
    depth = reference.tree_mask(torch.tensor([parents]))[0][0].tolist()
    for node in range(T):
        after = emitted[path[:, depth[node]] == node, depth[node]]
        after = after[after >= 0]
        assert len(after) >= N // 25, f"node {node}: {len(after)} samples of {N} rows"
        assert chi_square_p(after, p1[0, node].double().numpy()) > 1e-4, f"after node {node}"


# ----------------------------------------------------------------------- invariants
@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 5), K=st.integers(1, 6), V=st.integers(2, 40), seed=st.integers(0, 10_000),
       with_q=st.booleans())
def test_chain_invariants(B, K, V, seed, with_q):
    p, drafts, q, num_draft, uniforms = chain_case(B, K, V, seed, q_zero=False)
    out = spec_ext.chain_rejection_sample(p, drafts, q if with_q else None, num_draft, uniforms)
    for b in range(B):
        a = int(out.num_accepted[b])
        assert 0 <= a <= int(num_draft[b])
        assert out.tokens[b, :a].tolist() == drafts[b, :a].tolist()
        assert 0 <= int(out.tokens[b, a]) < V
        assert (out.tokens[b, a + 1:] == -1).all()


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 12), V=st.integers(2, 30), seed=st.integers(0, 10_000), greedy=st.booleans())
def test_tree_invariants(T, V, seed, greedy):
    g = torch.Generator().manual_seed(seed)
    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, T)])
    p = probs(2, T, V, generator=g)
    tokens = torch.randint(-1, V, (2, T), generator=g)
    out = (spec_ext.tree_greedy_verify(p, tokens, parents) if greedy
           else spec_ext.tree_rejection_sample(p, tokens, parents))
    for b in range(2):
        a = int(out.num_accepted[b])
        path = out.path[b, :a + 1].tolist()
        assert path[0] == 0
        assert all(int(parents[child]) == parent for parent, child in zip(path, path[1:]))
        assert out.tokens[b, :a].tolist() == [int(tokens[b, n]) for n in path[1:]]
        assert 0 <= int(out.tokens[b, a]) < V
        assert (out.tokens[b, a + 1:] == -1).all() and (out.path[b, a + 1:] == -1).all()


# ----------------------------------------------------------------------- bad input
def test_chain_bad_input():
    p, drafts, q, num_draft, uniforms = chain_case(2, 3, 10, 0)
    with pytest.raises(ValueError, match="draft_tokens: expected shape"):
        spec_ext.chain_rejection_sample(p, drafts[:, :2], q)
    with pytest.raises(ValueError, match="target_probs: expected dtype torch.float32"):
        spec_ext.chain_rejection_sample(p.double(), drafts, q)
    with pytest.raises(ValueError, match="target_logits: expected dtype torch.float32"):
        spec_ext.greedy_verify(p.double(), drafts)
    with pytest.raises(ValueError, match="target_probs: rows must sum to 1.*summing to 3"):
        spec_ext.chain_rejection_sample(p * 3, drafts, q)
    with pytest.raises(ValueError, match="draft_probs: rows must sum to 1.*summing to 5"):
        spec_ext.chain_rejection_sample(p, drafts, q * 5)
    with pytest.raises(ValueError, match="target_probs: rows must sum to 1"):
        spec_ext.tree_rejection_sample(p * 3, torch.tensor([[0, 1, 2, 3]] * 2), torch.tensor([-1, 0, 1, 2]))
    with pytest.raises(ValueError, match="num_draft: every entry"):
        spec_ext.chain_rejection_sample(p, drafts, q, torch.tensor([4, 1]))
    with pytest.raises(ValueError, match="draft_tokens: ids must be"):
        spec_ext.chain_rejection_sample(p, drafts.clone().fill_(10), q)
    bad = p.clone()
    bad[1, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="target_probs: contains NaN"):
        spec_ext.chain_rejection_sample(bad, drafts, q)
    with pytest.raises(ValueError, match="target_probs: contains an all-zero"):
        spec_ext.chain_rejection_sample(p * 0, drafts, q)
    with pytest.raises(ValueError, match="uniforms: expected dtype torch.float64"):
        spec_ext.chain_rejection_sample(p, drafts, q, uniforms=uniforms.float())


@pytest.mark.parametrize("backend", CHAIN_ALL)
def test_chain_without_validation_still_emits_valid_ids(backend):
    V = 9
    p = torch.full((3, 3, V), float("nan"))
    p[1] = 0
    p[2] = 0
    p[2, :, 4] = 1.0
    drafts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    dev = device_for(backend)
    out = spec_ext.chain_rejection_sample(p.to(dev), drafts.to(dev), backend=backend, validate=False)
    emitted = out.tokens[torch.arange(3), out.num_accepted]
    assert bool(((emitted >= 0) & (emitted < V)).all())
    assert out.tokens[2, 0].item() == 4


def test_tree_bad_input():
    p = torch.softmax(torch.randn(1, 3, 5), -1)
    with pytest.raises(ValueError, match="parents"):
        spec_ext.tree_rejection_sample(p, torch.tensor([[0, 1, 2]]), torch.tensor([-1, 0, 2]))
    with pytest.raises(ValueError, match="siblings"):
        spec_ext.tree_rejection_sample(p, torch.tensor([[0, 1, 2]]), torch.tensor([-1, 0, 0]), siblings="other")
    with pytest.raises(ValueError, match="tree_tokens: ids must be"):
        spec_ext.tree_rejection_sample(p, torch.tensor([[0, 1, 7]]), torch.tensor([-1, 0, 0]))


def test_tree_max_depth_argument():
    parents = torch.tensor(TREES["chain"])
    p = torch.nn.functional.one_hot(torch.tensor([[1, 2, 3, 4]]), 6).float()
    tokens = torch.tensor([[0, 1, 2, 3]])
    computed = spec_ext.tree_rejection_sample(p, tokens, parents)
    given_depth = spec_ext.tree_rejection_sample(p, tokens, parents, max_depth=3)
    assert computed.path.tolist() == given_depth.path.tolist() == [[0, 1, 2, 3]]
    assert computed.tokens.tolist() == given_depth.tokens.tolist() == [[1, 2, 3, 4]]
    with pytest.raises(ValueError, match="max_depth: 1 is less than"):
        spec_ext.tree_greedy_verify(p, tokens, parents, max_depth=1)


@pytest.mark.parametrize("backend", backend_params("chain_verify", with_torch=True))
def test_greedy_verification_takes_logits_masked_with_minus_inf(backend):
    """Logits masked with -inf (how HF's processors, bad words and grammars mask tokens) are
    verified with validation on, on every backend, chain and tree: the argmax over what is left
    (hand-computed), drafts of masked tokens rejected; NaN, +inf and a row masked entirely are
    refused by name."""
    dev = device_for(backend)
    logits = torch.tensor([[[0.0, 5.0, 1.0, float("-inf")], [float("-inf"), float("-inf"), 2.0, 1.0],
                            [3.0, float("-inf"), float("-inf"), 0.0]],
                           [[float("-inf"), 0.0, 1.0, 0.5], [1.0, float("-inf"), 0.0, 4.0],
                            [float("-inf"), float("-inf"), float("-inf"), 7.0]]])
    drafts = torch.tensor([[1, 2], [3, 1]])  # row 0: both argmaxes; row 1: a masked-out draft after one wrong
    out = spec_ext.greedy_verify(logits.to(dev), drafts.to(dev), backend=backend)
    assert out.num_accepted.tolist() == [2, 0] and out.tokens.tolist() == [[1, 2, 0], [2, -1, -1]]
    parents = torch.tensor([-1, 0, 1])
    tree = spec_ext.tree_greedy_verify(logits.to(dev), torch.tensor([[0, 1, 2], [0, 3, 1]]).to(dev), parents.to(dev),
                                       backend=backend if backend in ops_backends("tree_verify") else "auto")
    assert tree.num_accepted.tolist() == [2, 0] and tree.tokens[:, 0].tolist() == [1, 2]
    for value, problem in ((float("nan"), "contains NaN"), (float("inf"), "contains \\+inf")):
        bad = logits.clone()
        bad[1, 0, 2] = value
        with pytest.raises(ValueError, match=f"target_logits: {problem}"):
            spec_ext.greedy_verify(bad.to(dev), drafts.to(dev), backend=backend)
    masked = logits.clone()
    masked[0, 1] = float("-inf")
    with pytest.raises(ValueError, match="target_logits: has a row masked entirely"):
        spec_ext.greedy_verify(masked.to(dev), drafts.to(dev), backend=backend)
    with pytest.raises(ValueError, match="target_logits: has a row masked entirely"):
        spec_ext.tree_greedy_verify(masked.to(dev), torch.tensor([[0, 1, 2], [0, 3, 1]]).to(dev), parents.to(dev))


def ops_backends(op):
    from spec_ext.ops import registry
    return registry.backends_of(op)
