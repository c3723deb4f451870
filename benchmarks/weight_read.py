"""A target whose decode step is weight reads, with the bundled target's function.

The bundled target (models/stdlib-target: 8 layers, hidden 320, MLP 864) reads ~33 MB per
step in float32, which stays in this machine's caches, so a verification of k+1 tokens
costs arithmetic there, not reads. :func:`widened_target` widens every MLP with zero rows:
gate and up projections get ``intermediate_size - 864`` zero output rows and the down
projection as many zero input columns. The new channels compute silu(0) * 0 = 0 and the
down projection adds 0 * them, so every logit is the original's in exact arithmetic (a
float32 GEMM over the longer inner dimension may block its sums differently, so the last
bits can differ; greedy outputs are compared in e2e.py). At 16384: 8 x 3 x 320 x 16384 = 126M MLP parameters, ~0.5 GB of float32 read per step.

Built on the fly from the loaded model (a few seconds); nothing large is committed.

    from weight_read import widened_target
    big = widened_target(target)            # target: a loaded LlamaForCausalLM (or any gate/up/down MLP)
"""
from __future__ import annotations

import copy

import torch
from torch import nn


def _widen_linear(linear: nn.Linear, out_features: int | None = None, in_features: int | None = None) -> nn.Linear:
    """A copy of ``linear`` with zero output rows appended up to ``out_features`` (and a zero
    bias there) or zero input columns appended up to ``in_features``."""
    out_now, in_now = linear.weight.shape
    out_features, in_features = out_features or out_now, in_features or in_now
    if out_features < out_now or in_features < in_now:
        raise ValueError(f"intermediate_size: cannot narrow a {in_now} -> {out_now} projection to "
                         f"{in_features} -> {out_features}")
    wide = nn.Linear(in_features, out_features, bias=linear.bias is not None, device="meta", dtype=linear.weight.dtype)
    weight = torch.zeros(out_features, in_features, dtype=linear.weight.dtype, device=linear.weight.device)
    weight[:out_now, :in_now] = linear.weight.detach()
    wide.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        bias = torch.zeros(out_features, dtype=linear.bias.dtype, device=linear.bias.device)
        bias[:out_now] = linear.bias.detach()
        wide.bias = nn.Parameter(bias, requires_grad=False)
    return wide


def widened_target(target: nn.Module, intermediate_size: int = 16384) -> nn.Module:
    """A copy of ``target`` (a causal LM whose decoder MLPs have ``gate_proj``, ``up_proj``
    and ``down_proj`` linears: Llama, Qwen2/3, Mistral, Gemma...) with every MLP widened by
    zero rows to ``intermediate_size`` channels; the same function, more weights to read.
    ``config.intermediate_size`` is updated to match. ``target`` itself is left unchanged.

    Raises ValueError where the model has no such MLP or ``intermediate_size`` is smaller
    than the model's own."""
    mlps = [m for m in target.modules() if all(isinstance(getattr(m, name, None), nn.Linear)
                                               for name in ("gate_proj", "up_proj", "down_proj"))]
    if not mlps:
        raise ValueError(f"target: {type(target).__name__} has no gate_proj/up_proj/down_proj MLP to widen")
    own = mlps[0].gate_proj.out_features
    if intermediate_size < own:
        raise ValueError(f"intermediate_size: must be >= the target's own {own}, got {intermediate_size}")
    # copy everything but the MLP weights (those are rebuilt), so the copy never holds two sets
    skip = {id(p) for m in mlps for name in ("gate_proj", "up_proj", "down_proj") for p in getattr(m, name).parameters()}
    memo = {i: None for i in skip}
    wide = copy.deepcopy(target, memo)
    for original, mlp in zip(mlps, [m for m in wide.modules() if all(
            hasattr(m, name) for name in ("gate_proj", "up_proj", "down_proj")) and isinstance(m.down_proj, nn.Linear)]):
        mlp.gate_proj = _widen_linear(original.gate_proj, out_features=intermediate_size)
        mlp.up_proj = _widen_linear(original.up_proj, out_features=intermediate_size)
        mlp.down_proj = _widen_linear(original.down_proj, in_features=intermediate_size)
        if hasattr(mlp, "intermediate_size"):
            mlp.intermediate_size = intermediate_size
    config = getattr(wide, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        text.intermediate_size = intermediate_size
    wide.eval()
    return wide


def read_bytes(model: nn.Module) -> int:
    """Bytes of the parameters a decode step reads (every parameter once; a tied embedding once)."""
    return sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
