"""skinny_linear: the CPU kernel against the float64 reference (with a budget relative to
F.linear's own float32 error), its row invariance, its dispatch rule and its errors."""
import pytest
import torch
import torch.nn.functional as F

import spec_ext
from spec_ext import ops, reference

pytestmark = pytest.mark.skipif(not ops.registered("skinny_linear", "CPU"), reason="C++ kernels not built")

SHAPES = [  # leading dims of x, K, N
    ((1,), 320, 864),     # a decode step of the bundled target's MLP
    ((1, 5), 320, 160),   # a verification block
    ((3,), 7, 5),         # K below one 16-lane vector: all tail, odd N
    ((3,), 17, 5),        # one vector and a tail of 1
    ((2, 7), 193, 33),    # 14 rows: two register blocks, a K tail
    ((16,), 64, 1),
    ((40,), 96, 48),      # more rows than the auto path sends to the kernel
]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("lead,K,N", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_reference(backend, lead, K, N, with_bias):
    g = torch.Generator().manual_seed(K * N)
    x = torch.randn(*lead, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if with_bias else None
    y = spec_ext.ops.skinny_linear(x, w, b, backend=backend)
    exact = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double())
    assert y.shape == (*lead, N) and y.dtype == torch.float32
    mkl_error = (F.linear(x, w, b).double() - exact).abs().max().item()
    assert (y.double() - exact).abs().max().item() <= 4 * mkl_error + 1e-6


def test_non_contiguous_operands_and_no_rows():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 6, generator=g)[:, ::2].T  # [3, 40], strided
    w = torch.randn(40, 24, generator=g).T         # [24, 40], transposed
    assert not x.is_contiguous() and not w.is_contiguous()
    y = spec_ext.ops.skinny_linear(x, w, backend="cpu")
    torch.testing.assert_close(y, spec_ext.ops.skinny_linear(x.contiguous(), w.contiguous(), backend="cpu"),
                               rtol=0, atol=0)
    torch.testing.assert_close(y.double(), reference.skinny_linear(x.double(), w.double(), None), rtol=1e-5, atol=1e-5)
    assert spec_ext.ops.skinny_linear(torch.randn(0, 40), w, backend="cpu").shape == (0, 24)


def test_a_rows_result_does_not_depend_on_the_other_rows():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(9, 320, generator=g), torch.randn(500, 320, generator=g)
    together = spec_ext.ops.skinny_linear(x, w, backend="cpu")
    for m in range(9):
        assert torch.equal(spec_ext.ops.skinny_linear(x[m:m + 1], w, backend="cpu")[0], together[m])


def test_auto_takes_the_kernel_for_few_rows_and_f_linear_beyond():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g)
    few, many = torch.randn(2, 8, 96, generator=g), torch.randn(ops.SKINNY_ROWS + 1, 96, generator=g)
    assert torch.equal(spec_ext.ops.skinny_linear(many, w), F.linear(many, w))
    expected = torch.ops.spec_ext.skinny_linear(few, w, None) if ops.linear.kernel_applies("cpu") else F.linear(few, w)
    assert torch.equal(spec_ext.ops.skinny_linear(few, w), expected)
    half = few.to(torch.bfloat16)
    assert torch.equal(spec_ext.ops.skinny_linear(half, w.to(torch.bfloat16)), F.linear(half, w.to(torch.bfloat16)))


def test_bad_input():
    x, w = torch.randn(2, 8), torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight: expected \\[N, K=8\\]"):
        spec_ext.ops.skinny_linear(x, torch.randn(3, 7))
    with pytest.raises(ValueError, match="weight: expected dtype"):
        spec_ext.ops.skinny_linear(x, w.double())
    with pytest.raises(ValueError, match="bias: expected shape"):
        spec_ext.ops.skinny_linear(x, w, torch.randn(4))
    with pytest.raises(ValueError, match="x: backend='cpu' takes float32"):
        spec_ext.ops.skinny_linear(x.half(), w.half(), backend="cpu")
    with pytest.raises(ValueError, match="backend must be one of"):
        spec_ext.ops.skinny_linear(x, w, backend="triton")
    with pytest.raises(RuntimeError, match="expected x \\[..., K\\] and weight \\[N, K\\]"):
        torch.ops.spec_ext.skinny_linear(torch.randn(2, 8), torch.randn(3, 4), None)  # unchecked entry point


ISAS = ("portable", "avx2", "avx512")


def isas_here() -> list[str]:
    """The paths this CPU can run (each one below its best); a path it lacks is reported
    by the skip of the test that needs it."""
    import os
    saved = os.environ.pop("SPEC_EXT_CPU_ISA", None)
    try:
        best = ops.linear.cpu_isa()
    finally:
        if saved is not None:
            os.environ["SPEC_EXT_CPU_ISA"] = saved
    return list(ISAS[:ISAS.index(best) + 1])


@pytest.mark.parametrize("seed", range(6))
def test_every_isa_path_gives_the_same_bits(seed, monkeypatch):
    """AVX-512, AVX2 and the portable loop sum in one order: a row's result is the same bits
    on every machine (random M in 1..48, odd K and N, with and without bias)."""
    here = isas_here()
    if len(here) < 2:
        pytest.skip(f"this CPU runs only the {here[0]} path: nothing to compare it with")
    g = torch.Generator().manual_seed(seed)
    M = int(torch.randint(1, 49, (1,), generator=g))
    K, N = (int(v) * 2 + 1 for v in torch.randint(1, 200, (2,), generator=g))
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if seed % 2 else None
    results = {}
    for isa in here:
        monkeypatch.setenv("SPEC_EXT_CPU_ISA", isa)
        assert ops.linear.cpu_isa() == isa
        results[isa] = spec_ext.ops.skinny_linear(x, w, b, backend="cpu")
    for isa in here[1:]:
        assert torch.equal(results[isa], results["portable"]), (isa, M, K, N)
    exact = reference.skinny_linear(x.double(), w.double(), None if b is None else b.double())
    assert (results["portable"].double() - exact).abs().max() <= 4 * (F.linear(x, w, b).double() - exact).abs().max()


@pytest.mark.parametrize("isa", ISAS)
def test_each_isa_can_be_forced(isa, monkeypatch):
    if isa not in isas_here():
        pytest.skip(f"this CPU has no {isa} path")
    monkeypatch.setenv("SPEC_EXT_CPU_ISA", isa)
    assert ops.linear.cpu_isa() == isa
    # auto takes the kernel on the vector paths only: the portable loop is slower than MKL
    assert ops.linear.kernel_applies("cpu") == (isa != "portable")
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    expected = torch.ops.spec_ext.skinny_linear(x, w, None) if isa != "portable" else F.linear(x, w)
    assert torch.equal(spec_ext.ops.skinny_linear(x, w), expected)


def test_an_unknown_isa_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SPEC_EXT_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="SPEC_EXT_CPU_ISA must be portable, avx2 or avx512, got 'sse9'"):
        spec_ext.ops.skinny_linear(torch.randn(2, 8), torch.randn(3, 8), backend="cpu")
