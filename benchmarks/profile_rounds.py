"""Where the time of a speculative generate call goes: target forwards, draft forwards and
everything else (sampling/verification kernels, cache moves, Python), next to the target
alone with HF generate on the same prompt, in the same run.

    python benchmarks/profile_rounds.py [--policy fixed] [--k 3] [--batch 1] [--repeats 3] [--dtype float32]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.models import hf  # noqa: E402
from stdlib_data import code_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policy", default="fixed")
    parser.add_argument("--k", type=int, default=3, help="draft length of --policy fixed")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"])
    args = parser.parse_args()
    dtype = args.dtype if args.dtype == "auto" else getattr(torch, args.dtype)
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target")
    target = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "stdlib-target", dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "stdlib-draft", dtype=dtype).eval()
    target.generation_config.eos_token_id = None
    ids = torch.tensor(code_prompts(tokenizer, "test", args.batch, 96, seed=0))
    policy = spec_ext.policies.Fixed(args.k) if args.policy == "fixed" else args.policy

    spent, calls = defaultdict(float), defaultdict(int)
    forward = hf.forward

    def timed_forward(model, *a, **k):
        started = time.perf_counter()
        out = forward(model, *a, **k)
        role = "target" if model is target else "draft"
        spent[role] += time.perf_counter() - started
        calls[role] += 1
        return out

    hf.forward = timed_forward
    rows = defaultdict(list)
    with torch.inference_mode():
        for _ in range(args.repeats):
            started = time.perf_counter()
            target.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                            pad_token_id=0)
            alone = time.perf_counter() - started
            spent.clear()
            calls.clear()
            out = spec_ext.generate(target, draft, ids, max_new_tokens=args.new_tokens, eos_token_id=[], policy=policy)
            wall = out.stats.wall_time
            rows["target alone ms/token"].append(alone * 1e3 / args.new_tokens)
            rows["speed-up"].append(alone / wall)
            rows["spec_ext wall ms"].append(wall * 1e3)
            for role in ("target", "draft"):
                rows[f"{role} forwards ms"].append(spent[role] * 1e3)
                rows[f"{role} ms/forward"].append(spent[role] * 1e3 / max(1, calls[role]))
            rows["everything else ms"].append((wall - spent["target"] - spent["draft"]) * 1e3)
            rows["rounds"].append(out.stats.target_calls)
            rows["mean accepted"].append(out.stats.mean_accepted)
    hf.forward = forward
    print(f"{args.policy}{f' k={args.k}' if args.policy == 'fixed' else ''}, batch {args.batch}, "
          f"{args.new_tokens} new tokens, {target.dtype}, medians of {args.repeats}:")
    for name, values in rows.items():
        print(f"  {name:24} {statistics.median(values):9.2f}")


if __name__ == "__main__":
    main()
