"""Speculative decoding with the target split across processes by transformers' tensor
parallelism: a runnable example and its CPU benchmark.

    torchrun --nproc-per-node 2 benchmarks/tp_generate.py       # the example: text and tokens/s on rank 0
    python benchmarks/tp_generate.py --compare                  # 2 ranks x 1 thread vs 1 process x 2 threads

Every rank loads the target with ``DistributedConfig(tp_size=N)`` and the draft whole, and
calls ``spec_ext.generate`` with the same arguments; rank 0 drafts, verifies and samples,
the others run their shard of each target forward, and every rank gets the same output.
The bundled target has 5 key-value heads, which do not split in 2: this script gives each
query head its own copy of its key-value head (10 of them; the same function, exactly) and
saves that copy to a temporary folder to load it split. ``--compare`` runs the same
measurement on 2 ranks x 1 thread (torchrun, gloo) and in 1 process x 2 threads, side by
side: tokens/s and the time per target forward spent in collectives (the forward's own
all-reduces and all-gathers, and spec_ext's broadcast of each forward's inputs to the
other ranks). Writes benchmarks/results/tp_cpu.csv.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ("fixed", "auto", "tree")


def heads_for_splitting(target_dir: Path, folder: str) -> str:
    """Save to ``folder`` the target with one key-value head per query head (GQA -> MHA:
    head h of k_proj/v_proj becomes heads 2h and 2h+1 when 2 query heads share it)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    config = model.config
    repeat = config.num_attention_heads // config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.k_proj, layer.self_attn.v_proj):
                weight = proj.weight.view(config.num_key_value_heads, head_dim, -1)
                proj.weight = torch.nn.Parameter(weight.repeat_interleave(repeat, 0).reshape(-1, weight.shape[-1]))
    config.num_key_value_heads = config.num_attention_heads
    model.save_pretrained(folder)
    return folder


class CollectiveClock:
    """Time spent waiting for the target forward's collectives (functional collectives:
    the caller blocks in ``wait_tensor``)."""

    def __init__(self):
        from torch.distributed import _functional_collectives as fc
        self.seconds, self.calls, wait = 0.0, 0, fc.wait_tensor

        def timed(tensor):
            started = time.perf_counter()
            out = wait(tensor)
            self.seconds += time.perf_counter() - started
            self.calls += 1
            return out
        fc.wait_tensor = timed


def measure(args, split_dir: str | None = None) -> list[dict]:
    """Rows of tokens/s, with the target split (loaded from ``split_dir``) or whole."""
    import spec_ext
    from spec_ext.engine.tensor_parallel import channel
    from stdlib_data import code_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer
    rank = int(os.environ.get("RANK", 0))
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    split, clock = split_dir is not None, None
    if split:
        from transformers.distributed import DistributedConfig
        target = AutoModelForCausalLM.from_pretrained(
            split_dir, dtype=torch.float32,
            distributed_config=DistributedConfig(tp_size=int(os.environ["WORLD_SIZE"]))).eval()
        clock = CollectiveClock()
    else:
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    prompts = code_prompts(tokenizer, "test", args.prompts, 96, seed=0)
    n = args.new_tokens
    spec_ext.generate(target, draft, prompts[:1], max_new_tokens=8, eos_token_id=[], policy="fixed")  # warm-up
    rates = {name: [] for name in ("target alone",) + POLICIES}
    collective = {name: [] for name in rates}
    broadcast = {name: [] for name in rates}
    forwards = {name: 0 for name in rates}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        for name in rates:
            before = (clock.seconds if clock else 0.0, channel(target).seconds if split else 0.0)
            started = time.perf_counter()
            if name == "target alone":
                with torch.inference_mode():
                    alone = target.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                            pad_token_id=tokenizer.eos_token_id)
                calls = n
            else:
                out = spec_ext.generate(target, draft, ids, max_new_tokens=n, eos_token_id=[], policy=name)
                assert torch.equal(out.sequences, alone), f"{name}: greedy output differs from the target's"
                calls = out.stats.target_calls
            rates[name].append(n / (time.perf_counter() - started))
            forwards[name] += calls
            if split:
                collective[name].append((clock.seconds - before[0]) / calls)
                broadcast[name].append((channel(target).seconds - before[1]) / calls)
        if rank == 0 and args.show:
            print(tokenizer.decode(alone[0]), flush=True)
            print("-" * 60, flush=True)
    setup = f"{os.environ.get('WORLD_SIZE', 1)} ranks x 1 thread (tensor-parallel)" if split else \
        f"1 process x {torch.get_num_threads()} threads"
    rows = []
    for name, values in rates.items():
        rows.append(dict(setup=setup, method=name, tokens_per_s=round(statistics.median(values), 1),
                         speedup=round(statistics.median(v / a for v, a in zip(values, rates["target alone"])), 3),
                         forwards_per_token=round(forwards[name] / (n * len(prompts)), 3),
                         collective_ms_per_forward=round(1e3 * statistics.median(collective[name]), 3)
                         if split else "",
                         broadcast_ms_per_forward=round(1e3 * statistics.median(broadcast[name]), 3)
                         if split and name != "target alone" else "",
                         prompts=len(prompts), new_tokens=n))
    return rows


def run_split(args) -> None:
    """Under torchrun: every rank runs the measurement; rank 0 prints it (and saves it)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        # before the process group exists: with one, save_pretrained writes on rank 0 only
        split_dir = heads_for_splitting(args.target, tmp)
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        rows = measure(args, split_dir)
    if dist.get_rank() == 0:
        for row in rows:
            print(row, flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def compare(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "split.json")
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", __file__, "--out", out,
                   "--prompts", str(args.prompts), "--new-tokens", str(args.new_tokens)]
        subprocess.run(command, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        split_rows = json.loads(Path(out).read_text())
    torch.set_num_threads(2)
    rows = measure(args) + split_rows
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "tp_cpu.csv"
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(row)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--compare", action="store_true", help="run 2 ranks x 1 thread and 1 process x 2 threads")
    parser.add_argument("--show", action="store_true", help="print each continuation (rank 0)")
    parser.add_argument("--out", help="(under torchrun) also save rank 0's rows to this JSON file")
    args = parser.parse_args()
    if args.compare:
        compare(args)
    elif "RANK" in os.environ:
        run_split(args)
    else:
        parser.error("run under torchrun (torchrun --nproc-per-node 2 benchmarks/tp_generate.py) or with --compare")


if __name__ == "__main__":
    main()
