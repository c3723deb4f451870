"""tree_attention: every backend against the reference; the reference against an
independent oracle (causal attention over prefix + each node's root-to-node path)."""
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


def budget(dtype, q, k, v, prefix, mask):
    """flash-attention style: allowed error = 2x PyTorch's own error in this dtype + a floor."""
    if dtype == torch.float32:
        return 1e-4
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
    expected = reference.tree_attention(q.float(), k.float(), v.float(), prefix, mask, D ** -0.5)
    err = (out.cpu().float() - expected).abs().max().item()
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
    torch.testing.assert_close(out, reference.tree_attention(q, k, v, prefix, mask, D ** -0.5), rtol=1e-4, atol=1e-4)


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
    expected = reference.tree_attention(q, k, v, prefix, mask, D ** -0.5)
    assert torch.equal(expected[0, :, 0], torch.zeros(Hq, D)) and expected[1].abs().sum() > 0
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)


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
            torch.testing.assert_close(out[b, :, i].double(), oracle, rtol=1e-5, atol=1e-5)


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
        assert err <= (1e-5 if dtype == torch.float32 else budget(dtype, q, k, v, prefix, mask)), (n, err)


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
