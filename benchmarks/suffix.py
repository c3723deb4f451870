"""Suffix decoding on a repeated workload: 32 requests made from held-out third-party code
(click and jinja2, which the bundled pair never saw), in order, where later requests revisit
earlier functions: the same prompt again, the prompt with the function renamed or a constant
changed, and a request whose answer quotes an earlier output (another file's context, then an
earlier function's first lines). Every method runs each request (B=1) or each batch of 8
consecutive requests (B=8) in turn, interleaved; the suffix cache is fed in the workload's order.

Methods: the target alone (HF generate), HF prompt lookup (``prompt_lookup_num_tokens=10``,
batch 1 only: HF refuses it for batches), ``NGram`` (spec_ext, the row's own text), the bundled
head (models/stdlib-head, policy auto), ``Suffix`` alone (the cache and the row's own text),
and ``Suffix`` beside the head where the build supports it (rows without a cache match drafted
by the head), then the head again (a control: the
spread of one request's ratio between two runs of the same method, against which the suffix
beside the head's per-request ratios to the head alone are read). Greedy outputs are checked equal to the
target's. ``--requests`` times a subset of the requests (the others still go into the caches,
their output computed once, so the timed ones see the caches the whole workload gives them).

The cache's own cost is measured apart: a SuffixCache filled to 1M tokens (the stdlib train
split's files, then the workload), the B=1 greedy workload run through it, every lookup timed;
the report gives the lookups' time per round beside the round's time, and the memory per stored token.

    python benchmarks/suffix.py                     # writes benchmarks/results/suffix_cpu.csv and .txt
    python benchmarks/suffix.py --configs 1:0 --repeats 1 --new-tokens 64   # a quick look
"""
from __future__ import annotations

import argparse
import ast
import csv
import math
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.models.eagle import load_head  # noqa: E402
from spec_ext.policies import NGram, Suffix, SuffixCache  # noqa: E402
from stdlib_data import read_text, split_files, thirdparty_files  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
MODELS = ROOT / "models"


def load(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every method generates exactly --new-tokens
    return model


def base_functions(count: int, seed: int) -> list[dict]:
    """``count`` functions (8 to 40 lines) of distinct third-party files: the file's lines before
    each (its context), its def line and first body line."""
    files = thirdparty_files()
    random.Random(seed).shuffle(files)
    picked = []
    for path in files:
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and 8 <= node.end_lineno - node.lineno <= 40:
                start = node.lineno - 1
                picked.append(dict(name=node.name, context=lines[max(0, start - 30):start],
                                   head=lines[start:start + 2], file=path.name))
                break
        if len(picked) == count:
            return picked
    raise ValueError(f"found {len(picked)} functions, wanted {count}")


def changed(function: dict, kind: str, index: int) -> dict:
    """The function's prompt renamed (kind "renamed") or with its first integer constant changed
    (kind "constant"; renamed where the prompt has none)."""
    import re
    text = "\n".join(function["context"] + function["head"])
    if kind == "constant" and re.search(r"\b\d+\b", text):
        new = re.sub(r"\b(\d+)\b", lambda m: str(int(m.group(1)) + 7), text, count=1)
    else:
        new = re.sub(rf"\b{re.escape(function['name'])}\b", f"{function['name']}_v{index}", text)
    return dict(function, text=new)


def workload(tokenizer, count: int = 8, seed: int = 0, context_tokens: int = 160) -> list[dict]:
    """32 requests: ``count`` new functions and, after each, revisits of it (again, renamed or a
    constant changed, quoted from another file's context), in a deterministic interleaved order."""
    functions = base_functions(count, seed)
    rng = random.Random(seed)

    def prompt(text: str) -> list[int]:
        ids = tokenizer(text + "\n").input_ids
        return ids[-context_tokens:]

    def base(i):
        return "\n".join(functions[i]["context"] + functions[i]["head"])

    kinds = ["again", "changed", "quoted"]
    events, pending, introduced = [], [], 0
    while introduced < count or pending:
        if introduced < count and (not pending or rng.random() < 0.4):
            events.append(("new", introduced))
            pending += [(kind, introduced) for kind in kinds]
            introduced += 1
        else:
            events.append(pending.pop(rng.randrange(len(pending))))
    requests = []
    for n, (kind, i) in enumerate(events):
        if kind in ("new", "again"):
            text = base(i)
        elif kind == "changed":
            text = changed(functions[i], "constant" if n % 2 else "renamed", n)["text"]
        else:  # another function's context, then this one's first lines: the answer quotes the earlier output
            other = functions[(i + 1) % count]
            text = "\n".join(other["context"] + [""] + functions[i]["head"])
        requests.append(dict(index=n, kind=kind, function=i, ids=prompt(text)))
    return requests


def left_pad(prompts, pad):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


class Timed:
    """Wraps a cache's ``propose`` and records the seconds of every call."""

    def __init__(self, cache: SuffixCache):
        self.cache, self.seconds = cache, []
        self._propose = cache.propose

        def propose(*args, **kwargs):
            started = time.perf_counter()
            out = self._propose(*args, **kwargs)
            self.seconds.append(time.perf_counter() - started)
            return out

        cache.propose = propose


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def methods(target, head, batch: int) -> dict:
    """Name -> (a function that makes the method's per-pass state, then runs a batch)."""
    def hf(prompt_lookup):
        def run(state, ids, mask, n, temperature, seed):
            torch.manual_seed(seed)
            sample = dict(do_sample=True, temperature=temperature, top_k=0) if temperature else dict(do_sample=False)
            extra = dict(prompt_lookup_num_tokens=10) if prompt_lookup else {}
            out = target.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                  **sample, **extra)
            return out[:, ids.shape[1]:], None
        return lambda: None, run

    def ours(make_policy, draft):
        def run(policy, ids, mask, n, temperature, seed):
            out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n, temperature=temperature,
                                    eos_token_id=[], pad_token_id=0, policy=make_policy(policy), seed=seed)
            return out.sequences[:, ids.shape[1]:], out.stats
        return run

    cached = lambda: SuffixCache()  # noqa: E731  a fresh cache per pass over the workload
    table = {"target alone": hf(False)}
    if batch == 1:
        table["hf prompt lookup"] = hf(True)
    table["ngram"] = (lambda: None, ours(lambda _: NGram(), None))
    table["suffix"] = (cached, ours(lambda cache: Suffix(cache), None))
    if head is not None:
        table["head"] = (lambda: None, ours(lambda _: "auto", head))
        try:
            spec_ext.drafters.build(head, Suffix(SuffixCache()))
            table["suffix beside head"] = (cached, ours(lambda cache: Suffix(cache), head))
        except ValueError as error:
            print(f"suffix beside head: not run ({error})")
        table["head again"] = table["head"]  # the control: how far one request's ratio moves between two equal runs
    return table


def run_config(target, head, requests, batch, temperature, n, repeats, pad, timed=None):
    """Per pass, per batch of requests, every method in turn: rows of the CSV. ``timed``: the
    batch indices to time (None: all); the others' outputs (greedy, by NGram: the target's, computed once)
    go into the methods' caches only (greedy)."""
    table = methods(target, head, batch)
    groups = [requests[i:i + batch] for i in range(0, len(requests), batch)]
    rows = []
    for repeat in range(repeats):
        states = {name: make() for name, (make, _) in table.items()}
        for g, group in enumerate(groups):
            ids, mask = left_pad([r["ids"] for r in group], pad)
            if timed is not None and g not in timed:
                if temperature:
                    raise ValueError("--requests: greedy only (a skipped batch's output is the target's greedy)")
                new = spec_ext.generate(target, None, ids, attention_mask=mask, max_new_tokens=n, eos_token_id=[],
                                        pad_token_id=0, policy=NGram()).sequences[:, ids.shape[1]:]
                for state in states.values():
                    if isinstance(state, SuffixCache):
                        for r, row in zip(group, new.tolist()):
                            state.add(r["ids"], row)
                continue
            outputs = {}
            for name, (_, run) in table.items():
                seed = 1000 * repeat + g
                started = time.perf_counter()
                new, stats = run(states[name], ids, mask, n, temperature, seed)
                seconds = time.perf_counter() - started
                outputs[name] = new
                rows.append(dict(batch=batch, temperature=temperature, repeat=repeat, group=g,
                                 requests=" ".join(str(r["index"]) for r in group),
                                 kinds=" ".join(r["kind"] for r in group), method=name, seconds=round(seconds, 4),
                                 new_tokens=int(new.numel()), target_calls="" if stats is None else stats.target_calls,
                                 accepted="" if stats is None else stats.accepted,
                                 text_matched="" if stats is None else stats.matched,
                                 cache_matched="" if stats is None else stats.cache_matched,
                                 cache_accepted="" if stats is None else stats.cache_accepted,
                                 rounds="" if stats is None else stats.rounds,
                                 load=round(os.getloadavg()[0], 2),
                                 equal_to_target="" if temperature else bool(torch.equal(new, outputs["target alone"]))))
            print(f"B={batch} T={temperature} pass {repeat} batch {g}: " + ", ".join(
                f"{r['method']} {r['seconds']:.2f}s" for r in rows[-len(table):]), flush=True)
    return rows


def summary(rows) -> list[str]:
    """Per configuration and method: the speed-up over the target alone (the median of the
    passes per request, then the geometric mean over requests, and total time over total time),
    and for the suffix beside the head the smallest per-request ratio to the head alone."""
    lines = []
    configs = sorted({(r["batch"], r["temperature"]) for r in rows})
    for batch, temperature in configs:
        mine = [r for r in rows if (r["batch"], r["temperature"]) == (batch, temperature)]
        names = list(dict.fromkeys(r["method"] for r in mine))
        time_of = {}
        for name in names:
            by_group = {}
            for r in mine:
                if r["method"] == name:
                    by_group.setdefault(r["group"], []).append(r["seconds"])
            time_of[name] = {g: statistics.median(s) for g, s in by_group.items()}
        base = time_of["target alone"]
        lines.append(f"B={batch} T={temperature}: {len(base)} batches, speed-up over the target alone")
        for name in names:
            ratios = [base[g] / time_of[name][g] for g in base]
            spread = [min(base[g] / s for s in (r["seconds"] for r in mine if r["method"] == name and r["group"] == g))
                      for g in base]
            geo = math.exp(statistics.mean(math.log(x) for x in ratios))
            total = sum(base.values()) / sum(time_of[name].values())
            equal = {r["equal_to_target"] for r in mine if r["method"] == name} - {""}
            lines.append(f"  {name:20s} geomean {geo:5.2f}x  total {total:5.2f}x  per batch min {min(ratios):.2f}x "
                         f"max {max(ratios):.2f}x (slowest pass min {min(spread):.2f}x)"
                         + (f"  greedy equal: {equal == {True}}" if equal else ""))
        floor = None
        if "head again" in names and "head" in names:
            control = sorted(time_of["head"][g] / time_of["head again"][g] for g in base)
            floor = control[0]
            lines.append(f"  head again / head alone (the same method twice: the noise of one batch's ratio), per batch: "
                         f"min {floor:.2f}x, p10 {control[len(control) // 10]:.2f}x, max {control[-1]:.2f}x, "
                         f"{sum(x < 1 for x in control)} of {len(control)} below 1")
        for beside in ("suffix beside head",):
            if beside in names and "head" in names:
                ratios = [time_of["head"][g] / time_of[beside][g] for g in base]
                total = sum(time_of["head"].values()) / sum(time_of[beside].values())
                # batches whose rows found nothing in the cache in any pass: the default's rounds throughout
                empty = [g for g in base if all(not r["cache_matched"] for r in mine
                                                if r["method"] == beside and r["group"] == g)]
                lines.append(f"  {beside} / head alone, per batch: min {min(ratios):.2f}x, "
                             f"{sum(x < 1 for x in ratios)} of {len(ratios)} below 1, total {total:.2f}x"
                             + (f"; below the control's min: {sum(x < floor for x in ratios)}" if floor else "")
                             + (f"; where the cache had nothing ({len(empty)}): min "
                                f"{min(time_of['head'][g] / time_of[beside][g] for g in empty):.2f}x" if empty else ""))
        if "suffix beside head" in names and "head" in names:
            lines += per_batch(mine, time_of)
        loads = [r["load"] for r in mine]
        lines.append(f"  machine load (1-minute average at each batch's end): min {min(loads):.2f} median "
                     f"{statistics.median(loads):.2f} max {max(loads):.2f} on {os.cpu_count()} cores")
        if "suffix" in names and "ngram" in names:
            lines.append(f"  suffix / ngram, total: {sum(time_of['ngram'].values()) / sum(time_of['suffix'].values()):.2f}x")
    return lines


def per_batch(mine, time_of) -> list[str]:
    """Per batch, the head alone against the suffix beside it: target forwards, accepted drafts,
    the rounds whose drafts came from the text (own or cache) and from the cache, the time ratio
    (median of the passes) and the median time per target forward (each pass's seconds / forwards)."""
    def first(name, g):
        return next(r for r in mine if r["method"] == name and r["group"] == g)

    def per_call(name, g):
        return statistics.median(r["seconds"] / max(1, r["target_calls"]) for r in mine
                                 if r["method"] == name and r["group"] == g) * 1e3

    others = [name for name in ("suffix beside head",) if name in time_of]
    lines = ["  per batch: head alone (forwards, accepted, ms per forward) | " + " | ".join(
        f"{name} (forwards, accepted, text rounds, cache rounds, ms per forward, time ratio head / it)"
        for name in others)]
    for g in sorted(time_of["head"]):
        h = first("head", g)
        line = f"    {g:2d} {h['kinds']:8.8s} head {h['target_calls']:3d} {h['accepted']:4d} {per_call('head', g):6.1f}"
        for name in others:
            s = first(name, g)
            line += (f" | {s['target_calls']:3d} {s['accepted']:4d} {s['text_matched']:3d} {s['cache_matched']:3d} "
                     f"{per_call(name, g):6.1f} {time_of['head'][g] / time_of[name][g]:.2f}x")
        lines.append(line)
    return lines


def cache_cost(target, tokenizer, requests, n, stored_tokens: int = 1_000_000) -> list[str]:
    """The cache's own cost at ``stored_tokens`` stored tokens: fill it with the stdlib train
    split's files (300-token requests), then run the B=1 greedy workload through it, every lookup
    timed. Its budget is twice that, so no segment is evicted and all of them stay stored."""
    before = rss_bytes()
    budget = 2 * stored_tokens
    cache = SuffixCache(budget=budget)
    started, stored = time.perf_counter(), 0
    for path in split_files("train"):
        ids = tokenizer(read_text(path)).input_ids
        for i in range(0, len(ids), 300):
            cache.add([], ids[i:i + 300])
            stored += len(ids[i:i + 300])
        if cache.tokens >= stored_tokens:
            break
    fill = time.perf_counter() - started
    memory = rss_bytes() - before
    timer = Timed(cache)
    wall = calls = rounds = 0
    for request in requests:
        ids = torch.tensor([request["ids"]])
        started = time.perf_counter()
        out = spec_ext.generate(target, None, ids, max_new_tokens=n, eos_token_id=[], policy=Suffix(cache))
        wall += time.perf_counter() - started
        calls += out.stats.target_calls
        rounds += out.stats.rounds
    seconds = sorted(timer.seconds)
    per_round = sum(seconds) / max(1, rounds)
    round_time = wall / max(1, calls)
    return [f"cache cost at {cache.tokens} stored tokens (budget {budget}; filled with {stored} tokens of the stdlib "
            f"train split in {fill:.1f}s, {fill / stored * 1e6:.1f} us per token added)",
            f"  memory: {memory / 2**20:.0f} MiB resident for the cache, {memory / max(1, cache.tokens):.0f} B per "
            f"stored token",
            f"  lookups: {len(seconds)} (one per row and round), median {seconds[len(seconds) // 2] * 1e6:.0f} us, "
            f"p90 {seconds[int(len(seconds) * 0.9)] * 1e6:.0f} us, max {seconds[-1] * 1e6:.0f} us",
            f"  per round: {per_round * 1e6:.0f} us of lookups in a round of {round_time * 1e3:.2f} ms "
            f"({100 * per_round / round_time:.2f}% of the round; B=1 greedy, the workload's {len(requests)} requests)",
            f"  the cache's tokens after the workload: {cache.tokens} (budget {budget})"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=MODELS / "stdlib-target")
    parser.add_argument("--head", type=Path, default=MODELS / "stdlib-head")
    parser.add_argument("--configs", nargs="+", default=["1:0", "8:0", "1:1.0", "8:1.0"], help="batch:temperature")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the whole workload (fresh caches each)")
    parser.add_argument("--no-cost", action="store_true", help="skip the 1M-token cache cost")
    parser.add_argument("--name", default="suffix_cpu")
    parser.add_argument("--requests", type=int, nargs="+", default=None,
                        help="time only these batches (B=1: request indices); the others only feed the caches")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: on a shared machine, spinning OpenMP threads cost more than they give)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = load(args.target)
    head = load_head(args.head, target.dtype) if args.head.exists() else None
    requests = workload(tokenizer)
    pad = tokenizer.pad_token_id or 0
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    head_line = (f"commit {commit}, cpu {torch.get_num_threads()} threads, {args.new_tokens} new tokens, "
                 f"{args.repeats} passes, {len(requests)} requests: "
                 + ", ".join(f"{k} {sum(r['kind'] == k for r in requests)}" for k in ("new", "again", "changed",
                                                                                      "quoted"))
                 + (f"; timed: requests {args.requests}" if args.requests else ""))
    RESULTS.mkdir(exist_ok=True)
    cost = [] if args.no_cost else cache_cost(target, tokenizer, requests, args.new_tokens)
    rows = []
    for config in args.configs:  # the files are written after each configuration
        batch, temperature = int(config.split(":")[0]), float(config.split(":")[1])
        rows += run_config(target, head, requests, batch, temperature, args.new_tokens, args.repeats, pad,
                           None if args.requests is None else set(args.requests))
        with open(RESULTS / f"{args.name}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        lines = [head_line] + summary(rows) + cost
        (RESULTS / f"{args.name}.txt").write_text("\n".join(lines) + "\n")
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
