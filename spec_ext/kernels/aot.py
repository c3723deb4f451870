"""Ahead-of-time compilation of the launchers' own launches for a GPU that is not here, and
what each compiled kernel uses. Static figures: nothing here runs on a GPU.

The launchers are called on meta tensors inside :func:`spec_ext.kernels.launch.planning`,
so each records the kernel, grid, constexprs and launch options it would use. A stand-in
Triton driver then reports the target GPU to ``JITFunction.warmup``, which specialises the
arguments as a real launch would (types, 16-byte alignment, divisibility by 16, ints equal
to 1) and compiles down to a cubin (``ptxas`` ships in the Triton wheel). From the compiled
kernel: registers, local memory (spills) and static shared memory from ``cuobjdump
-res-usage`` of its cubin, dynamic shared memory from its metadata, MMA instructions and
global-load widths from its PTX; resident programs per SM from those against the SM's limits.

Triton's interpreter replaces ``@triton.jit`` at import, so this needs a process started
without ``TRITON_INTERPRET=1``::

    env -u TRITON_INTERPRET python -m spec_ext.kernels.aot --arch 90 --shapes test   # JSON rows
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Callable, Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from spec_ext.kernels.launch import A100, H200, LAUNCHERS, Launch, Target, planning


@dataclasses.dataclass(frozen=True)
class SMLimits:
    """Per-SM limits of a compute capability (CUDA C Programming Guide, table of technical
    specifications); shared memory in bytes, ``reserved`` per block by the driver."""
    registers: int
    shared: int
    shared_per_block: int
    warps: int
    blocks: int
    reserved: int = 1024


LIMITS = {90: SMLimits(65536, 228 * 1024, 227 * 1024, 64, 32), 80: SMLimits(65536, 164 * 1024, 163 * 1024, 64, 32)}
TARGETS = {90: H200, 80: A100}


def resident_programs(registers: int, shared: int, num_warps: int, limits: SMLimits) -> int:
    """Programs (CTAs) of one kernel resident on an SM at once: registers are allocated per
    warp in units of 256 (per thread, rounded up to 8), shared memory per block in units of
    128 bytes plus the driver's reserve; 0 if one program does not fit."""
    regs_per_warp = -(-registers * 32 // 256) * 256
    by_registers = (limits.registers // regs_per_warp) // num_warps if regs_per_warp else limits.blocks
    if shared > limits.shared_per_block:
        return 0
    by_shared = limits.shared // (-(-(shared + limits.reserved) // 128) * 128)
    return max(0, min(limits.blocks, limits.warps // num_warps, by_registers, by_shared))


class _StandInDriver:
    """What ``JITFunction.warmup`` asks of a driver, for a GPU that is not here. The device
    id is the arch, so each target gets its own compile cache in the JIT function."""

    def __init__(self, target: Target):
        self.target = GPUTarget("cuda", target.arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.target.arch

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("meta")


@contextlib.contextmanager
def _compiling_for(target: Target) -> Iterator[None]:
    previous = getattr(driver, "_active", None)
    driver.set_active(_StandInDriver(target))
    try:
        yield
    finally:
        driver.set_active(previous)  # None: the real driver is made on first use, as before


def compile_launch(launch: Launch, target: Target):
    """The CompiledKernel of ``launch`` for ``target`` (Triton's own specialisation)."""
    with _compiling_for(target):
        return launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.meta)


_TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_LOAD = re.compile(r"\bld\.global[\w.:]*")


def _resource_usage(cubin: bytes, name: str) -> dict[str, int]:
    """REG, STACK, SHARED, LOCAL of kernel ``name`` from ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([os.path.join(_TOOLS, "cuobjdump"), "-res-usage", f.name], check=True,
                              capture_output=True, text=True).stdout
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith("Function") and line.strip().rstrip(":").endswith(name):
            return {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", lines[i + 1])}
    raise RuntimeError(f"cuobjdump shows no function {name}:\n{text}")


def load_widths(ptx: str) -> dict[int, int]:
    """Bits per global load instruction -> how many there are in the PTX."""
    widths: dict[int, int] = {}
    for op in _LOAD.findall(ptx):
        vector = re.search(r"\.v(\d+)", op)
        element = re.search(r"\.[bfus](\d+)$", op)
        bits = (int(vector.group(1)) if vector else 1) * (int(element.group(1)) if element else 32)
        widths[bits] = widths.get(bits, 0) + 1
    return dict(sorted(widths.items()))


def usage(compiled, target: Target) -> dict:
    """What a compiled kernel uses on ``target`` (static), and a digest of its cubin (``binary``: two
    launches with one digest run one machine code)."""
    meta = compiled.metadata
    res = _resource_usage(compiled.asm["cubin"], meta.name)
    ptx, ttir = compiled.asm["ptx"], compiled.asm["ttir"]
    shared = meta.shared + res.get("SHARED", 0)
    dots = ttir.count("tt.dot")
    if not dots:
        mma = "-"
    elif "wgmma.mma_async" in ptx:
        mma = "wgmma"
    elif re.search(r"\bmma\.sync", ptx):
        mma = "mma"
    else:
        mma = "none (FMA)"
    return dict(binary=hashlib.sha256(compiled.asm["cubin"]).hexdigest()[:16],
                registers=res["REG"], spill_bytes=res.get("STACK", 0) + res.get("LOCAL", 0), shared_bytes=shared,
                num_warps=meta.num_warps, num_stages=meta.num_stages,
                resident_per_sm=resident_programs(res["REG"], shared, meta.num_warps, LIMITS[target.arch]),
                dots=dots, tensor_cores=mma, load_bits=load_widths(ptx))


# ----------------------------------------------------------------------------- the cases
def _m(*shape, dtype=torch.float32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _i64(*shape):
    return _m(*shape, dtype=torch.int64)


def _chain(B, K, V, mode):
    greedy = mode == "greedy"
    q = _m(B, K, V) if mode == "q" else None
    u = None if greedy else _m(B, K + 1, dtype=torch.float64)
    return _m(B, K + 1, V), _i64(B, K), q, _i64(B), u, greedy


def _tree(B, T, V, mode):
    greedy = mode == "greedy"
    q = _m(B, T, V) if mode in ("q", "q iid") else None
    u = None if greedy else _m(B, T + 1, dtype=torch.float64)
    return _m(B, T, V), _i64(B, T), _i64(B, T), q, u, greedy, mode != "q iid"


def _attention(B, Hq, Hkv, S, T, D, dtype, tree, window=0, softcap=0.0, sinks=False):
    mask = _m(1, T, (T + 31) // 32, dtype=torch.int32) if tree else None
    return (_m(B, Hq, T, D, dtype=dtype), _m(B, Hkv, S, D, dtype=dtype), _m(B, Hkv, S, D, dtype=dtype), _i64(B), mask,
            D ** -0.5, window, softcap, _m(Hq) if sinks else None)


BENCH_TREE_T = 8  # len(spec_ext.policies.Tree((3, 2, 1, 1)).parents), the tree of benchmarks/bench_kernels.py


def cases(shapes: str) -> Iterator[tuple[str, str, tuple]]:
    """(op, shape, the kernel-level arguments on meta tensors). "bench": the shapes of
    benchmarks/bench_kernels.py on a GPU; "test": a few of them and odd ones (V not a
    multiple of the block, K=1, T=1, T=128, D=64/256, fp32 and fp16, a causal chain; the
    Triton linear at 1 to 64 rows, every dtype pair it takes), each distinct launch
    configuration at least once."""
    if shapes == "bench":
        chains = [(B, K, V, "q") for B in (1, 16, 64) for K in (1, 5, 8) for V in (32000, 128256)]
        chains += [(16, 5, 32000, "greedy"), (64, 8, 128256, "greedy")]
        trees = [(B, BENCH_TREE_T, 32000, mode) for B in (1, 16, 64) for mode in ("none", "greedy")]
        masks = [(1, 22), (64, 64)]
        attention = [(B, 32, Hkv, S, T, 128, torch.bfloat16, True) for B, S, T, Hkv in
                     [(1, 4096, 8, 8), (1, 4096, 64, 8), (8, 4096, 8, 8), (8, 4096, 64, 8), (32, 2048, 16, 8),
                      (1, 32768, 64, 8), (8, 16384, 32, 8)]]
        kv = [(64, B, 8, 4096, 128, M) for B in (1, 16) for M in (4, 16)] + [(64, 64, 8, 1024, 128, 8)]
        features = []
        linear = [(M, K, N, torch.bfloat16, torch.bfloat16, False) for M in (1, 8, 64)
                  for K, N in ((4096, 4096), (4096, 14336), (14336, 4096))]
    else:
        chains = [(1, 1, 32000, "q"), (64, 1, 32000, "q"), (64, 8, 128256, "q"), (16, 1, 8193, "none"),
                  (16, 5, 32000, "greedy"), (1, 8, 8193, "greedy")]
        trees = [(1, BENCH_TREE_T, 32000, "q"), (16, 22, 8193, "q iid"), (1, BENCH_TREE_T, 32000, "none"),
                 (1, BENCH_TREE_T, 32000, "greedy"), (64, 1, 8193, "greedy")]
        masks = [(1, 22), (4, 1), (2, 128)]
        attention = [(1, 32, 8, 4096, 8, 128, torch.bfloat16, True), (1, 32, 8, 4096, 64, 128, torch.bfloat16, True),
                     (1, 8, 1, 1000, 1, 64, torch.float16, False), (2, 4, 2, 700, 128, 256, torch.bfloat16, True),
                     (1, 4, 4, 300, 5, 64, torch.float32, True)]
        # window, softcap and sinks (Gemma 2/3, GPT-OSS): all on a tree, a window on a chain
        features = [((1, 32, 8, 4096, 64, 128, torch.bfloat16, True), (1024, 30.0, True)),
                    ((2, 8, 1, 1000, 8, 64, torch.float16, False), (128, 0.0, False)),
                    ((1, 4, 4, 300, 5, 256, torch.float32, True), (16, 50.0, True))]
        # shapes that differ only in T (1 and 33: the tree mask one word or two): the invariant
        # kernels must compile them to one binary
        features += [((1, 8, 2, 600, T, 64, torch.float16, True), (64, 0.0, True)) for T in (1, 33)]
        features += [((2, 4, 4, 300, T, 128, torch.bfloat16, False), (0, 20.0, False)) for T in (1, 33)]
        kv = [(64, 1, 8, 4096, 128, 4), (2, 3, 2, 100, 64, 1)]
        # (M, K, N, x dtype, weight dtype, bias): one row and 64, odd K and N, every dtype pair
        linear = [(1, 320, 864, torch.float32, torch.float32, False), (64, 16384, 320, torch.bfloat16, torch.bfloat16, True),
                  (5, 323, 16385, torch.float16, torch.float16, False), (33, 4096, 4096, torch.float32, torch.bfloat16, True),
                  (64, 320, 864, torch.float32, torch.float32, False), (1, 16384, 320, torch.bfloat16, torch.bfloat16, True)]
    for B, K, V, mode in chains:
        yield "chain_verify", f"B={B},K={K},V={V},{mode}", _chain(B, K, V, mode)
    for B, T, V, mode in trees:
        yield "tree_verify", f"B={B},T={T},V={V},{mode}", _tree(B, T, V, mode)
    for B, T in masks:
        yield "tree_mask", f"B={B},T={T}", (_i64(B, T),)
    for (B, Hq, Hkv, S, T, D, dtype, tree), (window, softcap, sinks) in [(a, (0, 0.0, False)) for a in attention] + \
            features:
        shape = f"B={B},Hq={Hq},Hkv={Hkv},S={S},T={T},D={D},{str(dtype)[6:]},{'tree' if tree else 'chain'}"
        if window or softcap or sinks:
            shape += f",window={window},softcap={softcap},sinks={sinks}"
        yield "tree_attention", shape, _attention(B, Hq, Hkv, S, T, D, dtype, tree, window, softcap, sinks)
    for M, K, N, x_dtype, w_dtype, bias in linear:
        yield "skinny_linear", f"M={M},K={K},N={N},x={str(x_dtype)[6:]},w={str(w_dtype)[6:]},bias={bias}", (
            _m(M, K, dtype=x_dtype), _m(N, K, dtype=w_dtype), _m(N, dtype=x_dtype) if bias else None)
    for N, B, H, S, D, M in kv:
        yield "compact_kv", f"N={N},B={B},H={H},S={S},D={D},M={M},fp16", (
            _m(N, B, H, S, D, dtype=torch.float16), _i64(B, M), _i64(B))


def launchers() -> dict[tuple[str, str], Callable]:
    """(op, backend) -> the Triton launcher serving it (:data:`spec_ext.kernels.launch.LAUNCHERS`).
    Nothing above the kernels is imported: no compiled extension, no op registry."""
    import importlib

    return {key: getattr(importlib.import_module(f"spec_ext.kernels.{module}"), name)
            for key, (module, name) in LAUNCHERS.items()}


def plans(target: Target, shapes: str, ops=None) -> Iterator[tuple[str, str, str, Launch]]:
    """(op, backend, shape, launch) of every Triton launcher (of ``ops``; None: all) at
    every case's shape."""
    by_op = launchers()
    for op, shape, args in cases(shapes):
        for (name, backend), launcher in by_op.items():
            if name == op and (ops is None or op in ops):
                with planning(target) as launches:
                    launcher(*args)
                for launch in launches:
                    yield op, backend, shape, launch


def constexprs(launch: Launch) -> str:
    return ",".join(f"{k}={v}" for k, v in launch.meta.items())


def report(arch: int, shapes: str, ops=None) -> Iterator[dict]:
    """One row per planned launch: the launch, then its compiled usage or the compile error."""
    target = TARGETS[arch]
    for op, backend, shape, launch in plans(target, shapes, ops):
        row = dict(arch=f"sm_{arch}", op=op, backend=backend, shape=shape, kernel=launch.kernel.fn.__name__,
                   constexprs=constexprs(launch), grid="x".join(map(str, launch.grid)), programs=launch.programs,
                   sms=target.sms)
        try:
            row.update(usage(compile_launch(launch, target), target))
            resident = row["resident_per_sm"] * target.sms
            row["waves"] = round(launch.programs / resident, 3) if resident else None
        except Exception as error:  # reported, not raised: one row per failure
            row["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:500]}"
        yield row


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90], choices=sorted(LIMITS))
    parser.add_argument("--shapes", choices=["test", "bench"], default="test")
    parser.add_argument("--ops", nargs="+", help="only these ops (default: all)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("spec_ext.kernels.aot: unset TRITON_INTERPRET (the interpreter never compiles)")
    for arch in args.arch:
        for row in report(arch, args.shapes, args.ops):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
