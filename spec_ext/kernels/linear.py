"""A row-invariant linear in Triton: ``y = x @ weight.T + bias`` for a few rows of x (a decode
step, a verification block of up to 64 rows), each row's result the same bits whatever the
number of rows in the call.

Programs run over (a block of BLOCK_N weight rows, a block of BLOCK_M rows of x); every block
size is a constant, never chosen from the row count M, and M is not specialised on (Triton
would compile another kernel for M = 1), so one compiled kernel serves every M and a row's
arithmetic does not depend on M or on its place in its block. The order of each y[m, n]: x
and the weight widened to float32, the products of one K block of BLOCK_K summed by
``tl.sum`` (one reduction tree, fixed by the compiled layout: every row and column alike),
the blocks added in rising K into a float32 accumulator, then + bias in float32, then one
rounding to x's dtype. No ``tl.dot``: its tensor-core instruction (and in the interpreter
numpy's matmul) is picked by tile shape. The weight is read from memory once per row block
(up to 4 at 64 rows; the others mostly from L2).

Opt-in (backend "triton_invariant" of :func:`spec_ext.ops.skinny_linear`,
:func:`spec_ext.ops.invariant_linear` on a GPU); tested bit-invariant in the Triton
interpreter and compiled ahead of time for sm_80/sm_90 (spec_ext/kernels/aot.py), not yet run
on a GPU.
"""
import torch
import triton
import triton.language as tl
from torch.library import triton_op

from spec_ext.kernels.launch import wrap_triton

BLOCK_M = 16
BLOCK_N = 32
BLOCK_K = 32


@triton.jit(do_not_specialize=["M"])
def _invariant_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, M, N, K, ldx, ldw,
                             HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + m.to(tl.int64)[:, None] * ldx
    w_rows = w_ptr + n.to(tl.int64)[:, None] * ldw
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + kk
        x = tl.load(x_rows + k[None, :], mask=(m[:, None] < M) & (k[None, :] < K), other=0.0).to(tl.float32)
        w = tl.load(w_rows + k[None, :], mask=(n[:, None] < N) & (k[None, :] < K), other=0.0).to(tl.float32)
        acc += tl.sum(x[:, None, :] * w[None, :, :], 2)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + n, mask=n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + m.to(tl.int64)[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


@triton_op("spec_ext_triton::skinny_linear_invariant", mutates_args=())
def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] float32 (weight float32 or bfloat16) or bfloat16 / float16 (weight of its
    dtype), weight [N, K], bias [N] or None -> [..., N] in x's dtype (see the module docstring)."""
    K, N = x.shape[-1], weight.shape[0]
    rows = x.reshape(-1, K)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    M = rows.shape[0]
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M and N:
        wrap_triton(_invariant_linear_kernel)[(triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))](
            rows, weight, y if bias is None else bias.contiguous(), y, M, N, K, rows.stride(0), weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4)
    return y.view(*x.shape[:-1], N)
