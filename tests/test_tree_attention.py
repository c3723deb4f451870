"""tree_attention: every backend against the reference; the reference against an
independent oracle (causal attention over prefix + each node's root-to-node path); the
sliding window, soft-capping and sinks of every backend and of the reference against an
oracle that writes the dense mask out from the tree's parents."""
import functools

import numpy
import pytest
import torch

import spec_ext
from spec_ext import reference
from helpers import backend_params, device_for, random_parents

BACKENDS = backend_params("tree_attention")


def make(B, Hq, Hkv, T, S, D, dtype, seed, prefix=None):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    if prefix is None:
        prefix = torch.randint(0, S - T + 1, (B,), generator=g)
        prefix[0] = 0
    return q, k, v, prefix, g


# fp32: the largest error against the float64 reference, measured over CASES x trees: 1.3e-6
# (cpu, torch), 1.6e-6 (sdpa), 1.5e-6 (triton), 1.0e-6 (triton_split, interpreter); the
# window/softcap/sinks cases below: 1.1e-6. One budget for every backend, about 2x that.
FP32_BUDGET = 3e-6


def budget(dtype, q, k, v, prefix, mask):
    """The allowed error against the float64 reference: FP32_BUDGET in float32; else, flash-
    attention style, 2x PyTorch's own error in this dtype + a floor."""
    if dtype == torch.float32:
        return FP32_BUDGET
    exact = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, q.shape[-1] ** -0.5)
    lowp = reference.tree_attention(q, k, v, prefix, mask, q.shape[-1] ** -0.5)  # f32 math, dtype output
    return 2 * (lowp.double() - exact).abs().max().item() + 1e-3


CASES = [  # B, Hq, Hkv, T, S, D
    (1, 1, 1, 1, 1, 64),
    (2, 4, 4, 5, 37, 64),
    (3, 8, 2, 17, 101, 128),
    (2, 8, 4, 64, 129, 64),
    (1, 4, 1, 9, 70, 128),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("tree", ["causal", "random", "shared"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_matches_reference(backend, case, tree, dtype):
    B, Hq, Hkv, T, S, D = case
    if backend.startswith("triton") and device_for(backend) == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 math")
    if backend == "triton_invariant" and device_for(backend) == "cpu" and B * Hq * T > 300:
        pytest.skip("triton_invariant runs one program per query: 20-40 s a call here in the interpreter; the "
                    "smaller cases cover its paths")
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, dtype, seed=T * S)
    mask = None
    if tree == "random":
        mask = reference.tree_mask(random_parents(B, T, g))[1]
    elif tree == "shared":
        mask = reference.tree_mask(random_parents(1, T, g))[1]
    dev = device_for(backend)
    out = spec_ext.tree_attention(q.to(dev), k.to(dev), v.to(dev), prefix.to(dev),
                                  None if mask is None else mask.to(dev), backend=backend)
    assert out.dtype == dtype and out.shape == q.shape
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    err = (out.cpu().double() - expected).abs().max().item()
    assert err <= budget(dtype, q, k, v, prefix, mask), err


@pytest.mark.skipif(not spec_ext.ops.registered("tree_attention", "CPU"), reason="C++ kernels not built")
@pytest.mark.parametrize("tree", ["causal", "random", "blind"])
def test_cpu_kernel_on_blocks_too_big_for_its_batched_path(tree):
    """Over 2^20 scores the CPU kernel goes one head at a time (the CASES above all stay
    batched); "blind": row 0 has no prefix and its first query sees no key."""
    B, Hq, Hkv, T, S, D = 2, 8, 2, 64, 1100, 32
    prefix = torch.tensor([0, S - T] if tree == "blind" else [S - T, 700])
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=5, prefix=prefix)
    assert B * Hq * T * (int(prefix.max()) + T) > 2 ** 20  # scores up to the longest row
    mask = reference.tree_mask(random_parents(B, T, g))[1] if tree != "causal" else None
    if tree == "blind":
        mask[0, 0] = 0
    out = spec_ext.tree_attention(q, k, v, prefix, mask, backend="cpu")
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    assert (out.double() - expected).abs().max().item() <= FP32_BUDGET


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T", [1, 6])
def test_a_query_that_sees_no_key_gets_zeros(backend, T):
    """Row 0 has no prefix and its tree mask hides everything from query 0; row 1 is normal."""
    B, Hq, Hkv, S, D = 2, 4, 2, 16, 32
    q, k, v, _, _ = make(B, Hq, Hkv, T, S, D, torch.float32, seed=7)
    prefix = torch.tensor([0, 5])
    mask = reference.tree_mask(torch.tensor([-1] + list(range(T - 1))).expand(B, T))[1].clone()
    mask[0, 0] = 0
    dev = device_for(backend)
    out = spec_ext.tree_attention(q.to(dev), k.to(dev), v.to(dev), prefix.to(dev), mask.to(dev), backend=backend).cpu()
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    assert torch.equal(expected[0, :, 0], torch.zeros(Hq, D, dtype=torch.float64)) and expected[1].abs().sum() > 0
    assert not out.isnan().any() and torch.equal(out[0, :, 0], torch.zeros(Hq, D))
    assert (out.double() - expected).abs().max().item() <= FP32_BUDGET


def test_reference_matches_per_branch_oracle():
    B, H, T, S, D = 3, 2, 12, 40, 16
    q, k, v, prefix, g = make(B, H, H, T, S, D, torch.float64, seed=1)
    parents = random_parents(B, T, g)
    out = reference.tree_attention(q, k, v, prefix, reference.tree_mask(parents)[1], D ** -0.5)
    for b in range(B):
        for i in range(T):
            path, node = [], i
            while node >= 0:
                path.append(node)
                node = int(parents[b, node])
            keys = list(range(int(prefix[b]))) + [int(prefix[b]) + n for n in sorted(path)]
            weights = torch.softmax(q[b, :, i, None] @ k[b, :, keys].transpose(-1, -2) * D ** -0.5, -1)
            oracle = (weights @ v[b, :, keys]).squeeze(1)
            torch.testing.assert_close(out[b, :, i], oracle, rtol=1e-12, atol=1e-12)


def test_causal_equals_sdpa_over_prefix_and_new_tokens():
    B, H, T, S, D = 2, 4, 6, 20, 32
    q, k, v, _, _ = make(B, H, H, T, S, D, torch.float32, seed=2, prefix=torch.tensor([0, 0]))
    prefix = torch.tensor([9, 9])
    out = spec_ext.tree_attention(q, k, v, prefix)
    mask = torch.ones(T, 9 + T, dtype=torch.bool)
    mask[:, 9:] = torch.ones(T, T, dtype=torch.bool).tril()
    expected = torch.nn.functional.scaled_dot_product_attention(q, k[:, :, :9 + T], v[:, :, :9 + T], attn_mask=mask)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bad_input():
    q, k, v, prefix, _ = make(2, 4, 2, 3, 10, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="prefix_lens: need"):
        spec_ext.tree_attention(q, k, v, torch.tensor([8, 0]))
    with pytest.raises(ValueError, match="k: query heads"):
        spec_ext.tree_attention(q, k[:, :1].expand(2, 3, 10, 8).contiguous(), v[:, :1].expand(2, 3, 10, 8), prefix)
    with pytest.raises(ValueError, match="k: expected dtype"):
        spec_ext.tree_attention(q, k.half(), v, prefix)
    with pytest.raises(ValueError, match="tree_mask: expected"):
        spec_ext.tree_attention(q, k, v, prefix, torch.zeros(2, 4, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_lens: expected shape"):
        spec_ext.tree_attention(q, k, v, prefix[:1])


def test_an_unchecked_call_computes_what_the_checked_call_does():
    q, k, v, prefix, _ = make(2, 4, 2, 3, 10, 8, torch.float32, seed=3)
    mask = spec_ext.ops.tree_mask(torch.tensor([-1, 0, 0]))[1]
    unchecked = spec_ext.tree_attention(q, k, v, prefix, mask, 0.3, validate=False)
    assert torch.equal(unchecked, spec_ext.tree_attention(q, k, v, prefix, mask, scale=0.3))
    spec_ext.set_validation(False)
    try:  # the global switch: no check runs, not even the one that reads prefix_lens on the host
        assert torch.equal(spec_ext.tree_attention(q, k, v, prefix, mask, 0.3), unchecked)
    finally:
        spec_ext.set_validation(True)
    with pytest.raises(ValueError, match="prefix_lens"):
        spec_ext.tree_attention(q, k, v, prefix + 100, mask, 0.3)


SPLIT_CASES = [  # B, Hq, Hkv, T, S, D, prefix, splits: what each split boundary case covers
    (1, 4, 4, 3, 150, 64, [147], 3),           # GQA group 1; S not a multiple of the 64-key chunk
    (2, 8, 2, 5, 100, 64, [95, 40], 7),        # group 4; more splits than chunks (the last ones see nothing)
    (1, 8, 1, 6, 256, 128, [192], 4),          # group 8; the last split holds only the tree's keys
    (2, 4, 2, 1, 70, 256, [0, 69], 2),         # T=1; a row with no prefix; D=256
    (1, 2, 1, 128, 300, 64, [172], 3),         # T=128: two blocks of packed rows, a mask of 4 words
]


@pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: "x".join(map(str, c[:6])) + f"-{c[7]}splits")
@pytest.mark.parametrize("tree", ["causal", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_split_kv_kernel_at_split_boundaries(case, tree, dtype):
    from spec_ext.kernels.tree_attention_split import split_kv_attention
    B, Hq, Hkv, T, S, D, prefix, splits = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, dtype, seed=S + T, prefix=torch.tensor(prefix))
    mask = reference.tree_mask(random_parents(B, T, g))[1] if tree == "random" else None
    dev = device_for("triton")
    args = [t.to(dev) for t in (q, k, v, prefix)]
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    for n in (splits, 1):  # forced splits, and one split: the same result up to rounding
        out = split_kv_attention(*args, None if mask is None else mask.to(dev), D ** -0.5, num_splits=n).cpu()
        assert out.dtype == dtype and not out.isnan().any()
        err = (out.double() - expected).abs().max().item()
        assert err <= budget(dtype, q, k, v, prefix, mask), (n, err)


@pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")
def test_split_count_fills_the_gpu_and_never_exceeds_the_key_blocks():
    from spec_ext.kernels.tree_attention_split import BLOCK_S, split_count

    class H200:
        type = "cuda"
    import spec_ext.kernels.tree_attention_split as split
    sms = split._sm_count
    split._sm_count = lambda device: 132
    try:
        assert split_count(1, 8, 1, 32768, H200) == 33      # B=1: about two waves of 132 SMs
        assert split_count(32, 8, 1, 2048, H200) == 2
        assert split_count(64, 8, 4, 4096, H200) == 1       # enough programs already
        assert split_count(1, 1, 1, 100, H200) == -(-100 // BLOCK_S)  # at most one per key block
    finally:
        split._sm_count = sms


# ------------------------------------------------- window, softcap and sinks (issue 30)
def oracle(q, k, v, prefix, parents, scale, window=None, softcap=None, sinks=None):
    """Attention written out one (row, query) at a time in float64 from the tree's parents:
    prefix key s sits at position s, node j at prefix + depth(j); query i sees the prefix
    and its own root path, within the window; the sink is one more column of a plain
    softmax. Returns (out [B,Hq,T,D] float64, visible [B,T,S] bool)."""
    B, Hq, T, D = q.shape
    S, group = k.shape[2], Hq // k.shape[1]
    keys_all, values_all = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = torch.zeros(B, Hq, T, D, dtype=torch.float64)
    visible = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        P = int(prefix[b])
        depth = []
        for i in range(T):
            parent = int(parents[b, i])
            depth.append(0 if parent < 0 else depth[parent] + 1)
        for i in range(T):
            path, node = [], i
            while node >= 0:
                path.append(node)
                node = int(parents[b, node])
            candidates = [(s, s) for s in range(P)] + [(P + j, P + depth[j]) for j in sorted(path)]
            query_position = P + depth[i]
            keys = [s for s, position in candidates if window is None or query_position - position < window]
            visible[b, i, keys] = True
            scores = (keys_all[b, :, keys] @ q[b, :, i].double().unsqueeze(-1)).squeeze(-1) * scale  # [Hq, n]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            if sinks is not None:
                scores = torch.cat([scores, sinks.double().unsqueeze(1)], 1)
            weights = torch.softmax(scores, -1)[:, :len(keys)]
            out[b, :, i] = (weights.unsqueeze(1) @ values_all[b, :, keys]).squeeze(1)
    return out, visible


def eager_in_dtype(q, k, v, visible, scale, softcap=None, sinks=None):
    """What an eager attention (as HF's) computes in q's dtype with the dense mask:
    the scale of PyTorch's own rounding error in that dtype."""
    group = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ keys.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink], -1)
    weights = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)[..., :k.shape[2]]
    return weights @ values


FEATURE_CASES = [  # id, (B, Hq, Hkv, T, S, D), prefix, tree, window, softcap, sinks
    ("window<chain-g1", (3, 4, 4, 9, 40, 32), [0, 17, 5], "chain", 3, None, False),
    ("window<tree-g4", (2, 8, 2, 12, 50, 32), [30, 3], "tree", 4, None, False),
    ("window-inside-prefix-g8", (2, 8, 1, 3, 40, 64), [30, 12], "shared", 5, None, False),
    ("window1-sinks", (2, 4, 2, 6, 20, 32), [7, 0], "tree", 1, None, True),
    ("window1-chain", (1, 4, 4, 5, 12, 32), [4], "chain", 1, None, False),
    ("softcap-g4", (2, 8, 2, 7, 30, 64), [10, 0], "tree", None, 4.0, False),
    ("sinks-g4", (3, 4, 1, 5, 25, 32), [0, 9, 20], "chain", None, None, True),
    ("all-tree-g8", (2, 8, 1, 10, 60, 64), [45, 13], "tree", 6, 4.0, True),
    ("all-shared-g4", (3, 8, 2, 8, 40, 32), [0, 21, 32], "shared", 3, 4.0, True),
    ("all-decode-g4", (3, 8, 2, 1, 50, 64), [49, 10, 0], "chain", 8, 4.0, True),
    ("window-decode-g8", (2, 8, 1, 1, 33, 32), [32, 5], "chain", 4, None, False),
    ("window1-sinks-decode", (2, 4, 4, 1, 9, 32), [8, 3], "chain", 1, None, True),
    ("window<tree-T40-all", (2, 4, 2, 40, 70, 32), [20, 3], "tree", 3, 4.0, True),  # two mask words
]
LOW_PRECISION_CASES = [case for case in FEATURE_CASES if case[5] is not None]  # the soft-capped ones


def feature_inputs(case, dtype):
    """The op's arguments for a FEATURE_CASES row, and the parents the oracle reads."""
    _, (B, Hq, Hkv, T, S, D), prefix, tree, window, softcap, with_sinks = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, dtype, seed=B * T * S + D, prefix=torch.tensor(prefix))
    if tree == "chain":
        parents, mask = torch.arange(-1, T - 1).expand(B, T), None
    else:
        parents = random_parents(B if tree == "tree" else 1, T, g)
        mask = reference.tree_mask(parents)[1]
        parents = parents.expand(B, T)
    sinks = torch.randn(Hq, generator=g) * 2 + 1 if with_sinks else None
    scale = 0.5 if softcap is not None else D ** -0.5  # large enough scores that the cap bites
    return q, k, v, prefix, mask, parents, scale, window, softcap, sinks


# backends with no hook inside the softmax: they refuse softcap and sinks by name (auto avoids them)
NO_SOFTMAX_HOOK = ("sdpa",)


def run_backend(backend, q, k, v, prefix, mask, scale, window, softcap, sinks):
    """The backend's output on CPU; None where it refuses softcap or sinks (checked here)."""
    dev = device_for(backend)
    on = [None if t is None else t.to(dev) for t in (q, k, v, prefix, mask, sinks)]
    call = functools.partial(spec_ext.tree_attention, *on[:5], scale, window=window, softcap=softcap, sinks=on[5],
                             backend=backend)
    if backend in NO_SOFTMAX_HOOK and (softcap is not None or sinks is not None):
        with pytest.raises(ValueError, match="softcap" if softcap is not None else "sinks"):
            call()
        return None
    return call().cpu()


@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c[0])
def test_reference_matches_the_feature_oracle(case):
    q, k, v, prefix, mask, parents, scale, window, softcap, sinks = feature_inputs(case, torch.float64)
    expected, visible = oracle(q, k, v, prefix, parents, scale, window, softcap, sinks)
    assert torch.equal(reference.visibility(prefix, mask, q.shape[2], k.shape[2], window or 0), visible)
    out = reference.tree_attention(q, k, v, prefix, mask, scale, window or 0, softcap or 0.0, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c[0])
def test_features_match_the_oracle_in_float32(backend, case):
    q, k, v, prefix, mask, parents, scale, window, softcap, sinks = feature_inputs(case, torch.float32)
    out = run_backend(backend, q, k, v, prefix, mask, scale, window, softcap, sinks)
    if out is None:
        return
    expected, _ = oracle(q, k, v, prefix, parents, scale, window, softcap, sinks)
    assert out.dtype == torch.float32 and out.shape == q.shape
    err = (out.double() - expected).abs().max().item()
    assert err <= FP32_BUDGET, err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LOW_PRECISION_CASES, ids=lambda c: c[0])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_softcap_in_low_precision_within_pytorchs_own_error(backend, case, dtype):
    if backend.startswith("triton") and device_for(backend) == "cpu" and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 math")
    q, k, v, prefix, mask, parents, scale, window, softcap, sinks = feature_inputs(case, dtype)
    out = run_backend(backend, q, k, v, prefix, mask, scale, window, softcap, sinks)
    if out is None:
        return
    expected, visible = oracle(q, k, v, prefix, parents, scale, window, softcap, sinks)
    own = (eager_in_dtype(q, k, v, visible, scale, softcap, sinks).double() - expected).abs().max().item()
    assert out.dtype == dtype
    err = (out.double() - expected).abs().max().item()
    assert err <= 2 * own, (err, own)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sink_on_a_query_that_sees_only_itself_gates_its_value(backend):
    """window 1: every query sees only its own key, so out = sigmoid(score - sink) * v_self
    (the sink takes the rest of the weight and has no value)."""
    B, H, T, S, D = 2, 4, 5, 16, 32
    q, k, v, _, g = make(B, H, H, T, S, D, torch.float32, seed=11)
    prefix, sinks = torch.tensor([6, 0]), torch.randn(H, generator=g)
    out = run_backend(backend, q, k, v, prefix, None, D ** -0.5, 1, None, sinks)
    if out is None:
        return
    for b in range(B):
        own = slice(int(prefix[b]), int(prefix[b]) + T)
        score = (q[b] * k[b, :, own]).sum(-1).double() * D ** -0.5            # [H, T]
        expected = torch.sigmoid(score - sinks.double()[:, None]).unsqueeze(-1) * v[b, :, own].double()
        torch.testing.assert_close(out[b].double(), expected, rtol=0, atol=FP32_BUDGET)


# the dense-mask backends read every key they are given (weight 0, but 0 * NaN = NaN), as
# the docstrings of spec_ext.tree_attention and spec_ext.ops.sdpa say
READS_UNSEEN_KEYS = {
    "torch": "the reference multiplies the dense [T, S] weights with all of v",
    "sdpa": "sdpa multiplies the dense [T, S] weights with all of v",
}


def poison_unseen_keys(k, v, prefix, T, window):
    """NaN in k and v of row b at and below prefix[b] - window (its root, at position
    prefix[b], sees prefix[b] - window + 1 on; window None: none there) and from
    prefix[b] + T on."""
    for b, P in enumerate(prefix.tolist()):
        for cache in (k, v):
            if window is not None:
                cache[b, :, :max(P - window + 1, 0)] = float("nan")
            cache[b, :, P + T:] = float("nan")


@pytest.mark.parametrize("backend", backend_params("tree_attention", with_torch=True))
@pytest.mark.parametrize("T", [1, 9])
def test_keys_no_query_sees_are_never_read(request, backend, T):
    """A ragged batch, each row with its own prefix and tree: k and v hold NaN at and below
    each row's prefix - window and from its prefix + T on (other rows see some of those
    positions). A backend that reads them, even with weight 0, returns NaN."""
    if backend in READS_UNSEEN_KEYS:
        request.applymarker(pytest.mark.xfail(strict=True, reason=READS_UNSEEN_KEYS[backend]))
    B, Hq, Hkv, S, D, window = 3, 4, 2, 40, 32, 5
    q, k, v, _, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=19 + T)
    prefix = torch.tensor([20, 7, 28])
    if T == 1:
        parents, mask = torch.arange(-1, T - 1).expand(B, T), None
    else:
        parents = random_parents(B, T, g)
        mask = reference.tree_mask(parents)[1]
    clean = k.clone(), v.clone()
    poison_unseen_keys(k, v, prefix, T, window)
    sinks = torch.randn(Hq, generator=g)
    for softcap, sink in ((None, None), (4.0, sinks)):
        out = run_backend(backend, q, k, v, prefix, mask, D ** -0.5, window, softcap, sink)
        if out is None:
            continue
        expected, _ = oracle(q, *clean, prefix, parents, D ** -0.5, window, softcap, sink)
        assert out.isfinite().all()
        assert (out.double() - expected).abs().max().item() <= FP32_BUDGET


@pytest.mark.parametrize("backend", backend_params("tree_attention", with_torch=True))
@pytest.mark.parametrize("T", [1, 6])
def test_a_nan_that_a_row_sees_stays_in_that_row(backend, T):
    """NaN in a prefix key of row 0, which all its queries see: row 0 comes out NaN and no
    other row does, also where the other rows' unseen keys hold NaN too (on the backends
    that promise not to read them: the C++ kernel multiplies a ragged batch's NaN rows
    again over their own keys, which must neither hide row 0's NaN nor spread it)."""
    B, Hq, Hkv, S, D = 3, 4, 2, 40, 32
    q, k, v, _, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=29 + T)
    prefix = torch.tensor([12, 25, 3])
    parents = random_parents(B, T, g)
    mask = reference.tree_mask(parents)[1]
    clean = k.clone(), v.clone()
    k[0, :, 5] = v[0, :, 5] = float("nan")
    if backend not in READS_UNSEEN_KEYS:
        poison_unseen_keys(k[1:], v[1:], prefix[1:], T, None)
    out = run_backend(backend, q, k, v, prefix, mask, D ** -0.5, None, None, None)
    assert out[0].isnan().all()
    expected, _ = oracle(q, *clean, prefix, parents, D ** -0.5)
    assert (out[1:].double() - expected[1:]).abs().max().item() <= FP32_BUDGET


@pytest.mark.parametrize("backend", backend_params("tree_attention", with_torch=True))
@pytest.mark.parametrize("sink_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sinks_in_the_models_dtype_are_read_as_float32(backend, sink_dtype):
    """GPT-OSS keeps s_aux in the model's dtype: the op takes it as it is and computes what
    the float64 oracle gives for those sinks (fp16 and bf16 widen to float32 exactly; the
    rounding to sink_dtype moves the output by far more than the budget, so a backend that
    reads them in another precision fails)."""
    q, k, v, prefix, mask, parents, scale, window, softcap, sinks = feature_inputs(FEATURE_CASES[7], torch.float32)
    low = sinks.to(sink_dtype)
    out = run_backend(backend, q, k, v, prefix, mask, scale, window, softcap, low)
    if out is None:
        return
    expected, _ = oracle(q, k, v, prefix, parents, scale, window, softcap, low.double())
    assert (out.double() - expected).abs().max().item() <= FP32_BUDGET


@pytest.mark.parametrize("backend", backend_params("tree_attention", with_torch=True))
@pytest.mark.parametrize("T", [1, 6])
def test_a_sink_of_minus_inf_is_no_sink(backend, T):
    """A query that sees no key gets zeros whatever its sink: a finite sink takes all the
    weight and has no value; -inf adds exp(-inf) = 0 to an empty sum, which is no sink,
    and no sink gives zeros there (not 0/0 = NaN). On queries that see keys, -inf changes
    nothing: the oracle's softmax with a -inf column."""
    B, Hq, Hkv, S, D = 2, 4, 2, 16, 32
    q, k, v, _, _ = make(B, Hq, Hkv, T, S, D, torch.float32, seed=23 + T)
    prefix = torch.tensor([0, 5])
    parents = torch.arange(-1, T - 1).expand(B, T)
    mask = reference.tree_mask(parents)[1].clone()
    mask[0, 0] = 0  # row 0 has no prefix: its query 0 sees no key
    sinks = torch.tensor([float("-inf"), 0.5, float("-inf"), -1.0])
    out = run_backend(backend, q, k, v, prefix, mask, D ** -0.5, None, None, sinks)
    if out is None:
        return
    assert not out.isnan().any() and torch.equal(out[0, :, 0], torch.zeros(Hq, D))
    expected, _ = oracle(q, k, v, prefix, parents, D ** -0.5, sinks=sinks)
    seen = torch.ones(B, T, dtype=torch.bool)
    seen[0, 0] = False
    assert (out.double() - expected).permute(0, 2, 1, 3)[seen].abs().max().item() <= FP32_BUDGET


@pytest.mark.skipif(not spec_ext.ops.registered("tree_attention", "CPU"), reason="C++ kernels not built")
@pytest.mark.parametrize("S, prefix, window", [(1100, [1036, 300], 700), (4000, [3900, 2900], 30)],
                         ids=["window-reaches-key-0", "both-prefixes-beyond-the-window"])
def test_cpu_kernel_with_every_feature_on_blocks_too_big_for_its_batched_path(S, prefix, window):
    """Row 1's window reaching key 0 reads all columns; with both prefixes beyond the window
    the first column read is 2870 and each row's keys start at its own offset in it."""
    B, Hq, Hkv, T, D = 2, 8, 2, 64, 32
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=13, prefix=torch.tensor(prefix))
    parents = random_parents(B, T, g)
    mask, sinks = reference.tree_mask(parents)[1], torch.randn(Hq, generator=g)
    columns = int(prefix.max()) + T - max(int(prefix.min()) - window, 0)
    assert B * Hq * T * columns > 2 ** 20  # past the batched path
    expected, _ = oracle(q, k, v, prefix, parents, 0.5, window, 4.0, sinks)
    poison_unseen_keys(k, v, prefix, T, window)  # each head reads its row's keys only
    out = spec_ext.tree_attention(q, k, v, prefix, mask, 0.5, window=window, softcap=4.0, sinks=sinks, backend="cpu")
    assert (out.double() - expected).abs().max().item() <= FP32_BUDGET


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_query_that_sees_no_key_gets_zeros_with_softcap_and_sinks(backend):
    B, Hq, Hkv, T, S, D = 2, 4, 2, 6, 16, 32
    q, k, v, _, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=17)
    prefix, sinks = torch.tensor([0, 5]), torch.randn(Hq, generator=g)
    mask = reference.tree_mask(torch.arange(-1, T - 1).expand(B, T))[1].clone()
    mask[0, 0] = 0
    out = run_backend(backend, q, k, v, prefix, mask, D ** -0.5, None, 3.0, sinks)
    if out is None:
        return
    assert torch.equal(out[0, :, 0], torch.zeros(Hq, D)) and not out.isnan().any()
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, prefix, mask, D ** -0.5, 0, 3.0, sinks),
                               rtol=0, atol=FP32_BUDGET)


@pytest.mark.skipif(not spec_ext.ops.registered("tree_attention", "CPU"), reason="C++ kernels not built")
def test_cpu_kernel_refuses_a_negative_softcap_and_sinks_of_the_wrong_length():
    """validate=False skips the Python checks; the kernel itself refuses what it would misread."""
    q, k, v, prefix, _ = make(2, 4, 2, 1, 10, 8, torch.float32, seed=0)
    with pytest.raises(RuntimeError, match="softcap must be >= 0"):
        torch.ops.spec_ext.tree_attention(q, k, v, prefix, None, 0.5, 0, -1.0, None)
    with pytest.raises(RuntimeError, match="sinks must hold one logit per query head"):
        torch.ops.spec_ext.tree_attention(q, k, v, prefix, None, 0.5, 0, 0.0, torch.zeros(2))


def test_feature_arguments_are_checked_by_name():
    q, k, v, prefix, _ = make(2, 4, 2, 3, 10, 8, torch.float32, seed=0)
    for window in (0, -2, 2.5, True, "4"):
        with pytest.raises(ValueError, match="window: expected None or an int >= 1"):
            spec_ext.tree_attention(q, k, v, prefix, window=window)
    for softcap in (0.0, -1.0, float("nan"), float("inf"), True, "30"):
        with pytest.raises(ValueError, match="softcap: expected None or a finite float > 0"):
            spec_ext.tree_attention(q, k, v, prefix, softcap=softcap)
    with pytest.raises(ValueError, match="sinks: expected shape"):
        spec_ext.tree_attention(q, k, v, prefix, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="sinks: expected dtype"):
        spec_ext.tree_attention(q, k, v, prefix, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="sinks: expected 1-D"):
        spec_ext.tree_attention(q, k, v, prefix, sinks=torch.zeros(1, 4))
    # an int softcap and a numpy integer window are fine
    out = spec_ext.tree_attention(q, k, v, prefix, window=numpy.int64(2), softcap=30, backend="torch")
    assert torch.equal(out, reference.tree_attention(q, k, v, prefix, None, 8 ** -0.5, 2, 30.0))
