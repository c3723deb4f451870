import os

import torch

# Triton reads TRITON_INTERPRET when it is imported: set it before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from spec_ext import ops  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def backend_params(op: str):
    """One pytest param per backend; those that cannot run here are skipped with the reason."""
    params = []
    status = ops.backends()
    for name in ops.BACKENDS:
        reason = None
        if name == "cpu" and not ops.registered(op, "CPU"):
            reason = status["cpu"]
        elif name == "cuda" and (DEVICE != "cuda" or not ops.registered(op, "CUDA")):
            reason = status["cuda"]
        elif name == "triton" and status["triton"] != "available":
            reason = status["triton"]
        marks = [pytest.mark.skip(reason=f"{name} backend {reason}")] if reason else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def device_for(backend: str) -> str:
    """Tensors for a backend: CPU for torch/cpu, the GPU (or the Triton interpreter's CPU) otherwise."""
    return "cpu" if backend in ("torch", "cpu") else DEVICE
