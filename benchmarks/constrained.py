"""Speculation under HF's logits settings, on the bundled pair, batch 1 greedy, side by side in one run:

* ``grammar``: held-out stdlib files cut at the start of a ``def`` line; the grammar (a
  regular expression) asks for the def line (indented up to 8 spaces) and a one-line docstring. The target alone runs HF's
  generate with llguidance's masks as an HF logits processor (a stateful one, as a user
  would write for plain decoding); spec_ext runs the same grammar through ``grammar=``.
  Reported: tokens/s, the speed-up (median of per-prompt ratios), accepted drafts per
  round, the grammar's cost per round (masks for every draft position, the drafter's
  and the target's) against the round's wall time, and whether the outputs are identical.
* ``repetition_penalty``: held-out prompts, 128 new tokens, the target alone (HF) and
  spec_ext with and without ``repetition_penalty=1.1``.

    python benchmarks/constrained.py [--prompts 8] [--repeats 2] [--name constrained_cpu]

Writes benchmarks/results/<name>.csv.
"""
from __future__ import annotations

import argparse
import csv
import re
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation import LogitsProcessor

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.bundled import bundled_path  # noqa: E402
from spec_ext.policies import Fixed  # noqa: E402
from stdlib_data import code_prompts, read_text, split_files  # noqa: E402
from e2e import timed  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DEF_DOCSTRING = (r' {0,8}def [a-z_][a-z0-9_]{0,40}\([^()\n]{0,80}\)( -> [A-Za-z_][A-Za-z0-9_.\[\], ]{0,40})?:\n'
                 r' {4,12}"""[^"\n]{1,120}"""\n')


class GrammarForPlainDecoding(LogitsProcessor):
    """llguidance's masks for HF's plain (non-speculative) generate: one matcher per row,
    advanced by the token each call adds (stateful: right for plain decoding only)."""

    def __init__(self, grammar: str, tokenizer, vocab: int, rows: int):
        import llguidance
        import llguidance.hf
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)
        self.matchers = [llguidance.LLMatcher(self.tokenizer, grammar, log_level=0) for _ in range(rows)]
        self.started = False

    def __call__(self, input_ids, scores):
        from llguidance.torch import fill_next_token_bitmask
        if self.started:
            for matcher, token in zip(self.matchers, input_ids[:, -1].tolist()):
                matcher.consume_token(token)
        self.started = True
        bits = torch.zeros(len(self.matchers), (scores.shape[-1] + 31) // 32, dtype=torch.int32)
        for b, matcher in enumerate(self.matchers):
            fill_next_token_bitmask(matcher, bits, b)
        allowed = ((bits[..., None] >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten(1)
        return scores.masked_fill(~allowed[:, :scores.shape[-1]], float("-inf"))


def def_prompts(tokenizer, count: int, prompt_tokens: int = 192) -> list[list[int]]:
    """Held-out files cut at the start of a ``def`` line (every ``count``-th one, spread over the files)."""
    cuts = []
    for path in split_files("test"):
        text = read_text(path)
        for match in re.finditer(r"^ {0,8}def ", text, re.M):
            cuts.append(text[:match.start()])
    step = max(1, len(cuts) // count)
    return [tokenizer(text, add_special_tokens=False).input_ids[-prompt_tokens:] for text in cuts[::step][:count]]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="the fixed draft length")
    parser.add_argument("--name", default="constrained_cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    target_dir, draft_dir = bundled_path("stdlib-target"), bundled_path("stdlib-draft")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    eos, vocab = tokenizer.eos_token_id, target.config.vocab_size
    fast = {"fixed": spec_ext.accelerate(target, draft, policy=Fixed(args.k)),
            "auto": spec_ext.accelerate(target, draft)}
    grammar = spec_ext.Grammar.regex(DEF_DOCSTRING)
    rows = []

    def measure(workload, prompts, new_tokens, settings, hf_settings, grammar_on):
        per = {name: dict(rates=[], ratios=[], accepted=[], cost=[], identical=0) for name in fast}
        alone_rates = []
        for _ in range(args.repeats):
            for prompt in prompts:
                ids = torch.tensor([prompt])
                extra = dict(hf_settings)
                if grammar_on:
                    extra["logits_processor"] = [GrammarForPlainDecoding(grammar.definition, tokenizer, vocab, 1)]
                expected, seconds = timed(lambda: target.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                                  eos_token_id=eos, pad_token_id=eos, **extra))
                alone = (expected.shape[1] - len(prompt)) / seconds
                alone_rates.append(alone)
                for name, model in fast.items():
                    kw = dict(settings, tokenizer=tokenizer, grammar=grammar) if grammar_on else dict(settings)
                    got, seconds = timed(lambda: model.generate(ids, max_new_tokens=new_tokens, do_sample=False,
                                                                eos_token_id=eos, pad_token_id=eos, **kw))
                    stats = model.last_stats
                    rate = (got.shape[1] - len(prompt)) / seconds
                    r = per[name]
                    r["rates"].append(rate)
                    r["ratios"].append(rate / alone)
                    r["accepted"].append(stats.mean_accepted)
                    r["cost"].append(stats.processing_time / stats.wall_time)
                    r["identical"] += torch.equal(got, expected)
        runs = args.repeats * len(prompts)
        rows.append(dict(workload=workload, method="target alone (HF generate)", tokens_per_s=statistics.median(
            alone_rates), speedup=1.0, accepted_per_round="", processing_share="", identical=""))
        for name, r in per.items():
            rows.append(dict(workload=workload, method=f"spec_ext {name}" + (f" k={args.k}" if name == "fixed" else ""),
                             tokens_per_s=statistics.median(r["rates"]), speedup=statistics.median(r["ratios"]),
                             accepted_per_round=statistics.median(r["accepted"]),
                             processing_share=statistics.median(r["cost"]), identical=f"{r['identical']}/{runs}"))
        for row in rows[-len(per) - 1:]:
            print({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}, flush=True)

    measure("grammar: def line + docstring", def_prompts(tokenizer, args.prompts), 96, {}, {}, True)
    held_out = code_prompts(tokenizer, "test", args.prompts)
    measure("no settings", held_out, 128, {}, {}, False)
    measure("repetition_penalty=1.1", held_out, 128, dict(repetition_penalty=1.1), dict(repetition_penalty=1.1),
            False)
    write_rows(args.name, rows)


def write_rows(name: str, rows: list[dict], comment: str = "") -> None:
    """benchmarks/results/<name>.csv: ``rows`` (floats to 4 places) after a ``# comment`` line, if any."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"{name}.csv"
    with out.open("w", newline="") as f:
        if comment:
            f.write(f"# {comment}\n")
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
