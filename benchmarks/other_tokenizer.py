"""A draft with another tokenizer against the bundled draft, on the bundled target, side by side in one run.

The second draft, ``models/stdlib-draft-sp`` (``python benchmarks/train_other_draft.py``: a
SentencePiece-style tokenizer of 3000 tokens and a draft of the bundled draft's shape trained
on it, then on the target's re-tokenised greedy continuations), drafts through
:class:`spec_ext.drafters.OtherTokenizerDrafter` in each mode (token-level intersection,
string-level exact match, and auto: both measured, then the better); the bundled draft (the
target's tokenizer, distilled from the target) drafts as usual. Each under a fixed draft
length, the Auto length policy, and beside the text's n-gram drafts (``policy="ngram"``: rows
whose text repeats draft from it, the others from the draft model). Held-out stdlib prompts,
greedy, batch 1 and batch 8; tokens/s against the target alone (HF generate) in the same
pass (the median of the per-call ratios, each prompt or batch of 8 against the target alone
on it just before, and their least and greatest: at batch 8 a call lasts as long as its
slowest row, so the spread is wide), accepted drafts per round, and whether the outputs are
identical to the target's.

    python benchmarks/other_tokenizer.py [--prompts 32] [--repeats 3] [--new-tokens 128] [--name other_tokenizer_cpu]

Writes benchmarks/results/<name>.csv.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.bundled import bundled_path  # noqa: E402
from spec_ext.policies import Fixed  # noqa: E402
from spec_ext.vocab import vocab_map  # noqa: E402
from stdlib_data import code_prompts  # noqa: E402
from constrained import write_rows  # noqa: E402
from e2e import timed  # noqa: E402



def load(name: str):
    path = bundled_path(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every method generates exactly --new-tokens
    return model, AutoTokenizer.from_pretrained(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--k", type=int, default=4, help="the fixed draft length")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--name", default="other_tokenizer_cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    target, tokenizer = load("stdlib-target")
    draft, _ = load("stdlib-draft")
    other, other_tokenizer = load("stdlib-draft-sp")
    share = vocab_map(other_tokenizer, tokenizer)
    methods = {}
    # no suffix cache ("ngram" keeps one by default): the repeats would draft the earlier repeats' outputs
    for policy, name, modes in ((lambda: Fixed(args.k), f"fixed k={args.k}", ("tli", "slem", "auto")),
                                (lambda: "auto", "auto", ("tli", "slem", "auto")),
                                (lambda: "ngram", "beside n-gram drafts", ("slem", "auto"))):
        methods[f"same tokenizer (bundled draft), {name}"] = spec_ext.accelerate(target, draft, policy=policy(),
                                                                                 suffix_cache=False)
        for mode in modes:
            methods[f"other tokenizer ({mode}), {name}"] = spec_ext.accelerate(
                target, other, policy=policy(), tokenizer=tokenizer, draft_tokenizer=other_tokenizer,
                tokenizer_mode=mode, suffix_cache=False)
    prompts = code_prompts(tokenizer, "test", args.prompts)
    rows = []
    for batch in args.batches:
        groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        per = {name: dict(rates=[], ratios=[], accepted=[], identical=0, runs=0) for name in methods}
        alone_rates = []
        for _ in range(args.repeats):
            for group in groups:
                width = max(map(len, group))
                ids = torch.tensor([[0] * (width - len(p)) + p for p in group])
                mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
                expected, seconds = timed(lambda: target.generate(ids, attention_mask=mask,
                                                                  max_new_tokens=args.new_tokens, do_sample=False,
                                                                  pad_token_id=0))
                alone = len(group) * args.new_tokens / seconds
                alone_rates.append(alone)
                for name, model in methods.items():
                    got, seconds = timed(lambda: model.generate(ids, attention_mask=mask,
                                                                max_new_tokens=args.new_tokens, do_sample=False,
                                                                pad_token_id=0))
                    rate = len(group) * args.new_tokens / seconds
                    r = per[name]
                    r["rates"].append(rate)
                    r["ratios"].append(rate / alone)
                    r["accepted"].append(model.last_stats.mean_accepted)
                    r["identical"] += torch.equal(got, expected)
                    r["runs"] += 1
        rows.append(dict(batch=batch, method="target alone (HF generate)", tokens_per_s=statistics.median(alone_rates),
                         speedup=1.0, speedup_min="", speedup_max="", accepted_per_round="", identical=""))
        for name, r in per.items():
            rows.append(dict(batch=batch, method=name, tokens_per_s=statistics.median(r["rates"]),
                             speedup=statistics.median(r["ratios"]), speedup_min=min(r["ratios"]),
                             speedup_max=max(r["ratios"]), accepted_per_round=statistics.median(r["accepted"]),
                             identical=f"{r['identical']}/{r['runs']}"))
        for row in rows[-len(per) - 1:]:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    write_rows(args.name, rows, f"shared tokens {share.shared} of the target's {len(tokenizer)}")


if __name__ == "__main__":
    main()
