"""skinny_linear: every ISA path of the CPU kernel against float64 (within the rounding
bound of a float32 dot product), the same bits on every path, thread count and batch,
bfloat16 weights, strided inputs, the auto entry's choice and the errors."""
import os

import pytest
import torch
import torch.nn.functional as F

import spec_ext
from spec_ext import ops, reference
from spec_ext.ops.linear import FEW_ROWS, ISA_VARIABLE, LONG_K, SKINNY_BYTES, SKINNY_ROWS, uses_kernel

pytestmark = pytest.mark.skipif(not ops.registered("skinny_linear", "CPU"), reason="C++ kernels not built")

ISAS = ("portable", "avx2", "avx512")
NAMES = {"portable": "portable C++", "avx2": "AVX2 + FMA", "avx512": "AVX-512F"}
U = 2.0 ** -24  # float32's unit roundoff


def best_isa() -> str:
    saved = os.environ.pop(ISA_VARIABLE, None)
    try:
        return ops.linear.cpu_isa()
    finally:
        if saved is not None:
            os.environ[ISA_VARIABLE] = saved


def isas_here() -> list[str]:
    """The paths this CPU can run (its best and every one below)."""
    return list(ISAS[:ISAS.index(best_isa()) + 1])


def force(monkeypatch, isa: str) -> None:
    """Run the kernel on ``isa`` from now on in this test, or skip naming the ISA the CPU lacks."""
    if isa not in isas_here():
        pytest.skip(f"this CPU has no {isa} path ({NAMES[isa]} not reported by the CPU; best: {best_isa()})")
    monkeypatch.setenv(ISA_VARIABLE, isa)
    assert ops.linear.cpu_isa() == isa


def cpu(x, w, b=None):
    return spec_ext.ops.skinny_linear(x, w, b, backend="cpu")


def assert_within_rounding(y, x, w, b=None):
    """|y - exact| <= (K + 2) u (|x| |w|^T + |b|) elementwise: the bound of any float32 dot
    product of K terms (fused or not) plus the bias, against the float64 reference."""
    K = x.shape[-1]
    exact = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double())
    scale = x.double().abs() @ w.double().abs().T
    if b is not None:
        scale = scale + b.double().abs()
    bound = (K + 2) * U * scale + 1e-30
    error = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((error <= bound).all()), f"worst error / bound {(error / bound).max().item():.3g}"


def case(M, K, N, seed, bias=True, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = (torch.randn(N, K, generator=g) / max(K, 1) ** 0.5).to(dtype)
    b = torch.randn(N, generator=g) if bias else None
    return x, w, b


# (K, N): odd K and N (a K tail below one 8-wide vector, N not a multiple of any block), one
# lane vector exactly, and K long enough to be cut into chunks for 5 or more rows of x
ODD = [(7, 5), (67, 29), (8, 3), (129, 17)]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_path_matches_float64_for_1_to_32_rows(isa, dtype, monkeypatch):
    force(monkeypatch, isa)
    for M in range(1, 33):
        for K, N in ODD:
            x, w, b = case(M, K, N, seed=M * 1000 + K, bias=M % 2 == 0, dtype=dtype)
            assert_within_rounding(cpu(x, w, b), x, w, b)


@pytest.mark.parametrize("isa", ISAS)
def test_long_k_in_chunks_matches_float64(isa, monkeypatch):
    """K beyond two chunks (a tile's partial sums wait in a small buffer between chunks) for
    5-33 rows, with N over several tiles of weight rows (the last one partial) too."""
    force(monkeypatch, isa)
    for M, K, N in [(5, 3301, 7), (9, 1900, 7), (33, 777, 7), (2, 3000, 7), (16, 1100, 150), (32, 700, 97)]:
        x, w, b = case(M, K, N, seed=K, bias=True)
        y = cpu(x, w, b)
        assert_within_rounding(y, x, w, b)
        for m in range(0, M, 5):  # a row alone (one block, no chunks): the same bits
            assert torch.equal(cpu(x[m:m + 1], w, b)[0], y[m]), (M, K, N, m)


@pytest.mark.parametrize("seed", range(8))
def test_every_path_gives_the_same_bits(seed, monkeypatch):
    """AVX-512, AVX2 and the portable loop sum in one order: the same bits (random M in 1..40,
    odd K and N, chunked K, with and without bias, float32 and bfloat16 weights)."""
    here = isas_here()
    if len(here) < 2:
        pytest.skip(f"this CPU runs only the {here[0]} path: nothing to compare it with")
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 41, (1,), generator=g))
    K = 3301 if seed == 7 else int(torch.randint(1, 400, (1,), generator=g)) * 2 + 1
    N = int(torch.randint(1, 100, (1,), generator=g)) * 2 + 1
    dtype = torch.bfloat16 if seed % 4 >= 2 else torch.float32
    x, w, b = case(M, K, N, seed, bias=seed % 2 == 1, dtype=dtype)
    results = {}
    for isa in here:
        monkeypatch.setenv(ISA_VARIABLE, isa)
        results[isa] = cpu(x, w, b)
    for isa in here[1:]:
        assert torch.equal(results[isa], results["portable"]), (isa, M, K, N, dtype)
    assert_within_rounding(results["portable"], x, w, b)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16_bit_weights_give_the_bits_of_the_widened_weights(isa, dtype, monkeypatch):
    """bfloat16 -> float32 (a 16-bit shift) and float16 -> float32 are exact: the kernel on
    float32 x and a 16-bit weight is the kernel on weight.float(), bit for bit, on every path."""
    force(monkeypatch, isa)
    for M, K, N in [(1, 320, 37), (4, 33, 9), (7, 129, 13), (32, 16, 11), (6, 2000, 5)]:
        x, w, b = case(M, K, N, seed=K + N, bias=M > 3, dtype=dtype)
        assert torch.equal(cpu(x, w, b), cpu(x, w.float(), b))
        assert torch.equal(cpu(x, w, b.to(dtype) if b is not None else None),
                           cpu(x, w.float(), b.to(dtype).float() if b is not None else None))


@pytest.mark.parametrize("isa", ISAS)
def test_strided_and_non_contiguous_operands(isa, monkeypatch):
    force(monkeypatch, isa)
    g = torch.Generator().manual_seed(2)
    K, N = 41, 23
    base_x = torch.randn(6, K + 9, generator=g)
    base_w = torch.randn(N, K + 5, generator=g)
    views = [
        (base_x[:, 3:3 + K], base_w[:, 2:2 + K]),          # row strides beyond K, elements adjacent
        (torch.randn(K, 5, generator=g).T, torch.randn(K, N, generator=g).T),  # transposed
        (base_x[::2, :K], base_w[::2, :K]),               # every other row
        (base_x[:, ::2], None),                           # elements two apart (x only)
    ]
    for x, w in views:
        w = base_w[:, :x.shape[-1]] if w is None else w
        b = torch.randn(w.shape[0], generator=g)
        y = cpu(x, w, b)
        assert torch.equal(y, cpu(x.contiguous(), w.contiguous(), b))
        assert_within_rounding(y, x, w, b)
    lead = torch.randn(2, 3, 5, K, generator=g)[:, :, 1:4]  # [2, 3, 3, K], leading dims strided
    y = cpu(lead, base_w[:, :K])
    assert y.shape == (2, 3, 3, N)
    assert torch.equal(y, cpu(lead.reshape(-1, K).contiguous(), base_w[:, :K].contiguous()).view(2, 3, 3, N))


def test_empty_operands():
    w, b = torch.randn(24, 40), torch.randn(24)
    assert cpu(torch.randn(0, 40), w).shape == (0, 24)
    assert cpu(torch.randn(3, 40), w[:0]).shape == (3, 0)
    assert torch.equal(cpu(torch.randn(3, 0), torch.randn(24, 0), b), b.expand(3, 24))  # K = 0: the bias


def test_a_rows_result_does_not_depend_on_the_other_rows_or_threads():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(33, 320, generator=g), torch.randn(500, 320, generator=g)
    together = cpu(x, w)
    for m in range(33):
        assert torch.equal(cpu(x[m:m + 1], w)[0], together[m])
    for M in (1, 3, 4, 9, 32):
        assert torch.equal(cpu(x[:M], w), together[:M])
    big, rows = torch.randn(4096, 64, generator=g), x[:7, :64]  # many tasks: the threads split the weight rows
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu(rows, big)
        torch.set_num_threads(2)
        assert torch.equal(cpu(rows, big), one)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("lead,K,N", [((1,), 320, 864), ((1, 5), 320, 160), ((3,), 7, 5), ((2, 7), 193, 33),
                                      ((16,), 64, 1), ((40,), 96, 48)], ids=str)
def test_backends_match_float64(backend, lead, K, N):
    g = torch.Generator().manual_seed(K * N)
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g)
    y = spec_ext.ops.skinny_linear(x, w, b, backend=backend)
    assert y.shape == (*lead, N)
    assert_within_rounding(y.reshape(-1, N), x.reshape(-1, K), w, b)


def test_the_auto_rule():
    """uses_kernel: FEW_ROWS rows always, SKINNY_ROWS rows from SKINNY_BYTES of weights with
    rows of at most LONG_K, never more."""
    assert FEW_ROWS <= SKINNY_ROWS
    assert uses_kernel(1, 1, 1 << 20) and uses_kernel(FEW_ROWS, 1, 1 << 20)
    assert not uses_kernel(FEW_ROWS + 1, SKINNY_BYTES - 1, 64) and uses_kernel(FEW_ROWS + 1, SKINNY_BYTES, 64)
    assert uses_kernel(SKINNY_ROWS, SKINNY_BYTES, LONG_K) and not uses_kernel(SKINNY_ROWS, SKINNY_BYTES, LONG_K + 1)
    assert not uses_kernel(SKINNY_ROWS + 1, 1 << 40, 64)


@pytest.mark.parametrize("isa", ISAS)
def test_auto_takes_the_kernel_where_the_rule_says(isa, monkeypatch):
    """On every build: with AVX2 or AVX-512, auto is the kernel where uses_kernel says so and
    F.linear elsewhere (a bfloat16 weight widened for it); on the portable path (slower than
    MKL) and for float16/bfloat16 x always F.linear."""
    force(monkeypatch, isa)
    vector = isa != "portable"
    assert ops.linear.kernel_applies("cpu") == vector
    assert not ops.linear.kernel_applies("cpu", torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    small = torch.randn(64, 96, generator=g)                         # 24 KB
    large = torch.randn(SKINNY_BYTES // (4 * 96) + 1, 96, generator=g)  # just over SKINNY_BYTES
    long = torch.randn(SKINNY_BYTES // (4 * LONG_K) + 1, LONG_K + 8, generator=g)  # as large, with long rows
    for w in (small, large, large.bfloat16(), long):
        K = w.shape[1]
        for rows in (1, FEW_ROWS, FEW_ROWS + 1, SKINNY_ROWS, SKINNY_ROWS + 1):
            x = torch.randn(rows // 2, 2, K, generator=g) if rows % 2 == 0 else torch.randn(rows, K, generator=g)
            b = torch.randn(w.shape[0], generator=g)
            takes = vector and uses_kernel(rows, w.numel() * w.element_size(), K)
            expected = torch.ops.spec_ext.skinny_linear(x, w, b) if takes else F.linear(x, w.float(), b)
            assert torch.equal(spec_ext.ops.skinny_linear(x, w, b), expected), (isa, rows, tuple(w.shape), w.dtype)
    half = torch.randn(2, 96, generator=g).bfloat16()
    assert torch.equal(spec_ext.ops.skinny_linear(half, small.bfloat16()), F.linear(half, small.bfloat16()))


def test_bad_input():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight: expected \\[N, K=8\\]"):
        spec_ext.ops.skinny_linear(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="weight: expected dtype torch.float32 or torch.bfloat16 or torch.float16, "
                                         "got torch.float64"):
        spec_ext.ops.skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="weight: expected dtype torch.bfloat16, got torch.float32"):
        spec_ext.ops.skinny_linear(x.bfloat16(), w)  # float32 weights take float32 x
    with pytest.raises(ValueError, match="weight: expected 2-D"):
        spec_ext.ops.skinny_linear(x, w[None])
    with pytest.raises(ValueError, match="weight: expected device cpu"):
        spec_ext.ops.skinny_linear(x, w.to("meta"))
    with pytest.raises(ValueError, match="bias: expected shape \\(3,\\)"):
        spec_ext.ops.skinny_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="bias: expected dtype torch.float32 or torch.bfloat16, got torch.float64"):
        spec_ext.ops.skinny_linear(x, w.bfloat16(), torch.randn(3).double())
    with pytest.raises(ValueError, match="x: expected dtype"):
        spec_ext.ops.skinny_linear(x.long(), w)
    with pytest.raises(ValueError, match="x: expected 1-D or"):
        spec_ext.ops.skinny_linear(torch.tensor(1.0), w)
    with pytest.raises(ValueError, match="weight: expected dtype torch.float16, got torch.bfloat16"):
        spec_ext.ops.skinny_linear(x.half(), w.bfloat16(), backend="cpu")  # half x takes half weights
    with pytest.raises(ValueError, match="backend must be one of"):
        spec_ext.ops.skinny_linear(x, w, backend="triton")
    with pytest.raises(RuntimeError, match="expected x \\[..., K\\] and weight \\[N, K\\]"):
        torch.ops.spec_ext.skinny_linear(torch.randn(2, 8), torch.randn(3, 4), None)  # unchecked entry point
    with pytest.raises(RuntimeError, match="x float32 and weight float32, bfloat16 or float16, or x and weight both"):
        torch.ops.spec_ext.skinny_linear(x.half(), w.bfloat16(), None)


def test_an_unknown_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(ISA_VARIABLE, "sse9")
    with pytest.raises(RuntimeError, match="SPEC_EXT_CPU_ISA must be portable, avx2 or avx512, got 'sse9'"):
        cpu(torch.randn(2, 8), torch.randn(3, 8))


def choices_for(rows: int, n: int, k: int) -> list[dict]:
    return [c for c in spec_ext.ops.registry._C.skinny_linear_choices() if (c["rows"], c["n"], c["k"]) == (rows, n, k)]


def test_with_avx512_each_shape_keeps_the_path_it_timed_faster(monkeypatch):
    """Unforced on an AVX-512 CPU, a shape's first calls alternate between the AVX2 and the
    AVX-512 path, timed; later calls take the faster one. Same bits throughout."""
    if best_isa() != "avx512":
        pytest.skip(f"this CPU has no avx512 path (best: {best_isa()}): auto has one path, nothing to time")
    monkeypatch.delenv(ISA_VARIABLE, raising=False)
    M, K, N = 3, 72, 37  # a shape no other test runs
    x, w, b = case(M, K, N, seed=5)
    with monkeypatch.context() as forced:
        forced.setenv(ISA_VARIABLE, "avx2")
        expected = cpu(x, w, b)
    assert choices_for(M, N, K) == []  # a forced call times nothing
    for call in range(8):
        assert torch.equal(cpu(x, w, b), expected)
        (entry,) = choices_for(M, N, K)
        if call < 5:  # three timed trials each, alternating, before the choice
            assert entry["chosen"] == ""
    assert entry["chosen"] == ("avx512" if entry["avx512_us"] <= entry["avx2_us"] else "avx2")
    assert entry["avx2_us"] > 0 and entry["avx512_us"] > 0 and entry["weight_dtype"] == "float32"


def test_without_avx512_nothing_is_timed(monkeypatch):
    """On a CPU whose best path is AVX2 or portable (or with a path forced) a call runs that
    path untimed: no shape is ever recorded."""
    M, K, N = 2, 40, 11
    x, w, b = case(M, K, N, seed=6)
    if best_isa() == "avx512":
        monkeypatch.setenv(ISA_VARIABLE, "avx2")
    for _ in range(8):
        cpu(x, w, b)
    assert choices_for(M, N, K) == []
