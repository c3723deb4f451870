"""Every Triton kernel of spec_ext/kernels/ compiles ahead of time for sm_80 and sm_90, as its
launcher would launch it (constexprs, num_warps, num_stages, argument specialisation),
without spills: spec_ext/kernels/aot.py plans the launchers on meta tensors at a few benchmark and
odd shapes and compiles each launch for a GPU that is not here (static figures).

The interpreter (TRITON_INTERPRET=1, set for this suite) replaces @triton.jit at import,
so the compile runs in subprocesses started without it, one per arch, each with a fresh
Triton cache (nothing is reused between runs)."""
import importlib
import inspect
import json
import os
import pkgutil
import re
import subprocess
import sys

import pytest

ARCHS = (80, 90)


def _tools_missing() -> str | None:
    try:
        import triton
    except ImportError as error:
        return f"Triton is not installed ({error})"
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    missing = [tool for tool in ("ptxas", "cuobjdump") if not os.path.exists(os.path.join(bin_dir, tool))]
    return f"the Triton wheel has no {missing} under {bin_dir}" if missing else None


pytestmark = pytest.mark.skipif(_tools_missing() is not None, reason=str(_tools_missing()))


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """arch -> the JSON rows of ``python -m spec_ext.kernels.aot --shapes test``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = {}
    for arch in ARCHS:
        cache = tmp_path_factory.mktemp(f"triton_cache_sm{arch}")
        procs[arch] = subprocess.Popen(
            [sys.executable, "-m", "spec_ext.kernels.aot", "--arch", str(arch), "--shapes", "test"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env, TRITON_CACHE_DIR=str(cache)))
    out = {}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=1200)
        assert proc.returncode == 0, stderr[-4000:]
        out[arch] = [json.loads(line) for line in stdout.splitlines()]
    return out


def test_the_kernels_plan_every_launcher_without_the_layers_above_them():
    """spec_ext/kernels/ sits below spec_ext.ops (docs/architecture.md): planning every launch the
    compile makes loads no spec_ext module outside spec_ext.kernels, and plans every Triton
    backend the op registry dispatches to."""
    code = ("import json, sys\n"
            "from spec_ext.kernels import aot\n"
            "planned = sorted({(op, backend) for op, backend, _, _ in aot.plans(aot.H200, 'test')})\n"
            "loaded = sorted(m for m in sys.modules\n"
            "                if m.startswith('spec_ext.') and not m.startswith('spec_ext.kernels'))\n"
            "print(json.dumps(dict(planned=planned, loaded=loaded)))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["loaded"] == []
    from spec_ext.ops import registry
    assert {tuple(key) for key in result["planned"]} == set(registry.TRITON_KERNELS)


def describe(row):
    return f"{row['arch']} {row['op']}/{row['backend']} {row['shape']} {row['kernel']}[{row['constexprs']}]"


@pytest.mark.parametrize("arch", ARCHS)
def test_every_launch_compiles_and_fits_without_spills(rows, arch):
    assert rows[arch], "no launch was planned"
    failed = [f"{describe(r)}: {r['error']}" for r in rows[arch] if "error" in r]
    assert not failed, "\n".join(failed)
    spilled = [f"{describe(r)}: {r['spill_bytes']} bytes of local memory per thread, {r['registers']} registers"
               for r in rows[arch] if r["spill_bytes"]]
    assert not spilled, "\n".join(spilled)
    unfit = [describe(r) for r in rows[arch] if r["resident_per_sm"] < 1]
    assert not unfit, "no program fits on an SM: " + "\n".join(unfit)


def kernel_modules():
    import spec_ext.kernels
    names = [m.name for m in pkgutil.iter_modules(spec_ext.kernels.__path__) if m.name not in ("aot", "launch")]
    return [importlib.import_module(f"spec_ext.kernels.{name}") for name in names]


def test_every_kernel_of_kernels_is_compiled(rows):
    """Each @triton.jit function of spec_ext/kernels/ is launched by a plan, or called (transitively)
    by a kernel that is."""
    import triton
    jitted = {}
    for module in kernel_modules():
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)
            if isinstance(obj, triton.runtime.KernelInterface) and inspect.getmodule(fn) is module:
                jitted[name] = inspect.getsource(fn)
    assert "_tree_sample_kernel" in jitted and "key_block" in jitted
    covered = {r["kernel"] for arch in ARCHS for r in rows[arch]}
    grew = True
    while grew:
        called = {name for name in jitted if name not in covered
                  and any(re.search(rf"\b{name}\(", jitted[c]) for c in covered if c in jitted)}
        covered |= called
        grew = bool(called)
    assert not set(jitted) - covered, f"never compiled: {sorted(set(jitted) - covered)}"


@pytest.mark.parametrize("arch", ARCHS)
def test_split_counts_use_the_resident_programs_the_compile_reports(rows, arch):
    from spec_ext.kernels import rejection_sampling_split as vocabulary
    tables = {"_argmax_partials": vocabulary.ARGMAX_RESIDENT, "_mass_partials": vocabulary.MASS_RESIDENT}
    for kernel, table in tables.items():
        reported = [r["resident_per_sm"] for r in rows[arch] if r["kernel"] == kernel]
        assert reported and table[arch] == min(reported), (kernel, table, reported)
    from spec_ext.kernels.tree_attention_split import SPLIT_RESIDENT
    for (table_arch, block_r, block_d, size), resident in SPLIT_RESIDENT.items():
        if table_arch == arch:
            dtypes = ("float16", "bfloat16") if size == 2 else ("float32",)
            reported = [r["resident_per_sm"] for r in rows[arch] if r["kernel"] == "_split_kernel"
                        and f"BLOCK_R={block_r}," in r["constexprs"] and f"BLOCK_D={block_d}," in r["constexprs"]
                        and set(r["shape"].split(",")) & set(dtypes)]
            assert reported and resident == min(reported), ((block_r, block_d, size), resident, reported)


def _vocabulary(row):
    return int(re.search(r"V=(\d+)", row["shape"]).group(1))


@pytest.mark.parametrize("arch", ARCHS)
def test_split_kernels_load_128_bits_where_rows_are_aligned(rows, arch):
    """A vocabulary chunk of whole blocks keeps 16-byte alignment when V is a multiple of 16."""
    checked = [r for r in rows[arch] if r["kernel"] in ("_argmax_partials", "_mass_partials")
               and _vocabulary(r) % 16 == 0]
    assert checked
    narrow = [f"{describe(r)}: {r['load_bits']}" for r in checked if "128" not in r["load_bits"]]
    assert not narrow, "\n".join(narrow)


def _without_width(shape: str) -> str:
    """A planned shape without its T= (tree_attention) or M= (skinny_linear) field."""
    return ",".join(part for part in shape.split(",") if not part.startswith(("T=", "M=")))


@pytest.mark.parametrize("arch", ARCHS)
def test_invariant_kernels_compile_one_binary_for_every_width(rows, arch):
    """The invariant kernels' contract rests on one machine code for every T (tree attention,
    T = 1 and 33: the mask one word or two) and every row count M (the linear, 1 and 64):
    Triton specialises an int argument equal to 1 or divisible by 16 into another kernel
    unless told not to (do_not_specialize), and a constexpr sized from T or M would too."""
    groups = {}
    for r in rows[arch]:
        if r["backend"] == "triton_invariant":
            groups.setdefault((r["op"], r["kernel"], _without_width(r["shape"])), []).append(r)
    paired = {key: group for key, group in groups.items() if len(group) > 1}
    assert {op for op, _, _ in paired} == {"tree_attention", "skinny_linear"}, sorted(groups)
    for (op, kernel, shape), group in paired.items():
        assert len({r["binary"] for r in group}) == 1, (op, kernel, shape, [(r["shape"], r["binary"]) for r in group])
    # and the flash kernel, whose query block is sized from T, does compile T = 1 and 33 apart
    flash = [r for r in rows[arch] if r["backend"] == "triton" and r["op"] == "tree_attention"
             and _without_width(r["shape"]) in {shape for op, _, shape in paired if op == "tree_attention"}]
    assert len({r["binary"] for r in flash}) > 1
