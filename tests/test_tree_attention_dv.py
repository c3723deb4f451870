"""Values of another head size than the keys' (Dv != D: MLA, DeepSeek-V3's keys are
``qk_nope_head_dim + qk_rope_head_dim`` wide, its values ``v_head_dim``): every backend that
takes them against the reference, the reference against per-row eager attention, the
kernels that take Dv = D only refusing by name (and ``auto`` never sending such calls to
them), the SpecCache of two widths and ``compact_kv`` over tensors of two widths."""
import pytest
import torch

import spec_ext
from spec_ext import reference
from helpers import backend_params, device_for, random_parents

SAME_HEAD_SIZE_ONLY = ("cuda", "triton", "triton_split")
CASES = [  # B, Hq, Hkv, T, S, D, Dv
    (1, 2, 2, 1, 9, 24, 16),
    (2, 4, 2, 5, 37, 48, 32),
    (3, 4, 1, 9, 41, 16, 40),
]


def make(B, Hq, Hkv, T, S, D, Dv, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, T, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    prefix = torch.randint(0, S - T + 1, (B,), generator=g)
    return q, k, v, prefix, g


def test_reference_equals_eager_attention_per_row():
    """Each row's causal attention over its prefix and new tokens, written out with the
    keys' scale D^-0.5 and GQA by repetition."""
    q, k, v, prefix, _ = make(2, 4, 2, 3, 12, 24, 8, torch.float64, seed=1)
    out = reference.tree_attention(q, k, v, prefix, None, 24 ** -0.5)
    assert out.shape == (2, 4, 3, 8)
    for b in range(2):
        n = int(prefix[b]) + 3
        keys, values = k[b, :, :n].repeat_interleave(2, 0), v[b, :, :n].repeat_interleave(2, 0)
        scores = q[b] @ keys.transpose(-1, -2) * 24 ** -0.5
        scores[:, torch.arange(3)[:, None] + int(prefix[b]) < torch.arange(n)[None]] = float("-inf")
        torch.testing.assert_close(out[b], torch.softmax(scores, -1) @ values, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", backend_params("tree_attention"))
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("tree", ["causal", "random"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backends_take_values_of_another_width_or_refuse_by_name(backend, case, tree, dtype):
    B, Hq, Hkv, T, S, D, Dv = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, Dv, dtype, seed=S)
    mask = None if tree == "causal" else reference.tree_mask(random_parents(B, T, g))[1]
    dev = device_for(backend)
    args = q.to(dev), k.to(dev), v.to(dev), prefix.to(dev), None if mask is None else mask.to(dev)
    if backend in SAME_HEAD_SIZE_ONLY:
        with pytest.raises(ValueError, match=rf"v: backend '{backend}' needs values of the keys' head size D={D}, "
                                             rf"got Dv={Dv}"):
            spec_ext.tree_attention(*args, backend=backend)
        return
    out = spec_ext.tree_attention(*args, backend=backend)
    assert out.shape == (B, Hq, T, Dv) and out.dtype == dtype
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    tolerance = 3e-6 if dtype == torch.float32 else 3e-2
    assert (out.cpu().double() - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("window,softcap,sinks", [(4, None, False), (None, 3.0, True)])
def test_auto_takes_windows_softcaps_and_sinks_with_values_of_another_width(window, softcap, sinks):
    q, k, v, prefix, g = make(2, 4, 2, 5, 30, 24, 16, torch.float32, seed=3)
    mask = reference.tree_mask(random_parents(2, 5, g))[1]
    sink = torch.randn(4, generator=g) if sinks else None
    out = spec_ext.tree_attention(q, k, v, prefix, mask, window=window, softcap=softcap, sinks=sink)
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, 24 ** -0.5,
                                        window or 0, softcap or 0.0, sink)
    assert (out.double() - expected).abs().max().item() <= 3e-6


def test_auto_on_a_gpu_sends_values_of_another_width_to_sdpa_or_torch():
    """What ``auto`` picks for a Dv != D call, for every device type (whatever the table
    says): on a GPU never a kernel that takes Dv = D only."""
    from spec_ext.ops.attention import _value_head_backend
    cuda = torch.device("cuda")
    assert _value_head_backend("auto", cuda, 0.0, None, 24, 16) == "sdpa"
    assert _value_head_backend("auto", cuda, 2.0, None, 24, 16) == "torch"
    assert _value_head_backend("auto", cuda, 0.0, torch.zeros(2), 24, 16) == "torch"
    assert _value_head_backend("auto", torch.device("cpu"), 0.0, None, 24, 16) == "auto"


def test_mismatched_values_are_refused_by_name():
    q, k, v, prefix, _ = make(2, 4, 2, 3, 12, 24, 8, torch.float32, seed=2)
    with pytest.raises(ValueError, match=r"v: expected \[B, Hkv, S\] = \(2, 2, 12\) like k"):
        spec_ext.tree_attention(q, k, v[:, :, :10], prefix)


def test_spec_cache_of_two_widths_writes_commits_and_keeps_rows():
    """Keys 12 wide, values 8: every write lands at the row's offset, a tree commit moves
    both buffers' accepted paths, keep_rows and reserve keep both."""
    from spec_ext.models import SpecCache
    cache = SpecCache(2, None, None, 2, 16)
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 3, 4, 12, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    for layer in range(2):
        k, v = cache.update(keys + layer, values + layer, layer)
        assert k.shape == (2, 3, 4, 12) and v.shape == (2, 3, 4, 8)
    assert [b.shape for b in cache.buffers] == [(2, 2, 3, 16, 12), (2, 2, 3, 16, 8)]
    cache.advance([4, 1])
    nodes_k, nodes_v = torch.randn(2, 3, 3, 12, generator=g), torch.randn(2, 3, 3, 8, generator=g)
    for layer in range(2):
        cache.update(nodes_k + layer, nodes_v + layer, layer)
    cache.commit(torch.tensor([[0, 2, -1], [0, 1, 2]]), [1, 2])
    assert cache.host_lengths == [6, 4]
    for layer in range(2):
        k, v = cache._layers[layer]
        torch.testing.assert_close(k[0, :, 4:6], nodes_k[0, :, [0, 2]] + layer, rtol=0, atol=0)
        torch.testing.assert_close(v[0, :, 4:6], nodes_v[0, :, [0, 2]] + layer, rtol=0, atol=0)
        torch.testing.assert_close(v[1, :, 1:4], nodes_v[1] + layer, rtol=0, atol=0)
        torch.testing.assert_close(v[0, :, :4], values[0] + layer, rtol=0, atol=0)
    before = [b.clone() for b in cache.buffers]
    cache.keep_rows([1])
    cache.reserve(40)
    assert cache.capacity == 40 and cache.host_lengths == [4]
    for new, old in zip(cache.buffers, before):
        torch.testing.assert_close(new[:, 0, :, :16], old[:, 1], rtol=0, atol=0)
    with pytest.raises(ValueError, match="8 value dims"):
        cache.update(torch.randn(1, 3, 1, 12), torch.randn(1, 3, 1, 12), 0)


@pytest.mark.parametrize("backend", backend_params("compact_kv", with_torch=True))
def test_compact_kv_moves_tensors_of_two_widths_in_one_call(backend):
    dev = device_for(backend)
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 2, 3, 10, 12, generator=g).to(dev)
    values = torch.randn(2, 2, 3, 10, 8, generator=g).to(dev)
    caches = [*keys.unbind(0), *values.unbind(0)]
    expected = [c.clone() for c in caches]
    src, dst = torch.tensor([[5, 7, 9], [3, -1, -1]]), torch.tensor([5, 2])
    reference.compact_kv(expected, src, dst)
    spec_ext.compact_kv(caches, src.to(dev), dst.to(dev), backend=backend)
    for got, want in zip(caches, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
