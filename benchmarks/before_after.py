"""Two checkouts of spec_ext side by side: the main workloads of e2e (Auto with the draft
model at B=1 and B=8, the head), block_drafters, suffix and weight_read, each timed under
both checkouts in alternation (a fresh process per run, the first checkout alternating from
pass to pass), so that a change that should not move speed can be shown not to.

Each run loads the bundled models, makes one ``accelerate`` object (kept over the run's
calls, as a server keeps it), warms it on one call, then times ``--calls`` calls of held-out
code prompts (greedy, ``--new-tokens`` tokens, no EOS) and reports tokens per second and
the greedy tokens' hash (equal across checkouts where the output is). The workloads use
only the public API, so any checkout that has it can be compared.

    OMP_NUM_THREADS=2 python benchmarks/before_after.py --checkouts /tmp/before . [--passes 3]
        [--workloads auto_b1 auto_b8 head_auto head_fixed4 dflash suffix weight_read]

Writes benchmarks/results/<name>.csv: one row per workload, checkout and pass, and prints
per workload the median tokens/s of each checkout, the spread (min-max over passes) and the
ratio of medians (second checkout over the first).
"""
from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"
WORKLOADS = ["auto_b1", "auto_b8", "head_auto", "head_fixed4", "dflash", "suffix", "weight_read"]


def run_workload(name: str, calls: int, new_tokens: int) -> dict:
    """Time one workload with the spec_ext importable here; {tokens_per_s, hash, seconds}."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import spec_ext
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from stdlib_data import code_prompts
    from weight_read import widened_target

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        return model

    torch.manual_seed(0)
    target = load(MODELS / "stdlib-target")
    prompts = code_prompts(AutoTokenizer.from_pretrained(MODELS / "stdlib-target"), count=calls * 8 + 8)
    batch = 8 if name == "auto_b8" else 1
    draft, kwargs = {
        "auto_b1": (load(MODELS / "stdlib-draft"), {}),
        "auto_b8": (load(MODELS / "stdlib-draft"), {}),
        "head_auto": (str(MODELS / "stdlib-head"), {}),
        "head_fixed4": (str(MODELS / "stdlib-head"), dict(policy=spec_ext.policies.Fixed(4))),
        "dflash": (str(MODELS / "stdlib-dflash"), dict(policy=spec_ext.policies.Fixed(3))),
        "suffix": (None, dict(policy="suffix", suffix_cache=spec_ext.SuffixCache())),
        "weight_read": (load(MODELS / "stdlib-draft"), {}),
    }[name]
    if name == "weight_read":
        target = widened_target(target, 16384)
    fast = spec_ext.accelerate(target, draft, **kwargs)
    groups = [prompts[i * batch:(i + 1) * batch] for i in range(calls + 1)]
    if name == "suffix":  # requests that revisit earlier ones: each prompt comes twice
        groups = [groups[0]] + [groups[1 + i // 2] for i in range(calls)]
    digest = hashlib.sha256()
    seconds = 0.0
    for i, group in enumerate(groups):
        ids = torch.tensor(group)
        started = time.perf_counter()
        out = fast.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                            do_sample=False)
        if i:  # the first call warms up
            seconds += time.perf_counter() - started
            digest.update(str(out[:, ids.shape[1]:].tolist()).encode())
    return dict(tokens_per_s=calls * batch * new_tokens / seconds, seconds=seconds, hash=digest.hexdigest()[:12])


def load_average() -> float:
    return os.getloadavg()[0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkouts", nargs=2, type=Path, required=True, metavar="DIR",
                        help="two source trees with spec_ext built in place (the first is the baseline)")
    parser.add_argument("--workloads", nargs="+", default=WORKLOADS, choices=WORKLOADS)
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--calls", type=int, default=4, help="timed calls per run (after one warm-up call)")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--name", default="before_after_cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_workload(args.worker, args.calls, args.new_tokens)))
        return
    for checkout in args.checkouts:
        if not (checkout / "spec_ext" / "__init__.py").is_file():
            raise SystemExit(f"--checkouts: {checkout} holds no spec_ext package")
    labels = [str(c.resolve()) for c in args.checkouts]
    rows = []
    out = ROOT / "benchmarks" / "results" / f"{args.name}.csv"
    for workload in args.workloads:
        for p in range(args.passes):
            order = [0, 1] if p % 2 == 0 else [1, 0]
            for i in order:
                env = dict(os.environ, PYTHONPATH=str(args.checkouts[i].resolve()))
                before = load_average()
                result = subprocess.run([sys.executable, __file__, "--checkouts", *labels, "--worker", workload,
                                         "--calls", str(args.calls), "--new-tokens", str(args.new_tokens)],
                                        env=env, cwd=args.checkouts[i], capture_output=True, text=True)
                if result.returncode:
                    raise SystemExit(f"{workload} under {labels[i]} failed:\n{result.stderr[-3000:]}")
                measured = json.loads(result.stdout.strip().splitlines()[-1])
                rows.append(dict(workload=workload, checkout=labels[i], passed=p, load=f"{before:.2f}", **measured))
                print(f"{workload:12s} pass {p} {labels[i]}: {measured['tokens_per_s']:.1f} tok/s "
                      f"({measured['hash']}, load {before:.2f})", flush=True)
                with open(out, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
    print(f"\n| workload | {Path(labels[0]).name} tok/s (spread) | {Path(labels[1]).name} tok/s (spread) | ratio | same tokens |")
    print("|---|---|---|---|---|")
    for workload in args.workloads:
        mine = [[r for r in rows if r["workload"] == workload and r["checkout"] == label] for label in labels]
        medians = [statistics.median(r["tokens_per_s"] for r in m) for m in mine]
        spreads = [f"{min(r['tokens_per_s'] for r in m):.0f}-{max(r['tokens_per_s'] for r in m):.0f}" for m in mine]
        same = {r["hash"] for r in mine[0]} == {r["hash"] for r in mine[1]}
        print(f"| {workload} | {medians[0]:.1f} ({spreads[0]}) | {medians[1]:.1f} ({spreads[1]}) | "
              f"{medians[1] / medians[0]:.3f} | {'yes' if same else 'no'} |")


if __name__ == "__main__":
    main()
