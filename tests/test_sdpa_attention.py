"""Backend "sdpa" of tree_attention against the reference, the keys cut to what can be seen,
and what backend="auto" picks (spec_ext.ops.selection)."""
import pytest
import torch

import spec_ext
from spec_ext import reference
from spec_ext.models.cache import SpecCache
from spec_ext.ops import registry, sdpa, selection
from helpers import DEVICE, backend_params, device_for, random_parents
from test_tree_attention import CASES, budget, make

WINDOWS = [0, 1, 3, 40]  # 0: none; 1: each query sees only itself; 40: wider than some rows' prefixes


def tree_of(kind, B, T, g):
    if kind == "random":
        return reference.tree_mask(random_parents(B, T, g))[1]
    if kind == "shared":
        return reference.tree_mask(random_parents(1, T, g))[1]
    return None


@pytest.mark.parametrize("case", CASES + [(2, 2, 1, 40, 60, 16), (3, 6, 3, 33, 70, 32)],
                         ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("tree", ["causal", "random", "shared"])
@pytest.mark.parametrize("window", WINDOWS)
def test_float32_matches_reference(case, tree, window):
    """fp32 within 1e-5; T=33 and T=40 take a second word of tree bits."""
    B, Hq, Hkv, T, S, D = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=T * S + window)
    mask = tree_of(tree, B, T, g)
    dev = device_for("sdpa")
    out = spec_ext.tree_attention(q.to(dev), k.to(dev), v.to(dev), prefix.to(dev),
                                  None if mask is None else mask.to(dev), window=window or None, backend="sdpa")
    expected = reference.tree_attention(q, k, v, prefix, mask, D ** -0.5, window)
    assert out.dtype == torch.float32 and out.shape == q.shape
    assert (out.cpu() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tree", ["causal", "random"])
@pytest.mark.parametrize("window", [0, 3])
def test_mask_is_the_reference_visibility(tree, window):
    B, T, S = 4, 21, 50
    g = torch.Generator().manual_seed(11)
    prefix = torch.tensor([0, 29, 7, 13])
    mask = tree_of(tree, B, T, g)
    visible = sdpa.visible_keys(prefix, mask, T, S, window)
    assert visible.shape == (B, 1, T, S) and visible.dtype == torch.bool
    assert torch.equal(visible[:, 0], reference.visibility(prefix, mask, T, S, window))


@pytest.mark.parametrize("case", [CASES[2], CASES[4]], ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_low_precision_within_the_reference_budget(case, dtype):
    B, Hq, Hkv, T, S, D = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, dtype, seed=S)
    mask = tree_of("random", B, T, g)
    dev = device_for("sdpa")
    out = spec_ext.tree_attention(q.to(dev), k.to(dev), v.to(dev), prefix.to(dev), mask.to(dev), backend="sdpa")
    expected = reference.tree_attention(q.float(), k.float(), v.float(), prefix, mask, D ** -0.5)
    assert out.dtype == dtype
    assert (out.cpu().float() - expected).abs().max().item() <= budget(dtype, q, k, v, prefix, mask)


def test_softcap_and_sinks_are_refused_by_name():
    q, k, v, prefix, _ = make(2, 4, 2, 3, 10, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match="softcap: backend 'sdpa'"):
        spec_ext.tree_attention(q, k, v, prefix, softcap=30.0, backend="sdpa")
    with pytest.raises(ValueError, match="sinks: backend 'sdpa'"):
        spec_ext.tree_attention(q, k, v, prefix, sinks=torch.zeros(4), backend="sdpa", validate=False)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if DEVICE == "cuda" else []))
def test_auto_sends_softcap_and_sinks_where_they_are_computed(device):
    q, k, v, prefix, _ = make(2, 4, 2, 3, 10, 8, torch.float32, seed=1)
    sinks = torch.randn(4)
    args = [t.to(device) for t in (q, k, v, prefix)]
    for softcap, sink in ((5.0, None), (None, sinks), (5.0, sinks)):
        out = spec_ext.tree_attention(*args, softcap=softcap, sinks=None if sink is None else sink.to(device))
        expected = reference.tree_attention(q, k, v, prefix, None, 8 ** -0.5, 0, softcap or 0.0, sink)
        torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)
        call = (*args, None, 8 ** -0.5, 0, softcap or 0.0, sink)
        assert "this call: sdpa" not in registry.explain("tree_attention", device, call)


@pytest.mark.parametrize("backend", backend_params("tree_attention"))
def test_keys_cut_to_the_longest_row_give_the_full_buffers_result(backend):
    """What SpecCache.update returns: views [B,H,max(prefix)+T,D] of longer buffers (not
    contiguous); every backend reads them as the whole buffers."""
    B, Hq, Hkv, T, S, D = 3, 4, 2, 5, 64, 16
    q, k, v, _, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=4)
    prefix = torch.tensor([20, 3, 31])
    mask = tree_of("random", B, T, g)
    dev = device_for(backend)
    seen = int(prefix.max()) + T
    cut = [t.to(dev)[:, :, :seen] for t in (k, v)]
    assert not cut[0].is_contiguous()
    out = spec_ext.tree_attention(q.to(dev), *cut, prefix.to(dev), mask.to(dev), backend=backend)
    torch.testing.assert_close(out.cpu(), reference.tree_attention(q, k, v, prefix, mask, D ** -0.5),
                               rtol=1e-4, atol=1e-4)


def test_kernels_read_cut_views_in_their_buffer_without_a_copy():
    """The C++, CUDA and Triton kernels index contiguous keys: a view cut along the keys of
    a contiguous buffer reaches them as that buffer (same memory, no per-layer copy);
    anything else non-contiguous is copied."""
    buffer = torch.randn(2, 3, 3, 10, 4)  # [2L, B, H, S, D], as SpecCache holds it
    cut = buffer[1][:, :, :6]
    whole = registry.uncut(cut)
    assert whole.is_contiguous() and whole.data_ptr() == buffer[1].data_ptr() and whole.shape == (3, 3, 10, 4)
    assert torch.equal(whole[:, :, :6], cut)
    transposed = buffer[0].transpose(1, 2)
    assert torch.equal(registry.uncut(transposed), transposed)
    assert registry.uncut(transposed).data_ptr() != transposed.data_ptr()
    last = buffer[1][:, :, :6, :2]  # cut along D too: not one buffer's keys
    assert registry.uncut(last).data_ptr() != last.data_ptr()


def test_spec_cache_update_returns_views_up_to_the_longest_row():
    cache = SpecCache(num_layers=1, num_kv_heads=2, head_dim=8, batch_size=3, capacity=32)
    cache.advance([0, 0, 0])
    new = torch.randn(3, 2, 4, 8)
    keys, values = cache.update(new, new, 0)
    assert keys.shape == (3, 2, 4, 8)
    cache.advance([4, 1, 2])  # ragged: the longest row has 4
    keys, values = cache.update(new[:, :, :3], new[:, :, :3], 0)
    assert keys.shape == values.shape == (3, 2, 7, 8)
    assert keys.data_ptr() == cache.buffer[0].data_ptr() and values.data_ptr() == cache.buffer[1].data_ptr()
    assert torch.equal(keys[1, :, 1:4], new[1, :, :3])  # written at the row's own offset


def test_explain_names_the_rows_and_the_command_of_every_entry():
    for (device, op), table in selection.TABLE.items():
        text = registry.explain(op, device)
        for entry in table:
            assert entry.backend in text and entry.rows in text and entry.command in text
    with pytest.raises(ValueError, match="op must be one of"):
        registry.explain("attention")


@pytest.fixture
def table_on(monkeypatch):
    """auto's measured table switched on, whatever the environment says."""
    monkeypatch.delenv(selection.SWITCH, raising=False)


def test_cuda_table_sends_tree_attention_to_sdpa(table_on):
    q = torch.empty(1, 32, 8, 128, device="meta")
    k = torch.empty(1, 8, 4096, 128, device="meta")
    for window in (0, 128):
        call = (q, k, k, torch.empty(1, device="meta"), None, 0.1, window, 0.0, None)
        assert registry.explain("tree_attention", "cuda", call).endswith(
            "this call: sdpa (every call without softcap or sinks)")


def test_cuda_table_sends_softcap_and_sinks_to_the_reference(table_on):
    """No GPU run has checked or timed the CUDA and Triton kernels' softcap and sink paths:
    auto on CUDA gives those calls to the PyTorch reference, and explain says why. Asked of
    the table for a CUDA device (meta tensors: nothing runs); then the function auto builds
    for CUDA, which picks by shapes and arguments only, run on CPU tensors: the reference's
    own result, to the bit."""
    cuda = torch.device("cuda")
    assert [name for name, _ in registry.auto_choices("tree_attention", cuda)] == ["sdpa", "torch"]
    q = torch.empty(1, 32, 8, 128, device="meta")
    k = torch.empty(1, 8, 4096, 128, device="meta")
    sinks = torch.empty(32, device="meta")
    shapes = selection.entries("cuda", "tree_attention")[1].shapes
    assert "correct by construction" in shapes and "never run them on a GPU" in shapes
    for window, softcap, sink in ((0, 30.0, None), (0, 0.0, sinks), (128, 30.0, sinks)):
        call = (q, k, k, torch.empty(1, device="meta"), None, 0.1, window, softcap, sink)
        assert registry.explain("tree_attention", "cuda", call).endswith(f"this call: torch ({shapes})")
    q, k, v, prefix, g = make(2, 4, 2, 3, 10, 8, torch.float32, seed=6)
    auto = registry.kernel("tree_attention", "auto", cuda)
    for softcap, sink in ((5.0, None), (0.0, torch.randn(4, generator=g))):
        expected = reference.tree_attention(q, k, v, prefix, None, 0.3, 2, softcap, sink)
        assert torch.equal(auto(q, k, v, prefix, None, 0.3, 2, softcap, sink), expected)


CROSSOVER = [  # (B, Hq, Hkv, T, S, D), what auto picks on CPU with the C++ kernels
    ((1, 32, 32, 1, 512, 128), "cpu"), ((2, 32, 8, 16, 512, 128), "cpu"), ((1, 4, 2, 40, 300, 64), "cpu"),
    ((1, 10, 5, 6, 256, 32), "cpu"), ((8, 10, 5, 22, 256, 32), "sdpa"), ((1, 32, 8, 8, 4096, 128), "sdpa"),
    ((1, 32, 32, 64, 512, 128), "sdpa"), ((1, 32, 32, 65, 512, 128), "cpu"), ((1, 32, 8, 4, 512, 128), "cpu"),
    ((2, 32, 32, 4, 512, 128), "sdpa"), ((1, 32, 32, 4, 512, 128), "cpu"),
    # GQA: T <= 16 under 2^20 scores (B*Hq*T*S) stays with the C++ kernel (issue 38: B=1, Hq=16, Hkv=4, T=12)
    ((1, 16, 4, 12, 1512, 64), "cpu"), ((1, 16, 4, 17, 1512, 64), "sdpa"), ((1, 16, 4, 16, 4095, 64), "cpu"),
    ((1, 16, 4, 16, 4096, 64), "sdpa"),
]


@pytest.mark.parametrize("case, picked", CROSSOVER, ids=lambda c: "x".join(map(str, c)) if isinstance(c, tuple) else c)
def test_auto_on_cpu_matches_the_reference_on_both_sides_of_the_crossover(table_on, case, picked):
    """``picked``: what auto takes with the C++ kernels; without them (a build without
    spec_ext._C) the table's sdpa entry still holds and the rest falls to the reference."""
    B, Hq, Hkv, T, S, D = case
    q, k, v, prefix, g = make(B, Hq, Hkv, T, S, D, torch.float32, seed=3, prefix=torch.full((B,), S - T))
    mask = tree_of("random", B, T, g)
    call = (q, k, v, prefix, mask, D ** -0.5, 0, 0.0, None)
    expected = picked if registry.registered("tree_attention", "CPU") or picked == "sdpa" else "torch"
    assert f"this call: {expected} " in registry.explain("tree_attention", "cpu", call)
    out = spec_ext.tree_attention(q, k, v, prefix, mask)
    exact = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    assert (out.double() - exact).abs().max().item() <= budget(torch.float32, q, k, v, prefix, mask)


def test_auto_on_cpu_without_the_cpp_kernels():
    """A build without spec_ext._C, in a process that cannot import it: the table's sdpa
    entry where it applies, the reference (the fixed order) elsewhere."""
    import json
    import os
    import subprocess
    import sys
    code = ("import json, sys, warnings; sys.modules['spec_ext._C'] = None; warnings.simplefilter('ignore')\n"
            "import torch\n"
            "from spec_ext.ops import registry\n"
            "assert not registry.registered('tree_attention', 'CPU')\n"
            "picks = []\n"
            f"for B, Hq, Hkv, T, S, D in {[case for case, _ in CROSSOVER]!r}:\n"
            "    q, k = torch.empty(B, Hq, T, D, device='meta'), torch.empty(B, Hkv, S, D, device='meta')\n"
            "    call = (q, k, k, torch.empty(B, device='meta'), None, D ** -0.5, 0, 0.0, None)\n"
            "    picks.append(registry.explain('tree_attention', 'cpu', call).splitlines()[-1].strip())\n"
            "print(json.dumps(picks))\n")
    env = {key: value for key, value in os.environ.items() if key != selection.SWITCH}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr
    for (case, picked), line in zip(CROSSOVER, json.loads(result.stdout), strict=True):
        if picked == "sdpa":
            assert line.startswith("this call: sdpa ("), (case, line)
        else:
            assert line == "this call: torch (the fixed order)", (case, line)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device (CUDA graph capture and sync detection)")
def test_cuda_graph_captures_it_without_a_host_sync():
    q, k, v, prefix, g = make(2, 8, 2, 9, 300, 64, torch.float16, seed=5)
    mask = tree_of("random", 2, 9, g)
    args = [t.cuda() for t in (q, k, v, prefix, mask)]
    expected = reference.tree_attention(q.float(), k.float(), v.float(), prefix, mask, 64 ** -0.5)
    torch.cuda.set_sync_debug_mode("error")
    try:
        sdpa.tree_attention(*args, 64 ** -0.5, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        sdpa.tree_attention(*args, 64 ** -0.5)  # warm-up on the capture stream
        with torch.cuda.graph(graph, stream=stream):
            out = sdpa.tree_attention(*args, 64 ** -0.5)
    graph.replay()
    torch.cuda.synchronize()
    assert (out.cpu().float() - expected).abs().max().item() <= budget(torch.float16, q, k, v, prefix, mask)
