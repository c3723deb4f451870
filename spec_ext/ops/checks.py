"""Argument checks shared by the ops: each failure is a ValueError naming the argument."""
from __future__ import annotations

import torch
from torch import Tensor

FLOAT_TYPES = (torch.float32, torch.float16, torch.bfloat16)


def fail(name: str, problem: str):
    raise ValueError(f"{name}: {problem}")


def check_tensor(name: str, x, ndim: int | tuple[int, ...], dtypes=None, device=None) -> None:
    if not isinstance(x, Tensor):
        fail(name, f"expected a Tensor, got {type(x).__name__}")
    ndims = (ndim,) if isinstance(ndim, int) else ndim
    if x.dim() not in ndims:
        fail(name, f"expected {' or '.join(f'{n}-D' for n in ndims)}, got shape {tuple(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        fail(name, f"expected dtype {' or '.join(str(d) for d in dtypes)}, got {x.dtype}")
    if device is not None and x.device != device:
        fail(name, f"expected device {device}, got {x.device}")


def check_shape(name: str, x: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(shape):
        fail(name, f"expected shape {tuple(shape)}, got {tuple(x.shape)}")


def check_ids(name: str, ids: Tensor, upper: int) -> None:
    if ids.numel() and bool(((ids < -1) | (ids >= upper)).any()):
        fail(name, f"ids must be -1 (padding) or in [0, {upper}); found {ids[(ids < -1) | (ids >= upper)][0].item()}")


SUM_TOLERANCE = 1e-3  # a float32 softmax over 128k entries sums to 1 within ~1e-5


def check_distributions(name: str, probs: Tensor, rows: Tensor | None = None) -> None:
    """probs [..., V]: finite, non-negative, each row summing to 1 (on the rows selected by
    ``rows``): unnormalised rows would change the acceptance ratios silently."""
    data = probs if rows is None else probs[rows]
    if data.numel() == 0:
        return
    if not bool(torch.isfinite(data).all()):
        fail(name, "contains NaN or inf")
    if bool((data < 0).any()):
        fail(name, "contains negative probabilities")
    sums = data.sum(-1, dtype=torch.float64)
    if bool((sums <= 0).any()):
        fail(name, "contains an all-zero probability row")
    if bool(((sums - 1).abs() > SUM_TOLERANCE).any()):
        bad = sums[(sums - 1).abs() > SUM_TOLERANCE][0].item()
        fail(name, f"rows must sum to 1 (probabilities, not logits or scaled weights); "
                   f"found a row summing to {bad:.6g}")


def check_parents(parents: Tensor) -> None:
    """parents [B,T]: one root (node 0) and every other node after its parent."""
    if parents.shape[-1] == 0:
        fail("parents", "a tree needs at least its root (T >= 1)")
    if bool((parents[:, 0] != -1).any()):
        fail("parents", "node 0 must be the root (parents[..., 0] == -1)")
    index = torch.arange(parents.shape[1], device=parents.device)
    bad = (parents[:, 1:] < 0) | (parents[:, 1:] >= index[1:])
    if bool(bad.any()):
        b, i = (int(v) for v in torch.nonzero(bad)[0])
        fail("parents", f"parents[{b}, {i + 1}] = {int(parents[b, i + 1])}; every non-root node i needs "
                        f"0 <= parent < i (one root, nodes in topological order)")
