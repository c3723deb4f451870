"""skinny_linear: ``x @ weight.T + bias`` for the few token rows of a decode step or a
verification block, on CPU; :func:`invariant_linear`, the linear whose every row's result is
the same bits whatever the number of rows in the call (docs/invariance.md)."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.registry import _C
from spec_ext.ops.checks import FLOAT_TYPES, check_shape, check_tensor, fail

# Where backend="auto" takes the CPU kernel (float32 x, AVX2 + FMA or AVX-512): up to FEW_ROWS
# rows of x always; up to SKINNY_ROWS rows when the weight is at least SKINNY_BYTES (read from
# memory, not from a core's L2) and its rows are at most LONG_K floats. Measured by
# benchmarks/bench_linear.py (benchmarks/results/linear_cpu.csv; AMD EPYC, AVX2, one thread, a
# loaded machine, load 2.3-2.5), kernel over F.linear, float32 / bfloat16 weights: 1-16 rows 1.04-8x
# on every shape but 16384 -> 320 at 1 row (0.98x); 32 rows: 1.07-1.19x on the
# 5-21 MB weights with short rows (320 -> 4096, 320 -> 16384), but 0.82-0.92x where the weight
# is in cache (1.1 MB) or its rows are long (16384 -> 320: 0.93-0.98x, MKL wins there).
# LONG_K: past it, 17-32 rows stay on F.linear: the kernel cuts long rows into K chunks (since
# issue 49 per tile of a few register blocks, the partial sums M x tile x 8 floats, not growing
# with N), but at 32 rows over long rows it measured 0.85-0.98x F.linear before that change.
FEW_ROWS = 16
SKINNY_ROWS = 32
SKINNY_BYTES = 4 << 20
LONG_K = 512


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "auto",
                  validate: bool | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a few rows of x (a decode step, a verification block):
    what ``torch.nn.functional.linear`` computes, faster on CPU for up to ``SKINNY_ROWS``
    rows of x in all (see ``FEW_ROWS`` and ``SKINNY_BYTES`` for where ``auto`` takes it).

    The CPU kernel (csrc/cpu/skinny_linear.cpp) reads each weight once for all rows of x (a
    register block of up to 4 rows of x times 3-8 weight rows, 8 rows on AVX-512; a long K is
    cut into chunks, tile by tile of weight rows, so that every row block reuses the weight
    vectors loaded for the first, while it prefetches the weights that come next), on AVX-512, AVX2 +
    FMA (+ F16C) or portable C++ (``cpu_isa``; ``SPEC_EXT_CPU_ISA`` forces a lower one). With
    float32 x, weights may be float32, bfloat16 or float16 (x and the sums stay float32;
    bfloat16 and float16 -> float32 are exact, so such a weight gives the same bits as
    ``weight.float()``, reading half the bytes); bfloat16 or float16 x takes weights of its own
    dtype: both widen exactly to float32, the sums and the bias are float32, and y is rounded
    once to x's dtype.

    Rounding: each y[m, n] is one dot product in a fixed order, the same on every path,
    thread count and batch: 8 interleaved float32 partial sums over k (lane j takes the k
    with k mod 8 = j below K - K mod 8, one fused multiply-add each, k rising), added as a
    tree (j + j+4, j + j+2, 0 + 1), then the last K mod 8 terms fused in order, then + bias
    in float32, then (bfloat16/float16 x) one rounding to x's dtype.
    So a row's result does not depend on the other rows with it (the contract
    :func:`invariant_linear` rests on), and is the same bits on
    every machine, but not MKL's bits: F.linear sums in its own (blocked, shape-dependent)
    order. Both are float32 dot products; they differ by float32 rounding, typically a few
    units in the last place of the larger terms (|error| up to about K * 2^-24 * sum |w x|
    in the worst case, ~sqrt(K) of that in practice). A model run on it (the lean forward's
    ``fast_linear``, "auto" by default in generate/accelerate) gives logits within ~1e-5 of
    HF's; greedy decoding picks the same tokens unless two logits tie within that rounding
    (none on the bundled pair's held-out prompts). ``fast_linear=False`` keeps HF's own
    arithmetic (F.linear) for the target; the draft's rounding never reaches the output.

    Args:
        x: [..., K] float32, bfloat16 or float16 ("auto" sends bfloat16 and float16 to F.linear).
        weight: [N, K], x's dtype, or bfloat16 / float16 with float32 x. bias: [N] (x's or the
            weight's dtype) or None.
        backend: "auto" (the kernel where it applies: CPU, float32 x, AVX2 or AVX-512, at
            most ``FEW_ROWS`` rows, or ``SKINNY_ROWS`` for a weight of ``SKINNY_BYTES`` or
            more with K at most ``LONG_K``: :func:`uses_kernel`; F.linear otherwise), "cpu"
            (the kernel, any row count, any ISA path, every dtype above), "triton_invariant"
            (spec_ext/kernels/linear.py: a fixed-order Triton linear, row-invariant, not yet
            run on a GPU; see :func:`invariant_linear`) or "torch" (the float64 reference).
        validate: False skips every check (a model forward calls this per layer).
    Returns:
        [..., N] in x's dtype.

    Example:
        >>> w = torch.randn(864, 320); x = torch.randn(1, 5, 320)
        >>> y = skinny_linear(x, w)         # [1, 5, 864], close to F.linear(x, w)
    """
    if registry.checking(validate):
        _check(x, weight, bias, backend)
    if backend == "auto":
        return _auto(x.device, x.dtype, os.environ.get(ISA_VARIABLE))(x, weight, bias)
    return registry.kernel("skinny_linear", backend, x.device)(x, weight, bias)


def uses_kernel(rows: int, weight_bytes: int, K: int) -> bool:
    """The rule ``auto`` follows where the kernel can run: whether x with ``rows`` rows in
    all and a weight [N, K] of ``weight_bytes`` take it (else F.linear)."""
    return rows <= FEW_ROWS or (rows <= SKINNY_ROWS and weight_bytes >= SKINNY_BYTES and K <= LONG_K)


def cpu_isa() -> str | None:
    """The instruction set of the CPU kernel: "avx512", "avx2" (with FMA) or "portable"
    (the best this CPU has, or a lower one named by the environment variable
    ``SPEC_EXT_CPU_ISA``, read at every call: a path above the CPU's best gives its best);
    None without the built extension. The three paths give the same bits."""
    return _C.skinny_linear_isa() if registry.registered("skinny_linear", "CPU") else None


def kernel_applies(device: torch.device | str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``backend="auto"`` runs the kernel (for the rows :func:`uses_kernel` gives)
    for x on ``device`` in ``dtype``, rather than F.linear: CPU float32 with AVX2 + FMA or
    AVX-512 (the portable path is correct but slower than MKL)."""
    return auto_linear(torch.device(device), dtype) is not _f_linear


def auto_linear(device: torch.device, dtype: torch.dtype):
    """``(x, weight, bias) -> y``: what ``skinny_linear(..., backend="auto", validate=False)``
    runs for x on ``device`` in ``dtype`` with the ``SPEC_EXT_CPU_ISA`` of now, for a model
    forward to take once and call per layer (reading the environment per layer cost 3% of a
    decode round of the bundled pair)."""
    return _auto(device, dtype, os.environ.get(ISA_VARIABLE))


ISA_VARIABLE = "SPEC_EXT_CPU_ISA"

INVARIANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def invariant_linear(device: torch.device | str, dtype: torch.dtype):
    """``(x, weight, bias) -> y``, unchecked: ``x @ weight.T + bias`` whose every row is the same
    bits whatever the number of rows in the call (1, k+1, 64 or more) and whatever rows come
    with it: a verification block's row equals the same row computed alone in a decode step.
    F.linear is not (MKL and oneDNN pick their algorithm, and so their order of summation, by
    the row count); this is the fixed-order kernel at every row count, never F.linear.

    On CPU: skinny_linear's kernel (backend "cpu": every ISA path gives the same bits, so a
    row's result is also the same on every x86-64 machine); x float32 with weights float32,
    bfloat16 or float16, or x bfloat16 / float16 with weights of its dtype; float32 sums, the bias added
    in float32, y rounded once to x's dtype. Costs what skinny_linear costs at that row count
    (docs/invariance.md, one thread: float32 what auto costs up to 16 rows, 0.6-1.0x at 17-33,
    1.1-1.3x at 64; bfloat16 0.3-0.9x F.linear up to 8 rows, 2-4x at 64; float16 0.2-0.5x
    F.linear from 2 rows on). On a
    GPU: the Triton kernel of spec_ext/kernels/linear.py (backend "triton_invariant": float32
    sums over K in blocks in a fixed order, same dtypes), tested bit-invariant in the Triton
    interpreter and compiled ahead of time for sm_80/sm_90, not yet run on a GPU.

    Args:
        device: where x and the weights are; dtype: x's dtype, float32, bfloat16 or float16.
    Returns:
        the function; it takes x [..., K], weight [N, K], bias [N] or None and returns [..., N]
        in x's dtype. ValueError naming ``device`` where there is no invariant kernel (a CPU
        without the built extension, a GPU without Triton), or ``dtype`` for another dtype.

    Example:
        >>> linear = invariant_linear("cpu", torch.bfloat16)
        >>> w = torch.randn(864, 320).bfloat16(); x = torch.randn(5, 320).bfloat16()
        >>> torch.equal(linear(x, w, None)[3], linear(x[3:4], w, None)[0])
        True
    """
    device = torch.device(device)
    if dtype not in INVARIANT_DTYPES:
        fail("dtype", f"the invariant linear takes float32, bfloat16 or float16 x, got {dtype}")
    return _invariant(device)


@functools.lru_cache(None)
def _invariant(device: torch.device):
    if device.type == "cpu":
        if not registry.registered("skinny_linear", "CPU"):
            fail("device", f"the invariant linear on CPU is skinny_linear's C++ kernel: {registry.backends()['cpu']}")
        return registry.kernel("skinny_linear", "cpu", device)
    if device.type != "cuda":
        fail("device", f"the invariant linear runs on CPU (C++) or CUDA (Triton), got {device}")
    try:
        registry.resolve("skinny_linear", "triton_invariant", device)
    except ValueError as error:
        fail("device", f"no invariant linear on {device}: its Triton kernel cannot run ({error})")
    return registry.kernel("skinny_linear", "triton_invariant", device)


def _f_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear, with a bfloat16 weight (and bias) widened to x's dtype first."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if bias is not None and bias.dtype != x.dtype:
        bias = bias.to(x.dtype)
    return F.linear(x, weight, bias)


@functools.lru_cache(None)
def _auto(device: torch.device, dtype: torch.dtype, forced_isa: str | None):
    if (dtype != torch.float32 or registry.resolve("skinny_linear", "auto", device) != "cpu"
            or cpu_isa() not in ("avx512", "avx2")):
        return _f_linear
    kernel = registry.kernel("skinny_linear", "cpu", device)
    few, most, least, long = FEW_ROWS, SKINNY_ROWS, SKINNY_BYTES, LONG_K

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        size = x.numel()  # uses_kernel, inlined (a call per layer)
        K = x.shape[-1]
        if size <= few * K or (size <= most * K and K <= long and weight.numel() * weight.element_size() >= least):
            return kernel(x, weight, bias)
        return _f_linear(x, weight, bias)

    return linear


def _check(x, weight, bias, backend) -> None:
    check_tensor("x", x, tuple(range(1, 8)), FLOAT_TYPES)
    weight_types = (torch.float32, torch.bfloat16, torch.float16) if x.dtype == torch.float32 else (x.dtype,)
    check_tensor("weight", weight, 2, weight_types, x.device)
    if weight.shape[1] != x.shape[-1]:
        fail("weight", f"expected [N, K={x.shape[-1]}] (K = x's last dim), got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, tuple(dict.fromkeys((x.dtype, weight.dtype))), x.device)
        check_shape("bias", bias, (weight.shape[0],))
    registry.resolve("skinny_linear", backend, x.device)  # ValueError naming backend
