"""Width invariance (docs/invariance.md): a row's or a position's result is the same bits
whatever the number of rows or positions that share the call, in float32, bfloat16 and
float16, on every ISA path of the CPU linear, on every invariant tree-attention backend and
through the lean forward with ``invariant=True``. Each width's result is compared with the
same row or query computed alone (width 1); correctness against float64 references."""
import copy
import functools
import os

import pytest
import torch
import torch.nn.functional as F

import spec_ext
from spec_ext import ops, reference
from spec_ext.ops.linear import ISA_VARIABLE, invariant_linear
from helpers import DEVICE, device_for, random_parents

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = (1, 2, 3, 5, 7, 8, 9, 16, 17, 31, 33, 63, 64)
ISAS = ("portable", "avx2", "avx512")
CPU_BUILT = ops.registered("skinny_linear", "CPU")
TRITON = spec_ext.backends()["triton"] == "available"
INTERPRETED = DEVICE == "cpu"


def best_isa() -> str:
    saved = os.environ.pop(ISA_VARIABLE, None)
    try:
        return ops.linear.cpu_isa()
    finally:
        if saved is not None:
            os.environ[ISA_VARIABLE] = saved


def no_bf16_in_the_interpreter(backend: str, dtype) -> None:
    if backend.startswith("triton") and INTERPRETED and dtype == torch.bfloat16:
        pytest.skip("the Triton interpreter has no bf16 math")


# ------------------------------------------------------------------ linear
def linear_case(K, N, dtype, weight_dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(max(WIDTHS), K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(weight_dtype)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w, b


def assert_rows_invariant(linear, x, w, b):
    """For every width M of WIDTHS, rows 0..M-1 of one call equal each row computed alone."""
    alone = torch.stack([linear(x[m:m + 1], w, b)[0] for m in range(x.shape[0])])
    for M in WIDTHS:
        together = linear(x[:M], w, b)
        assert together.dtype == x.dtype and together.shape == (M, w.shape[0])
        for m in range(M):
            assert torch.equal(together[m], alone[m]), f"width {M}, row {m}"
    return alone


def assert_close_to_float64(y, x, w, b):
    """|y - exact| within 2x the error of PyTorch's own F.linear in x's dtype (float32 sums,
    one rounding at the end in bfloat16/float16) plus a float32 floor."""
    exact = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double())
    theirs = F.linear(x, w.to(x.dtype), b)
    floor = 4 * x.shape[-1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T).max().item()
    budget = 2 * (theirs.double() - exact).abs().max().item() + floor
    error = (y.double() - exact).abs().max().item()
    assert error <= budget, (error, budget)


# (K, N): a K tail below one 8-wide vector, odd N, the bundled target's 320 -> 864, and a K
# long enough that 5 and more rows cut it into chunks
LINEAR_SHAPES = [(67, 29), (320, 864), (1100, 37)]
WEIGHTS = [(torch.float32, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
           (torch.float16, torch.float16)]


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype,weight_dtype", WEIGHTS, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("K,N", LINEAR_SHAPES, ids=str)
def test_cpu_linear_rows_are_the_same_bits_at_every_width(isa, dtype, weight_dtype, K, N, monkeypatch):
    if isa not in ISAS[:ISAS.index(best_isa()) + 1]:
        pytest.skip(f"this CPU has no {isa} path (best: {best_isa()})")
    monkeypatch.setenv(ISA_VARIABLE, isa)
    assert ops.linear.cpu_isa() == isa
    x, w, b = linear_case(K, N, dtype, weight_dtype, bias=K != 320, seed=K + N)
    alone = assert_rows_invariant(invariant_linear("cpu", dtype), x, w, b)
    assert_close_to_float64(alone, x, w, b)


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
def test_cpu_linear_paths_give_the_same_bits_in_bfloat16_and_float16(monkeypatch):
    """bfloat16 / float16 x: the portable loop, AVX2 and AVX-512 sum in one order and round
    once, so they agree bit for bit (as they do in float32)."""
    here = ISAS[:ISAS.index(best_isa()) + 1]
    if len(here) < 2:
        pytest.skip(f"this CPU runs only the {here[0]} path")
    for dtype in (torch.bfloat16, torch.float16):
        x, w, b = linear_case(1100, 37, dtype, dtype, bias=True, seed=3)
        results = []
        for isa in here:
            monkeypatch.setenv(ISA_VARIABLE, isa)
            results.append(ops.skinny_linear(x, w, b, backend="cpu"))
        assert all(torch.equal(r, results[0]) for r in results[1:]), dtype


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cpu_linear_in_half_precision_rounds_the_float32_result_once(dtype, monkeypatch):
    """bfloat16 / float16 x and weights: the bits of the float32 kernel on the widened operands
    (bias added in float32), rounded once to x's dtype."""
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    x, w, b = linear_case(131, 45, dtype, dtype, bias=True, seed=4)
    expected = ops.skinny_linear(x.float(), w.float(), b.float(), backend="cpu").to(dtype)
    assert torch.equal(ops.skinny_linear(x, w, b, backend="cpu"), expected)


@pytest.mark.skipif(not TRITON, reason="Triton cannot run here")
@pytest.mark.parametrize("dtype,weight_dtype", WEIGHTS, ids=lambda t: str(t)[6:])
def test_triton_linear_rows_are_the_same_bits_at_every_width(dtype, weight_dtype):
    no_bf16_in_the_interpreter("triton", torch.bfloat16 if torch.bfloat16 in (dtype, weight_dtype) else dtype)
    x, w, b = linear_case(67, 45, dtype, weight_dtype, bias=True, seed=5)
    x, w, b = x.to(DEVICE), w.to(DEVICE), b.to(DEVICE)
    triton_linear = functools.partial(ops.skinny_linear, backend="triton_invariant")
    alone = assert_rows_invariant(triton_linear, x, w, b)
    assert_close_to_float64(alone.cpu(), x.cpu(), w.cpu(), b.cpu())
    if DEVICE == "cuda":  # on a GPU this is the invariant linear (on CPU the C++ kernel is)
        assert torch.equal(invariant_linear(DEVICE, dtype)(x[:9], w, b), alone[:9])


def test_invariant_linear_refuses_what_it_cannot_serve():
    with pytest.raises(ValueError, match="dtype: the invariant linear takes float32, bfloat16 or float16"):
        invariant_linear("cpu", torch.float64)
    with pytest.raises(ValueError, match="device: "):
        invariant_linear("meta", torch.float32)


# ------------------------------------------------------------------ tree attention
ATTENTION_BACKENDS = [pytest.param("cpu", marks=pytest.mark.skipif(not ops.registered("tree_attention_invariant", "CPU"),
                                                                   reason="C++ kernels not built")),
                      pytest.param("cuda", marks=pytest.mark.skipif(
                          DEVICE != "cuda" or not ops.registered("tree_attention", "CUDA"),
                          reason="the cuda backend needs a GPU and the built CUDA kernels")),
                      pytest.param("triton_invariant", marks=pytest.mark.skipif(not TRITON,
                                                                                reason="Triton cannot run here"))]
FEATURES = {"plain": (0, 0.0, False), "window": (7, 0.0, False), "softcap+sinks": (0, 20.0, True),
            "all": (9, 30.0, True)}
T_MAX = 33
T_SIZES = (1, 2, 3, 5, 8, 9, 17, 33)


def attention_inputs(dtype, seed, D=36, Dv=36):
    """B=2 rows (prefixes 5 and 40), Hq=4 over Hkv=2, D=36 (a tail after 4 8-wide lanes), keys
    room for T_MAX new tokens; queries for T_MAX positions."""
    g = torch.Generator().manual_seed(seed)
    B, Hq, Hkv, S = 2, 4, 2, 40 + T_MAX + 3
    q = torch.randn(B, Hq, T_MAX, D, generator=g).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    v = torch.randn(B, Hkv, S, Dv, generator=g).to(dtype)
    sinks = torch.randn(Hq, generator=g)
    return q, k, v, torch.tensor([5, 40]), sinks, g


def attend(backend, q, k, v, prefix, mask, window, softcap, sinks):
    dev = device_for(backend)
    out = spec_ext.tree_attention(q.to(dev), k.to(dev), v.to(dev), prefix.to(dev),
                                  None if mask is None else mask.to(dev), window=window or None,
                                  softcap=softcap or None, sinks=None if sinks is None else sinks.to(dev),
                                  backend=backend, invariant=True)
    return out.cpu()


def attention_budget(dtype, q, k, v, prefix, mask, window, softcap, sinks):
    """Against the float64 reference: 3e-6 in float32 (tests/test_tree_attention.py's budget);
    else 2x the reference's own error in the dtype + a floor."""
    args = (prefix, mask, q.shape[-1] ** -0.5, window, softcap)
    exact = reference.tree_attention(q.double(), k.double(), v.double(), *args,
                                     None if sinks is None else sinks.double())
    if dtype == torch.float32:
        return exact, 3e-6
    lowp = reference.tree_attention(q, k, v, *args, sinks)
    return exact, 2 * (lowp.double() - exact).abs().max().item() + 1e-3


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_chain_queries_equal_the_same_query_alone(backend, feature, dtype):
    """Query i of a causal block of T is the same bits as a call of T = 1 at prefix + i with
    the block's earlier tokens in the cache, for T in T_SIZES."""
    no_bf16_in_the_interpreter(backend, dtype)
    window, softcap, with_sinks = FEATURES[feature]
    q, k, v, prefix, sinks, _ = attention_inputs(dtype, seed=len(feature))
    sinks = sinks if with_sinks else None
    alone = [attend(backend, q[:, :, i:i + 1], k, v, prefix + i, None, window, softcap, sinks)[:, :, 0]
             for i in range(T_MAX)]
    for T in T_SIZES:
        together = attend(backend, q[:, :, :T], k, v, prefix, None, window, softcap, sinks)
        for i in range(T):
            assert torch.equal(together[:, :, i], alone[i]), f"T={T}, query {i}"
    exact, budget = attention_budget(dtype, q, k, v, prefix, None, window, softcap, sinks)
    assert (together.double() - exact).abs().max().item() <= budget


def cut(mask, T):
    """The tree mask of the first T nodes (parents come before children: a tree again)."""
    return mask[:, :T, :(T + 31) // 32].contiguous()


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_nodes_do_not_depend_on_the_other_nodes(backend, feature, dtype):
    """Node i of a tree is the same bits in every cut of the tree that holds it, T in T_SIZES
    (the cut after it among them for the last node of each), as in the whole tree of T_MAX
    nodes (one mask per row: the rows' trees differ)."""
    no_bf16_in_the_interpreter(backend, dtype)
    window, softcap, with_sinks = FEATURES[feature]
    q, k, v, prefix, sinks, g = attention_inputs(dtype, seed=11)
    sinks = sinks if with_sinks else None
    mask = reference.tree_mask(random_parents(2, T_MAX, g))[1]
    whole = attend(backend, q, k, v, prefix, mask, window, softcap, sinks)
    for T in T_SIZES:
        together = attend(backend, q[:, :, :T], k, v, prefix, cut(mask, T), window, softcap, sinks)
        for i in range(T):
            assert torch.equal(together[:, :, i], whole[:, :, i]), f"T={T}, node {i}"
    exact, budget = attention_budget(dtype, q, k, v, prefix, mask, window, softcap, sinks)
    assert (whole.double() - exact).abs().max().item() <= budget


def compacted_path(k, v, prefix, parents, b, node):
    """Row b's keys and values with node's root-to-node path moved to prefix, prefix + 1, ...
    (as compact_kv leaves an accepted path), and the path's depth."""
    path = [node]
    while parents[b, path[-1]] >= 0:
        path.append(int(parents[b, path[-1]]))
    path.reverse()
    keys, values = k[b:b + 1].clone(), v[b:b + 1].clone()
    start = int(prefix[b])
    keys[:, :, start:start + len(path)] = k[b:b + 1, :, [start + j for j in path]]
    values[:, :, start:start + len(path)] = v[b:b + 1, :, [start + j for j in path]]
    return keys, values, len(path) - 1


@pytest.mark.parametrize("backend", [p for p in ATTENTION_BACKENDS if p.values[0] != "triton_invariant"])
@pytest.mark.parametrize("feature", ["plain", "all"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_tree_node_equals_its_path_decoded_one_token_at_a_time(backend, feature, dtype):
    """On the kernels that go key by key (cpu, cuda): a tree node over the tree is the same
    bits as the node alone (T = 1) over its accepted path compacted into the cache, what
    decoding the path one token at a time computes."""
    window, softcap, with_sinks = FEATURES[feature]
    q, k, v, prefix, sinks, g = attention_inputs(dtype, seed=12)
    sinks = sinks if with_sinks else None
    parents = random_parents(2, 17, g)
    mask = reference.tree_mask(parents)[1]
    together = attend(backend, q[:, :, :17], k, v, prefix, mask, window, softcap, sinks)
    for b in range(2):
        for node in range(17):
            keys, values, depth = compacted_path(k, v, prefix, parents, b, node)
            alone = attend(backend, q[b:b + 1, :, node:node + 1], keys, values, prefix[b:b + 1] + depth, None,
                           window, softcap, sinks)
            assert torch.equal(together[b, :, node], alone[0, :, 0]), (b, node)


@pytest.mark.skipif(not ops.registered("tree_attention_invariant", "CPU"), reason="C++ kernels not built")
def test_the_cpu_kernel_at_one_query_is_its_invariant_path():
    """The default cpu backend takes the invariant loop at T = 1 (a decode step), GEMMs from T =
    2 on: so a decode step on backend "cpu" equals the invariant kernel's query."""
    q, k, v, prefix, sinks, _ = attention_inputs(torch.float32, seed=13)
    for i in (0, 7):
        one = q[:, :, i:i + 1]
        assert torch.equal(spec_ext.tree_attention(one, k, v, prefix + i, backend="cpu"),
                           spec_ext.tree_attention(one, k, v, prefix + i, invariant=True))


def test_invariant_attention_refuses_backends_that_are_not():
    q, k, v, prefix, _, _ = attention_inputs(torch.float32, seed=14)
    for backend in ("torch", "sdpa", "triton", "triton_split"):
        with pytest.raises(ValueError, match=f"backend: '{backend}' is not width-invariant"):
            spec_ext.tree_attention(q[:, :, :3], k, v, prefix, backend=backend, invariant=True)


@pytest.mark.skipif(not ops.registered("tree_attention_invariant", "CPU"), reason="C++ kernels not built")
def test_invariant_cpu_kernel_takes_values_of_another_head_size_and_traces():
    """MLA (Dv != D) on the invariant path, and the op's fake implementation (torch.compile)."""
    q, k, v, prefix, sinks, _ = attention_inputs(torch.float32, seed=15, Dv=20)
    out = spec_ext.tree_attention(q[:, :, :5], k, v, prefix, sinks=sinks, invariant=True)
    exact, budget = attention_budget(torch.float32, q[:, :, :5], k, v, prefix, None, 0, 0.0, sinks)
    assert out.shape == (2, 4, 5, 20) and (out.double() - exact).abs().max().item() <= budget
    torch.library.opcheck(torch.ops.spec_ext.tree_attention_invariant.default,
                          (q[:, :, :3].contiguous(), k, v, prefix, None, 0.3, 2, 5.0, sinks))


# ------------------------------------------------------------------ the lean forward
def lean_forward(decoder, model, steps, rows=2, capacity=64):
    """Run ``steps`` through a fresh SpecCache of ``rows`` rows: a forward (ids [B,T],
    positions [B,T], tree mask or None) that the cache then keeps whole, or a rollback
    ("rollback", lengths). Returns each forward's (logits, hidden)."""
    from spec_ext.models import SpecCache
    cache = SpecCache.for_model(model, rows, capacity)
    outs = []
    with torch.inference_mode():
        for step in steps:
            if step[0] == "rollback":
                cache.rollback(step[1])
                continue
            ids, positions, mask = step
            outs.append(decoder(ids, cache, positions, mask, hidden=True))
            cache.advance([ids.shape[1]] * rows)
    return outs


def one_at_a_time(ids, positions):
    """The forwards that feed [B,T] tokens one position at a time."""
    return [(ids[:, j:j + 1], positions[:, j:j + 1], None) for j in range(ids.shape[1])]


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral_window"])
def test_lean_invariant_forward_gives_a_position_the_same_logits_alone_or_in_a_block(kind, dtype):
    """A prompt of 7 tokens fed at once, then (rows cut back to 7 and 4: a ragged batch) a
    verification block of 6: every position's logits and hidden state are the bits of
    feeding the same tokens one at a time (qwen2: biased projections; qwen3: q/k norms;
    mistral_window: a window of 5, passed by the block)."""
    from spec_ext.models.lean import LeanDecoder
    from test_lean import lean_model
    model = lean_model(kind).to(dtype)
    decoder = LeanDecoder(model, invariant=True)
    g = torch.Generator().manual_seed(0)
    prompt, block = torch.randint(0, 61, (2, 7), generator=g), torch.randint(0, 61, (2, 6), generator=g)
    cut = torch.tensor([7, 4])
    block_positions = cut[:, None] + torch.arange(6)
    rollback = ("rollback", cut.tolist())
    at_once = lean_forward(decoder, model, [(prompt, torch.arange(7).expand(2, 7), None), rollback,
                                            (block, block_positions, None)])
    singly = lean_forward(decoder, model, one_at_a_time(prompt, torch.arange(7).expand(2, 7)) + [rollback] +
                          one_at_a_time(block, block_positions))
    for j in range(7):
        assert torch.equal(at_once[0][0][:, j], singly[j][0][:, 0]), f"prompt position {j}"
        assert torch.equal(at_once[0][1][:, j], singly[j][1][:, 0])
    for j in range(6):
        assert torch.equal(at_once[1][0][:, j], singly[7 + j][0][:, 0]), f"block position {j}"
        assert torch.equal(at_once[1][1][:, j], singly[7 + j][1][:, 0])
    assert at_once[1][0].dtype == torch.float32


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_lean_invariant_tree_verification_equals_decoding_each_path(dtype):
    """A tree of 7 nodes verified in one forward: each node's logits are the bits of decoding
    its root-to-node path one token at a time (what the accepted path's plain decoding gives)."""
    from spec_ext.models.lean import LeanDecoder
    from test_lean import lean_model
    model = lean_model("llama").to(dtype)
    decoder = LeanDecoder(model, invariant=True)
    g = torch.Generator().manual_seed(1)
    parents = [-1, 0, 0, 1, 2, 2, 5]
    tree = spec_ext.build_tree(parents)
    prompt, nodes = torch.randint(0, 61, (1, 5), generator=g), torch.randint(0, 61, (1, 7), generator=g)
    lengths = torch.tensor([5])
    prefill = (prompt, torch.arange(5)[None], None)
    verified = lean_forward(decoder, model, [prefill, (nodes, tree.positions(lengths), tree.mask)], rows=1)[1]
    for node in range(7):
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        ids = nodes[:, path]
        decoded = lean_forward(decoder, model, [prefill] + one_at_a_time(ids, 5 + torch.arange(len(path))[None]),
                               rows=1)
        assert torch.equal(verified[0][:, node], decoded[-1][0][:, 0]), node


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
def test_lean_invariant_forward_is_close_to_the_hf_forward():
    """The invariant forward computes the model: within float32 rounding of the plain lean
    forward, which is the HF forward's bits (tests/test_lean.py)."""
    from spec_ext.models import SpecCache
    from spec_ext.models.lean import LeanDecoder
    from test_lean import lean_model
    model = lean_model("qwen3")
    ids = torch.randint(0, 61, (2, 9), generator=torch.Generator().manual_seed(2))
    positions = torch.arange(9).expand(2, 9)
    with torch.inference_mode():
        expected = LeanDecoder(model)(ids, SpecCache.for_model(model, 2, 16), positions)
        logits = LeanDecoder(model, invariant=True)(ids, SpecCache.for_model(model, 2, 16), positions)
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_lean_invariant_needs_an_invariant_linear(monkeypatch):
    from spec_ext.models.lean import LeanDecoder, prepare
    from test_lean import lean_model
    model = lean_model("llama")
    with pytest.raises(ValueError, match="invariant: expected True or False"):
        prepare(model, invariant="yes")
    monkeypatch.setattr(ops.linear, "_invariant", lambda device: ops.checks.fail("device", "none here"))
    with pytest.raises(ValueError, match="device: none here"):
        LeanDecoder(model, invariant=True)


@pytest.mark.skipif(not ops.registered("tree_attention_invariant", "CPU"), reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_invariant_cpu_kernel_gives_the_same_bits_on_every_isa_path(dtype, monkeypatch):
    """The scores come from skinny_linear's kernel (the same bits on every path) and the softmax
    loop is built for the baseline target and for AVX2, neither fusing a multiply-add: forcing
    SPEC_EXT_CPU_ISA=portable changes no bit (with a window, softcap and sinks)."""
    if best_isa() == "portable":
        pytest.skip("this CPU runs only the portable path")
    q, k, v, prefix, sinks, g = attention_inputs(dtype, seed=16)
    mask = reference.tree_mask(random_parents(2, 9, g))[1]
    results = []
    for isa in ("portable", best_isa()):
        monkeypatch.setenv(ISA_VARIABLE, isa)
        results.append(attend("cpu", q[:, :, :9], k, v, prefix, mask, 9, 30.0, sinks))
    assert torch.equal(results[0], results[1])


# ------------------------------------------------------------------ every architecture, end to end
def hf_forwards(model, steps, rows=2, capacity=64):
    """As :func:`lean_forward`, through :func:`spec_ext.models.forward` inside an invariant
    block (the HF modules, or the lean forward for the models it takes)."""
    from spec_ext.models import SpecCache, attention_implementation, forward
    cache = SpecCache.for_model(model, rows, capacity)
    outs = []
    with torch.inference_mode(), attention_implementation(model, invariant=True):
        for step in steps:
            if step[0] == "rollback":
                cache.rollback(step[1])
                continue
            ids, positions, mask = step
            outs.append(forward(model, ids, cache, positions, mask).logits)
            cache.advance([ids.shape[1]] * rows)
    return outs


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", __import__("test_architectures").ARCHITECTURES)
def test_every_architectures_invariant_forward_gives_a_position_the_same_logits_alone_or_in_a_block(kind, dtype):
    """The HF modules (and the lean forward where it applies) with ``invariant=True``: a ragged
    verification block of 9 after a prompt of 7 (rows cut back to 7 and 4) gives every
    position the logits of feeding its tokens one at a time, bit for bit (mixtures of experts,
    MLA, sinks, soft-caps, windows, Conv1D, GELU, rotary), and a tree's nodes those of their
    paths decoded alone."""
    from test_architectures import sharpened_model
    model = sharpened_model(kind).to(dtype)
    g = torch.Generator().manual_seed(0)
    prompt, block = torch.randint(3, 61, (2, 7), generator=g), torch.randint(3, 61, (2, 9), generator=g)
    cut = torch.tensor([7, 4])
    block_positions = cut[:, None] + torch.arange(9)
    rollback = ("rollback", cut.tolist())
    at_once = hf_forwards(model, [(prompt, torch.arange(7).expand(2, 7), None), rollback,
                                  (block, block_positions, None)])
    singly = hf_forwards(model, one_at_a_time(prompt, torch.arange(7).expand(2, 7)) + [rollback] +
                         one_at_a_time(block, block_positions))
    for j in range(9):
        assert torch.equal(at_once[1][:, j], singly[7 + j][:, 0]), f"block position {j}"
    parents = [-1, 0, 0, 1, 2, 2, 5]
    tree = spec_ext.build_tree(parents)
    nodes = torch.randint(3, 61, (1, 7), generator=g)
    prefill = (prompt[:1, :5], torch.arange(5)[None], None)
    verified = hf_forwards(model, [prefill, (nodes, tree.positions(torch.tensor([5])), tree.mask)], rows=1)[1]
    for node in (3, 6):  # two leaves, on either branch
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        path.reverse()
        decoded = hf_forwards(model, [prefill] + one_at_a_time(nodes[:, path], 5 + torch.arange(len(path))[None]),
                              rows=1)
        assert torch.equal(verified[:, node], decoded[-1][:, 0]), node


def plain_and_speculative(target, draft, prompts, policy, new=20, **kwargs):
    plain = spec_ext.generate(target, None, prompts, max_new_tokens=new, eos_token_id=[], policy="plain", **kwargs)
    out = spec_ext.generate(target, draft, prompts, max_new_tokens=new, eos_token_id=[], policy=policy, **kwargs)
    return plain.sequences, out


RAGGED = [[5, 17, 33, 8, 9, 10, 11], [40, 3], [7, 21, 50, 4]]


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", __import__("test_architectures").ARCHITECTURES)
def test_on_every_architecture_greedy_speculation_is_bit_identical_to_plain_decoding(kind, dtype):
    """``invariant=True``, a ragged batch: chains (Fixed) and trees (DynamicTree) from a draft
    model give exactly ``Plain()``'s tokens, drafts accepted."""
    from spec_ext.policies import DynamicTree, Fixed
    from test_architectures import sharpened_model
    from helpers import perturbed
    target = sharpened_model(kind).to(dtype)
    draft = perturbed(target, 0.01, seed=1)
    for policy in (Fixed(4), DynamicTree(depth=3, top_k=3, nodes=8)):
        plain, out = plain_and_speculative(target, draft, RAGGED, policy, invariant=True)
        assert torch.equal(out.sequences, plain), policy
        assert out.stats.accepted > 0, policy


@pytest.mark.skipif(not CPU_BUILT, reason="C++ kernels not built")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_policy_and_drafter_is_bit_identical_to_plain_decoding(dtype, tmp_path_factory):
    """Llama (the lean forward) with a draft model under every serial and parallel policy, an
    EAGLE-3 head, a DFlash block and the text; glm4_moe (the HF modules) with its MTP layers:
    ``invariant=True`` greedy output equals ``Plain()``'s, bit for bit, in bfloat16 and float16
    (without it, llama's bfloat16 chains part from plain decoding at a near-tie)."""
    import test_mtp
    from spec_ext.policies import (SVIP, Adaptive, Auto, Confidence, DynamicTree, Fixed, Heuristic, NGram, PEARL,
                                   Suffix, SuffixCache, Tree)
    from test_architectures import sharpened_model
    from test_dflash import random_dflash
    from test_heads import echo_head
    from helpers import perturbed
    target = sharpened_model("llama").to(dtype)
    draft = perturbed(target, 0.01, seed=1)
    cases = [(draft, p) for p in (Fixed(4), Auto(), Adaptive(), Heuristic(), Confidence(), SVIP(), Tree(),
                                  DynamicTree(depth=3, top_k=3, nodes=8), PEARL(gamma=2), NGram())]
    full = copy.deepcopy(target).float()  # (.float() and .to() convert a module in place)
    cases += [(echo_head(full, noise=0.05).to(dtype), p) for p in (Fixed(3), DynamicTree(depth=3, top_k=3))]
    cases += [(random_dflash(full, scale=0.3).to(dtype), p) for p in (Fixed(), Adaptive(tree=Tree()))]
    cases += [(None, NGram()), (None, Suffix(SuffixCache()))]
    for drafter, policy in cases:
        plain, out = plain_and_speculative(target, drafter, RAGGED, policy, invariant=True)
        assert torch.equal(out.sequences, plain), (type(drafter).__name__, policy)
    test_mtp._TMP[:] = [tmp_path_factory]
    with_mtp, _ = test_mtp.target_with_mtp("glm4_moe", 2)
    with_mtp = copy.deepcopy(with_mtp).to(dtype)  # the target test_mtp keeps for its own tests
    for policy in (Fixed(), DynamicTree(depth=3, top_k=3, nodes=8)):
        plain, out = plain_and_speculative(with_mtp, "mtp", RAGGED, policy, invariant=True)
        assert torch.equal(out.sequences, plain), ("mtp", policy)


def test_generate_takes_invariant_where_measured_no_slower_and_refuses_bad_values():
    """None (the default): on for a float16 target on the CPU's lean forward, off elsewhere."""
    from spec_ext.engine.generate import _invariant
    from test_architectures import sharpened_model
    llama = sharpened_model("llama")
    assert _invariant(None, llama.half()) is CPU_BUILT and _invariant(None, llama.float()) is False
    assert _invariant(None, llama.bfloat16()) is False and _invariant(None, sharpened_model("gpt2").half()) is False
    with pytest.raises(ValueError, match="invariant: expected True, False or None, got 'yes'"):
        spec_ext.generate(llama.float(), None, [[1, 2]], policy="plain", invariant="yes")
