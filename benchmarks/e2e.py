"""End-to-end benchmark on the bundled pair: the target alone (HF generate), HF assisted
generation with the draft (its defaults, and the heuristic schedule), and spec_ext with
every policy, on held-out stdlib prompts, side by side in one run.

For each configuration (batch 1 / batch 8, greedy / temperature 0.7, and batch 1 at
temperature 1 where SpecBranch is compared with PEARL) every method runs
on the same prompts; tokens/s are medians over prompts and repeats and speed-ups are
medians of per-prompt ratios against the target alone measured in the same pass;
vs_best_fixed is the median of per-pass ratios against the fixed k chosen on validation
(the target alone's timing noise drops out of it). Greedy
outputs are compared with the target's own. Writes benchmarks/results/e2e_cpu.csv, speed-up
bars (e2e_cpu_speedup.png), accepted-length and chosen-draft-length histograms at batch 1
greedy (e2e_cpu_accepted.png, e2e_cpu_lengths.png). The learned policies and the best fixed k come
from benchmarks/train_policies.py, which chose them on the validation split.

    python benchmarks/e2e.py [--prompts 8] [--repeats 1] [--new-tokens 128] [--configs 1:0 ...] [--name e2e_cpu]
                             [--only TEXT ...] [--workloads heldout grounded]

Workloads: ``heldout``, the held-out prompts above (a file cut at a line break), and
``grounded``, input-grounded prompts from the same held-out split: a function's source,
then the first lines of the same function again, so that the continuation is a copy (what
prompt lookup is for). The n-gram rows (spec_ext.policies.NGram) run without the draft
model, except "ngram beside the draft"; HF prompt lookup (prompt_lookup_num_tokens=10) runs
at batch 1 only, as HF's does. Each run also measures the n-gram matcher's cost per round
at 32K tokens of history against a verification round of the target (<name>_matcher.csv).

    python benchmarks/e2e.py --workloads grounded heldout --configs 1:0 8:0 1:1.0 8:1.0 \
        --only "best on validation" ngram "prompt lookup" --name e2e_ngram_cpu

Where the step is weight reads (``--widen 16384``: the bundled target with every MLP
widened by zero rows, the same function, ~0.5 GB of float32 read per step; built on the fly
by benchmarks/weight_read.py). Every row then also has, beside its measured speed-up
(``speedup`` against HF's generate of the target alone, ``speedup_lean`` against the target
alone on spec_ext's lean forward with generate's default linear layers, both in the same
pass): ``verify_steps``, the measured cost
of its verifications over one decode step (each verification's width priced by a table of
the lean forward's cost by width at the batch size, measured before the configuration),
``draft_forwards`` per round and ``draft_step`` (one draft forward over one target step), and
``bound`` = (1 + accepted per round) / (verify_steps + draft_forwards x draft_step), the
speed-up those rounds allow over the lean target alone if nothing but the forwards cost.
The lean target alone's row has ``prefill_share``, the share of its time its prompt's forward
took (every method pays that forward too), and every row ``bound_with_prefill`` =
1 / (prefill_share + (1 - prefill_share) / bound), what the call allows when only its decoding
is sped up (where the step is weight reads, the prompt's forward is compute bound: about a
quarter of a 128-token call):

    python benchmarks/e2e.py --widen 16384 --configs 1:0 8:0 --repeats 2 --only auto "fixed k=" \
        "ngram beside" "ngram tree" --name e2e_weight_read_cpu
"""
from __future__ import annotations

import argparse
import ast
import csv
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.models.eagle import load_head  # noqa: E402
from spec_ext.ops.linear import ISA_VARIABLE  # noqa: E402
from stdlib_data import code_prompts, read_text, split_files  # noqa: E402
from weight_read import read_bytes, widened_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
POLICIES = ["fixed", "auto", "heuristic", "confidence", "svip", "tree", "specdecpp", "adalength", "pearl",
            "specbranch", "learnedspecbranch"]
SAME_WINDOW = "serial fixed k=PEARL's gamma"
BEST_FIXED = "(best on validation)"
DYNAMIC_SHAPE = (4, 4, 16)  # depth, top-k, nodes: EAGLE-2's defaults (6, 10, 60) verify too many nodes on 2 cores
DYNAMIC_TREE = "dynamictree d={} k={} n={}".format(*DYNAMIC_SHAPE)
HEAD = ROOT / "models" / "stdlib-head"  # the row every method is also compared with, pass by pass


def policies(greedy: bool = True, batch: int = 1) -> dict:
    """Row name -> policy; adds Fixed(k) with the best k on the validation split for the
    decoding mode and batch size (benchmarks/train_policies.py) when that sweep exists."""
    chosen = {name: name for name in POLICIES}
    chosen["pearl"] = spec_ext.policies.PEARL()
    chosen["auto, model only"] = spec_ext.policies.Auto(text=False)  # the default without the text beside it
    chosen["fixed k=4"] = spec_ext.policies.Fixed(4)  # the k the heads' agreement is compared at
    chosen[DYNAMIC_TREE] = spec_ext.policies.DynamicTree(*DYNAMIC_SHAPE)
    if (ROOT / "models" / "policies" / "validation.json").exists():
        k = best_fixed(greedy, batch)
        chosen[f"fixed k={k} {BEST_FIXED}"] = spec_ext.policies.Fixed(k)
    return chosen


def head_rows(head_dir: Path, greedy: bool = True, batch: int = 1) -> dict:
    """Row name -> policy of the rows drafted by the feature head in ``head_dir``; with its
    predictors (``train_policies.py --head``), the learned policies and the best fixed k that
    its validation replay chose for the decoding mode and batch size."""
    from spec_ext.policies import AdaLength, DynamicTree, Fixed, SpecDecPP
    from spec_ext.policies import Auto
    rows = {"head fixed k=4": Fixed(4), "head auto": "auto", "head auto, model only": Auto(text=False),
            f"head {DYNAMIC_TREE}": DynamicTree(*DYNAMIC_SHAPE)}
    predictors = head_dir / "policies"
    if (predictors / "validation.json").exists():
        k = best_fixed(greedy, batch, predictors / "validation.json")
        rows |= {f"head fixed k={k} {BEST_FIXED}": Fixed(k),
                 "head specdecpp": SpecDecPP(predictors / "specdecpp.safetensors"),
                 "head adalength": AdaLength(predictors / "adalength.safetensors")}
    return rows


def ngram_rows(greedy: bool = True, batch: int = 1) -> dict:
    """Row name -> (NGram policy, whether it runs beside the draft model); beside the draft
    (chains), the draft model drafts the best fixed k of the validation split where the text
    has no match."""
    from spec_ext.policies import NGram
    return {"ngram chain, no draft": (NGram(tree=False), False), "ngram tree, no draft": (NGram(tree=True), False),
            "ngram beside the draft": (NGram(tree=False, draft_k=best_fixed(greedy, batch)), True)}


def grounded_prompts(tokenizer, split: str = "test", count: int = 8, seed: int = 0, head_lines: int = 2,
                     longest: int = 128, shortest_copy: int = 32) -> list[list[int]]:
    """Input-grounded prompts: the source of a function of a ``split`` file, a blank line, and
    the first ``head_lines`` lines of the same function again, so that a copy begins (of at
    least ``shortest_copy`` tokens). The prompt is a prefix of the tokens of the whole text
    (function, blank line, function), cut before the line break that ends the head lines: the
    tokenizer merges a line break with the next line's indentation, so a prompt ending in a
    bare line break would be a token boundary the model never saw (it reads it as the end of
    the function). At most ``longest`` tokens: the bundled pair was trained on 256-token
    windows, so prompt + 128 new tokens stay inside what it knows. Chosen by ``seed``."""
    candidates = []
    for path in split_files(split):
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno > head_lines:
                source = "\n".join(lines[node.lineno - 1:node.end_lineno]) + "\n"
                head = "\n".join(lines[node.lineno - 1:node.lineno - 1 + head_lines])
                whole = tokenizer(source + "\n" + source, add_special_tokens=False, return_offsets_mapping=True)
                cut = len(source + "\n" + head)
                ids = [i for i, (_, end) in zip(whole["input_ids"], whole["offset_mapping"]) if end <= cut]
                if len(whole["input_ids"]) - len(ids) >= shortest_copy and len(ids) <= longest:
                    candidates.append(ids)
    return random.Random(seed).sample(candidates, count)


def matcher_cost(tokenizer, target, history_tokens: int = 32768, rounds: int = 400, per_round: int = 3):
    """Median seconds per round of the n-gram matcher (commit ``per_round`` tokens, then propose
    a chain, or a tree) over a held-out history of ``history_tokens`` tokens, and of one
    verification forward of the target (11 tokens after a 512-token prefix, batch 1)."""
    from spec_ext.drafters import TextSource
    from spec_ext.policies import Call, NGram, RoundState
    history = []
    for path in split_files("test"):
        history += tokenizer(read_text(path), add_special_tokens=False)["input_ids"]
        if len(history) >= history_tokens + rounds * per_round:
            break
    costs = {}
    for name, policy in (("chain", NGram(tree=False)), ("tree", NGram(tree=True))):
        controller, text = policy.start(Call(1)), TextSource(policy.text_settings(False))
        started = time.perf_counter()
        text.start([history[:history_tokens]])
        costs[f"index_{history_tokens}_tokens_s"] = time.perf_counter() - started
        times = []
        for r in range(rounds):
            new = history[history_tokens + r * per_round:history_tokens + (r + 1) * per_round]
            started = time.perf_counter()
            text.rows[0].extend(new)
            controller.plan(RoundState(1, text))
            times.append(time.perf_counter() - started)
        costs[f"matcher_{name}_round_s"] = statistics.median(times)
    ids = torch.tensor([history[:512]])
    times = []
    with torch.inference_mode(), spec_ext.models.attention_implementation(target, fast_linear=DEFAULT_LINEAR):
        for _ in range(20):
            cache = spec_ext.SpecCache.for_model(target, 1, 600)
            spec_ext.models.forward(target, ids, cache, torch.arange(512)[None])
            cache.advance([512])
            _, t = timed(lambda: spec_ext.models.forward(target, ids[:, :11], cache, 512 + torch.arange(11)[None]))
            times.append(t)
    costs["target_verification_round_s"] = statistics.median(times)
    return costs


def load(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None  # every method generates exactly --new-tokens
    return model


def timed(fn):
    started = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - started


def left_pad(prompts, pad):
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


# the linear layers spec_ext.generate runs by default (its fast_linear="auto"): the lean
# baselines, the verification costs and the draft steps the bounds are priced by run on it too
DEFAULT_LINEAR = "auto"


def lean_alone(target, group, n, temperature, fast_linear, prefill: list | None = None):
    """The target alone, no draft, on spec_ext's lean forward and SpecCache: separates what
    the forward (and fast_linear's kernel) gains from what speculation gains. ``prefill``: the
    seconds of the prompt's forward are appended to it."""
    assert len(set(map(len, group))) == 1, "equal-length prompts only"
    sampler = spec_ext.engine.Sampler(temperature)
    ids = torch.tensor(group)
    B, L = ids.shape
    tokens = []
    with torch.inference_mode(), spec_ext.models.attention_implementation(target, fast_linear=fast_linear):
        cache = spec_ext.SpecCache.for_model(target, B, L + n)
        started = time.perf_counter()
        logits = spec_ext.models.forward(target, ids, cache, torch.arange(L).expand(B, L)).logits[:, -1]
        if prefill is not None:
            prefill.append(time.perf_counter() - started)
        cache.advance([L] * B)
        for step in range(n):
            token = logits.argmax(-1) if sampler.greedy else torch.multinomial(sampler.probs(logits), 1)[:, 0]
            tokens.append(token)
            if step + 1 < n:
                logits = spec_ext.models.forward(target, token[:, None], cache, cache.lengths[:, None]).logits[:, 0]
                cache.advance([1] * B)
    return torch.cat([ids, torch.stack(tokens, 1)], 1)


class VerificationWidths:
    """While entered, records the width (tokens per row: a chain's 1 + drafts, a tree's nodes)
    of every verification forward the serial engine runs, in ``widths``."""

    def __enter__(self):
        import spec_ext.engine.serial as serial
        self.widths, self._serial, self._forward = [], serial, serial.forward

        def forward(model, ids, *args, **kwargs):
            self.widths.append(ids.shape[1])
            return self._forward(model, ids, *args, **kwargs)

        serial.forward = forward
        return self

    def __exit__(self, *exc):
        self._serial.forward = self._forward

    def take(self) -> list[int]:
        widths, self.widths[:] = list(self.widths), []
        return widths


WIDTHS = (*range(1, 14), 16, 20, 24, 28, 33)  # measured; the widths between are interpolated


def width_costs(target, draft, head, prompt, batch: int, repeats: int = 7) -> dict:
    """Fastest-of-``repeats`` seconds (after a first call left out) of one lean forward of the
    target over ``w`` new tokens per row at batch ``batch`` after the prompt, for every w of
    WIDTHS (``"target"``: {w: s}); of one draft step of the draft model and of the head at that
    batch (``"draft"``, ``"head"``)."""
    ids = torch.tensor([prompt] * batch)
    L = ids.shape[1]
    costs = {"target": {}}
    with torch.inference_mode(), spec_ext.models.attention_implementation(target, fast_linear=DEFAULT_LINEAR):
        cache = spec_ext.SpecCache.for_model(target, batch, L + max(WIDTHS) + 1)
        spec_ext.models.forward(target, ids, cache, torch.arange(L).expand(batch, L))
        cache.advance([L] * batch)
        for w in WIDTHS:
            new = ids[:, :w] if w <= L else ids.repeat(1, -(-w // L))[:, :w]
            times = [timed(lambda: spec_ext.models.forward(target, new, cache, L + torch.arange(w).expand(batch, w)))[1]
                     for _ in range(repeats + 1)]
            costs["target"][w] = min(times[1:])
    with torch.inference_mode(), spec_ext.models.attention_implementation(draft, fast_linear=DEFAULT_LINEAR):
        cache = spec_ext.SpecCache.for_model(draft, batch, L + 1)
        spec_ext.models.forward(draft, ids, cache, torch.arange(L).expand(batch, L))
        cache.advance([L] * batch)
        step = torch.full((batch, 1), L)
        costs["draft"] = min(timed(lambda: spec_ext.models.forward(draft, ids[:, -1:], cache, step))[1]
                             for _ in range(3 * repeats))
    if head is not None:
        from spec_ext.drafters import HeadDrafter
        drafter = HeadDrafter(head)
        drafter.bind(target)
        with torch.inference_mode():
            cache = spec_ext.SpecCache(head.num_layers, None, None, batch, L + 1, head.fc.weight.dtype, "cpu")
            hidden = torch.randn(batch, L, head.hidden_size, dtype=head.fc.weight.dtype)
            head(drafter.embed(ids), hidden, torch.arange(L).expand(batch, L), cache, target_head=drafter.target_head)
            cache.advance([L] * batch)
            step = torch.full((batch, 1), L)
            costs["head"] = min(timed(lambda: head(drafter.embed(ids[:, -1:]), hidden[:, -1:], step, cache,
                                                   target_head=drafter.target_head))[1] for _ in range(3 * repeats))
    return costs


def verification_cost(costs: dict, width: int) -> float:
    """One verification of ``width`` tokens per row over one decode step, interpolated
    between the measured widths."""
    table = costs["target"]
    lower = max(w for w in table if w <= width)
    upper = min((w for w in table if w >= width), default=lower)
    value = table[lower] if upper == lower else \
        table[lower] + (table[upper] - table[lower]) * (width - lower) / (upper - lower)
    return value / table[1]


def bound_columns(method: str, r: dict, costs: dict | None, prefill_share: float | None = None) -> dict:
    """verify_steps, draft_forwards, draft_step, bound and bound_with_prefill of a method's
    rows (module docstring)."""
    widths = sum(r.get("widths", []), [])
    stats = r["stats"]
    if costs is None or not widths or not stats:
        return dict(verify_steps="", draft_forwards="", draft_step="", bound="", bound_with_prefill="")
    verify = statistics.mean(verification_cost(costs, w) for w in widths)
    forwards = sum(s.draft_calls for s in stats) / len(widths)
    step = 0.0 if "no draft" in method else (costs.get("head", 0.0) if "head" in method else costs["draft"])
    step /= costs["target"][1]
    accepted = np.mean([s.mean_accepted for s in stats])
    bound = (1 + accepted) / (verify + forwards * step)
    return dict(verify_steps=round(verify, 3), draft_forwards=round(forwards, 2), draft_step=round(step, 3),
                bound=round(bound, 3), bound_with_prefill="" if prefill_share is None else
                round(1 / (prefill_share + (1 - prefill_share) / bound), 3))


def paired_ratio(result: dict, reference: dict | None) -> float | str:
    """Median over passes (prompt group x repeat) of a method's rate over the reference's
    rate in the same pass: the target alone's own timing noise drops out, unlike in the ratio
    of two speed-ups."""
    if reference is None or len(reference["rates"]) != len(result["rates"]):
        return ""
    return round(statistics.median(a / b for a, b in zip(result["rates"], reference["rates"])), 3)


def best_fixed(greedy: bool = True, batch: int = 1, sweep: Path = ROOT / "models" / "policies" / "validation.json"
               ) -> int:
    """The fixed k the validation replay (``sweep``: the draft model's by default) chose for
    greedy decoding or for sampling, at batch 1 or (batch > 1) for batches."""
    if not sweep.exists():
        return 4
    report = json.loads(sweep.read_text())
    if batch > 1 and "batch" in report:
        report = report["batch"]
    return report["best_fixed_k"] if greedy else report.get("best_fixed_k_sampling", report["best_fixed_k"])


def run_config(target, draft, prompts, batch, temperature, n, repeats, pad, wanted=lambda method: True,
               isas=(None,), head=None, head_dir: Path = HEAD):
    """Returns {method: dict(rates, ratios, stats, matches)} for one configuration; only the
    methods ``wanted`` accepts run, besides the target alone; with ``isas``, spec_ext's
    methods run once per forced skinny_linear path (names tagged " [avx2]" ...)."""
    greedy = temperature == 0
    sample = {} if greedy else dict(do_sample=True, temperature=temperature, top_k=None, top_p=None)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    results: dict[str, dict] = {}
    gammas: list[int] = []

    def record(method, rate, ratio, stats=None, match=None, prefill_share=None):
        entry = results.setdefault(method, dict(rates=[], ratios=[], stats=[], matches=[], widths=[],
                                                prefill_shares=[]))
        entry["widths"].append(tracer.take())
        entry["rates"].append(rate)
        entry["ratios"].append(ratio)
        if stats is not None:
            entry["stats"].append(stats)
        if match is not None:
            entry["matches"].append(match)
        if prefill_share is not None:
            entry["prefill_shares"].append(prefill_share)

    tracer = VerificationWidths()
    with tracer:
        run_passes(target, draft, groups, batch, temperature, n, repeats, pad, wanted, isas, head, head_dir, sample,
                   greedy, record, gammas)
    for method in results:
        if gammas and method.startswith("spec_ext pearl"):
            results[method]["gammas"] = gammas
    return results


def run_passes(target, draft, groups, batch, temperature, n, repeats, pad, wanted, isas, head, head_dir, sample,
               greedy, record, gammas):
    """Every pass (prompt group x repeat) of one configuration: each method on the same
    prompts, the target alone (HF's generate and the lean forward) first."""
    for _ in range(repeats):
        for group in tqdm(groups, desc=f"batch={batch} T={temperature}", leave=False):
            ids, mask = left_pad(group, pad)
            alone, t = timed(lambda: target.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                                     pad_token_id=pad, **(sample or dict(do_sample=False))))
            base = len(group) * n / t
            record("target alone", base, 1.0)
            if len(set(map(len, group))) == 1:  # the bound's baseline (equal-length prompts only)
                prefill = []
                out, t = timed(lambda: lean_alone(target, group, n, temperature, DEFAULT_LINEAR, prefill))
                record("target alone, lean forward", len(group) * n / t, len(group) * n / t / base,
                       match=bool(torch.equal(out, alone)) if greedy else None, prefill_share=prefill[0] / t)
            if batch == 1:
                for name, schedule in (("HF assisted (defaults)", None), ("HF assisted (heuristic)", "heuristic")):
                    if not wanted(name):
                        continue
                    config = draft.generation_config
                    saved = (config.num_assistant_tokens_schedule, config.num_assistant_tokens,
                             config.assistant_confidence_threshold)
                    if schedule:
                        config.num_assistant_tokens_schedule = schedule
                        config.assistant_confidence_threshold = 0.0
                    out, t = timed(lambda: target.generate(ids, attention_mask=mask, assistant_model=draft,
                                                           max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                                           **(sample or dict(do_sample=False))))
                    (config.num_assistant_tokens_schedule, config.num_assistant_tokens,
                     config.assistant_confidence_threshold) = saved
                    new = out.shape[1] - ids.shape[1]
                    record(name, new / t, new / t / base, match=bool(torch.equal(out, alone)) if greedy else None)
                name = "HF prompt lookup (prompt_lookup_num_tokens=10)"
                if wanted(name):
                    out, t = timed(lambda: target.generate(ids, attention_mask=mask, prompt_lookup_num_tokens=10,
                                                           max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                                                           **(sample or dict(do_sample=False))))
                    new = out.shape[1] - ids.shape[1]
                    record(name, new / t, new / t / base, match=bool(torch.equal(out, alone)) if greedy else None)
            for isa in isas:  # each forced path of skinny_linear, on the same prompts in the same pass
                if isa is not None:
                    os.environ[ISA_VARIABLE] = isa
                tag = "" if isa is None else f" [{isa}]"
                for name, policy in policies(greedy, batch).items():
                    if not wanted(f"spec_ext {name}"):
                        continue
                    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n,
                                            temperature=temperature, eos_token_id=[], pad_token_id=pad, policy=policy)
                    rate = out.stats.tokens_per_s
                    match = bool(torch.equal(out.sequences, alone)) if greedy else None
                    record(f"spec_ext {name}{tag}", rate, rate / base, out.stats, match)
                    if name == "pearl":  # serial SD with the window PEARL chose, on the same prompts
                        gammas.append(out.stats.gamma)
                        out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n,
                                                temperature=temperature, eos_token_id=[], pad_token_id=pad,
                                                policy=spec_ext.policies.Fixed(out.stats.gamma))
                        rate = out.stats.tokens_per_s
                        record(f"spec_ext {SAME_WINDOW}{tag}", rate, rate / base, out.stats,
                               bool(torch.equal(out.sequences, alone)) if greedy else None)
                for name, policy in (head_rows(head_dir, greedy, batch) if head is not None else {}).items():
                    if not wanted(f"spec_ext {name}"):
                        continue
                    out = spec_ext.generate(target, head, ids, attention_mask=mask, max_new_tokens=n,
                                            temperature=temperature, eos_token_id=[], pad_token_id=pad, policy=policy)
                    rate = out.stats.tokens_per_s
                    record(f"spec_ext {name}{tag}", rate, rate / base, out.stats,
                           bool(torch.equal(out.sequences, alone)) if greedy else None)
                for name, (policy, beside) in ngram_rows(greedy, batch).items():
                    if not wanted(f"spec_ext {name}"):
                        continue
                    out = spec_ext.generate(target, draft if beside else None, ids, attention_mask=mask,
                                            max_new_tokens=n, temperature=temperature, eos_token_id=[],
                                            pad_token_id=pad, policy=policy)
                    rate = out.stats.tokens_per_s
                    record(f"spec_ext {name}{tag}", rate, rate / base, out.stats,
                           bool(torch.equal(out.sequences, alone)) if greedy else None)
                k = best_fixed(greedy, batch)
                if wanted(f"spec_ext fixed k={k}*, fast_linear"):
                    out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n,
                                            temperature=temperature, eos_token_id=[], pad_token_id=pad,
                                            policy=spec_ext.policies.Fixed(k), fast_linear=True)
                    rate = out.stats.tokens_per_s
                    record(f"spec_ext fixed k={k}*, fast_linear{tag}", rate, rate / base, out.stats,
                           bool(torch.equal(out.sequences, alone)) if greedy else None)
                if wanted(f"spec_ext fixed k={k}*, HF modules"):  # what models without a lean forward get
                    with spec_ext.models.hf_modules(target, draft):
                        out = spec_ext.generate(target, draft, ids, attention_mask=mask, max_new_tokens=n,
                                                temperature=temperature, eos_token_id=[], pad_token_id=pad,
                                                policy=spec_ext.policies.Fixed(k))
                    rate = out.stats.tokens_per_s
                    record(f"spec_ext fixed k={k}*, HF modules{tag}", rate, rate / base, out.stats,
                           bool(torch.equal(out.sequences, alone)) if greedy else None)
                for fast in (False, True) if isa is not None else (True,):  # without fast_linear: the baseline
                    if not wanted(f"target alone, lean forward{', fast_linear' if fast else ''}"):
                        continue
                    out, t = timed(lambda: lean_alone(target, group, n, temperature, fast))
                    rate = len(group) * n / t
                    record(f"target alone, lean forward{', fast_linear' if fast else ''}{tag}", rate, rate / base,
                           match=bool(torch.equal(out, alone)) if greedy else None)
            os.environ.pop(ISA_VARIABLE, None)


def forward_costs(target, draft, prompt, head=None):
    """Median ms of one decode forward (HF cache) of target and draft, 1 and 6 new tokens; and
    one draft step of the draft model (lean forward) and of the head, as spec_ext runs them."""
    costs = {}
    ids = torch.tensor([prompt])
    for name, model in (("target", target), ("draft", draft)):
        for width in (1, 6):
            times = []
            for _ in range(15):
                cache = model(ids[:, :-width], use_cache=True).past_key_values
                _, t = timed(lambda: model(ids[:, -width:], past_key_values=cache, use_cache=True))
                times.append(t)
            costs[f"{name}_T{width}_ms"] = statistics.median(times) * 1e3
    L = ids.shape[1]
    step = torch.tensor([[L]])
    with spec_ext.models.attention_implementation(draft, fast_linear=DEFAULT_LINEAR):
        cache = spec_ext.SpecCache.for_model(draft, 1, L + 1)
        spec_ext.models.forward(draft, ids, cache, torch.arange(L)[None])
        cache.advance([L])
        times = [timed(lambda: spec_ext.models.forward(draft, ids[:, -1:], cache, step))[1] for _ in range(50)]
    costs["draft_step_ms"] = statistics.median(times) * 1e3
    if head is not None:
        from spec_ext.drafters import HeadDrafter
        drafter = HeadDrafter(head)
        drafter.bind(target)
        cache = spec_ext.SpecCache(head.num_layers, None, None, 1, L + 1, head.fc.weight.dtype, "cpu")
        hidden = torch.randn(1, L, head.hidden_size, dtype=head.fc.weight.dtype)
        head(drafter.embed(ids), hidden, torch.arange(L)[None], cache, target_head=drafter.target_head)
        cache.advance([L])
        times = [timed(lambda: head(drafter.embed(ids[:, -1:]), hidden[:, -1:], step, cache,
                                    target_head=drafter.target_head))[1] for _ in range(50)]
        costs["head_step_ms"] = statistics.median(times) * 1e3
    return costs


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--head", type=Path, default=HEAD,
                        help="a feature head for the target (its rows run when the folder exists)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--configs", nargs="+", default=["1:0", "8:0", "1:0.7", "8:0.7", "1:1.0"],
                        help="batch:temperature pairs")
    parser.add_argument("--name", default="e2e_cpu", help="file prefix under benchmarks/results")
    parser.add_argument("--busy-core", action="store_true",
                        help="run a competing CPU-bound process (one busy core) for the whole benchmark")
    parser.add_argument("--isas", nargs="+", choices=["avx512", "avx2", "portable"],
                        help="run spec_ext's methods once per forced skinny_linear path, side by side")
    parser.add_argument("--only", nargs="+", metavar="TEXT",
                        help="run only the methods whose row name contains one of these (the target alone always "
                        "runs: it is the baseline), e.g. --only 'fixed' specdecpp adalength")
    parser.add_argument("--workloads", nargs="+", default=["heldout"], choices=["heldout", "grounded", "thirdparty"],
                        help="heldout: held-out file prefixes; grounded: a held-out function, then its first lines "
                        "again (a copy begins)")
    parser.add_argument("--widen", type=int, metavar="INTERMEDIATE",
                        help="widen the target's MLPs by zero rows to this size (16384: ~0.5 GB read per step, the "
                        "same function; benchmarks/weight_read.py)")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="every method runs in it; auto: as stored (the bundled pair: bfloat16). In bfloat16 "
                        "greedy outputs depend on the attention kernel's rounding (HF's own sdpa and eager "
                        "attention disagree), so only float32 can show equality with HF generate")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target, args.dtype), load(args.draft, args.dtype)
    if args.widen:
        target = widened_target(target, args.widen)
        print(f"target widened to intermediate_size {args.widen}: {read_bytes(target) / 1e9:.2f} GB of parameters")
    head = None
    if args.head is not None and args.head.exists():
        head = load_head(args.head, target.dtype)
    prompts = {"heldout": lambda: code_prompts(tokenizer, "test", args.prompts, args.prompt_tokens, seed=0),
               "grounded": lambda: grounded_prompts(tokenizer, "test", args.prompts, seed=0),
               "thirdparty": lambda: code_prompts(tokenizer, "thirdparty", args.prompts, args.prompt_tokens, seed=0)}
    prompts = {workload: prompts[workload]() for workload in args.workloads}
    pad = tokenizer.pad_token_id
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True,
                            cwd=ROOT).stdout.strip()
    device = f"cpu-{torch.get_num_threads()}threads{'-one-core-busy' if args.busy_core else ''}"
    RESULTS.mkdir(exist_ok=True)
    matched = set()

    def wanted(method):
        hits = {text for text in args.only or () if text in method}
        matched.update(hits)
        return not args.only or bool(hits)

    competitor = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy_core else None
    try:
        rows, histograms, costs = [], {}, {}
        for workload, group in prompts.items():
            found = measure_configs(args, parser, target, draft, group, pad, commit, device, wanted, matched, workload,
                                    head)
            rows += found[0]
            histograms.update(found[1])
            costs = costs or found[2]
        if any(r["method"].startswith("spec_ext ngram") for r in rows):
            write_matcher_cost(args, matcher_cost(tokenizer, target), commit, device)
    finally:
        if competitor is not None:
            competitor.kill()
    write_results(args, rows, histograms, costs, matched)


def write_matcher_cost(args, costs, commit, device):
    """<name>_matcher.csv: the n-gram matcher's seconds per round at 32K tokens of history, and
    their share of a target verification round."""
    with (RESULTS / f"{args.name}_matcher.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["measure", "seconds", "share_of_target_round", "device", "commit"])
        for name, seconds in costs.items():
            writer.writerow([name, f"{seconds:.3g}", f"{seconds / costs['target_verification_round_s']:.2g}",
                             device, commit])
    print(f"n-gram matcher at 32K tokens of history: {costs}")


def measure_configs(args, parser, target, draft, prompts, pad, commit, device, wanted, matched, workload="heldout",
                    head=None):
    rows, histograms = [], {}
    with torch.inference_mode():
        costs = forward_costs(target, draft, prompts[0], head)
        for config in args.configs:
            batch, temperature = int(config.split(":")[0]), float(config.split(":")[1])
            results = run_config(target, draft, prompts, batch, temperature, args.new_tokens, args.repeats, pad,
                                 wanted, args.isas or (None,), head, args.head)
            if args.only and not matched:
                parser.error(f"--only: {args.only} matched no method (names: {sorted(policies())}, "
                             "'HF assisted', 'fast_linear', 'lean forward')")
            reference = next((r for method, r in results.items() if BEST_FIXED in method), None)
            lean = results.get("target alone, lean forward")
            share = statistics.median(lean["prefill_shares"]) if lean and lean["prefill_shares"] else None
            widths = width_costs(target, draft, head, prompts[0], batch)
            print(f"batch {batch}: a verification by width over one step "
                  f"{ {w: round(verification_cost(widths, w), 2) for w in WIDTHS} }, one step "
                  f"{widths['target'][1] * 1e3:.1f} ms, draft step {widths['draft'] * 1e3:.2f} ms"
                  + (f", head step {widths['head'] * 1e3:.2f} ms" if "head" in widths else ""))
            for method, r in results.items():
                stats = r["stats"]
                row = dict(method=method, workload=workload, batch=batch, temperature=temperature,
                           tokens_per_s=round(statistics.median(r["rates"]), 1),
                           speedup=round(statistics.median(r["ratios"]), 3),
                           speedup_lean=paired_ratio(r, lean),
                           spread=f"{min(r['ratios']):.2f}-{max(r['ratios']):.2f}",
                           vs_best_fixed=paired_ratio(r, reference),
                           mean_accepted=round(np.mean([s.mean_accepted for s in stats]), 3) if stats else "",
                           acceptance_rate=round(np.mean([s.acceptance_rate for s in stats]), 3) if stats else "",
                           **agreement(sum((s.accepted_lengths for s in stats), [])),
                           target_calls=sum(s.target_calls for s in stats) if stats else "",
                           draft_calls=sum(s.draft_calls for s in stats) if stats else "",
                           rollback=sum(s.rollback for s in stats) if stats else "",
                           matched_rounds=round(sum(s.matched for s in stats) / max(1, sum(s.rounds for s in stats)),
                                                3) if stats else "",
                           matches_target=(all(r["matches"]) if r["matches"] else ""),
                           pearl_gamma=(statistics.median(r["gammas"]) if "gammas" in r else ""),
                           prefill_share="" if not r["prefill_shares"] else
                           round(statistics.median(r["prefill_shares"]), 3),
                           **bound_columns(method, r, widths, share),
                           target_read_mb=round(read_bytes(target) / 1e6, 1),
                           new_tokens=args.new_tokens, prompts=args.prompts,
                           dtype=str(target.dtype).removeprefix("torch."), device=device, commit=commit)
                rows.append(row)
                if stats:
                    histograms[(f"{workload}: {method}", batch, temperature)] = (sum((s.accepted_lengths for s in stats), []),
                                                                sum((s.draft_lengths for s in stats), []))
    return rows, histograms, costs


def agreement(lengths: list[int]) -> dict:
    """The first draft's acceptance (rounds with at least one accepted) and the next three's
    given the ones before them: a drafter's agreement curve (chains of fixed length)."""
    if not lengths:
        return dict(first_draft=0.0, conditional="")
    at_least = [sum(n >= j for n in lengths) for j in range(5)]
    return dict(first_draft=round(at_least[1] / at_least[0], 3),
                conditional=" / ".join(f"{at_least[j + 1] / at_least[j]:.2f}" if at_least[j] else "-"
                                       for j in range(1, 4)))


def write_results(args, rows, histograms, costs, matched):
    for text in sorted(set(args.only or ()) - matched):
        print(f"--only: {text!r} matched no method", file=sys.stderr)
    out = RESULTS / f"{args.name}.csv"
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"\nHF forward costs (ms; spec_ext runs the lean forward, see bench_forward.py): {costs}  "
          f"draft/target cost ratio (T=1): {costs['draft_T1_ms'] / costs['target_T1_ms']:.3f}")
    if "head_step_ms" in costs:
        print(f"one draft step as spec_ext runs it: draft model {costs['draft_step_ms']:.3f} ms, head "
              f"{costs['head_step_ms']:.3f} ms (head/draft {costs['head_step_ms'] / costs['draft_step_ms']:.2f})")
    target_threads, draft_threads = spec_ext.engine.split_threads()
    print(f"serial methods: {torch.get_num_threads()} intra-op threads; PEARL (threads mode): {target_threads} for "
          f"the target, {draft_threads} for the draft; its gamma (median per config): "
          f"{ {(r['batch'], r['temperature']): r['pearl_gamma'] for r in rows if r['pearl_gamma'] != ''} }")
    print(f"\n{'method':48} {'workload':>8} {'batch':>5} {'temp':>5} {'tok/s':>8} {'speed-up':>9} {'vs lean':>7} "
          f"{'vs k*':>6} {'acc/call':>9} {'verify':>6} {'drafts':>6} {'bound':>6} {'w/ pre':>6} {'matched':>7} "
          f"{'== target':>10}")
    for r in rows:
        print(f"{r['method']:48} {r['workload']:>8} {r['batch']:5} {r['temperature']:5} {r['tokens_per_s']:8.1f} "
              f"{r['speedup']:8.2f}x {str(r['speedup_lean']):>7} {str(r['vs_best_fixed']):>6} "
              f"{str(r['mean_accepted']):>9} {str(r['verify_steps']):>6} {str(r['draft_forwards']):>6} "
              f"{str(r['bound']):>6} {str(r['bound_with_prefill']):>6} {str(r['matched_rounds']):>7} "
              f"{str(r['matches_target']):>10}")
    (RESULTS / f"{args.name}_costs.txt").write_text(f"{costs}\n")
    plot(rows, histograms, args.name)


def plot(rows, histograms, name):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    configs = list(dict.fromkeys((r["batch"], r["temperature"]) for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.5 * len(configs), 4), squeeze=False)
    for ax, (batch, temperature) in zip(axes[0], configs):
        sub = [r for r in rows if r["batch"] == batch and r["temperature"] == temperature]
        several = len({r["workload"] for r in rows}) > 1
        ax.barh([f"{r['workload']}: {r['method']}" if several else r["method"] for r in sub], [r["speedup"] for r in sub],
                color=["gray" if "spec_ext" not in r["method"] else "tab:blue" for r in sub])
        ax.axvline(1, color="black", lw=0.8)
        ax.set_title(f"batch {batch}, {'greedy' if temperature == 0 else f'T={temperature}'}")
        ax.set_xlabel("speed-up vs target alone")
    fig.tight_layout()
    fig.savefig(RESULTS / f"{name}_speedup.png", dpi=110)
    keys = [k for k in histograms if k[1] == 1 and k[2] == 0]
    if not keys:  # the histograms are of batch 1 greedy only
        print(f"plot: {name}_speedup.png in {RESULTS}")
        return
    for which, (filename, label) in enumerate(((f"{name}_accepted.png", "accepted drafts per round"),
                                                (f"{name}_lengths.png", "draft length chosen per round"))):
        columns = min(6, max(1, len(keys)))
        lines = -(-max(1, len(keys)) // columns)
        fig, axes = plt.subplots(lines, columns, figsize=(3.2 * columns, 3 * lines), squeeze=False)
        for ax in axes.flat[len(keys):]:
            ax.axis("off")
        for ax, key in zip(axes.flat, keys):
            values = histograms[key][which]
            ax.hist(values, bins=np.arange(0, max(values) + 2) - 0.5)
            ax.set_title(key[0].replace("spec_ext ", "").replace(f" {BEST_FIXED}", "*"), fontsize=9)
            ax.set_xlabel(label, fontsize=8)
        fig.tight_layout()
        fig.savefig(RESULTS / filename, dpi=110)
    print(f"plots: {name}_speedup.png, {name}_accepted.png, {name}_lengths.png in {RESULTS}")


if __name__ == "__main__":
    main()
