"""skinny_linear: ``x @ weight.T + bias`` for the few token rows of a decode step or a
verification block, on CPU."""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.registry import _C
from spec_ext.ops.checks import FLOAT_TYPES, check_shape, check_tensor, fail

SKINNY_ROWS = 48  # up to this many rows the CPU kernel beats MKL (benchmarks/results/kernels_cpu.csv)


def skinny_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, backend: str = "auto",
                  validate: bool | None = None) -> Tensor:
    """``x @ weight.T + bias`` for a few rows of x (a decode step, a verification block):
    what ``torch.nn.functional.linear`` computes, faster on CPU when x has at most
    ``SKINNY_ROWS`` rows in all. The CPU kernel streams each weight row once for every row
    of x (MKL packs cold weights first and reads them at a quarter of the speed here); it
    sums in a fixed order, so a row's result is the same bits whatever other rows come with
    it, but not the same bits as MKL's (float32 rounding apart).

    Args:
        x: [..., K] float32 (float16 and bfloat16 go to F.linear).
        weight: [N, K], same dtype and device. bias: [N] or None.
        backend: "auto" (the kernel where it applies: CPU, float32, AVX2 or AVX-512, at most
            ``SKINNY_ROWS`` rows; F.linear otherwise), "cpu" (the kernel, any row count)
            or "torch" (the float64 reference).
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


def cpu_isa() -> str | None:
    """The instruction set of the CPU kernel: "avx512", "avx2" (with FMA) or "portable"
    (the best this CPU has, or a lower one named by the environment variable
    ``SPEC_EXT_CPU_ISA``, read at every call); None without the built extension. The
    three paths give the same bits."""
    return _C.skinny_linear_isa() if registry.registered("skinny_linear", "CPU") else None


def kernel_applies(device: torch.device | str, dtype: torch.dtype = torch.float32) -> bool:
    """Whether ``backend="auto"`` runs the kernel (up to ``SKINNY_ROWS`` rows) for x on
    ``device`` in ``dtype``, rather than F.linear: CPU float32 with AVX2 + FMA or AVX-512
    (the portable path is correct but slower than MKL)."""
    return _auto(torch.device(device), dtype, os.environ.get(ISA_VARIABLE)) is not F.linear


ISA_VARIABLE = "SPEC_EXT_CPU_ISA"


@functools.lru_cache(None)
def _auto(device: torch.device, dtype: torch.dtype, forced_isa: str | None):
    if (dtype != torch.float32 or registry.resolve("skinny_linear", "auto", device) != "cpu"
            or cpu_isa() not in ("avx512", "avx2")):
        return F.linear
    kernel = registry.kernel("skinny_linear", "cpu", device)

    def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
        return kernel(x, weight, bias) if x.numel() <= SKINNY_ROWS * x.shape[-1] else F.linear(x, weight, bias)

    return linear


def _check(x, weight, bias, backend) -> None:
    check_tensor("x", x, tuple(range(1, 8)), FLOAT_TYPES)
    check_tensor("weight", weight, 2, (x.dtype,), x.device)
    if weight.shape[1] != x.shape[-1]:
        fail("weight", f"expected [N, K={x.shape[-1]}] (K = x's last dim), got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor("bias", bias, 1, (x.dtype,), x.device)
        check_shape("bias", bias, (weight.shape[0],))
    if backend != "auto" and registry.resolve("skinny_linear", backend, x.device) == "cpu" \
            and x.dtype != torch.float32:
        fail("x", f"backend='cpu' takes float32, got {x.dtype}")
