"""Tokens per target forward, before and after the first round that wastes nothing.

The bundled pair, greedy, on held-out stdlib prompts (batch 1 and 8), a short (24-token) and
a long (256-token) reply, with the bundled draft model (Fixed(5)) and the bundled head
(Fixed(5)): the target forwards per call and the new tokens per target forward. Counts, not
times: greedy decoding is deterministic, so one run of each gives them exactly.

"before" runs the same measurement on an earlier checkout (``--before DIR``: a source tree of
spec_ext with its extension built, e.g. ``git worktree add /tmp/before 4632205`` and a copy of
``spec_ext/_C*.so``), whose separate prefill re-read each prompt's last token in the first
round. Usage:

    python benchmarks/first_round.py [--before DIR] [--prompts 8] [--name first_round_cpu]
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LENGTHS = (24, 256)
BATCHES = (1, 8)


def measure(prompts: int) -> list[dict]:
    """One row per (draft, batch, reply length) with the code importable as ``spec_ext``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import spec_ext
    from spec_ext.policies import Fixed
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from stdlib_data import code_prompts

    def load(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # every call generates exactly max_new_tokens
        return model

    target = load(ROOT / "models" / "stdlib-target")
    drafts = {"draft model": load(ROOT / "models" / "stdlib-draft"), "head": str(ROOT / "models" / "stdlib-head")}
    texts = code_prompts(AutoTokenizer.from_pretrained(ROOT / "models" / "stdlib-target"), count=prompts)
    rows = []
    for name, draft in drafts.items():
        for batch in BATCHES:
            for new in LENGTHS:
                forwards = tokens = calls = 0
                for i in range(0, len(texts), batch):
                    out = spec_ext.generate(target, draft, texts[i:i + batch], max_new_tokens=new, eos_token_id=[],
                                            policy=Fixed(5))
                    forwards, tokens, calls = forwards + out.stats.target_calls, tokens + out.stats.new_tokens, calls + 1
                rows.append(dict(draft=name, batch=batch, new_tokens=new, forwards_per_call=round(forwards / calls, 3),
                                 tokens_per_forward=round(tokens / forwards, 4)))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, help="an earlier spec_ext checkout (built) to measure beside this one")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--name", default="first_round_cpu")
    parser.add_argument("--rows-only", action="store_true", help=argparse.SUPPRESS)  # (the --before subprocess)
    args = parser.parse_args()
    if args.rows_only:
        import spec_ext
        assert Path(spec_ext.__file__).resolve().is_relative_to(Path.cwd().resolve()), spec_ext.__file__
        print(json.dumps(measure(args.prompts)))
        return
    after = measure(args.prompts)
    before = None
    if args.before is not None:
        env = dict(os.environ, PYTHONPATH=str(args.before.resolve()))
        done = subprocess.run([sys.executable, __file__, "--rows-only", "--prompts", str(args.prompts)], env=env,
                              check=True, capture_output=True, text=True, cwd=args.before)
        before = json.loads(done.stdout.strip().splitlines()[-1])
    table = []
    for i, row in enumerate(after):
        line = dict(row)
        if before is not None:
            old = before[i]
            assert (old["draft"], old["batch"], old["new_tokens"]) == (row["draft"], row["batch"], row["new_tokens"])
            line = dict(draft=row["draft"], batch=row["batch"], new_tokens=row["new_tokens"],
                        forwards_before=old["forwards_per_call"], forwards_after=row["forwards_per_call"],
                        tokens_per_forward_before=old["tokens_per_forward"],
                        tokens_per_forward_after=row["tokens_per_forward"])
        table.append(line)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{args.name}.csv"
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {path}")
    for line in table:
        print(line)


if __name__ == "__main__":
    main()
