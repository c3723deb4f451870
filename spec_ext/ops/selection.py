"""What ``backend="auto"`` runs: a table by device class and op, from measurements.

Each op's entries are tried in order; the first whose backend can run here and whose
condition holds for the call's arguments (the kernel-level arguments of csrc/ops.cpp) is
taken. An entry names the benchmark rows it follows and the command that makes them. An
op without entries for a device class keeps the fixed order cuda > triton > cpu > torch
(nothing measured says otherwise). A condition reads shapes and host-side arguments only
(never a tensor's values): no host sync, and about a microsecond of host time per call
(measured 0.9-1.1 us for the CPU tree-attention choice on the shared 2-core machine, against
0.2-1 ms per layer for the kernels themselves).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# "0": auto ignores this table (the fixed order; for before/after comparisons); read at each
# call (spec_ext.ops.registry.table_on)
SWITCH = "SPEC_EXT_AUTO_TABLE"

H200_KERNELS = "issue 21's tables (H200 sm_90, fp32 probs; GPU time from CUDA-graph replay, eager: host included)"
H200_ATTENTION = ("issues 20 and 31 (H200 sm_90, bf16, Hq=32, Hkv=8, D=128, binary tree, prefix S - T, "
                  "GPU time from CUDA-graph replay)")
GPU_COMMAND = "bash benchmarks/gpu_run.sh (runs benchmarks/bench_kernels.py --graphs on the GPU)"
CPU_COMMAND = "python benchmarks/bench_kernels.py --ops attention"
REFACTORED = ("measured before the kernels were refactored (shared block steps) and before the Triton kernels "
              "were compiled ahead of time; re-measure with the command")


@dataclass(frozen=True)
class Entry:
    """``backend`` serves the calls for which ``applies(*kernel_args)`` is true (None: all)."""
    backend: str
    shapes: str
    rows: str
    command: str
    applies: Callable[..., bool] | None = None


def _no_softcap_or_sinks(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks) -> bool:
    return not softcap and sinks is None


def _cpu_sdpa_shapes(q, k, v, prefix_lens, tree_mask, scale, window, softcap, sinks) -> bool:
    """2..64 new tokens and B * Hq * T * S * D > 2^23 (S: the keys passed), except where the
    C++ kernel's GQA packing wins: GQA with T <= 16 new tokens on its batched path, whose
    B * Hq * T * S scores stay under 2^20 (4 MB: from there its scores fall out of cache)."""
    B, heads, T, D = q.shape
    kv_heads, S = k.shape[1], k.shape[2]
    if softcap or sinks is not None or not 2 <= T <= 64 or B * heads * T * S * D <= 1 << 23:
        return False
    return not (kv_heads < heads and T <= 16 and B * heads * T * S < 1 << 20)


def _sampling(target, draft_tokens, draft_probs, num_draft, uniforms, greedy, *rest) -> bool:
    return not greedy


def _greedy(target, draft_tokens, draft_probs, num_draft, uniforms, greedy, *rest) -> bool:
    return greedy


CPU_ROWS = ("benchmarks/results/kernels_cpu.csv, op tree_attention, backends cpu, sdpa and auto side by side (2 "
            "threads on a 2-core machine, where one call's time moves by up to 20% between rounds, so ratios "
            "near 1 are noise): ")
CROSSOVER_ROWS = ("benchmarks/results/tree_attention_crossover_cpu.csv, the fastest call of cpu and sdpa over "
                  "three runs (8, 10 and 6 rounds of 103 shapes, calls interleaved; 2 threads on the 2-core machine "
                  "while other test runs kept its load at 4-8: a row's median call took 1.12-1.26x its fastest "
                  "at the median row, 2.0-3.4x at the 80th percentile, and two runs' sdpa/cpu ratios of fastest "
                  "calls differ by 6-11% at the median shape, 12-28% at the 80th percentile): ")
CPU_COMMAND_CROSSOVER = "python benchmarks/bench_kernels.py --ops crossover --rounds 8 --repeats 6 --budget 0.3"
TABLE: dict[tuple[str, str], tuple[Entry, ...]] = {
    ("cpu", "tree_attention"): (
        Entry("sdpa", "2 <= T <= 64 new tokens with B*Hq*T*S*D > 2^23 (S: the keys passed), no softcap or sinks, "
                      "except GQA with T <= 16 under 2^20 scores (B*Hq*T*S: the C++ kernel's batched GEMMs)",
              CROSSOVER_ROWS + "above 2^23, GQA (groups 2, 4, 8) under 2^20 scores, SDPA / C++ time: T=4 1.19-1.65, "
              "T=8 1.11-1.37, T=12 0.98-1.23 (issue 38's B=1, Hq=16, Hkv=4, S=1512, D=64: 567 / 545 us, 1.04), "
              "T=16 0.93-1.16, T=22-32 0.85-0.99; at exactly 2^20 scores 0.64-1.11, 6 of 8 shapes below 0.83 "
              "(B=1, Hq=32, Hkv=8, S=4096, T=8: 5759 / 7022 us; the C++ batched GEMMs' scores are 4 MB there, "
              "twice a core's L2), beyond them (one head at a time, no GQA packing) 0.79-0.96; without GQA the 2^23 "
              "bound holds (B=1 and 2, Hq=32, S=512, T=4: 1.04, 0.94). This rule picks within 5% of the "
              "faster on 101 of the 103 shapes, at most 1.11x (B=4, Hq=16, Hkv=4, S=4096, T=4, exactly 2^20 "
              "scores: 0.75-3.5 between runs), then 1.08x (B=8, Hq=10, Hkv=5, S=256, T=16: 442 / 409 us); "
              "the one before it (GQA with T*Hq/Hkv <= 32 over <= 2^22 key elements) on 91, at most 1.36x. "
              "And " + CPU_ROWS + "medians, Hq=32, D=128 without GQA, T=4..64 over 2^23: SDPA 0.64-1.08 of "
              "the C++ time (B=8, S=512, T=32: 0.75-0.78); the bundled target at B=8, T=22: SDPA 0.83-0.97",
              f"{CPU_COMMAND_CROSSOVER}; {CPU_COMMAND}", _cpu_sdpa_shapes),
        Entry("cpu", "the rest: T = 1 (draft decode steps), T > 64, small calls (B*Hq*T*S*D <= 2^23: all of the "
                     "bundled pair's but its tree rounds at batch 8), GQA with T <= 16 under 2^20 scores, "
                     "softcap or sinks",
              CPU_ROWS + "T=1: the C++ loop 1.2-3.8x faster than SDPA in both runs; the bundled pair's shapes "
              "below B=8, T=22: SDPA's mask and call cost more than the whole C++ kernel (1.2-3x)", CPU_COMMAND),
    ),
    ("cuda", "tree_attention"): (
        Entry("sdpa", "every call without softcap or sinks",
              f"{H200_ATTENTION}: the cuda kernel 15-54x and triton 0.83-4.0x the time of SDPA with a dense mask "
              "(B,S,T = 1,4096,8: cuda 2562, triton 129, SDPA 91 us; 8,4096,64: 10968, 502, 203; 32,2048,16: "
              "5657, 306, 368, the one row where triton is faster; 1,32768,64: 24520, 2988, 738; 8,16384,32: "
              "27150, 1499, 734)", GPU_COMMAND, _no_softcap_or_sinks),
        Entry("torch", "softcap or sinks: the PyTorch reference, correct by construction on any device (SDPA has "
                       "neither; the CUDA and Triton kernels have both but have never run them on a GPU, and the CUDA "
                       "kernel takes 15-54x SDPA's time without them)",
              "none with softcap or sinks: until a GPU run checks and times the kernels' feature paths, these "
              "calls take the reference", GPU_COMMAND),
    ),
    ("cuda", "chain_verify"): (
        Entry("triton", "greedy verification",
              f"{H200_KERNELS}: greedy_verify B=16 K=5 V=32000 cuda 25, triton 14 us; B=64 K=8 V=128256: "
              f"130, 73 (no eager rows); {REFACTORED}", GPU_COMMAND, _greedy),
        Entry("cuda", "rejection sampling",
              f"{H200_KERNELS}: chain_rejection_sample K=5 V=32000 B=1 cuda 23 (eager 39), triton 32 (eager 84) "
              "us; B=16 40 (55), 33 (50); B=64 40, 33; B=64 K=8 V=128256 157, 184: cuda ahead in total and "
              f"eagerly, triton ahead by 7 us at B=16-64 K=5; {REFACTORED}", GPU_COMMAND, _sampling),
    ),
    ("cuda", "tree_verify"): (
        Entry("triton", "rejection sampling",
              f"{H200_KERNELS}: tree_rejection_sample T=22 B=16 V=32000 cuda 239, triton 154 us; B=64 "
              f"V=128256: 1862, 788 (no eager rows); {REFACTORED}", GPU_COMMAND, _sampling),
        Entry("cuda", "greedy verification (tree_greedy_verify: never measured on a GPU, the fixed order)",
              "none", GPU_COMMAND),
    ),
    ("cuda", "compact_kv"): (
        Entry("cuda", "every call",
              f"{H200_KERNELS}: 32 layers x (K, V) fp16 H=8 D=128: B=1 M=4 cuda 3.3 (eager 203), triton 87 (eager "
              f"1763) us; B=16 M=16 51 (112), 157 (1253); B=64 M=8 S=1024 133 (233), 189 (1962); {REFACTORED}",
              GPU_COMMAND),
    ),
}


def entries(device_type: str, op: str) -> tuple[Entry, ...]:
    """The table's entries for ``op`` on a device of type ``device_type`` ("cpu", "cuda"), in order."""
    return TABLE.get((device_type, op), ())
