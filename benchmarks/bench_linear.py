"""skinny_linear against F.linear (MKL) and against a plain copy of the same weight bytes.

For each shape (the bundled target's MLP 320 -> 864 and 864 -> 320, the weight-read regime's
320 -> 16384 and 16384 -> 320, a 4096-token vocabulary head 320 -> 4096), each weight dtype
(float32; bfloat16 weights with float32 x: the kernel reads half the bytes, F.linear gets the
weight widened beforehand, as ``auto`` does it) and each row count (1, 2, 4, 8, 16, 32), the
calls are timed in turn, round after round (a load change reaches all alike), and the
fastest of the rounds is kept for each: F.linear, skinny_linear(backend="cpu") on every ISA
path this CPU has (SPEC_EXT_CPU_ISA), and the copy of the weight into a preallocated tensor
of its dtype (``dst.copy_(weight)``; torch's clone, which also allocates, is reported
beside it). Every call reads a different copy of the weight (a ring bigger than the last
level cache for the large shapes), so the weights come from memory as in a model's forward.

Copy bandwidth: the weight's bytes over the copy's time (a copy reads and writes them: the
bytes moved are twice that). skinny_linear's bandwidth: the weight's bytes over its time;
``of_copy`` = copy time / kernel time (1.0: the kernel reads the weight as fast as a copy
copies it); the ``cpu_`` columns repeat both from the thread's CPU time (a loaded machine
takes the core away mid-call; with --threads 1 that time is not the kernel's). Writes benchmarks/results/linear_cpu.csv (one row per shape, dtype, rows and
method: the fastest and the median of the rounds, GB/s, speed-up over F.linear) and prints a
table. Run it with the machine as quiet as it gets and record ``uptime`` (printed first).

    python benchmarks/bench_linear.py [--threads 1] [--rounds 15] [--quick]

``--invariant``: the width-invariant path (docs/invariance.md) against what runs today, in
float32, bfloat16 and float16 (x and weights of one dtype), at 1 to 64 rows: per linear,
``invariant_linear`` (the kernel at every row count) against ``skinny_linear``'s auto (the
kernel or F.linear) and F.linear, weights from memory as above, on the bundled target's
shapes and the weight-read ones (linear_cpu.invariant.csv); per attention call of the
bundled target's shape (Hq 10, Hkv 5, D 32, a 200- or 500-token prefix, batch 1 and 8),
``tree_attention(invariant=True)`` against the cpu backend and auto
(linear_cpu.invariant_attention.csv); and per forward of the bundled target over a
200-token cache, the lean forward with ``invariant`` against it without (fast_linear auto)
(linear_cpu.invariant_forward.csv). Every row: the fastest of the rounds, the methods of a
shape called in turn within each round.

    python benchmarks/bench_linear.py --invariant [--threads 1] [--rounds 15] [--quick]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from spec_ext import ops
from spec_ext.ops.linear import ISA_VARIABLE, uses_kernel

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(320, 864), (864, 320), (320, 16384), (16384, 320), (320, 4096)]  # (K in, N out)
ROWS = (1, 2, 4, 8, 16, 32)
ISAS = ("portable", "avx2", "avx512")
RING_BYTES = 96 << 20  # more than this machine's 32 MB L3: each call's weight comes from memory


def isas_here() -> list[str]:
    saved = os.environ.pop(ISA_VARIABLE, None)
    try:
        best = ops.linear.cpu_isa()
    finally:
        if saved is not None:
            os.environ[ISA_VARIABLE] = saved
    return [] if best is None else list(ISAS[:ISAS.index(best) + 1])


def commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "csrc", "spec_ext"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def time_methods(methods: dict, rounds: int) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each method called once per round, in turn: the wall-clock seconds of every call, and
    the calling thread's CPU seconds (time.thread_time: without the time the thread waited
    for a core; the work of one thread only, so meaningful with --threads 1)."""
    wall, cpu = {name: [] for name in methods}, {name: [] for name in methods}
    for name, call in methods.items():  # warm-up (lazy init)
        call()
    for _ in range(rounds):
        for name, call in methods.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            call()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.thread_time() - start_cpu)
    return wall, cpu


def with_isa(isa: str, call):
    def run():
        os.environ[ISA_VARIABLE] = isa
        return call()
    return run


def bench_shape(K: int, N: int, dtype: torch.dtype, rows: tuple[int, ...], isas: list[str], rounds: int,
                portable_rows: int) -> list[dict]:
    g = torch.Generator().manual_seed(K * N)
    weight_bytes = N * K * torch.finfo(dtype).bits // 8
    ring = max(2, -(-RING_BYTES // weight_bytes))
    weights = [(torch.randn(N, K, generator=g) / K ** 0.5).to(dtype) for _ in range(ring)]
    widened = [w.float() for w in weights]  # what F.linear reads for a bfloat16 weight (auto widens it)
    copies = [w.clone() for w in weights]  # written once: no page faults in the timed copies
    turn = {"i": 0}

    def pick():
        turn["i"] = (turn["i"] + 1) % ring
        return turn["i"]

    out = []
    for M in rows:
        x = torch.randn(M, K, generator=g)
        methods = {"copy": lambda: copies[(i := pick())].copy_(weights[i]),
                   "clone": lambda: weights[pick()].clone(),
                   "F.linear": lambda: F.linear(x, widened[pick()])}
        for isa in isas:
            if isa == "portable" and M > portable_rows:
                continue  # the portable loop is a correctness path (minutes at 32 rows)
            methods[f"skinny[{isa}]"] = with_isa(isa, lambda: ops.skinny_linear(x, weights[pick()], backend="cpu",
                                                                              validate=False))
        times, cpu_times = time_methods(methods, rounds)
        os.environ.pop(ISA_VARIABLE, None)
        copy_best, linear_best = min(times["copy"]), min(times["F.linear"])
        copy_cpu, linear_cpu = min(cpu_times["copy"]), min(cpu_times["F.linear"])
        for name, t in times.items():
            best, best_cpu = min(t), min(cpu_times[name])
            out.append(dict(shape=f"{K}->{N}", K=K, N=N, weight=str(dtype).replace("torch.", ""), rows=M, method=name,
                            best_us=round(best * 1e6, 2), median_us=round(statistics.median(t) * 1e6, 2),
                            gb_per_s=round(weight_bytes / best / 1e9, 2),
                            of_copy=round(copy_best / best, 3), speedup_vs_f_linear=round(linear_best / best, 3),
                            cpu_best_us=round(best_cpu * 1e6, 2), cpu_of_copy=round(copy_cpu / max(best_cpu, 1e-9), 3),
                            cpu_speedup_vs_f_linear=round(linear_cpu / max(best_cpu, 1e-9), 3),
                            auto_takes_kernel=uses_kernel(M, weight_bytes, K), rounds=len(t)))
    return out


def print_table(rows: list[dict], isas: list[str]) -> None:
    best = {(r["shape"], r["weight"], r["rows"], r["method"]): r for r in rows}
    kernels = [f"skinny[{isa}]" for isa in isas if isa != "portable"] or [f"skinny[{isas[-1]}]"]
    head = f"{'shape':>11} {'weight':>8} {'M':>3} {'copy us':>9} {'GB/s':>6} {'F.linear':>9}"
    for k in kernels:
        head += f" {k:>15} {'GB/s':>6} {'of copy':>7} {'vs F.lin':>8} {'cpu: of copy':>12} {'vs F.lin':>8}"
    print("wall clock: fastest of the rounds; cpu: the same from the thread's CPU time (time.thread_time)")
    print(head + " auto")
    for (shape, weight, M, method), r in best.items():
        if method != "copy":
            continue
        line = f"{shape:>11} {weight:>8} {M:>3} {r['best_us']:9.1f} {r['gb_per_s']:6.1f} " \
               f"{best[(shape, weight, M, 'F.linear')]['best_us']:9.1f}"
        for k in kernels:
            s = best.get((shape, weight, M, k))
            line += f" {s['best_us']:15.1f} {s['gb_per_s']:6.1f} {s['of_copy']:7.2f} {s['speedup_vs_f_linear']:8.2f}" \
                    f" {s['cpu_of_copy']:12.2f} {s['cpu_speedup_vs_f_linear']:8.2f}" if s else " " * 62
        print(line + f" {'kernel' if r['auto_takes_kernel'] else 'F.linear'}")


INVARIANT_SHAPES = [(320, 320), (320, 160), (320, 864), (864, 320), (320, 4096), (320, 16384), (16384, 320)]
INVARIANT_ROWS = (1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def bench_invariant_linear(K: int, N: int, dtype: torch.dtype, rows: tuple[int, ...], rounds: int) -> list[dict]:
    """invariant_linear, skinny_linear's auto and F.linear on x and a weight [N, K] of one dtype."""
    g = torch.Generator().manual_seed(K * N)
    weight_bytes = N * K * torch.finfo(dtype).bits // 8
    ring = max(2, -(-RING_BYTES // weight_bytes))
    weights = [(torch.randn(N, K, generator=g) / K ** 0.5).to(dtype) for _ in range(ring)]
    turn = {"i": 0}

    def pick():
        turn["i"] = (turn["i"] + 1) % ring
        return weights[turn["i"]]

    invariant = ops.linear.invariant_linear("cpu", dtype)
    out = []
    for M in rows:
        x = torch.randn(M, K, generator=g).to(dtype)
        methods = {"invariant": lambda: invariant(x, pick(), None),
                   "auto": lambda: ops.skinny_linear(x, pick(), validate=False),
                   "F.linear": lambda: F.linear(x, pick())}
        times, _ = time_methods(methods, rounds)
        best = {name: min(t) for name, t in times.items()}
        for name, t in times.items():
            out.append(dict(kind="linear", shape=f"{K}->{N}", dtype=str(dtype)[6:], rows=M, method=name,
                            best_us=round(best[name] * 1e6, 2), median_us=round(statistics.median(t) * 1e6, 2),
                            of_auto=round(best[name] / best["auto"], 3), rounds=len(t)))
    return out


def bench_invariant_attention(dtype: torch.dtype, rounds: int) -> list[dict]:
    """tree_attention(invariant=True) against backend "cpu" and auto, the bundled target's heads."""
    g = torch.Generator().manual_seed(0)
    out = []
    for B, prefix in ((1, 200), (1, 500), (8, 200)):
        for T in (1, 2, 5, 8, 16, 33, 64):
            S = prefix + T
            q = torch.randn(B, 10, T, 32, generator=g).to(dtype)
            k, v = (torch.randn(B, 5, S, 32, generator=g).to(dtype) for _ in range(2))
            lengths = torch.full((B,), prefix)
            methods = {"invariant": lambda: ops.tree_attention(q, k, v, lengths, validate=False, invariant=True),
                       "cpu": lambda: ops.tree_attention(q, k, v, lengths, validate=False, backend="cpu"),
                       "auto": lambda: ops.tree_attention(q, k, v, lengths, validate=False)}
            times, _ = time_methods(methods, rounds)
            best = {name: min(t) for name, t in times.items()}
            for name, t in times.items():
                out.append(dict(kind="attention", shape=f"B={B},prefix={prefix},T={T},Hq=10,Hkv=5,D=32",
                                dtype=str(dtype)[6:], rows=B * T, method=name, best_us=round(best[name] * 1e6, 2),
                                median_us=round(statistics.median(t) * 1e6, 2),
                                of_auto=round(best[name] / best["auto"], 3), rounds=len(t)))
    return out


def bench_invariant_forward(dtype: torch.dtype, rounds: int) -> list[dict]:
    """One lean forward of the bundled target (T new tokens, batch 1, a 200-token cache):
    invariant against fast_linear auto (generate's default)."""
    from transformers import AutoModelForCausalLM

    from spec_ext.models import SpecCache
    from spec_ext.models.lean import LeanDecoder
    model = AutoModelForCausalLM.from_pretrained(Path(__file__).resolve().parents[1] / "models" / "stdlib-target",
                                                 dtype=dtype).eval()
    decoders = {"invariant": LeanDecoder(model, invariant=True), "auto": LeanDecoder(model, fast_linear=True)}
    g = torch.Generator().manual_seed(0)
    out = []
    for T in (1, 2, 5, 8, 16, 33):
        cache = SpecCache.for_model(model, 1, 256)
        with torch.inference_mode():
            decoders["auto"](torch.randint(0, 4096, (1, 200), generator=g), cache, torch.arange(200)[None])
        cache.advance([200])
        ids, positions = torch.randint(0, 4096, (1, T), generator=g), 200 + torch.arange(T)[None]

        def run(decoder):
            def call():
                with torch.inference_mode():
                    decoder(ids, cache, positions)  # the cache keeps 200: the new tokens are written over
            return call

        times, _ = time_methods({name: run(d) for name, d in decoders.items()}, rounds)
        best = {name: min(t) for name, t in times.items()}
        for name, t in times.items():
            out.append(dict(kind="forward", shape=f"stdlib-target,T={T},cache=200", dtype=str(dtype)[6:], rows=T,
                            method=name, best_us=round(best[name] * 1e6, 2),
                            median_us=round(statistics.median(t) * 1e6, 2),
                            of_auto=round(best[name] / best["auto"], 3), rounds=len(t)))
    return out


def invariant_main(args) -> None:
    os.environ.pop(ISA_VARIABLE, None)
    rows_list = (1, 5, 33) if args.quick else INVARIANT_ROWS
    rounds = 3 if args.quick else args.rounds
    results = {"invariant": [], "invariant_attention": [], "invariant_forward": []}
    load = os.getloadavg()
    for dtype in DTYPES:
        for K, N in INVARIANT_SHAPES:
            results["invariant"] += bench_invariant_linear(K, N, dtype, rows_list, rounds)
        results["invariant_attention"] += bench_invariant_attention(dtype, rounds)
        results["invariant_forward"] += bench_invariant_forward(dtype, rounds)
    load_after = os.getloadavg()
    version, head = getattr(__import__("spec_ext"), "__version__", "?"), commit()
    for name, rows in results.items():
        for r in rows:
            r.update(threads=args.threads, device="cpu", isa=ops.linear.cpu_isa(), load_before=f"{load[0]:.2f}",
                     load_after=f"{load_after[0]:.2f}", version=version, commit=head)
        path = args.out.with_name(f"linear_cpu.{name}.csv")
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
        table = {}
        for r in rows:
            table.setdefault((r["shape"], r["dtype"], r["rows"]), {})[r["method"]] = r["best_us"]
        for (shape, dtype, M), times in table.items():
            print(f"{shape:>40} {dtype:>8} {M:>3} " + " ".join(f"{m} {t:9.1f}" for m, t in times.items()) +
                  f"  invariant/auto {times['invariant'] / times['auto']:.2f}")
    print(f"load average before {load[0]:.2f}, after {load_after[0]:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (MKL's and the kernel's)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="rows 1, 4, 16 and 5 rounds (a smoke run)")
    parser.add_argument("--portable-rows", type=int, default=4, help="time the portable path up to this many rows")
    parser.add_argument("--out", type=Path, default=RESULTS / "linear_cpu.csv")
    parser.add_argument("--invariant", action="store_true", help="the width-invariant path against auto "
                                                                "(linear_cpu.invariant*.csv beside --out)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.invariant:
        return invariant_main(args)
    isas = isas_here()
    if not isas:
        raise SystemExit("skinny_linear's CPU kernel is not built (spec_ext._C)")
    load = os.getloadavg()
    print(f"uptime load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs; "
          f"{args.threads} thread(s); ISA paths {isas}")
    rows_list = (1, 4, 16) if args.quick else ROWS
    rounds = 5 if args.quick else args.rounds
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for K, N in SHAPES:
            rows += bench_shape(K, N, dtype, rows_list, isas, rounds, args.portable_rows)
    load_after = os.getloadavg()
    version, head = getattr(__import__("spec_ext"), "__version__", "?"), commit()
    for r in rows:
        r.update(threads=args.threads, device="cpu", load_before=f"{load[0]:.2f}", load_after=f"{load_after[0]:.2f}",
                 version=version, commit=head)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows, isas)
    print(f"load average after: {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}; wrote {args.out}")


if __name__ == "__main__":
    main()
