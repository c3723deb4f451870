"""Chain and tree verification: every backend against the reference (exact replay for
given uniforms), the output distribution against the target (chi-square), invariants
(hypothesis) and bad input."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from scipy.stats import chisquare

import spec_ext
from spec_ext import reference
from helpers import backend_params, device_for

CHAIN = backend_params("chain_verify")
TREE = backend_params("tree_verify")


def probs(*shape, generator, sharp=1.0, zero_frac=0.0):
    logits = torch.randn(*shape, generator=generator) * sharp
    if zero_frac:
        logits[torch.rand(*shape, generator=generator) < zero_frac] = float("-inf")
        logits[..., 0] = logits[..., 0].clamp_min(0)  # keep every row non-empty
    return torch.softmax(logits, -1)


def chain_case(B, K, V, seed, ragged=True, holes=True, q_zero=True, one_hot=False):
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


def mismatches(a, b):
    return int((a != b).any(-1).sum())


@pytest.mark.parametrize("backend", CHAIN)
@pytest.mark.parametrize("B,K,V", [(1, 1, 7), (4, 5, 64), (3, 8, 8193), (16, 5, 100)])
@pytest.mark.parametrize("with_q", [True, False])
def test_chain_replays_reference(backend, B, K, V, with_q):
    if backend.startswith("triton") and V > 1000 and device_for(backend) == "cpu":
        V = 1000  # the interpreter is slow; odd V still
    p, drafts, q, num_draft, uniforms = chain_case(B, K, V, seed=B * 100 + K * 10 + V)
    q = q if with_q else None
    dev = device_for(backend)
    move = lambda t: None if t is None else t.to(dev)
    out = spec_ext.chain_rejection_sample(move(p), move(drafts), move(q), move(num_draft), move(uniforms),
                                          backend=backend)
    ref = reference.chain_verify(p, drafts, q, num_draft, uniforms, greedy=False)
    assert mismatches(out.tokens.cpu(), ref[0]) <= max(1, B // 50), (out.tokens, ref[0])
    assert torch.equal(out.num_accepted.cpu(), ref[1])
    assert bool((out.tokens >= -1).all()) and bool((out.tokens < V).all())


@pytest.mark.parametrize("backend", CHAIN)
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


@pytest.mark.parametrize("backend", TREE)
@pytest.mark.parametrize("shape", list(TREES))
@pytest.mark.parametrize("mode", ["without_replacement", "iid", "deterministic", "greedy"])
def test_tree_replays_reference(backend, shape, mode):
    parents = torch.tensor(TREES[shape])
    T = len(parents)
    B, V = (3, 33) if backend.startswith("triton") else (8, 257)
    g = torch.Generator().manual_seed(T)
    p = probs(B, T, V, generator=g, sharp=2.0, zero_frac=0.2)
    q = probs(B, T, V, generator=g, sharp=2.0)
    tokens = sample_tree_tokens(parents.tolist(), q, mode != "iid", g)
    tokens[0, -1] = -1  # an absent node
    uniforms = torch.rand(B, T + 1, generator=g, dtype=torch.float64)
    dev = device_for(backend)
    if mode == "greedy":
        tokens[1, 1] = p[1, 0].argmax()
        out = spec_ext.tree_greedy_verify(p.to(dev), tokens.to(dev), parents.to(dev), backend=backend)
        ref = reference.tree_verify(p, tokens, parents.expand(B, T), None, None, True, True)
    else:
        q_arg = None if mode == "deterministic" else q
        siblings = "iid" if mode == "iid" else "without_replacement"
        out = spec_ext.tree_rejection_sample(p.to(dev), tokens.to(dev), parents.to(dev),
                                             None if q_arg is None else q_arg.to(dev), siblings, uniforms.to(dev),
                                             backend=backend)
        ref = reference.tree_verify(p, tokens, parents.expand(B, T), q_arg, uniforms, False, siblings != "iid")
    width = out.path.shape[1]
    assert width == int(reference.tree_mask(parents[None])[0].max()) + 1
    assert torch.equal(out.path.cpu(), ref[0][:, :width])
    assert mismatches(out.tokens.cpu(), ref[1][:, :width]) <= 1
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
    assert torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[2].cpu(), ref[2])
    assert mismatches(out[1].cpu(), ref[1]) == 0


# ----------------------------------------------------------------------- statistics
def chi_square_p(samples: np.ndarray, p: np.ndarray) -> float:
    support = p > 0
    assert np.all(np.isin(samples, np.nonzero(support)[0])), "a token outside the target's support"
    counts = np.bincount(samples, minlength=len(p))[support]
    return chisquare(counts, p[support] / p[support].sum() * counts.sum()).pvalue


@pytest.mark.parametrize("with_q", [True, False])
def test_chain_output_follows_target(with_q):
    N, K, V = 120_000, 3, 8
    g = torch.Generator().manual_seed(11)
    p1 = probs(1, K + 1, V, generator=g, sharp=1.5, zero_frac=0.2)
    q1 = probs(1, K, V, generator=g, sharp=1.5)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous()
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(N, K)
    if not with_q:  # deterministic drafts: the same token for every row, one-hot q
        drafts = q1.argmax(-1).expand(N, K).contiguous()
    out = spec_ext.chain_rejection_sample(p, drafts, q if with_q else None, generator=g)
    tokens = out.tokens.numpy()
    for i in range(K + 1):
        emitted = tokens[:, i][tokens[:, i] >= 0]
        if len(emitted) > 2000:
            assert chi_square_p(emitted, p1[0, i].double().numpy()) > 1e-4, f"position {i}"


@pytest.mark.parametrize("mode", ["without_replacement", "iid", "deterministic"])
def test_tree_output_follows_target(mode):
    parents = TREES["deep"]
    N, T, V = 100_000, len(parents), 6
    g = torch.Generator().manual_seed(5)
    p1 = probs(1, T, V, generator=g, sharp=1.5, zero_frac=0.15)
    q1 = probs(1, T, V, generator=g, sharp=1.5)
    p, q = p1.expand(N, -1, -1).contiguous(), q1.expand(N, -1, -1).contiguous()
    if mode == "deterministic":
        ranked = q1[0].argsort(-1, descending=True)
        tokens = torch.zeros(1, T, dtype=torch.int64)
        for node in range(T):
            kids = [i for i in range(T) if parents[i] == node]
            tokens[0, kids] = ranked[node, :len(kids)]
        tokens = tokens.expand(N, T).contiguous()
    else:
        tokens = sample_tree_tokens(parents, q, mode == "without_replacement", g)
    siblings = "iid" if mode == "iid" else "without_replacement"
    out = spec_ext.tree_rejection_sample(p, tokens, torch.tensor(parents), None if mode == "deterministic" else q,
                                         siblings, generator=g)
    path, emitted = out.path.numpy(), out.tokens.numpy()
    assert chi_square_p(emitted[:, 0], p1[0, 0].double().numpy()) > 1e-4
    for node in range(1, T):  # the token after node, given the path went through it at depth 1
        rows = path[:, 1] == node
        later = emitted[rows, 1]
        later = later[later >= 0]
        if len(later) > 2000:
            assert chi_square_p(later, p1[0, node].double().numpy()) > 1e-4, f"after node {node}"


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


@pytest.mark.parametrize("backend", CHAIN)
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
