"""How often feature heads and the draft model agree with the target's greedy continuations of
code the pair never saw (the installed click and jinja2 sources), teacher forced: the first
draft's agreement, the next three's given the ones before agreed, and the accepted drafts per
round at k = 4 that this gives (what a round of greedy speculative decoding accepts from a root
on the target's text). Every drafter is measured on the same sequences, side by side.

    python benchmarks/head_agreement.py [--heads models/stdlib-head DIR ...] [--prompts 64]

Writes benchmarks/results/head_agreement_cpu.csv (one row per drafter; a head's training step
and seconds when its training.json says them).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_data import code_prompts  # noqa: E402

from spec_ext.models.eagle import load_head  # noqa: E402
from spec_ext.training.corpus import continuations, tap_features  # noqa: E402
from spec_ext.training.head import agreement  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 4


@torch.no_grad()
def draft_model_agreement(target, draft, sequences: torch.Tensor, start: int) -> dict:
    """The draft model's teacher-forced runs: its argmax at position i against the target's,
    a round rooted at token i accepting the run of agreements from i on (at most K)."""
    agree = (draft(sequences).logits.argmax(-1) == target(sequences).logits.argmax(-1)).int()
    windows = agree[:, start - 1:].unfold(1, K, 1)  # [N, roots, K]: the drafts of a round rooted at each token
    run = windows.cumprod(-1).sum(-1).flatten()
    at_least = [float((run >= j).double().mean()) for j in range(K + 1)]
    return dict(first=at_least[1], conditional=[at_least[j + 1] / max(at_least[j], 1e-9) for j in range(1, K)],
                accepted_per_round=sum(at_least[1:]), positions=len(run))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--heads", type=Path, nargs="+", default=[ROOT / "models" / "stdlib-head"])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "agreement")
    parser.add_argument("--name", default="head_agreement_cpu")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=torch.float32).eval()
    prompts = code_prompts(tokenizer, "thirdparty", args.prompts, args.prompt_tokens, seed=0)
    sequences = continuations(target, prompts, args.new_tokens, True, 32,
                              args.work / f"thirdparty_{args.prompts}x{args.prompt_tokens}+{args.new_tokens}.pt")
    rows = [dict(drafter="draft model " + args.draft.name, step="", seconds="",
                 **draft_model_agreement(target, draft, sequences, args.prompt_tokens))]
    embed, target_head = target.get_input_embeddings(), target.get_output_embeddings()
    for path in args.heads:
        head = load_head(path).eval()
        ids = head.config.layer_ids
        features, last = tap_features(target, sequences, ids, None)
        log = path / "training.json"
        history = json.loads(log.read_text())["history"] if log.exists() else [{}]
        # pair t drafts from root t + 1: from P - 2 on, the rounds rooted where the draft model's are
        result = agreement(head, embed, target_head, (sequences, features, last), K, args.prompt_tokens - 2)
        rows.append(dict(drafter="head " + path.name, step=history[-1].get("step", ""),
                         seconds=history[-1].get("seconds", ""), **result))
    out = ROOT / "benchmarks" / "results" / f"{args.name}.csv"
    with out.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["drafter", "training_step", "training_seconds", "first_draft", "conditional_2_3_4",
                         "accepted_per_round_k4", "rounds"])
        for r in rows:
            writer.writerow([r["drafter"], r["step"], r["seconds"], f"{r['first']:.3f}",
                             " / ".join(f"{c:.2f}" for c in r["conditional"]), f"{r['accepted_per_round']:.2f}",
                             r["positions"]])
            print(f"{r['drafter']:40} first {r['first']:.3f}  conditional "
                  f"{' / '.join(f'{c:.2f}' for c in r['conditional'])}  accepted per round (k={K}) "
                  f"{r['accepted_per_round']:.2f}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
