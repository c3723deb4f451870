"""KV-cache rollback: move accepted positions of every layer's cache in one launch."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.checks import FLOAT_TYPES, check_shape, check_tensor, fail


def compact_kv(caches: Sequence[Tensor] | Tensor, src: Tensor, dst_start: Tensor, backend: str = "auto",
               validate: bool | None = None) -> None:
    """Move cache positions in place: for every tensor, row b's ``src[b, j]`` goes to
    ``dst_start[b] + j`` (j before the row's first -1). Overlapping ranges are fine.

    Args:
        caches: one stacked [N,B,H,S,D] tensor (each [B,H,S,D] contiguous; one launch) or a
            list of [B,H,S,D] tensors (e.g. every layer's K and V; contiguous, one dtype and
            device, one B and S; H and D may differ between them, as MLA's keys and values
            do; one launch per run of tensors of one shape lying evenly spaced in one
            storage, as the layers of one buffer do, else one per tensor).
        src: [B,M] int64 source positions, -1 padded at the end.
        dst_start: [B] int64 first destination position.

    Example:
        >>> kv = torch.randn(4, 2, 8, 32, 64)      # 2 layers x (K, V), B=2, S=32
        >>> compact_kv(kv, torch.tensor([[10, 12], [7, -1]]), torch.tensor([10, 7]))
    """
    check = registry.checking(validate)
    if isinstance(caches, Tensor):
        if check:
            check_tensor("caches", caches, 5, FLOAT_TYPES)
            if caches.shape[0] and not caches[0].is_contiguous():
                fail("caches", "each [B,H,S,D] tensor of the stack must be contiguous (the N tensors may be spaced "
                               "apart)")
            _check_moves(caches.shape[1], caches.shape[3], caches.device, src, dst_start)
        stacks = [caches]
    else:
        tensors = list(caches)
        if not tensors:
            return
        if check:
            _check(tensors, src, dst_start)
        stacks = _stacked(tensors)
    kernel = registry.kernel("compact_kv", backend, stacks[0].device)
    for stack in stacks:
        kernel(stack, src, dst_start)


def _stacked(tensors: list[Tensor]) -> list[Tensor]:
    """The kernels take [N,B,H,S,D]: per run of consecutive tensors of one shape, one
    strided view when they lie evenly spaced in one storage (every layer's K and V of one
    buffer: one launch), else one view each."""
    runs, start = [], 0
    for n in range(1, len(tensors) + 1):
        if n == len(tensors) or tensors[n].shape != tensors[start].shape:
            runs += _stacked_run(tensors[start:n])
            start = n
    return runs


def _stacked_run(tensors: list[Tensor]) -> list[Tensor]:
    """:func:`_stacked` of tensors of one shape."""
    first, size = tensors[0], tensors[0].element_size()
    step = tensors[1].data_ptr() - first.data_ptr() if len(tensors) > 1 else 0
    storage = first.untyped_storage().data_ptr()
    if (step >= first.numel() * size and step % size == 0 and first.is_contiguous()
            and all(t.data_ptr() == first.data_ptr() + i * step and t.shape == first.shape
                    and t.dtype == first.dtype and t.is_contiguous() and t.untyped_storage().data_ptr() == storage
                    for i, t in enumerate(tensors))):
        return [first.as_strided((len(tensors), *first.shape), (step // size, *first.stride()))]
    return [t.unsqueeze(0) for t in tensors]


def _check(tensors: list[Tensor], src: Tensor, dst_start: Tensor) -> None:
    first = tensors[0]
    for n, t in enumerate(tensors):
        check_tensor(f"caches[{n}]", t, 4, FLOAT_TYPES, first.device)
        if t.shape[0] != first.shape[0] or t.shape[2] != first.shape[2] or t.dtype != first.dtype:
            fail(f"caches[{n}]", f"expected [B={first.shape[0]}, H, S={first.shape[2]}, D] and dtype {first.dtype} "
                                 f"like caches[0], got {tuple(t.shape)} {t.dtype}")
        if not t.is_contiguous():
            fail(f"caches[{n}]", "must be contiguous")
    _check_moves(first.shape[0], first.shape[2], first.device, src, dst_start)


def _check_moves(B: int, S: int, device, src: Tensor, dst_start: Tensor) -> None:
    check_tensor("src", src, 2, (torch.int64,), device)
    if src.shape[0] != B:
        fail("src", f"expected [B={B}, M], got {tuple(src.shape)}")
    check_tensor("dst_start", dst_start, 1, (torch.int64,), device)
    check_shape("dst_start", dst_start, (B,))
    if src.numel():
        valid = src >= 0
        if bool((valid[:, 1:] & ~valid[:, :-1]).any()):
            fail("src", "-1 padding must come after every valid position of its row")
        if bool((src >= S).any()) or bool((src < -1).any()):
            fail("src", f"positions must be in [0, S={S}) or -1")
        count = valid.sum(1)
        if bool((dst_start < 0).any()) or bool(((dst_start + count > S) & (count > 0)).any()):
            fail("dst_start", f"need 0 <= dst_start and dst_start + moved <= S ({S})")
