"""The built extension registered every declared op for the dispatch keys it was built for."""
import json
from pathlib import Path

import pytest
import torch

import spec_ext
from spec_ext import ops

BUILD_INFO = Path(spec_ext.__file__).with_name("_build_info.json")


def test_extension_loaded():
    assert ops._C_ERROR is None, ops._C_ERROR


@pytest.mark.parametrize("op", ops.OPS)
def test_dispatch_keys(op):
    info = json.loads(BUILD_INFO.read_text())
    keys = {key for key in ("CPU", "CUDA") if ops.registered(op, key)}
    expected = {"CPU", "CUDA"} if info["cuda"] else {"CPU"}
    assert keys == expected, f"spec_ext::{op} registered {keys}, the build promised {expected}"


def test_schema_declared_once_matches_python_ops():
    declared = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("spec_ext::")}
    assert declared == set(ops.OPS)


def test_backends_report():
    status = spec_ext.backends()
    assert set(status) == {"torch", "cpu", "triton", "cuda"}
    assert status["torch"] == "available" and status["cpu"] == "available"
    for name, line in status.items():
        assert line == "available" or line.startswith("unavailable: "), (name, line)
    print("\nspec_ext backends:", json.dumps(status, indent=1))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        spec_ext.tree_mask(torch.tensor([-1, 0]), backend="metal")
