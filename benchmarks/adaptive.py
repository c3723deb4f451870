"""Adaptive verification against fixed draft lengths on the bundled target, with the bundled
draft model and the bundled EAGLE-3 head: greedy, B=1 and B=8, held-out prompts (the test
split of the stdlib modules the pair never trained on, or third-party code: see
benchmarks/stdlib_data.py), every method interleaved per prompt group and repeat, so the
machine's load falls on all of them alike.

Methods, for each drafter: ``fixed k=2,4,6,8``; ``adaptive`` (a fresh ``Adaptive()`` per
call: it measures its costs and learns its confidence bins from nothing each time);
``adaptive (warm)`` (the calls of a drafter and batch size share one memory, as ``accelerate``
keeps it for a server). The target alone (HF ``generate``) is measured in every pass, and each
method's speed-up is the median of its per-pass ratios against it. ``vs_best_fixed`` is the
median over passes of the method's tokens/s over the best fixed k's of that drafter in the
same pass (that k chosen by the median speed-up). Every greedy output is checked to equal the
target's own.

Cost model against measurement (``<name>_costs.csv``): for each fixed k, the measured seconds
per round (wall time over verification rounds) beside what the warm Adaptive's estimates
(its memory's Costs at the end) say such a round costs, draft(k) + verify(B, k + 1), and its
calibrated acceptance per confidence bin (the "bins" rows).

    OMP_NUM_THREADS=1 python benchmarks/adaptive.py [--prompts 8] [--repeats 2] [--new-tokens 64]
        [--batches 1 8] [--workload test|thirdparty] [--name adaptive_cpu] [--label loaded]

Writes benchmarks/results/<name>.csv and <name>_costs.csv; ``load_1min`` is the range of the
machine's 1-minute load average over the passes (2 cores: above 2, others' jobs share them).
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.models.eagle import load_head  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from spec_ext.policies import Adaptive, Call, Controller, Fixed, Memory, Report  # noqa: E402
from e2e import left_pad, load, timed  # noqa: E402
from stdlib_data import code_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
KS = (2, 4, 6, 8)


ROUND_SECONDS: dict = {}  # k -> the list RoundTimed(k) appends each round's seconds to


@dataclass(frozen=True)
class RoundTimed(Fixed):
    """Fixed(k) that records the seconds of every round but the first (which holds the
    drafter's prefill), from its plan to its commit (the report's): drafting, verification and
    the engine's bookkeeping, what Adaptive's estimates of a round stand for."""

    def start(self, call: Call) -> Controller:
        controller, seconds = super().start(call), ROUND_SECONDS.setdefault(self.k, [])
        observe = controller.observe

        def timed(report: Report) -> None:
            if report.warm:
                seconds.append(report.seconds)
            observe(report)
        controller.observe = timed
        return controller


def methods(draft, head, warm: dict, batch: int) -> dict:
    """{name: (drafter, the call's policy, the calls' memory or None)} for both drafters."""
    out = {}
    for label, drafter in (("draft model", draft), ("head", head)):
        for k in KS:
            out[f"{label}: fixed k={k}"] = (drafter, RoundTimed(k), None)
        out[f"{label}: adaptive"] = (drafter, Adaptive(), None)
        out[f"{label}: adaptive (warm)"] = (drafter, Adaptive(), warm.setdefault((label, batch), Memory()))
    return out


def percentile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def run(args, target, draft, head, prompts, pad, batch, warm, round_seconds):
    """Per method: tokens/s, ratio to the target alone, and the stats of every pass."""
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    groups = [g for g in groups if len(g) == batch]
    results: dict[str, dict] = {}
    table = methods(draft, head, warm, batch)
    names = list(table)
    for repeat in range(args.repeats):
        for g, group in enumerate(groups):
            ids, mask = left_pad(group, pad)
            expected, alone = timed(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                                            do_sample=False, pad_token_id=pad))
            tokens = batch * args.new_tokens
            entry = results.setdefault("target alone", dict(rates=[], ratios=[], stats=[], passes=[]))
            entry["rates"].append(tokens / alone)
            entry["ratios"].append(1.0)
            entry["passes"].append((repeat, g))
            shift = (repeat * len(groups) + g) % len(names)  # a different method first in every pass
            rates = {}
            for name in names[shift:] + names[:shift]:
                drafter, policy, memory = table[name]
                ROUND_SECONDS.clear()
                out, seconds = timed(lambda: spec_ext.generate(target, drafter, ids, attention_mask=mask,
                                                               max_new_tokens=args.new_tokens, eos_token_id=[],
                                                               pad_token_id=pad, policy=policy, memory=memory))
                for k, measured in ROUND_SECONDS.items():
                    round_seconds.setdefault((name.split(":")[0], batch, k), []).extend(measured)
                if not torch.equal(out.sequences, expected):
                    raise AssertionError(f"{name}: the greedy output differs from the target's (batch {batch})")
                entry = results.setdefault(name, dict(rates=[], ratios=[], stats=[], passes=[]))
                entry["rates"].append(tokens / seconds)
                entry["ratios"].append(alone / seconds)
                entry["stats"].append(out.stats)
                entry["passes"].append((repeat, g))
                rates[name] = tokens / seconds
            for label in ("draft model", "head"):
                results.setdefault(f"_pass_{label}", dict(rates=[]))["rates"].append(
                    {n: r for n, r in rates.items() if n.startswith(label)})
            results.setdefault("_load", dict(rates=[]))["rates"].append(os.getloadavg()[0])
            print(f"batch {batch} repeat {repeat} group {g}: " + ", ".join(
                f"{n} {results[n]['ratios'][-1]:.2f}x" for n in names), flush=True)
    return results


def rows_of(args, results, batch, commit, label):
    rows = []
    for drafter in ("draft model", "head"):
        passes = results[f"_pass_{drafter}"]["rates"]
        fixed = [f"{drafter}: fixed k={k}" for k in KS]
        best = max(fixed, key=lambda n: statistics.median(results[n]["ratios"]))
        for name in ["target alone"] * (drafter == "draft model") + fixed + [f"{drafter}: adaptive",
                                                                                f"{drafter}: adaptive (warm)"]:
            r = results[name]
            stats = r["stats"]
            vs_best = "" if name == "target alone" else round(statistics.median(p[name] / p[best] for p in passes), 3)
            rounds = sum(s.rounds for s in stats)
            rows.append(dict(
                method=name, best_fixed=best.split(": ")[1] if name != "target alone" else "", batch=batch,
                temperature=0.0, tokens_per_s=round(statistics.median(r["rates"]), 1),
                speedup=round(statistics.median(r["ratios"]), 3),
                p20=round(percentile(r["ratios"], 0.2), 3), p80=round(percentile(r["ratios"], 0.8), 3),
                spread=f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}", vs_best_fixed=vs_best,
                accepted_per_round=round(sum(s.accepted for s in stats) / rounds, 3) if stats else "",
                drafted_per_round=round(sum(s.drafted for s in stats) / rounds, 3) if stats else "",
                target_calls=sum(s.target_calls for s in stats) if stats else "",
                draft_calls=sum(s.draft_calls for s in stats) if stats else "",
                passes=len(r["ratios"]), new_tokens=args.new_tokens, prompts=args.prompts, workload=args.workload,
                machine=label, load_1min=f"{min(results['_load']['rates']):.1f}-{max(results['_load']['rates']):.1f}",
                device=f"cpu-{torch.get_num_threads()}threads", commit=commit))
    return rows


def cost_rows(results, warm, batch, round_seconds, target, context):
    """The warm Adaptive's cost estimates beside what each fixed-k round took (the median of
    :class:`RoundTimed`'s rounds), and its verification estimates by width beside the fastest
    of 5 forwards of that width (:func:`spec_ext.policies.calibrate`, after the passes)."""
    from spec_ext.policies import calibrate
    rows = []
    fastest = calibrate(target, rows=(batch,), widths=range(1, 10), context=context, repeats=5)
    rows.append(dict(drafter="target", batch=batch, k="verify by width 1..9, fastest of 5", measured_round_s="",
                     estimated_verify_s=" ".join(f"{fastest.verify(batch, w):.4f}" for w in range(1, 10)),
                     estimated_draft_s="", estimated_round_s="", accepted_per_round="",
                     measured_tokens_per_round_s=""))
    for drafter in ("draft model", "head"):
        # a controller started from the warm calls' memory: their costs and acceptance
        policy = Adaptive().start(Call(batch, True, memory=warm[(drafter, batch)]))
        costs = policy.costs
        rows.append(dict(drafter=drafter, batch=batch, k="its verify estimates by width 1..9", measured_round_s="",
                         estimated_verify_s=" ".join(f"{costs.verify(batch, w):.4f}" for w in range(1, 10)),
                         estimated_draft_s="", estimated_round_s="", accepted_per_round="",
                         measured_tokens_per_round_s=""))
        for k in KS:
            stats = results[f"{drafter}: fixed k={k}"]["stats"]
            measured = statistics.median(round_seconds[(drafter, batch, k)])
            verify, draft_s = costs.verify(batch, k + 1), costs.draft(k, rows=batch)
            accepted = sum(s.accepted for s in stats) / sum(s.rounds for s in stats)
            rows.append(dict(drafter=drafter, batch=batch, k=k, measured_round_s=f"{measured:.4g}",
                             estimated_verify_s="" if verify is None else f"{verify:.4g}",
                             estimated_draft_s="" if draft_s is None else f"{draft_s:.4g}",
                             estimated_round_s="" if None in (verify, draft_s) else f"{verify + draft_s:.4g}",
                             accepted_per_round=round(accepted, 3),
                             measured_tokens_per_round_s=f"{(1 + accepted) / measured:.4g}"))
        rows.append(dict(drafter=drafter, batch=batch, k="bins after the root", measured_round_s="",
                         estimated_verify_s=" ".join(f"{policy.accept.acceptance(c):.2f}" for c in
                                                     (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.935,
                                                      0.985)),
                         estimated_draft_s="", estimated_round_s="", accepted_per_round="",
                         measured_tokens_per_round_s=""))
        rows.append(dict(drafter=drafter, batch=batch, k="bins after an accepted draft", measured_round_s="",
                         estimated_verify_s=" ".join(f"{policy.accept.acceptance(c, 2):.2f}" for c in
                                                     (0.05, 0.15, 0.25, 0.35, 0.45, 0.55, 0.65, 0.75, 0.85, 0.935,
                                                      0.985)),
                         estimated_draft_s="", estimated_round_s="", accepted_per_round="",
                         measured_tokens_per_round_s=f"plan bound {policy._draft_bound(batch)}"))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--head", type=Path, default=ROOT / "models" / "stdlib-head")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--workload", default="test", choices=["test", "thirdparty"],
                        help="test: held-out stdlib modules; thirdparty: click and jinja2 as installed")
    parser.add_argument("--name", default="adaptive_cpu")
    parser.add_argument("--label", default="loaded", help="the machine's state, written in every row")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target, "float32"), load(args.draft, "float32")
    head = load_head(args.head, target.dtype)
    prompts = code_prompts(tokenizer, args.workload, args.prompts, args.prompt_tokens, seed=0)
    pad = tokenizer.pad_token_id
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    rows, costs, warm, round_seconds = [], [], {}, {}
    with torch.inference_mode():
        for batch in args.batches:
            results = run(args, target, draft, head, prompts, pad, batch, warm, round_seconds)
            rows += rows_of(args, results, batch, commit, args.label)
            costs += cost_rows(results, warm, batch, round_seconds, target, args.prompt_tokens + args.new_tokens // 2)
    RESULTS.mkdir(exist_ok=True)
    for path, table in ((RESULTS / f"{args.name}.csv", rows), (RESULTS / f"{args.name}_costs.csv", costs)):
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, list(table[0]))
            writer.writeheader()
            writer.writerows(table)
        print(f"wrote {path}")
    for r in rows:
        print(f"B={r['batch']} {r['method']:28s} {r['speedup']:.2f}x ({r['spread']}) vs best fixed "
              f"{r['vs_best_fixed']} accepted/round {r['accepted_per_round']}")


if __name__ == "__main__":
    main()
