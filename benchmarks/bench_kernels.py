"""Kernel microbenchmarks: every available backend side by side in one run.

Appends CSV rows (op, backend, shape, device, median_us, p20_us, p80_us, extra, version,
commit; extra holds min_us, the fastest call, and repeats, the calls timed) to
benchmarks/results/kernels_<device>.csv and draws kernels_<device>.png from its latest rows
(<device>: cpu, or the GPU's name such as NVIDIA-H200)
(speed-up of each backend over the torch reference). The backends of one shape are timed
call by call in turn (a load change reaches all alike); tree_attention also has the sdpa
backend and "auto" (what spec_ext.ops.selection picks, its per-call choice included), and
the run ends with auto against the fastest backend of the same run. "crossover" times
tree_attention's C++ kernel, SDPA and auto (no reference) around the CPU table's GQA bound,
several rounds of every shape in turn, and compares the fastest call of each: on a shared
machine a call's median moves by 30%, its fastest by a few percent.

    python benchmarks/bench_kernels.py [--ops rejection tree attention kv linear policy crossover] [--quick]
"""
from __future__ import annotations

import argparse
import csv
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

import spec_ext
from spec_ext import ops, reference
from spec_ext.ops import registry, selection
from spec_ext.ops.linear import ISA_VARIABLE

RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_OF = {"chain_rejection_sample": "chain_verify", "greedy_verify": "chain_verify", "tree_rejection_sample": "tree_verify",
             "tree_greedy_verify": "tree_verify", "skinny_linear[avx512] vs F.linear": "skinny_linear",
             "skinny_linear[avx2] vs F.linear": "skinny_linear", "skinny_linear[portable] vs F.linear": "skinny_linear",
             "acceptance_head vs torch ops": "acceptance_head", "anchor: SDPA, dense tree mask": "anchor",
             "anchor: SDPA flash, causal lower-right": "anchor",
             "anchor: plain copy of the same bytes": "anchor"}  # row -> op
FIELDS = ["op", "backend", "shape", "device", "median_us", "p20_us", "p80_us", "extra", "version", "commit"]


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name().replace(" ", "-")
    return f"cpu-{torch.get_num_threads()}threads"


def device_file() -> str:
    """The device part of the results' file names: cpu, or the GPU's name."""
    return torch.cuda.get_device_name().replace(" ", "-") if torch.cuda.is_available() else "cpu"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "describe", "--always", "--dirty"], text=True,
                                       cwd=Path(__file__).parent).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def measure(fns: dict, budget_s: float = 3.0, min_repeats: int = 3, max_repeats: int = 50) -> dict:
    """Seconds per call of each function, side by side: one warm-up each, then rounds of one
    call of every function in turn until the time budget per function (at least
    min_repeats), so a change of load on a shared machine reaches every backend alike. Each
    round runs them in a new (seeded) random order: no function mostly runs right after the
    same one (after the torch reference's large temporaries, say, which leave the caches cold)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for fn in fns.values():
        fn()
        sync()
    times = {name: [] for name in fns}
    order, shuffle = list(fns.items()), random.Random(0).shuffle
    started = time.perf_counter()
    while min(map(len, times.values())) < max_repeats and (
            min(map(len, times.values())) < min_repeats or time.perf_counter() - started < budget_s * len(fns)):
        shuffle(order)
        for name, fn in order:
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    return {name: np.array(t) for name, t in times.items()}


def graph_us(fn) -> str:
    """GPU time of one call alone, from CUDA-graph replay with L2 flushed (triton.testing),
    or why it could not be captured."""
    try:
        import triton.testing
        return f"{1e3 * triton.testing.do_bench_cudagraph(fn):.2f}"
    except Exception as error:  # noqa: BLE001 - a kernel that cannot be captured is recorded, not fatal
        return f"failed:{type(error).__name__}"


def backends_for(op: str, device: str) -> list[str]:
    """The backends measured for ``op``: every one that runs here, and "auto" (what the
    measured table of spec_ext.ops.selection picks, its choice per call included) where the
    table has entries for the device."""
    if op == "anchor":  # PyTorch's own kernel, recorded as backend "torch"
        return ["torch"]
    names = ["torch"]
    if device == "cpu" and ops.registered(op, "CPU"):
        names.append("cpu")
    if device == "cuda":
        if ops.registered(op, "CUDA"):
            names.append("cuda")
        if spec_ext.backends()["triton"] == "available":
            names += [b for b in registry.backends_of(op) if b.startswith("triton")]
    names += [b for b in registry.backends_of(op) if b == "sdpa"]
    if selection.entries(device, op):
        names.append("auto")
    return names


def rejection_cases(device, quick):
    grid = [(B, K, V) for B in (1, 16, 64) for K in (1, 5, 8) for V in (32000, 128256)]
    if quick:
        grid = [(16, 5, 32000)]
    for B, K, V in grid:
        g = torch.Generator().manual_seed(0)
        p = torch.softmax(torch.randn(B, K + 1, V, generator=g) * 3, -1).to(device)
        q = torch.softmax(torch.randn(B, K, V, generator=g) * 3, -1).to(device)
        drafts = torch.multinomial(q.view(-1, V).cpu(), 1, generator=g).view(B, K).to(device)
        u = torch.rand(B, K + 1, dtype=torch.float64, generator=g).to(device)
        nd = torch.full((B,), K, device=device)
        moved = p.numel() * 4 + q.numel() * 4

        def run(backend, p=p, q=q, drafts=drafts, u=u, nd=nd):
            return lambda: spec_ext.chain_rejection_sample(p, drafts, q, nd, u, backend=backend, validate=False)
        yield "chain_rejection_sample", f"B={B},K={K},V={V}", run, f"bytes_if_read_once={moved}"
        if (B, K, V) in ((16, 5, 32000), (64, 8, 128256)):  # logits read once: the greedy limit
            def greedy(backend, p=p, drafts=drafts, nd=nd):
                return lambda: spec_ext.greedy_verify(p, drafts, nd, backend=backend, validate=False)
            yield "greedy_verify", f"B={B},K={K},V={V}", greedy, f"bytes_if_read_once={p.numel() * 4}"


def tree_cases(device, quick):
    parents = torch.tensor(spec_ext.policies.Tree((3, 2, 1, 1)).parents)
    T, V = len(parents), 32000
    for B in ((16,) if quick else (1, 16, 64)):
        g = torch.Generator().manual_seed(0)
        p = torch.softmax(torch.randn(B, T, V, generator=g) * 3, -1).to(device)
        tokens = torch.topk(torch.randn(B, T, V, generator=g), 3, -1).indices[..., 0].to(device)
        u = torch.rand(B, T + 1, dtype=torch.float64, generator=g).to(device)
        par = parents.to(device)

        def sample(backend, p=p, tokens=tokens, u=u, par=par):
            return lambda: spec_ext.tree_rejection_sample(p, tokens, par, uniforms=u, max_depth=4, backend=backend,
                                                          validate=False)

        def greedy(backend, p=p, tokens=tokens, par=par):
            return lambda: spec_ext.tree_greedy_verify(p, tokens, par, max_depth=4, backend=backend, validate=False)
        yield "tree_rejection_sample", f"B={B},T={T},V={V}", sample, f"bytes_if_read_once={p.numel() * 4}"
        yield "tree_greedy_verify", f"B={B},T={T},V={V}", greedy, f"bytes_if_read_once={p.numel() * 4}"
    g = torch.Generator().manual_seed(0)
    for B, T in (((64, 64),) if quick else ((1, 22), (64, 64))):
        parents_bt = torch.stack([torch.cat([torch.tensor([-1]), (torch.rand(T - 1, generator=g) *
                                  torch.arange(1, T)).long()]) for _ in range(B)]).to(device)

        def build(backend, parents_bt=parents_bt):
            return lambda: spec_ext.tree_mask(parents_bt, backend=backend, validate=False)
        yield "tree_mask", f"B={B},T={T}", build, f"bytes={parents_bt.numel() * 8 * 2}"


def attention_cases(device, quick, grid=None):
    """tree_attention on a binary tree over a prefix of S - T keys, beside what a model runs
    otherwise: SDPA with the dense [T, S] mask HF builds, and (GPU) SDPA's causal
    lower-right kernel on the same shape as a chain (the speed bar for a tree). ``grid``:
    these (B, S, T, Hq, Hkv, D) in float32, tree_attention alone."""
    if grid is not None:
        dtype = torch.float32
    elif device == "cpu":  # 32 heads of 128 with and without GQA; the bundled target's and draft's heads
        grid = [(B, S, T, 32, Hkv, 128) for Hkv in (32, 8) for B in (1, 8) for S in (512, 4096)
                for T in (1, 4, 8, 32, 64)]
        grid += [(B, 256, T, 10, 5, 32) for B in (1, 8) for T in (1, 6, 22)] + [(B, 256, 1, 6, 6, 32) for B in (1, 8)]
        dtype = torch.float32
    else:  # the shapes of the tree-attention issue, Llama-3-8B's heads (GQA 32 / 8)
        grid = [(1, 4096, 8, 32, 8, 128), (1, 4096, 64, 32, 8, 128), (8, 4096, 8, 32, 8, 128),
                (8, 4096, 64, 32, 8, 128), (32, 2048, 16, 32, 8, 128), (1, 32768, 64, 32, 8, 128),
                (8, 16384, 32, 32, 8, 128)]
        dtype = torch.bfloat16
    anchors = grid is None
    if quick and anchors:
        grid = grid[:1]
    for B, S, T, H, Hkv, D in grid:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, T, D, generator=g).to(device, dtype)
        k = torch.randn(B, Hkv, S, D, generator=g).to(device, dtype)
        v = torch.randn(B, Hkv, S, D, generator=g).to(device, dtype)
        parents = torch.tensor([-1] + [(i - 1) // 2 for i in range(1, T)])
        mask = spec_ext.tree_mask(parents)[1].to(device)
        prefix = torch.full((B,), S - T, device=device)
        dense = reference.visibility(prefix, mask, T, S)[:, None]  # [B,1,T,S] bool
        flops = 4 * B * H * T * S * D
        shape = f"B={B},Hq={H},Hkv={Hkv},S={S},T={T},D={D},{str(dtype)[6:]}"
        moved = f"bytes={2 * B * Hkv * S * D * q.element_size()}"

        def run(backend, q=q, k=k, v=v, mask=mask, prefix=prefix):
            return lambda: spec_ext.tree_attention(q, k, v, prefix, mask, backend=backend, validate=False)
        yield "tree_attention", shape, run, f"flops={flops};{moved}"
        if not anchors:
            continue

        def sdpa_dense(backend, q=q, k=k, v=v, dense=dense):
            return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
        yield "anchor: SDPA, dense tree mask", shape, sdpa_dense, moved
        if device == "cuda":
            from torch.nn.attention.bias import causal_lower_right

            def sdpa_causal(backend, q=q, k=k, v=v, T=T, S=S):
                bias = causal_lower_right(T, S)
                return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
            yield "anchor: SDPA flash, causal lower-right", shape, sdpa_causal, moved


def crossover_cases(device, quick):
    """tree_attention on CPU where the C++ kernel's GQA packing and SDPA cross: groups of 2,
    4 and 8 query heads per KV head, T = 4..32 new tokens, over B * S * Hkv * D from 2^17 to
    2^24 key elements, on both sides of the C++ kernel's switch from batched GEMMs to one
    head at a time (B * Hq * T * S > 2^20 scores); the bundled target's heads at batch 8; a
    few rows without GQA on both sides of the 2^23 size bound. A binary tree over a prefix of
    S - T keys, as attention_cases."""
    if device != "cpu":
        return
    grid = [(B, S, T, Hq, Hkv, D) for Hq, Hkv, D in ((16, 4, 64), (32, 8, 128)) for B in (1, 4)
            for S in (512, 1512, 4096) for T in (4, 8, 12, 16, 24, 32)]
    grid += [(1, S, T, 32, 4, 128) for S in (1512, 4096) for T in (4, 8, 12, 16)]
    grid += [(1, S, T, Hq, Hkv, D) for Hq, Hkv, D in ((16, 8, 64), (32, 16, 128)) for S in (1512, 4096)
             for T in (4, 8, 16, 24)]
    grid += [(8, 256, T, 10, 5, 32) for T in (8, 16, 22)]
    grid += [(B, 512, 4, 32, 32, 128) for B in (1, 2)] + [(1, 1512, T, 16, 16, 64) for T in (8, 16)]
    if quick:
        grid = [(1, 1512, 12, 16, 4, 64)]
    for case in attention_cases(device, quick, grid):
        yield case


def kv_cases(device, quick):
    grid = [(B, M, 4096) for B in (1, 16) for M in (4, 16)]
    if device == "cuda":
        grid.append((64, 8, 1024))
    if quick:
        grid = [(1, 4, 4096)]
    L, H, D = 32, 8, 128
    for B, M, S in grid:
        caches = torch.empty(2 * L, B, H, S, D, dtype=torch.float16, device=device)
        src = (torch.arange(M, device=device) * 2 + 100).expand(B, M).contiguous()
        dst = torch.full((B,), 100, device=device)
        moved = 2 * (2 * L) * B * H * M * D * 2  # read + write, fp16
        shape = f"L={L},B={B},H={H},S={S},D={D},M={M},fp16"

        def run(backend, caches=caches, src=src, dst=dst):
            return lambda: spec_ext.compact_kv(caches, src, dst, backend=backend, validate=False)
        yield "compact_kv", shape, run, f"bytes={moved}"
        plain = torch.empty(moved // 4, dtype=torch.float16, device=device), \
            torch.empty(moved // 4, dtype=torch.float16, device=device)

        def copy(backend, plain=plain):  # the same bytes read and written by one contiguous copy
            return lambda: plain[0].copy_(plain[1])
        yield "anchor: plain copy of the same bytes", shape, copy, f"bytes={moved}"


def linear_cases(device, quick):
    """skinny_linear against what a model runs otherwise, F.linear (MKL on CPU; the "torch"
    rows here), on cold weights: each call takes the next matrix of a ring over 96 MB, so
    the weights come from memory as they do in a forward."""
    if device != "cpu":
        return
    grid = [(864, 320, M) for M in (1, 5, 8, 40)] + [(4096, 4096, M) for M in (1, 5, 16)]
    if quick:
        grid = [(864, 320, 5)]
    best = ops.linear.cpu_isa()
    isas = ["avx512", "avx2", "portable"][["avx512", "avx2", "portable"].index(best):] if best else []
    try:
        for N, K, M in grid:
            ring = [torch.randn(N, K) for _ in range(max(2, (96 << 20) // (N * K * 4)))]
            x = torch.randn(M, K)
            turn = iter(range(1 << 62))
            for isa in isas:  # each instruction-set path the CPU has, forced, beside F.linear

                def run(backend, ring=ring, x=x, turn=turn, isa=isa):
                    if backend == "torch":
                        return lambda: torch.nn.functional.linear(x, ring[next(turn) % len(ring)])
                    os.environ[ISA_VARIABLE] = isa  # stays set while this row is measured
                    return lambda: spec_ext.ops.skinny_linear(x, ring[next(turn) % len(ring)], backend=backend)
                yield f"skinny_linear[{isa}] vs F.linear", f"M={M},N={N},K={K},float32", run, f"bytes={N * K * 4}"
    finally:
        os.environ.pop(ISA_VARIABLE, None)


def policy_cases(device, quick):
    """acceptance_head (SpecDecPP's decision per draft step) against the float32 torch ops
    it replaces (the "torch" rows: draft_features, the predictor, a sigmoid), with the
    bundled draft's sizes (H=192, V=4096) and a 64-wide one-block head."""
    if device != "cpu":
        return
    from spec_ext.policies import ResidualMLP, draft_features
    head = ResidualMLP(192 + 3, hidden=64, depth=1)
    for B in ((1,) if quick else (1, 8)):
        hidden, probs = torch.randn(B, 192), torch.softmax(4 * torch.randn(B, 4096), -1)
        weights = head.weights()

        def run(backend, hidden=hidden, probs=probs, weights=weights):
            if backend == "torch":
                return lambda: torch.sigmoid(head(draft_features(hidden, probs))[:, 0])
            return lambda: ops.acceptance_head(hidden, probs, weights, 0, 1e-5, validate=False)
        yield "acceptance_head vs torch ops", f"B={B},H=192,V=4096,D=64,depth=1,float32", run, f"bytes={B * 4096 * 4}"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ops", nargs="+", default=["rejection", "tree", "attention", "kv", "linear", "policy"],
                        help="families (crossover: only when asked)")
    parser.add_argument("--quick", action="store_true", help="one shape per op")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds of repeats per measurement")
    parser.add_argument("--rounds", type=int, default=1,
                        help="crossover: time every shape this many times, a round over all shapes each")
    parser.add_argument("--repeats", type=int, default=50, help="at most this many calls per backend and shape")
    parser.add_argument("--graphs", action="store_true",
                        help="CUDA: also the GPU time alone (CUDA-graph replay) of every kernel that does not sync")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    families = {"rejection": rejection_cases, "tree": tree_cases, "attention": attention_cases, "kv": kv_cases,
                "linear": linear_cases, "policy": policy_cases, "crossover": crossover_cases}
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"kernels_{device_file()}.csv"
    rows = []
    with ResultFiles() as files:
        for family in args.ops:
            # the crossover's rows (no reference, rounds of each shape) have a file of their own
            writer, f = files.get(RESULTS / f"tree_attention_crossover_{device_file()}.csv" if family == "crossover"
                                  else out)
            cases = list(families[family](device, args.quick))
            if family == "crossover":  # rounds over all shapes: a load change reaches each shape alike
                cases = [case for _ in range(args.rounds) for case in cases]
            for op, shape, run, extra in tqdm(cases, desc=family):
                backends = backends_for(KERNEL_OF.get(op, op), device)
                if family == "crossover":  # the two sides of the choice and the choice itself
                    backends = [b for b in backends if b != "torch"]
                fns = {backend: run(backend) for backend in backends}
                for backend, t in measure(fns, budget_s=args.budget, max_repeats=args.repeats).items():
                    t = t * 1e6
                    row_extra = f"{extra};min_us={t.min():.2f};repeats={len(t)}"
                    if args.graphs and device == "cuda" and (backend != "torch" or op.startswith("anchor")):
                        # the torch reference syncs with the host: it cannot be captured
                        row_extra = f"{row_extra};graph_us={graph_us(fns[backend])}"
                    row = dict(op=op, backend=backend, shape=shape, device=device_name(),
                               median_us=round(float(np.median(t)), 2), p20_us=round(float(np.percentile(t, 20)), 2),
                               p80_us=round(float(np.percentile(t, 80)), 2), extra=row_extra,
                               version=spec_ext.__version__, commit=commit())
                    writer.writerow(row)
                    f.flush()
                    rows.append(row)
    report(rows)
    auto_report(rows)
    if "crossover" in args.ops:
        crossover_report(rows)
    if out.exists():
        plot(latest_rows(out, device_name()), RESULTS / f"kernels_{device_file()}.png")


class ResultFiles:
    """CSV files opened for appending (a header when new), one writer each."""

    def __init__(self):
        self.open = {}

    def get(self, path: Path):
        if path not in self.open:
            new = not path.exists()
            f = path.open("a", newline="")
            writer = csv.DictWriter(f, FIELDS)
            if new:
                writer.writeheader()
            self.open[path] = writer, f
        return self.open[path]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for _, f in self.open.values():
            f.close()


def latest_rows(path: Path, device: str) -> list[dict]:
    """The newest row of every (op, shape, backend) measured on ``device``, so the plot
    covers every family even when a run measured only some of them."""
    latest = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            if row["device"] == device:
                row["median_us"] = float(row["median_us"])
                latest[(row["op"], row["shape"], row["backend"])] = row
    return list(latest.values())


def report(rows):
    by_key = {}
    for r in rows:
        by_key.setdefault((r["op"], r["shape"]), {})[r["backend"]] = r
    print(f"\n{'op':24} {'shape':44} {'backend':8} {'median us':>12} {'vs torch':>9} {'achieved':>14}")
    for (op, shape), group in by_key.items():
        if "torch" not in group:  # crossover rows: crossover_report
            continue
        ref = group["torch"]["median_us"]
        for backend, r in group.items():
            fields = dict(part.split("=", 1) for part in r["extra"].split(";") if "=" in part)
            us = float(fields["graph_us"]) if fields.get("graph_us", "failed")[0].isdigit() else r["median_us"]
            moved = fields.get("bytes", fields.get("bytes_if_read_once"))
            achieved = (f"{float(moved) / (us * 1e-6) / 1e9:.1f} GB/s" if moved else
                        f"{float(fields['flops']) / (us * 1e-6) / 1e12:.2f} TFLOP/s" if "flops" in fields else "")
            graph = f" (GPU alone {fields['graph_us']} us)" if "graph_us" in fields else ""
            print(f"{op:24} {shape:44} {backend:8} {r['median_us']:12.1f} {ref / r['median_us']:8.1f}x "
                  f"{achieved:>14}{graph}")


def auto_report(rows):
    """For every shape with an "auto" row: what auto took against the fastest backend of the
    same run (the goal: within 5%)."""
    by_key = {}
    for r in rows:
        by_key.setdefault((r["op"], r["shape"]), {})[r["backend"]] = r["median_us"]
    lines = []
    for (op, shape), times in by_key.items():
        if "auto" in times:
            fastest = min((b for b in times if b != "auto"), key=times.get)
            lines.append(f"{op:16} {shape:44} auto {times['auto']:10.1f} us, fastest {fastest:7} {times[fastest]:10.1f}"
                         f" us: auto / fastest = {times['auto'] / times[fastest]:.3f}")
    if lines:
        print("\nauto against the fastest backend of the same run:\n" + "\n".join(lines))


def fastest_us(row) -> float:
    """The fastest call of a row (min_us in extra; the 20th percentile in rows from before it)."""
    fields = dict(part.split("=", 1) for part in row["extra"].split(";") if "=" in part)
    return float(fields.get("min_us", row["p20_us"]))


def crossover_report(rows):
    """Per shape, over the rounds of this run: the fastest call of the C++ kernel and of
    SDPA, their ratio in each round (the spread says how far the noise reached) and what
    auto took."""
    by_shape = {}
    for r in rows:
        if r["op"] == "tree_attention":
            by_shape.setdefault(r["shape"], []).append(r)
    print(f"\n{'shape':46} {'cpu min us':>10} {'sdpa min us':>11} {'sdpa/cpu per round':>26} {'auto/best':>9}")
    for shape, group in by_shape.items():
        best = {}
        for r in group:
            best[r["backend"]] = min(best.get(r["backend"], float("inf")), fastest_us(r))
        rounds = [fastest_us(s) / fastest_us(c) for c, s in zip((r for r in group if r["backend"] == "cpu"),
                                                                (r for r in group if r["backend"] == "sdpa"))]
        auto = best.get("auto", float("nan")) / min(best.get("cpu", float("inf")), best.get("sdpa", float("inf")))
        print(f"{shape:46} {best.get('cpu', float('nan')):10.0f} {best.get('sdpa', float('nan')):11.0f} "
              f"{' '.join(f'{x:.2f}' for x in rounds):>26} {auto:9.3f}")


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ops_ = sorted({r["op"] for r in rows if not r["op"].startswith("anchor")})  # anchors: one bar, no ratio
    fig, axes = plt.subplots(len(ops_), 1, figsize=(11, 3.2 * len(ops_)), squeeze=False)
    for ax, op in zip(axes[:, 0], ops_):
        shapes = list(dict.fromkeys(r["shape"] for r in rows if r["op"] == op))
        backends = [b for b in ("cpu", "cuda", "triton", "triton_split", "sdpa", "auto")
                    if any(r["backend"] == b and r["op"] == op for r in rows)]
        for i, backend in enumerate(backends):
            speedups = []
            for shape in shapes:
                group = {r["backend"]: r["median_us"] for r in rows if r["op"] == op and r["shape"] == shape}
                speedups.append(group["torch"] / group[backend] if backend in group else 0)
            ax.bar(np.arange(len(shapes)) + i * 0.8 / len(backends), speedups, 0.8 / len(backends), label=backend)
        ax.axhline(1, color="gray", lw=0.8)
        ax.set_xticks(np.arange(len(shapes)), shapes, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("speed-up vs torch ref")
        ax.set_yscale("log")
        ax.set_title(f"{op} ({rows[0]['device']})")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
