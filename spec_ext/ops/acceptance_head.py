"""acceptance_head: SpecDecPP's decision for one draft step (features, MLP, sigmoid) in one call."""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from spec_ext.ops import registry
from spec_ext.ops.checks import check_shape, check_tensor, fail


def acceptance_head(hidden: Tensor, probs: Tensor, weights: Sequence[Tensor], column: int, eps: float = 1e-5,
                    backend: str = "auto", validate: bool | None = None) -> Tensor:
    """SpecDecPP's predicted chance that the token drawn from ``probs`` is accepted: a
    residual MLP (:class:`spec_ext.policies.ResidualMLP`) on [hidden; log max p; entropy of
    p; max p - second largest p], sigmoid of output ``column``; one call per draft step.

    Args:
        hidden: [B,H] float32, the draft's last hidden state. probs: [B,V] float32, the
            distribution the draft gave from it (temperature 1).
        weights: float32 tensors in ResidualMLP's order (its ``weights()``): inp.weight
            [D,H+3], inp.bias [D], per block norm.weight [D], norm.bias [D], up.weight [D,D],
            up.bias [D], down.weight [D,D], down.bias [D]; out.weight [O,D], out.bias [O].
        column: output of the MLP to read (0 <= column < O). eps: the LayerNorms' epsilon.
        backend: "auto" (the CPU kernel for CPU tensors, else the float64 reference), "cpu" or
            "torch". validate: False skips every check (contiguous weights assumed).
    Returns:
        [B] float32 in (0, 1).

    Example:
        >>> from spec_ext.policies import ResidualMLP
        >>> head = ResidualMLP(64 + 3, hidden=32, depth=1)
        >>> probs = torch.softmax(torch.randn(2, 100), -1)
        >>> accept = acceptance_head(torch.randn(2, 64), probs, head.weights(), column=0)  # [2]
    """
    if registry.checking(validate):
        weights = [w.contiguous() if isinstance(w, Tensor) else w for w in weights]
        _check(hidden, probs, weights, column)
    return registry.kernel("acceptance_head", backend, hidden.device)(hidden, probs, list(weights), column, eps)


def _check(hidden, probs, weights, column) -> None:
    check_tensor("hidden", hidden, 2, (torch.float32,))
    check_tensor("probs", probs, 2, (torch.float32,), hidden.device)
    if probs.shape[0] != hidden.shape[0] or probs.shape[1] < 2:
        fail("probs", f"expected [B={hidden.shape[0]}, V>=2], got {tuple(probs.shape)}")
    if len(weights) < 4 or (len(weights) - 4) % 6:
        fail("weights", f"expected 4 + 6 * depth tensors (ResidualMLP.weights()), got {len(weights)}")
    D = weights[0].shape[0]
    shapes = [(D, hidden.shape[1] + 3), (D,)] + [(D,), (D,), (D, D), (D,), (D, D), (D,)] * ((len(weights) - 4) // 6)
    shapes += [(weights[-2].shape[0], D), (weights[-2].shape[0],)]
    for n, (w, shape) in enumerate(zip(weights, shapes)):
        check_tensor(f"weights[{n}]", w, len(shape), (torch.float32,), hidden.device)
        check_shape(f"weights[{n}]", w, shape)
    if not 0 <= column < weights[-2].shape[0]:
        fail("column", f"expected 0 <= column < {weights[-2].shape[0]} (the MLP's outputs), got {column}")
