"""Block drafters against the sequential ones, on held-out code: the bundled DFlash drafter
(models/stdlib-dflash) at block sizes 4, 8 and 16 (its first 3, 7 or 15 drafts verified), under
Auto (the default) and under adaptive verification, the bundled EAGLE-3 head
(models/stdlib-head) and the bundled draft model (models/stdlib-draft), each at fixed k, Auto
and adaptive verification, beside the target alone, in one run.

Configurations: batch 1 and batch 8 greedy, batch 1 at T=1; on the bundled target and
(``--weight-read``) on the same target with every MLP widened by zero rows
(benchmarks/weight_read.py: the same function, ~0.5 GB read per step, where a step costs
weight reads). Prompts: third-party code the pair never saw (click, jinja2). Every pass (a
group of prompts) runs every method on the same prompts, interleaved, each method's policy
kept from call to call (as ``accelerate(target, draft)`` keeps it: cold in the first group
only); speed-ups are medians
of per-pass ratios against the target alone (HF generate) in the same pass, with the 20th
and 80th percentiles. Per row also: accepted drafts per round, the round's cost (wall time
over rounds, ms), the verification's cost in target steps (each verification's width priced
by the lean forward's measured cost by width), draft forwards per round and one draft
forward's cost in target steps (a DFlash block's: its forward over as many slots as a row
verified model drafts per round on average, and the commit; Adaptive's verified drafts are
fewer than its block computed, so its price reads low), and ``bound`` = (1 + accepted) /
(verify_steps + draft_forwards x draft_step), what the rounds allow over the lean target alone if nothing
but the forwards cost, and ``load``: the machine's 1-minute load average before and after the
configuration. Writes benchmarks/results/<name>.csv and <name>.png.

    python benchmarks/block_drafters.py [--prompts 8] [--new-tokens 96] [--repeats 1] [--weight-read]
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from e2e import (DEFAULT_LINEAR, RESULTS, ROOT, VerificationWidths, best_fixed, lean_alone, left_pad, load,  # noqa: E402
                 timed, verification_cost, width_costs)
from spec_ext.drafters import BlockDrafter  # noqa: E402
from spec_ext.models.dflash import load_dflash  # noqa: E402
from spec_ext.models.eagle import load_head  # noqa: E402
from spec_ext.policies import Adaptive, Auto, Fixed  # noqa: E402
from stdlib_data import code_prompts  # noqa: E402
from weight_read import widened_target  # noqa: E402

CONFIGS = ((1, 0.0), (8, 0.0), (1, 1.0))


def methods(dflash, head, draft, greedy: bool, batch: int) -> dict:
    """Row name -> (drafter kind, the draft given to spec_ext.generate, policy)."""
    rows = {f"dflash block={b} (fixed {b - 1})": ("dflash", dflash, Fixed(b - 1)) for b in (4, 8, 16)
            if b <= dflash.block_size}
    rows["dflash auto"] = ("dflash", dflash, Auto())  # the default: accelerate(target, dflash)
    rows["dflash adaptive"] = ("dflash", dflash, Adaptive(max_draft=dflash.config.num_drafts))
    rows |= {"head fixed k=4": ("head", head, Fixed(4)), "head auto": ("head", head, Auto()),
             "head adaptive": ("head", head, Adaptive())}
    k = best_fixed(greedy, batch)
    rows |= {f"draft fixed k={k}": ("draft", draft, Fixed(k)), "draft auto": ("draft", draft, Auto()),
             "draft adaptive": ("draft", draft, Adaptive())}
    return rows


def block_cost(target, dflash, prompt: list[int], batch: int, slots: int, repeats: int = 7) -> float:
    """Fastest-of-``repeats`` seconds of one DFlash round's drafter work at ``batch``: the block
    forward after the prompt's context (its first ``slots`` drafts' outputs and logits) and the
    commit of 4 positions' features."""
    drafter = BlockDrafter(dflash)
    drafter.bind(target)
    L = len(prompt)
    with torch.inference_mode():
        drafter.start([prompt] * batch, L + 64 * repeats, spec_ext.engine.Sampler(0.0),
                      features=torch.randn(batch, L - 1, dflash.feature_width))
        roots = torch.tensor(prompt[-1:] * batch)
        features = torch.randn(batch, 4, dflash.feature_width)

        def round_():
            drafter.block(roots, slots)
            dflash.extend(dflash.project(features), drafter.cache, [4] * batch)

        return min(timed(round_)[1] for _ in range(repeats))


def run(target, models, prompts, batch, temperature, n, repeats, pad) -> dict:
    """{method: dict(rates, ratios, lean, stats, widths, matches)} for one configuration."""
    greedy = temperature == 0
    sample = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=None, top_p=None)
    results: dict[str, dict] = {}
    tracer = VerificationWidths()

    def record(method, rate, base, lean, stats=None, match=None):
        entry = results.setdefault(method, dict(rates=[], ratios=[], lean=[], stats=[], widths=[], matches=[]))
        entry["widths"].append(tracer.take())
        entry["rates"].append(rate)
        entry["ratios"].append(rate / base)
        entry["lean"].append(rate / lean)
        if stats is not None:
            entry["stats"].append(stats)
        if match is not None:
            entry["matches"].append(match)

    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    rows = methods(*models, greedy, batch)  # each policy kept across the calls, as accelerate(target, draft) keeps it
    with tracer:
        for _ in range(repeats):
            for group in tqdm(groups, desc=f"batch={batch} T={temperature}", leave=False):
                ids, mask = left_pad(group, pad)
                alone, t = timed(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n,
                                                         min_new_tokens=n, pad_token_id=pad, **sample))
                base = len(group) * n / t
                out, t = timed(lambda: lean_alone(target, group, n, temperature, DEFAULT_LINEAR))
                lean = len(group) * n / t
                record("target alone", base, base, lean)
                record("target alone, lean forward", lean, base, lean,
                       match=bool(torch.equal(out, alone)) if greedy else None)
                for name, (_, model, policy) in rows.items():
                    out = spec_ext.generate(target, model, ids, attention_mask=mask, max_new_tokens=n,
                                            temperature=temperature, eos_token_id=[], pad_token_id=pad, policy=policy)
                    record(name, out.stats.tokens_per_s, base, lean, out.stats,
                           bool(torch.equal(out.sequences, alone)) if greedy else None)
    return results


def quantile(values: list[float], q: float) -> float:
    return float(torch.tensor(values, dtype=torch.float64).quantile(q))


def rows_of(results: dict, costs: dict, kinds: dict, workload: str, batch: int, temperature: float) -> list[dict]:
    rows = []
    for method, r in results.items():
        stats, widths = r["stats"], sum(r["widths"], [])
        row = dict(workload=workload, batch=batch, temperature=temperature, method=method,
                   tokens_per_s=round(statistics.median(r["rates"]), 1),
                   speedup=round(statistics.median(r["ratios"]), 3), speedup_p20=round(quantile(r["ratios"], 0.2), 3),
                   speedup_p80=round(quantile(r["ratios"], 0.8), 3),
                   speedup_lean=round(statistics.median(r["lean"]), 3), passes=len(r["rates"]),
                   accepted_per_round="", round_ms="", verify_steps="", draft_forwards="", draft_step="", bound="",
                   matches_target="" if not r["matches"] else all(r["matches"]))
        if stats and widths:
            accepted = sum(s.accepted for s in stats) / sum(s.rounds for s in stats)
            verify = statistics.mean(verification_cost(costs, w) for w in widths)
            forwards = sum(s.draft_calls for s in stats) / sum(s.rounds for s in stats)
            step = costs[kinds[method]] / costs["target"][1]
            row.update(accepted_per_round=round(accepted, 3),
                       round_ms=round(1e3 * statistics.median(s.wall_time / s.rounds for s in stats), 2),
                       verify_steps=round(verify, 3), draft_forwards=round(forwards, 2), draft_step=round(step, 3),
                       bound=round((1 + accepted) / (verify + forwards * step), 3))
        rows.append(row)
    return rows


def plot(rows: list[dict], name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = list(dict.fromkeys((r["workload"], r["batch"], r["temperature"]) for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.8 * len(configs), 4.5), squeeze=False)
    for ax, (workload, batch, temperature) in zip(axes[0], configs):
        sub = [r for r in rows if (r["workload"], r["batch"], r["temperature"]) == (workload, batch, temperature)]
        colours = ["tab:red" if r["method"].startswith("dflash") else "tab:blue" if r["method"].startswith("head")
                   else "tab:green" if r["method"].startswith("draft") else "gray" for r in sub]
        ax.barh([r["method"] for r in sub], [r["speedup"] for r in sub], color=colours,
                xerr=[[r["speedup"] - r["speedup_p20"] for r in sub], [r["speedup_p80"] - r["speedup"] for r in sub]])
        ax.axvline(1, color="black", lw=0.8)
        ax.set_title(f"{workload}, batch {batch}, {'greedy' if temperature == 0 else f'T={temperature}'}")
        ax.set_xlabel("speed-up vs target alone (median, p20-p80)")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}.png", dpi=100)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--dflash", type=Path, default=ROOT / "models" / "stdlib-dflash")
    parser.add_argument("--head", type=Path, default=ROOT / "models" / "stdlib-head")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=[f"{b}:{t}" for b, t in CONFIGS], help="batch:temperature")
    parser.add_argument("--weight-read", action="store_true",
                        help="also every configuration on the target widened to weight reads (weight_read.py)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--name", default="block_drafters_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target, "float32"), load(args.draft, "float32")
    dflash, head = load_dflash(args.dflash).float().eval(), load_head(args.head).float().eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = code_prompts(tokenizer, "thirdparty", args.prompts, args.prompt_tokens)
    targets = [("heldout", target)] + ([("weight-read", widened_target(target))] if args.weight_read else [])
    rows = []
    for workload, model in targets:
        for config in args.configs:
            batch, temperature = int(config.split(":")[0]), float(config.split(":")[1])
            load_before = os.getloadavg()[0]
            costs = width_costs(model, draft, head, prompts[0], batch)
            results = run(model, (dflash, head, draft), prompts, batch, temperature, args.new_tokens, args.repeats,
                          pad)
            kinds = {}
            for name, (kind, _, policy) in methods(dflash, head, draft, temperature == 0, batch).items():
                if kind == "dflash":  # a block computes the slots it drafts: priced at the model's mean drafts a
                    stats = results[name]["stats"]  # (row, round) pair (Stats.rounds counts those; text rows aside)
                    slots = sum(s.drafted - s.text_drafted for s in stats) / max(
                        1, sum(s.rounds - s.matched for s in stats))
                    kind = f"dflash{min(dflash.config.num_drafts, max(1, round(slots)))}"
                    if kind not in costs:
                        costs[kind] = block_cost(model, dflash, prompts[0], batch, int(kind[len("dflash"):]))
                kinds[name] = kind
            costs["dflash"] = block_cost(model, dflash, prompts[0], batch, dflash.config.num_drafts)
            machine_load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"  # 1-minute load average before and after
            rows += [row | dict(load=machine_load) for row in rows_of(results, costs, kinds, workload, batch, temperature)]
            print(f"{workload} batch {batch} T={temperature}: one target step {1e3 * costs['target'][1]:.2f} ms; "
                  f"draft model step {costs['draft'] / costs['target'][1]:.3f}, head step "
                  f"{costs['head'] / costs['target'][1]:.3f}, dflash round {costs['dflash'] / costs['target'][1]:.3f}"
                  f" target steps")
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / f"{args.name}.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\n{'workload':>11} {'B':>2} {'T':>3} {'method':28} {'tok/s':>7} {'speed-up (p20-p80)':>19} {'acc/round':>9} "
          f"{'round ms':>8} {'verify':>6} {'draft':>6} {'bound':>6} {'== target':>9}")
    for r in rows:
        print(f"{r['workload']:>11} {r['batch']:2} {r['temperature']:3} {r['method']:28} {r['tokens_per_s']:7.1f} "
              f"{r['speedup']:6.2f}x ({r['speedup_p20']:.2f}-{r['speedup_p80']:.2f}) {str(r['accepted_per_round']):>9} "
              f"{str(r['round_ms']):>8} {str(r['verify_steps']):>6} {str(r['draft_step']):>6} {str(r['bound']):>6} "
              f"{str(r['matches_target']):>9}")
    plot(rows, args.name)


if __name__ == "__main__":
    main()
