"""The built extension registered every declared op for the dispatch keys it was built for."""
import json
from pathlib import Path

import pytest
import torch

import spec_ext
from spec_ext import ops
from spec_ext.ops import registry

BUILD_INFO = Path(spec_ext.__file__).with_name("_build_info.json")


def test_extension_loaded():
    assert registry._C_ERROR is None, registry._C_ERROR


@pytest.mark.parametrize("op", ops.OPS)
def test_dispatch_keys(op):
    info = json.loads(BUILD_INFO.read_text())
    keys = {key for key in ("CPU", "CUDA") if ops.registered(op, key)}
    expected = set(registry.KERNEL_KEYS[op]) if info["cuda"] else {"CPU"}
    assert keys == expected, f"spec_ext::{op} registered {keys}, the build promised {expected}"


def test_schema_declared_once_matches_python_ops():
    declared = {s.name.split("::")[1] for s in torch._C._jit_get_all_schemas() if s.name.startswith("spec_ext::")}
    assert declared == set(ops.OPS)


def test_backends_report():
    status = spec_ext.backends()
    assert set(status) == {"torch", "cpu", "triton", "cuda", "sdpa"}
    assert status["torch"] == status["cpu"] == status["sdpa"] == "available"
    if json.loads(BUILD_INFO.read_text())["cuda"]:  # a CPU-only op (skinny_linear) is no missing CUDA kernel
        assert status["cuda"] in ("available", "unavailable: built, but no CUDA device"), status["cuda"]
    for name, line in status.items():
        assert line == "available" or line.startswith("unavailable: "), (name, line)
    print("\nspec_ext backends:", json.dumps(status, indent=1))


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="backend must be one of"):
        spec_ext.tree_mask(torch.tensor([-1, 0]), backend="metal")


def test_fake_implementations_agree_with_kernels():
    parents = torch.tensor([[-1, 0, 0, 1]])
    torch.library.opcheck(torch.ops.spec_ext.tree_mask.default, (parents,))
    p = torch.softmax(torch.randn(2, 3, 11), -1)
    drafts = torch.randint(0, 11, (2, 2))
    u = torch.rand(2, 3, dtype=torch.float64)
    torch.library.opcheck(torch.ops.spec_ext.chain_verify.default, (p, drafts, None, torch.tensor([2, 1]), u, False))
    torch.library.opcheck(torch.ops.spec_ext.tree_verify.default,
                          (p[:, :3], torch.randint(0, 11, (2, 3)), torch.tensor([[-1, 0, 0]] * 2), None,
                           torch.rand(2, 4, dtype=torch.float64), False, True))
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 10, 8)
    torch.library.opcheck(torch.ops.spec_ext.tree_attention.default,
                          (q, k, k, torch.tensor([4]), None, 0.3, 0, 0.0, None))
    torch.library.opcheck(torch.ops.spec_ext.tree_attention.default,
                          (q, k, k, torch.tensor([4]), None, 0.3, 2, 5.0, torch.randn(2)))
    torch.library.opcheck(torch.ops.spec_ext.skinny_linear.default, (torch.randn(2, 3, 40), torch.randn(7, 40), None))


def test_compiled_function_uses_the_ops():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 10, 8)
    prefix = torch.tensor([4])

    def f(q, k):
        return torch.ops.spec_ext.tree_attention(q, k, k, prefix, None, 0.3, 0, 0.0, None) * 2

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k), f(q, k))


def test_import_without_extension_warns_and_keeps_torch_backend():
    import subprocess
    import sys
    code = ("import sys, warnings; sys.modules['spec_ext._C'] = None\n"
            "with warnings.catch_warnings(record=True) as w:\n"
            "    warnings.simplefilter('always')\n"
            "    import spec_ext, spec_ext.ops, torch\n"
            "assert any('spec_ext._C is not built' in str(x.message) for x in w), [str(x.message) for x in w]\n"
            "assert spec_ext.backends()['cpu'].startswith('unavailable')\n"
            "d, m = spec_ext.tree_mask(torch.tensor([-1, 0]))\n"
            "assert d.tolist() == [[0, 1]]\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_auto_table_switch_is_read_at_every_call(monkeypatch):
    """SPEC_EXT_AUTO_TABLE=0 switches auto's measured table off from the next call on, and
    unsetting it switches the table back on, within one process: what explain says, what
    resolve gives, and the function kernel() hands the op."""
    from spec_ext.ops import selection
    cpu = torch.device("cpu")
    q, k = torch.empty(2, 32, 16, 128, device="meta"), torch.empty(2, 32, 512, 128, device="meta")
    call = (q, k, k, torch.empty(2, device="meta"), None, 128 ** -0.5, 0, 0.0, None)  # the table: sdpa
    fixed = "cpu" if ops.registered("tree_attention", "CPU") else "torch"
    rows = [entry.rows for entry in selection.entries("cpu", "tree_attention")]
    for switch in (None, "0", "1", "0", None):
        if switch is None:
            monkeypatch.delenv(selection.SWITCH, raising=False)
        else:
            monkeypatch.setenv(selection.SWITCH, switch)
        text = registry.explain("tree_attention", cpu, call)
        picked = registry.kernel("tree_attention", "auto", cpu)
        if switch == "0":
            assert "the measured table is off (SPEC_EXT_AUTO_TABLE=0)" in text, text
            assert not any(row in text for row in rows) and text.endswith(f"this call: {fixed} (the fixed order)")
            assert registry.resolve("tree_attention", "auto", cpu) == fixed
            assert picked is registry.kernel("tree_attention", fixed, cpu)
        else:
            assert "table is off" not in text and all(row in text for row in rows)
            assert "this call: sdpa (" in text, text
            assert registry.resolve("tree_attention", "auto", cpu) == "auto"  # the pick depends on the call
            assert picked is not registry.kernel("tree_attention", fixed, cpu)
