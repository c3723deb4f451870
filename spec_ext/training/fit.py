"""Fitting a predictor's output columns (one per decoding mode), early-stopped on held-out sequences."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from spec_ext.policies import ResidualMLP


def asymmetric_l1(prediction: Tensor, target: Tensor, under_weight: float = 2.0) -> Tensor:
    """L1 loss with under-prediction (prediction < target) weighted ``under_weight``."""
    error = target - prediction
    return torch.where(error > 0, under_weight * error, -error).mean()


def train_predictor(model: ResidualMLP, data: dict[int, tuple[Tensor, Tensor]], loss: str, epochs: int = 8,
                    batch: int = 512, lr: float = 2e-3, seed: int = 0, progress: bool = True,
                    held_out: dict[int, tuple[Tensor, Tensor]] | None = None) -> dict:
    """Train ``model``'s output columns on ``data[column] = (x [M,F], y [M])``.

    loss: "bce" (acceptance probabilities, soft labels allowed), "asymmetric_l1"
    (lengths) or "cross_entropy" (class labels y; column c is output group c*3..c*3+2).
    held_out: data of the same form (best from other sequences than ``data``'s, as
    neighbouring positions of one sequence are near copies); the model keeps the weights of
    the epoch with the lowest held-out loss.
    Returns {"train": mean training loss per epoch, "held_out": held-out loss per epoch
    (with ``held_out``), "best_epoch": the epoch kept}.
    """
    from tqdm import tqdm
    if loss not in ("bce", "asymmetric_l1", "cross_entropy"):
        raise ValueError(f"loss: expected 'bce', 'asymmetric_l1' or 'cross_entropy', got {loss!r}")

    def objective(x: Tensor, y: Tensor, column: int) -> Tensor:
        if loss == "cross_entropy":
            return F.cross_entropy(model(x)[:, 3 * column:3 * column + 3], y.long())
        out = model(x)[:, column]
        return F.binary_cross_entropy_with_logits(out, y) if loss == "bce" else asymmetric_l1(out, y)

    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    steps_per_epoch = max(math.ceil(len(y) / batch) for _, y in data.values())
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, lr, total_steps=epochs * steps_per_epoch)
    history = dict(train=[], held_out=[], best_epoch=epochs - 1)
    best = (math.inf, None)
    for epoch in tqdm(range(epochs), desc=f"train {loss}", disable=not progress):
        model.train()
        orders = {c: torch.randperm(len(y), generator=generator) for c, (_, y) in data.items()}
        total = 0.0
        for step in range(steps_per_epoch):
            value = 0.0
            for column, (x, y) in data.items():
                index = orders[column][(step * batch) % len(y):][:batch]
                value = value + objective(x[index], y[index], column)
            optimizer.zero_grad(set_to_none=True)
            value.backward()
            optimizer.step()
            schedule.step()
            total += value.item()
        history["train"].append(total / steps_per_epoch)
        if held_out:
            model.eval()
            with torch.no_grad():
                value = sum(objective(x, y, column).item() for column, (x, y) in held_out.items())
            history["held_out"].append(value)
            if value < best[0]:
                best = (value, {k: v.clone() for k, v in model.state_dict().items()})
                history["best_epoch"] = epoch
    if best[1] is not None:
        model.load_state_dict(best[1])
    model.eval()
    return history
