"""PEARL across two processes (torch.distributed, gloo) on the bundled pair, side by side
with the target alone and serial speculative decoding with the same window.

Rank 1 holds the draft and runs spec_ext.serve_draft with 1 intra-op thread;
rank 0 holds the target (1 thread during PEARL). The target alone and serial SD run on
rank 0 with every core (rank 1 idles, blocked in a receive, meanwhile). Same held-out
prompts as benchmarks/e2e.py; batch 1, greedy and T=0.7. Appends rows to
benchmarks/results/pearl_distributed_cpu.csv.

    python benchmarks/pearl_distributed.py [--prompts 8] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def load(path):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def rank_main(rank: int, rendezvous: str, args) -> None:
    import spec_ext
    from spec_ext import serve_draft, shutdown
    from spec_ext.policies import PEARL
    from spec_ext.policies import Fixed
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    if rank == 1:
        serve_draft(load(args.draft))
        return
    from transformers import AutoTokenizer
    from stdlib_data import code_prompts
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target), load(args.draft)
    prompts = code_prompts(tokenizer, "test", args.prompts, 96, seed=0)
    cores = os.cpu_count()
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows = []
    for temperature in (0.0, 0.7):
        rates = {"target alone": [], "pearl (2 processes)": [], "serial fixed k=gamma": []}
        ratios = {k: [] for k in rates}
        gammas, accepted = [], []
        for prompt in prompts:
            ids = torch.tensor([prompt])
            sample = dict(do_sample=True, temperature=temperature) if temperature else dict(do_sample=False)
            torch.set_num_threads(cores)
            started = time.perf_counter()
            with torch.inference_mode():
                alone = target.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                        pad_token_id=tokenizer.pad_token_id, **sample)
            base = args.new_tokens / (time.perf_counter() - started)
            torch.set_num_threads(1)
            policy = PEARL(mode="distributed")
            out = spec_ext.generate(target, None, [prompt], max_new_tokens=args.new_tokens, eos_token_id=[],
                                    temperature=temperature, policy=policy)
            if not temperature:
                assert torch.equal(out.sequences, alone), "PEARL's greedy output differs from the target's"
            pearl = out.stats.tokens_per_s
            gamma = out.stats.gamma
            gammas.append(gamma)
            accepted.append(out.stats.mean_accepted)
            torch.set_num_threads(cores)
            out = spec_ext.generate(target, draft, [prompt], max_new_tokens=args.new_tokens, eos_token_id=[],
                                    temperature=temperature, policy=Fixed(gamma))
            for name, rate in (("target alone", base), ("pearl (2 processes)", pearl),
                               ("serial fixed k=gamma", out.stats.tokens_per_s)):
                rates[name].append(rate)
                ratios[name].append(rate / base)
            print(f"T={temperature} gamma={gamma} alone {base:.1f} pearl {pearl:.1f} "
                  f"serial {out.stats.tokens_per_s:.1f} tok/s", flush=True)
        pearl_vs_serial = statistics.median(p / s for p, s in zip(rates["pearl (2 processes)"],
                                                                   rates["serial fixed k=gamma"]))
        for name in rates:
            rows.append(dict(method=name, batch=1, temperature=temperature,
                             tokens_per_s=round(statistics.median(rates[name]), 1),
                             speedup=round(statistics.median(ratios[name]), 3),
                             pearl_vs_serial=round(pearl_vs_serial, 3) if name.startswith("pearl") else "",
                             gamma=statistics.median(gammas), pearl_mean_accepted=round(statistics.mean(accepted), 3),
                             threads=f"alone/serial {cores}; pearl 1+1 (two processes)",
                             prompts=len(prompts), new_tokens=args.new_tokens, device=f"cpu-{cores}cores",
                             commit=commit))
    shutdown()
    path = RESULTS / "pearl_distributed_cpu.csv"
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(row)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "rdv"), args), nprocs=2, start_method="spawn")


if __name__ == "__main__":
    main()
