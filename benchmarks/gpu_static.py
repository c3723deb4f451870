"""Static resource report of every GPU kernel for an H200 (sm_90), without a GPU.

Triton: every launcher's launches at the benchmark shapes (and the compile test's odd
ones), compiled ahead of time by spec_ext/kernels/aot.py -> benchmarks/results/triton_static_sm90.csv.
CUDA: the sm_90 cubins of the built extension (spec_ext/_C*.so), read with cuobjdump
(-res-usage, -sass) -> benchmarks/results/cuda_static_sm90.csv.

Columns: registers per thread, spill_bytes (local memory per thread: stack + local),
shared_bytes per block, resident programs (CTAs) per SM against the SM's limits (65536
registers, 228 KB shared, 227 KB per block, 64 warps, 32 blocks), and for Triton the grid
against 132 SMs (waves = programs / (resident x SMs)); tensor_cores: the MMA instruction
the dots compile to (mma.sync / wgmma; "-" without a dot); load_bits: global loads by
width. These are static figures from the compiler: nothing here ran on a GPU.

    env -u TRITON_INTERPRET python benchmarks/gpu_static.py
"""
import csv
import glob
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from spec_ext.kernels import aot  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
ARCH = 90
# threads per block and dynamic shared memory of each CUDA kernel, from its launch site in
# csrc/cuda/*.cu (the binary does not record them)
CUDA_LAUNCHES = {"compact_kv_kernel": (256, 32 * 1024), "chain_verify_kernel": (256, 0),
                 "tree_verify_kernel": (256, 0), "tree_mask_kernel": (128, 0),
                 "tree_attention_kernel": (256, 2 * 4096 * 4)}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def triton_rows():
    import triton
    for shapes in ("bench", "test"):
        for row in aot.report(ARCH, shapes):
            row.update(shapes=shapes, load_bits=json.dumps(row.get("load_bits", {})), triton=triton.__version__)
            yield row


def _cuobjdump(*args) -> str:
    return subprocess.run([os.path.join(aot._TOOLS, "cuobjdump"), *args], check=True, capture_output=True,
                          text=True).stdout


def _demangle(names):
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def cuda_rows(so: str):
    """One row per kernel of the .so's sm_90 code; a single row saying so when it has none."""
    if f"sm_{ARCH}" not in _cuobjdump("--list-elf", so):
        yield dict(kernel=f"(no sm_{ARCH} cubin in {os.path.basename(so)})")
        return
    usage, arch = {}, None
    lines = _cuobjdump("-res-usage", so).splitlines()
    for i, line in enumerate(lines):
        if line.startswith("arch = "):
            arch = line.split("=")[1].strip()
        elif line.strip().startswith("Function ") and arch == f"sm_{ARCH}":
            name = line.strip()[len("Function "):].rstrip(":")
            usage[name] = {k: int(v) for k, v in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", lines[i + 1])}
    sass, current = {}, None
    for line in _cuobjdump("-sass", "-arch", f"sm_{ARCH}", so).splitlines():
        found = re.search(r"Function : (\S+)", line)
        if found:
            current = found.group(1)
            sass[current] = []
        elif current:
            sass[current].append(line)
    names = _demangle(list(usage))
    for name, res in usage.items():
        text = "\n".join(sass.get(name, []))
        base = re.search(r"(\w+_kernel)", names[name])
        threads, dynamic = CUDA_LAUNCHES.get(base.group(1) if base else "", (None, 0))
        shared = res.get("SHARED", 0) + dynamic
        loads = {}
        for op in re.findall(r"\bLDG\.E[\w.]*", text):
            width = re.search(r"\.(128|64|U16|S16|U8|S8)\b", op)
            bits = {"128": 128, "64": 64, "U16": 16, "S16": 16, "U8": 8, "S8": 8}[width.group(1)] if width else 32
            loads[bits] = loads.get(bits, 0) + 1
        mma = "wgmma (HGMMA)" if "HGMMA" in text else "mma (HMMA)" if "HMMA" in text else "-"
        yield dict(kernel=names[name], registers=res["REG"], spill_bytes=res.get("STACK", 0) + res.get("LOCAL", 0),
                   static_shared_bytes=res.get("SHARED", 0), dynamic_shared_bytes=dynamic, threads=threads,
                   resident_per_sm=aot.resident_programs(res["REG"], shared, threads // 32, aot.LIMITS[ARCH])
                   if threads else None, tensor_cores=mma, load_bits=json.dumps(dict(sorted(loads.items()))))


def write(path, rows, extra):
    rows = [dict(row, **extra) for row in rows]
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)
    print(f"{path}: {len(rows)} rows")


def main():
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("gpu_static.py: unset TRITON_INTERPRET (the interpreter never compiles)")
    os.makedirs(RESULTS, exist_ok=True)
    extra = dict(commit=commit(), static="compiler figures, not measured on a GPU")
    write(os.path.join(RESULTS, f"triton_static_sm{ARCH}.csv"), triton_rows(), extra)
    so = sorted(glob.glob(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "spec_ext", "_C*.so")))
    if so:
        build = os.path.join(os.path.dirname(so[0]), "_build_info.json")
        info = open(build).read().strip() if os.path.exists(build) else ""
        write(os.path.join(RESULTS, f"cuda_static_sm{ARCH}.csv"), cuda_rows(so[0]), dict(extra, build=info))
    else:
        print("no spec_ext/_C*.so: build the extension for the CUDA report")


if __name__ == "__main__":
    main()
