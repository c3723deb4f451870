"""compact_kv against the reference, and SpecCache against fresh forwards of an HF model."""
import pytest
import torch

import spec_ext
from spec_ext import reference
from spec_ext.drafters.base import feed_rows, refeed_tree
from spec_ext.models import SpecCache, hf
from helpers import backend_params, device_for, llama_family

BACKENDS = backend_params("compact_kv")


def scatter_case(B, M, S, generator, overlap=True):
    src = torch.full((B, M), -1, dtype=torch.int64)
    dst = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        n = int(torch.randint(0, M + 1, (1,), generator=generator))
        if b == 0:
            n = M
        start = int(torch.randint(0, S - M - 4, (1,), generator=generator))
        if overlap:  # sorted positions just after the destination: source and destination overlap
            picks = torch.randperm(M + 4, generator=generator)[:n].sort().values + start
        else:
            picks = torch.randperm(S, generator=generator)[:n]
        src[b, :n] = picks
        dst[b] = start
    if B > 1:  # an identity move
        src[1, :2], dst[1] = torch.tensor([5, 6]), 5
    return src, dst


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layers,B,H,S,D,M", [(1, 1, 1, 16, 8, 1), (2, 3, 2, 40, 33, 6), (32, 2, 2, 24, 16, 4),
                                               (3, 4, 8, 64, 128, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("layout", ["stacked", "spaced stack", "views of one buffer", "separate tensors"])
def test_compact_kv_matches_reference(backend, layers, B, H, S, D, M, dtype, overlap, layout):
    g = torch.Generator().manual_seed(layers * 1000 + S)
    caches = torch.randn(2 * layers, B, H, S, D, generator=g).to(dtype)
    src, dst = scatter_case(B, M, S, g, overlap)
    expected = caches.clone()
    moved = slice(0, None, 2) if layout == "spaced stack" else slice(0, layers)  # the rest must stay
    reference.compact_kv(list(expected[moved].unbind(0)), src, dst)
    dev = device_for(backend)
    mine = caches.to(dev)
    argument = {"stacked": mine[:layers], "spaced stack": mine[::2], "views of one buffer": list(mine[:layers]),
                "separate tensors": [t.clone() for t in mine[:layers]]}[layout]
    spec_ext.compact_kv(argument, src.to(dev), dst.to(dev), backend=backend)
    if layout == "separate tensors":
        mine[:layers] = torch.stack(argument)
    assert torch.equal(mine.cpu(), expected)


def test_a_list_of_one_buffers_layers_is_one_stacked_view_and_separate_tensors_are_one_each():
    from spec_ext.ops.kv_cache import _stacked
    buffer = torch.randn(6, 2, 3, 8, 4)
    (view,) = _stacked(list(buffer.unbind(0)))
    assert view.data_ptr() == buffer.data_ptr() and torch.equal(view, buffer)
    (view,) = _stacked(list(buffer[1::2].unbind(0)))  # every other one: spaced twice as far
    assert view.stride(0) == 2 * buffer.stride(0) and torch.equal(view, buffer[1::2])
    assert len(_stacked([t.clone() for t in buffer])) == 6
    assert len(_stacked([buffer[0], buffer[2], buffer[1]])) == 3  # out of order


def test_reference_is_gather_then_store():
    cache = torch.arange(10.0).view(1, 1, 10, 1)
    reference.compact_kv([cache], torch.tensor([[3, 4, 5]]), torch.tensor([2]))
    assert cache.flatten().tolist() == [0, 1, 3, 4, 5, 5, 6, 7, 8, 9]
    cache = torch.arange(10.0).view(1, 1, 10, 1)
    reference.compact_kv([cache], torch.tensor([[2, 3]]), torch.tensor([3]))  # moving right, overlapping
    assert cache.flatten().tolist() == [0, 1, 2, 2, 3, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("backend", backend_params("compact_kv", with_torch=True))  # expected values by hand
def test_empty_and_right_moves(backend):
    dev = device_for(backend)
    cache = torch.arange(10.0).view(1, 1, 1, 10, 1).repeat(2, 2, 1, 1, 1).to(dev)
    src = torch.tensor([[2, 3], [-1, -1]], device=dev)
    spec_ext.compact_kv(cache, src, torch.tensor([3, 0], device=dev), backend=backend)
    assert cache[0, 0].flatten().tolist() == [0, 1, 2, 2, 3, 5, 6, 7, 8, 9]
    assert cache[0, 1].flatten().tolist() == list(map(float, range(10)))


def test_bad_input():
    caches = torch.zeros(2, 2, 1, 8, 4)
    with pytest.raises(ValueError, match="dst_start: need"):
        spec_ext.compact_kv(caches, torch.tensor([[1, 2], [0, -1]]), torch.tensor([7, 0]))
    with pytest.raises(ValueError, match="src: positions must be"):
        spec_ext.compact_kv(caches, torch.tensor([[1, 8], [0, -1]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="src: -1 padding"):
        spec_ext.compact_kv(caches, torch.tensor([[-1, 2], [0, -1]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"caches\[1\]: expected \[B=2, H, S="):  # H and D may differ (MLA)
        spec_ext.compact_kv([caches[0], torch.zeros(2, 1, caches[0].shape[2] + 1, 5)], torch.tensor([[1], [1]]),
                            torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"caches\[1\]: expected .* and dtype torch.float32"):
        spec_ext.compact_kv([caches[0], caches[1].half()], torch.tensor([[1], [1]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match=r"caches: each \[B,H,S,D\] tensor of the stack must be contiguous"):
        spec_ext.compact_kv(caches.transpose(3, 4), torch.tensor([[1], [1]]), torch.tensor([0, 0]))
    with pytest.raises(ValueError, match="caches: expected 5-D"):
        spec_ext.compact_kv(caches[0], torch.tensor([[1], [1]]), torch.tensor([0, 0]))


# ------------------------------------------------------------------- SpecCache on models


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@torch.no_grad()
def test_spec_cache_commit_and_rollback_match_fresh_forward(kind):
    model = llama_family(kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 61, (n,), generator=g).tolist() for n in (6, 2, 9)]
    cache = SpecCache.for_model(model, 3, 64)
    tree = spec_ext.build_tree([-1, 0, 0, 1, 1, 2, 3])
    committed = [list(p) for p in prompts]
    with hf.attention_implementation(model):
        ids = torch.tensor([p + [0] * (9 - len(p)) for p in prompts])
        hf.forward(model, ids, cache, torch.arange(9).expand(3, 9))
        cache.advance([len(p) - 1 for p in prompts])  # the last token is the next root
        for round_ in range(3):
            nodes = torch.randint(0, 61, (3, 7), generator=g)
            nodes[:, 0] = torch.tensor([c[-1] for c in committed])
            hf.forward(model, nodes, cache, tree.positions(cache.lengths), tree.mask)
            # accept a different root-to-node path per row (and nothing for row 2 in round 1)
            paths = torch.tensor([[0, 1, 3, 6], [0, 2, 5, -1], [0, 1, 4, -1]])
            accepted = [3, 2, 0 if round_ == 1 else 2]
            cache.commit(paths, accepted)
            for b in range(3):
                committed[b] += [int(nodes[b, n]) for n in paths[b, 1:accepted[b] + 1]]
                committed[b].append(int(torch.randint(0, 61, (1,), generator=g)))
        cache.rollback([n - 1 for n in cache.host_lengths])  # drop one kept token per row
        for b in range(3):
            committed[b].pop(-2)
        cache.keep_rows([2, 0])
        committed = [committed[2], committed[0]]
        last = torch.tensor([[c[-1]] for c in committed])
        logits = hf.forward(model, last, cache, cache.lengths[:, None]).logits
    for row, tokens in enumerate(committed):
        fresh = model(torch.tensor([tokens])).logits[0, -1]
        torch.testing.assert_close(logits[row, 0], fresh, rtol=1e-4, atol=1e-4)


def test_spec_cache_capacity_error():
    cache = SpecCache(1, 1, 4, batch_size=2, capacity=8)
    cache.advance([6, 2])
    with pytest.raises(ValueError, match="exceed the capacity of 8"):
        cache.update(torch.zeros(2, 1, 3, 4), torch.zeros(2, 1, 3, 4), 0)
    with pytest.raises(ValueError, match="lengths: rollback"):
        cache.rollback([7, 0])


def test_spec_cache_reserve_grows_and_keeps_every_row():
    cache = SpecCache(2, 2, 4, batch_size=3, capacity=8)
    cache.buffer.copy_(torch.randn_like(cache.buffer))
    cache.advance([8, 3, 0])
    held, before = cache.buffer, cache.buffer.clone()
    cache.reserve(8)  # enough already: the same buffer
    assert cache.capacity == 8 and cache.buffer is held
    cache.reserve(9)  # at least doubled
    assert cache.capacity == 16 and cache.buffer.shape[3] == 16 and cache.host_lengths == [8, 3, 0]
    torch.testing.assert_close(cache.buffer[:, :, :, :8], before, rtol=0, atol=0)
    cache.reserve(40)
    assert cache.capacity == 40
    keys = torch.randn(3, 2, 32, 4)
    for layer in range(2):  # the grown rows take writes up to the new capacity
        cache.update(keys, keys, layer)
    cache.advance([32, 32, 32])
    torch.testing.assert_close(cache.buffer[0, 0, :, 8:40], keys[0], rtol=0, atol=0)
    torch.testing.assert_close(cache.buffer[:, 1, :, :3], before[:, 1, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(cache.buffer[:, 0, :, :8], before[:, 0], rtol=0, atol=0)
    unsized = SpecCache(2, None, None, batch_size=2, capacity=4)  # sized by its first keys, at the grown capacity
    unsized.reserve(10)
    for layer in range(2):
        unsized.update(keys[:2, :, :10], keys[:2, :, :10], layer)
    assert unsized.buffer.shape == (4, 2, 2, 10, 4)


def test_feed_rows_writes_every_row_after_its_own_tokens_and_keeps_its_real_ones():
    """The drafters' catch-up (``feed_rows``): a ragged feed is padded to one width, each row's
    positions start at its own cached length, the cache grows to hold the padded width past
    the longest row and keeps row b's first ``lengths[b]``; the last kept column per row."""
    cache = SpecCache(1, 1, 2, batch_size=3, capacity=6)
    cache.advance([5, 1, 0])
    seen = {}

    def run(ids, positions):
        seen.update(ids=ids, positions=positions)
        return "out"

    ids = torch.tensor([[7, 8, 0], [9, 0, 0], [4, 5, 6]])
    out, last = feed_rows(cache, ids, [2, 1, 3], run)
    assert out == "out" and seen["ids"] is ids and last.tolist() == [1, 0, 2]
    assert seen["positions"].tolist() == [[5, 6, 7], [1, 2, 3], [0, 1, 2]]
    assert cache.capacity >= 8 and cache.host_lengths == [7, 2, 3] and cache.lengths.tolist() == [7, 2, 3]
    _, last = feed_rows(cache, ids[:, :1], [1, 1, 1], run, torch.tensor([1, 1, 1]))  # device lengths as given
    assert last.tolist() == [0, 0, 0] and cache.host_lengths == [8, 3, 4]


def test_refeed_tree_feeds_the_root_at_its_own_position_and_keeps_the_committed_tokens():
    """A tree re-fed (``refeed_tree``): node 0 (the last committed token) at its own position
    again and each node at the root's plus its depth, under the tree's mask; the cache then
    holds the committed tokens as before."""
    cache = SpecCache(1, 1, 2, batch_size=2, capacity=4)
    cache.advance([4, 2])
    seen = {}

    def run(ids, positions, mask):
        seen.update(positions=positions, mask=mask)
        return "logits"

    depth, mask = torch.tensor([[0, 1, 1, 2]] * 2), torch.ones(2, 4, 4, dtype=torch.bool)
    assert refeed_tree(cache, run, torch.zeros(2, 4, dtype=torch.int64), depth, mask) == "logits"
    assert seen["positions"].tolist() == [[3, 4, 4, 5], [1, 2, 2, 3]] and seen["mask"] is mask
    assert cache.host_lengths == [4, 2] and cache.capacity >= 7


def test_spec_cache_copy_rows_shares_a_prefix():
    cache = SpecCache(2, 2, 4, batch_size=4, capacity=8)
    cache.buffer.copy_(torch.randn_like(cache.buffer))
    cache.advance([5, 3, 0, 7])
    before = cache.buffer.clone()
    cache.copy_rows([0, 1], [2, 3])
    assert cache.host_lengths == [5, 3, 5, 3] and cache.lengths.tolist() == [5, 3, 5, 3]
    torch.testing.assert_close(cache.buffer[:, 2, :, :5], before[:, 0, :, :5], rtol=0, atol=0)
    torch.testing.assert_close(cache.buffer[:, 3, :, :3], before[:, 1, :, :3], rtol=0, atol=0)
    torch.testing.assert_close(cache.buffer[:, :2], before[:, :2], rtol=0, atol=0)
