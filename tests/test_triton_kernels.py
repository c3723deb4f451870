"""The Triton launchers' own choices, planned for an H200 (spec_ext/kernels/launch.py: launchers
called on meta tensors record their launches), and the cases that cover them, replayed
against the reference in the interpreter (or on a GPU)."""
import pytest
import torch

import spec_ext
from spec_ext import reference
from helpers import device_for

pytestmark = pytest.mark.skipif(spec_ext.backends()["triton"] != "available", reason="Triton cannot run here")


def meta(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def planned(fn, *args, **kwargs):
    from spec_ext.kernels.launch import H200, planning
    with planning(H200) as launches:
        fn(*args, **kwargs)
    return {launch.kernel.fn.__name__: launch for launch in launches}


def arg(launch, name):
    """The value the launch passes for the kernel parameter ``name``."""
    import inspect
    names = list(inspect.signature(launch.kernel.fn).parameters)
    return launch.args[names.index(name)] if names.index(name) < len(launch.args) else launch.meta[name]


# ------------------------------------------------------------------ vocabulary chunks
@pytest.mark.parametrize("V,splits", [(8193, 3), (83, 7), (32000, 3), (128256, 22), (5, 40)])
def test_vocabulary_chunks_are_whole_blocks_and_none_is_empty(V, splits):
    from spec_ext.kernels.rejection_sampling_split import chunking
    chunk, n, block = chunking(V, splits)
    assert block >= 16 and chunk % block == 0  # every chunk starts 16-entry aligned: 128-bit loads
    assert (n - 1) * chunk < V <= n * chunk  # the last chunk holds at least one entry
    assert splits <= n <= 2 * splits or chunk == 16  # rounded down: never fewer chunks than asked


@pytest.mark.parametrize("greedy", [True, False])
def test_split_verification_plans_a_wave_of_resident_programs_in_whole_blocks(greedy):
    from spec_ext.kernels.rejection_sampling_split import (ARGMAX_RESIDENT, MASS_RESIDENT, MIN_CHUNK,
                                                           split_chain_verify)
    B, K, V = 16, 5, 128256
    args = (meta(B, K + 1, V), meta(B, K, dtype=torch.int64), meta(B, K, V), meta(B, dtype=torch.int64),
            None if greedy else meta(B, K + 1, dtype=torch.float64), greedy)
    partials = planned(split_chain_verify, *args)["_argmax_partials" if greedy else "_mass_partials"]
    chunk, block = arg(partials, "chunk"), partials.meta["BLOCK_V"]
    rows, splits = partials.grid
    assert chunk % block == 0 and (splits - 1) * chunk < V <= splits * chunk and chunk >= MIN_CHUNK
    wave = (ARGMAX_RESIDENT if greedy else MASS_RESIDENT)[90] * 132
    assert 0.9 * wave <= rows * splits < 2 * wave  # about one full wave of resident programs


@pytest.mark.parametrize("V", [32000, 128256])
@pytest.mark.parametrize("op,K", [("chain q", 5), ("chain q", 8), ("chain greedy", 5), ("chain greedy", 8),
                                  ("tree greedy", 8)])
def test_split_verification_at_b1_fills_a_wave_or_splits_as_finely_as_128_bit_loads_allow(op, K, V):
    """B=1 at the shapes of benchmarks/bench_kernels.py (the tree: 8 nodes): the partials grid
    holds a wave of resident programs on 132 SMs, or where the row is too short for one,
    chunks of one warp's 128-bit loads (4 float32 a thread), the finest split that keeps them;
    either way every SM gets a program, and every thread of a block loads 4 entries or more."""
    from spec_ext.kernels.rejection_sampling_split import (ARGMAX_RESIDENT, MASS_RESIDENT, split_chain_verify,
                                                           split_tree_verify)
    i64 = torch.int64
    if op == "tree greedy":
        launches = planned(split_tree_verify, meta(1, K, V), meta(1, K, dtype=i64), meta(1, K, dtype=i64), None, None,
                           True, True)
    else:
        greedy = op == "chain greedy"
        launches = planned(split_chain_verify, meta(1, K + 1, V), meta(1, K, dtype=i64),
                           None if greedy else meta(1, K, V), meta(1, dtype=i64),
                           None if greedy else meta(1, K + 1, dtype=torch.float64), greedy)
    greedy = op != "chain q"
    partials = launches["_argmax_partials" if greedy else "_mass_partials"]
    chunk, block, warps = arg(partials, "chunk"), partials.meta["BLOCK_V"], partials.meta["num_warps"]
    rows, splits = partials.grid
    assert rows == (K if op == "tree greedy" else K + 1 if greedy else 1)
    assert chunk % block == 0 and (splits - 1) * chunk < V <= splits * chunk
    assert block >= 4 * 32 * warps
    wave = (ARGMAX_RESIDENT if greedy else MASS_RESIDENT)[90] * 132
    assert rows * splits >= wave or (chunk == 4 * 32 and rows * splits >= 132), (rows, splits, chunk, wave)


@pytest.mark.parametrize("mode", ["greedy", "q", "one-hot q"])
def test_split_chain_verification_at_odd_v_with_rounded_chunks(mode):
    """V = 8193 asked in 3 splits: 5 chunks of 2 x 1024 entries, the last one holding one."""
    from spec_ext.kernels.rejection_sampling_split import chunking, split_chain_verify
    B, K, V = 3, 3, 8193
    assert chunking(V, 3) == (2048, 5, 1024)
    g = torch.Generator().manual_seed(7)
    q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1)
    p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1)
    p[:, :K] = 0.7 * q + 0.3 * p[:, :K]  # close to q: some drafts are accepted
    drafts = torch.multinomial(q.view(-1, V), 1, generator=g).view(B, K)
    num_draft = torch.tensor([K, 2, 0])
    uniforms = torch.rand(B, K + 1, generator=g, dtype=torch.float64)
    dev = device_for("triton_split")
    move = lambda t: None if t is None else t.to(dev)
    if mode == "greedy":
        logits = torch.randn(B, K + 1, V, generator=torch.Generator().manual_seed(1))
        logits[:, :, 8192] = logits.max() + 1  # the argmax in the last, short chunk
        drafts = logits[:, :K].argmax(-1)
        drafts[1, 1] = 0
        out = split_chain_verify(move(logits), move(drafts), None, move(num_draft), None, True, num_splits=3)
        ref = reference.chain_verify(logits, drafts, None, num_draft, None, greedy=True)
    else:
        q = q if mode == "q" else None
        out = split_chain_verify(move(p), move(drafts), move(q), move(num_draft), move(uniforms), False, num_splits=3)
        ref = reference.chain_verify(p, drafts, q, num_draft, uniforms, greedy=False)
    assert torch.equal(out[0].cpu(), ref[0]) and torch.equal(out[1].cpu(), ref[1])


# ------------------------------------------------------------------ tree attention
def attention_inputs(B, Hq, Hkv, T, S, D, prefix, seed, tree=True):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g) for shape in ((B, Hq, T, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    parents = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1, generator=g) * torch.arange(1, T)).long()])
                           for _ in range(B)])
    mask = reference.tree_mask(parents)[1] if tree else None
    return q, k, v, torch.tensor(prefix), mask


def test_split_attention_plans_two_waves_of_resident_programs_and_no_empty_split():
    """B=1, T=64, S=4096 (GQA 4): 8 splits of 512 keys, 256 programs (was 9 splits, the
    ninth empty, 288 programs in three rounds of 132)."""
    from spec_ext.kernels.tree_attention_split import SPLIT_RESIDENT, split_kv_attention
    B, Hq, Hkv, T, S, D = 1, 32, 8, 64, 4096, 128
    q, k = meta(B, Hq, T, D, dtype=torch.bfloat16), meta(B, Hkv, S, D, dtype=torch.bfloat16)
    split = planned(split_kv_attention, q, k, k, meta(B, dtype=torch.int64), meta(1, T, 2, dtype=torch.int32), 0.1)
    split = split["_split_kernel"]
    chunk, splits = arg(split, "chunk"), split.grid[1]
    assert chunk % split.meta["BLOCK_S"] == 0 and (splits - 1) * chunk < S <= splits * chunk
    wave = SPLIT_RESIDENT[90, split.meta["BLOCK_R"], 128, 2] * 132
    assert wave <= split.programs <= 2 * wave


def test_split_attention_with_s_a_multiple_of_the_chunk():
    """S = 256 asked in 3 splits: two chunks of 128 keys and no third, empty one."""
    from spec_ext.kernels.tree_attention_split import split_kv_attention
    B, Hq, Hkv, T, S, D = 2, 4, 2, 6, 256, 32
    q, k, v, prefix, mask = attention_inputs(B, Hq, Hkv, T, S, D, [250, 100], seed=3)
    launches = planned(split_kv_attention, *(t.to("meta") for t in (q, k, v, prefix, mask)), D ** -0.5, num_splits=3)
    assert launches["_split_kernel"].grid[1] == 2 and arg(launches["_split_kernel"], "chunk") == 128
    dev = device_for("triton_split")
    out = split_kv_attention(*(t.to(dev) for t in (q, k, v, prefix, mask)), D ** -0.5, num_splits=3).cpu()
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "chain"])
def test_attention_reads_tree_bits_only_where_blocks_reach_the_tree(tree):
    """Prefixes at, just before and just after a 32-key block boundary, and none: the key
    block that straddles the prefix's end still takes its bits."""
    B, Hq, Hkv, T, S, D = 4, 2, 1, 9, 110, 16
    q, k, v, prefix, mask = attention_inputs(B, Hq, Hkv, T, S, D, [64, 63, 65, 0], seed=5, tree=tree)
    dev = device_for("triton")
    out = spec_ext.tree_attention(*(None if t is None else t.to(dev) for t in (q, k, v, prefix, mask)), D ** -0.5,
                                  backend="triton").cpu()
    expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, D ** -0.5)
    assert (out.double() - expected).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_window_skips_key_blocks_far_below_every_query(backend):
    """Long prefixes and a short window: the kernels start at the first key block the window
    reaches (keys from 224 on for row 0), with softcap and sinks on; and a window past the
    start (row 1)."""
    B, Hq, Hkv, T, S, D = 2, 4, 2, 6, 300, 32
    q, k, v, prefix, mask = attention_inputs(B, Hq, Hkv, T, S, D, [250, 70], seed=9)
    sinks = torch.randn(Hq, generator=torch.Generator().manual_seed(2))
    dev = device_for(backend)
    on = [t.to(dev) for t in (q, k, v, prefix, mask, sinks)]
    for window in (7, 90):
        out = spec_ext.tree_attention(*on[:5], 0.5, window=window, softcap=4.0, sinks=on[5], backend=backend).cpu()
        expected = reference.tree_attention(q.double(), k.double(), v.double(), prefix, mask, 0.5, window, 4.0,
                                            sinks.double())
        assert (out.double() - expected).abs().max().item() <= 3e-6, window
