"""Train the learned draft-length policies (spec_ext.learned) for a draft/target pair.

Stages (generated text is cached under --work, so a rerun skips it):
  1. the target continues prompts of the training split and of the validation split,
     greedily and sampled at T=1;
  2. teacher-forced features and labels of both decoding modes from both models
     (spec_ext.learned.features_and_labels);
  3. the SpecDecPP acceptance head (BCE; both modes' labels on all training text), the
     AdaLength length predictor (asymmetric L1) and SpecBranch's branch-point predictor
     (3 classes from the accepted length: none / some / at least ACCEPT_ALL_LENGTH;
     cross-entropy). An eighth of the training sequences is held out; each predictor keeps
     its epoch with the lowest held-out loss;
  4. the cost of a round with k drafts: measured in the loop at batch 1 and at --batch for a
     few k, lines fitted; and the learned policies' own time per decision at both sizes;
  5. on the validation split (never the test prompts), per decoding mode, the replay of
     spec_ext.learned.simulated_tokens_per_ms under that cost chooses the best fixed k, the
     SpecDecPP threshold and the AdaLength offset; two bounds (see bounds()) say what a length
     rule could gain at best: the oracle, which knows the run the target will accept, and a
     rule that knows each position's acceptance chance but not the draws. Then the same for
     batches of --batch rows that draft as one (simulated_batch_tokens_per_ms; a draft step
     costs more next to a verification there, so shorter drafts pay): the settings used at
     batch > 1;
  6. models/policies/{specdecpp,adalength,branch}.safetensors (settings in their metadata) and
     models/policies/validation.json (losses, costs, replayed rates, choices).

    python benchmarks/train_policies.py [--sequences 2048] [--fast-linear]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.learned import (GREEDY, SAMPLING, ResidualMLP, accepted_runs, branch_classes,  # noqa: E402
                              features_and_labels, simulated_batch_tokens_per_ms, simulated_tokens_per_ms,
                              train_predictor)
from stdlib_data import code_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 12  # longest chain the labels (and the learned policies) consider
ACCEPT_ALL_LENGTH = 4  # the branch predictor's "accept all" class: at least this many drafts accepted
COST_KS = (1, 2, 3, 4, 6, 8, 12)  # draft lengths whose round cost is measured
THRESHOLDS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.97)  # SpecDecPP's, replayed on validation
OFFSETS = (-1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0, 4.0)  # AdaLength's


def load(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def continuations(target, prompts, new_tokens, greedy, batch, path: Path) -> torch.Tensor:
    if path.exists():
        return torch.load(path)
    chunks = []
    torch.manual_seed(0)
    for i in tqdm(range(0, len(prompts), batch), desc=f"generate {'greedy' if greedy else 'T=1'}"):
        ids = torch.tensor(prompts[i:i + batch])
        sample = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=None, top_p=None)
        with torch.inference_mode():
            chunks.append(target.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                          pad_token_id=0, **sample))
    sequences = torch.cat(chunks)
    torch.save(sequences, path)
    return sequences


def dataset(target, draft, sequences, start, batch=32) -> dict:
    generator = torch.Generator().manual_seed(0)
    parts = [features_and_labels(target, draft, sequences[i:i + batch], start, MAX_LENGTH, generator)
             for i in range(0, len(sequences), batch)]
    data = {k: torch.cat([p[k] for p in parts]) for k in parts[0] if k != "sequence"}
    for mode in ("greedy", "sampling"):  # AdaLength's input in each mode
        data[f"adalength_in_{mode}"] = torch.cat([data["adalength_x"], data[f"adalength_history_{mode}"]], -1)
    data["sequence"] = torch.cat([p["sequence"] + i for i, p in zip(range(0, len(sequences), batch), parts)])
    data["positions"] = len(data["sequence"]) // len(sequences)
    return data


def by_sequence(data: dict, x: str, y: str, held: Tensor) -> tuple[tuple, tuple]:
    """(train, held-out) pairs of ``data[x], data[y]``; held [N] bool marks held-out sequences."""
    mask = held[data["sequence"]]
    return (data[x][~mask], data[y][~mask]), (data[x][mask], data[y][mask])


def round_costs(target, draft, prompts, new_tokens, repeats, fast_linear, batch=1) -> dict:
    """ms per round of Fixed(k), k in COST_KS, with ``batch`` prompts per generate call, over
    all prompts and repeats (every k runs on a group before the next group, so the box's
    drift hits all alike), and the least-squares line through them for every k in
    0..MAX_LENGTH (one noisy point would bend an interpolation and with it the choices)."""
    from spec_ext.policies import Fixed
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    elapsed, rounds = dict.fromkeys(COST_KS, 0.0), dict.fromkeys(COST_KS, 0)
    for _ in tqdm(range(repeats), desc=f"round costs, batch {batch}"):
        for group in groups:
            for k in COST_KS:
                out = spec_ext.generate(target, draft, group, max_new_tokens=new_tokens, eos_token_id=[],
                                        policy=Fixed(k), fast_linear=fast_linear)
                elapsed[k] += out.stats.wall_time
                rounds[k] += out.stats.target_calls - 1  # the first call is the prefill
    measured = {k: 1e3 * elapsed[k] / rounds[k] for k in COST_KS}
    per_draft, base = np.polyfit(list(measured), list(measured.values()), 1)
    round_ms = base + per_draft * np.arange(MAX_LENGTH + 1)
    return dict(measured_ms={k: round(v, 3) for k, v in measured.items()}, base_ms=round(float(base), 3),
                per_draft_ms=round(float(per_draft), 3), round_ms=round_ms.round(3).tolist())


def decision_ms(predictors, target, draft, batch=1, repeats=300) -> dict:
    """Median ms of the learned policies' own work for ``batch`` rows: SpecDecPP's per draft
    step (features and head), AdaLength's per round (embedding, history and predictor). Each
    call follows a draft forward, as in the loop: after one, small ops run 2-3x slower than
    back to back."""
    from spec_ext.learned import AdaLength, SpecDecPP
    specdecpp, adalength = SpecDecPP(predictors["specdecpp"]), AdaLength(predictors["adalength"])
    for policy in (specdecpp, adalength):
        policy.bind(target, draft)
        policy.start(batch, greedy=True)
    probs = torch.softmax(torch.randn(batch, draft.config.vocab_size) * 4, -1)
    token, draft_hidden = probs.argmax(-1), torch.randn(batch, draft.config.hidden_size)
    target_hidden = torch.randn(batch, target.config.hidden_size)
    agreed = torch.ones(batch, dtype=torch.bool)
    calls = dict(specdecpp_per_draft=lambda: specdecpp.keep_drafting(1, probs, token, draft_hidden),
                 adalength_per_round=lambda: (adalength.see_target(target_hidden, token),
                                              adalength.observe([3] * batch, [3] * batch),
                                              adalength.see_bonus_agreement(agreed), adalength.plan()))
    costs = {}
    with torch.inference_mode():
        for name, call in calls.items():
            times = []
            for _ in range(repeats):
                draft(token[:, None])
                started = time.perf_counter()
                call()
                times.append(time.perf_counter() - started)
            costs[name] = round(1e3 * statistics.median(times[repeats // 10:]), 4)
    return costs


def replay(accept: Tensor, candidates: dict, round_ms: list[float]) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's lengths [N,P]."""
    return {name: simulated_tokens_per_ms(accept, lengths, round_ms, MAX_LENGTH) for name, lengths in candidates.items()}


def batch_round_ms(alone_ms: list[float], batch_ms: list[float], batch: int):
    """(k, n) -> ms of a round with k drafts for n unfinished rows: the line between the
    batch-1 and the batch-``batch`` costs."""
    return lambda k, n: alone_ms[k] + (batch_ms[k] - alone_ms[k]) * (n - 1) / (batch - 1)


def replay_batches(accept: Tensor, candidates: dict, alone_ms: list[float], batch_ms: list[float],
                   batch: int) -> dict:
    """{name: (tokens per ms, mean drafts)} of each candidate's batch choice (rows, roots) -> k,
    in batches of ``batch`` rows (round costs: batch_round_ms)."""
    round_ms = batch_round_ms(alone_ms, batch_ms, batch)
    return {name: simulated_batch_tokens_per_ms(accept, choose, round_ms, MAX_LENGTH, batch)
            for name, choose in candidates.items()}


def best_of(rates: dict) -> tuple[dict, dict, dict]:
    """From replayed {name: (tokens per ms, mean drafts)} with names "family setting=value":
    the best name of each family (fixed, specdecpp, adalength), its value, and the table
    {name: tokens_per_ms, vs_best_fixed, mean_drafts}."""
    best = {family: max((n for n in rates if n.startswith(family)), key=lambda n: rates[n][0])
            for family in ("fixed", "specdecpp", "adalength")}
    reference = rates[best["fixed"]][0]
    table = {n: dict(tokens_per_ms=round(r, 4), vs_best_fixed=round(r / reference, 3), mean_drafts=round(k, 2))
             for n, (r, k) in rates.items()}
    return best, {family: float(name.split("=")[1]) for family, name in best.items()}, table


def survival(chances: Tensor, past_end: float) -> Tensor:
    """[N,P,MAX_LENGTH]: at [n, j, m], the product of chances[n, j..j+m] (chances [N,P] of
    acceptance per position; ``past_end`` stands in for positions past P)."""
    P = chances.shape[1]
    padded = torch.nn.functional.pad(chances, (0, MAX_LENGTH), value=past_end)
    return padded.unfold(1, MAX_LENGTH, 1)[:, :P].cumprod(-1)


def batch_choices(accept_probability: Tensor, length: Tensor) -> tuple[dict, dict, dict]:
    """The candidates of replay_batches: fixed k, SpecDecPP's batch rule (go on while 1 - the
    rows' mean predicted survival <= threshold) and AdaLength's (ceil of the rows' mean
    predicted length + offset)."""
    predicted = survival(accept_probability, past_end=1.0)

    def specdecpp(threshold):
        def choose(rows, roots):
            stop = (1 - predicted[rows, roots].mean(0)) > threshold
            return int(stop.float().argmax()) + 1 if bool(stop.any()) else MAX_LENGTH
        return choose

    def adalength(offset):
        return lambda rows, roots: int((length[rows, roots].mean() + offset).ceil().clamp(1, MAX_LENGTH))

    fixed = {f"fixed k={k}": (lambda rows, roots, k=k: k) for k in range(1, MAX_LENGTH + 1)}
    return (fixed, {f"specdecpp threshold={h}": specdecpp(h) for h in THRESHOLDS},
            {f"adalength offset={o}": adalength(o) for o in OFFSETS})


def bounds(accept: Tensor, chances: Tensor, round_ms, batch_ms) -> tuple[dict, dict]:
    """What length rules could reach at best, as replay candidates (lengths [N,P] at batch
    1, choose(rows, roots) for batches; batch_ms(k, n) the batch round cost):
      * "oracle": knows the run the target will accept (drafts exactly that many at batch 1;
        the k with the most tokens per ms for the batch's runs);
      * "chances known": knows every position's acceptance chance in advance (greedy: the
        outcome itself; sampling: sum_x min(p, q)) but not the draws, and takes the k with the
        most expected tokens per ms: at T=1 no rule that cannot see the random draws should
        beat it, however good its predictor."""
    runs = accepted_runs(accept.float(), MAX_LENGTH).long()
    expected = 1 + survival(chances, past_end=0.0).cumsum(-1)  # [N,P,k]: tokens a round yields with k drafts
    per_k = torch.tensor(round_ms[1:MAX_LENGTH + 1])
    alone = {"oracle": runs.clamp_min(1), "chances known": (expected / per_k).argmax(-1) + 1}
    ks = range(1, MAX_LENGTH + 1)

    def oracle(rows, roots):
        run = runs[rows, roots]
        return max(ks, key=lambda k: (int(run.clamp(max=k).sum()) + len(rows)) / batch_ms(k, len(rows)))

    def chances_known(rows, roots):
        tokens = expected[rows, roots].sum(0)
        return max(ks, key=lambda k: float(tokens[k - 1]) / batch_ms(k, len(rows)))
    return alone, {"oracle": oracle, "chances known": chances_known}


def specdecpp_lengths(accept_probability: Tensor, threshold: float) -> Tensor:
    """SpecDecPP's drafts per root [N,P]: the first m with 1 - prod of the next m predicted
    acceptances > threshold, at most MAX_LENGTH."""
    stop = (1 - survival(accept_probability, past_end=1.0)) > threshold
    first = stop.float().argmax(-1) + 1
    return torch.where(stop.any(-1), first, torch.full_like(first, MAX_LENGTH))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "policies")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "policies")
    parser.add_argument("--sequences", type=int, default=2048, help="training continuations per decoding mode")
    parser.add_argument("--validation-sequences", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=64, help="predictor width (wider ones over-fit this data)")
    parser.add_argument("--depth", type=int, default=1, help="residual blocks per predictor")
    parser.add_argument("--cost-prompts", type=int, default=6, help="validation prompts timed for the round cost")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch", type=int, default=8,
                        help="the batch size whose settings are tuned, used for every batch > 1")
    parser.add_argument("--fast-linear", action="store_true", help="tune for generate(..., fast_linear=True)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="use the dtype you will decode in; auto: as stored (the bundled pair: bfloat16)")
    args = parser.parse_args()
    if args.batch < 2:
        parser.error(f"--batch: the batch size tuned for batch > 1 must be >= 2, got {args.batch}")
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target, args.dtype), load(args.draft, args.dtype)
    dtype = str(target.dtype).removeprefix("torch.")
    texts = {}
    for split, count, seed in (("train", args.sequences, 7), ("validation", args.validation_sequences, 3)):
        prompts = code_prompts(tokenizer, split, count, args.prompt_tokens, seed=seed)
        for mode in ("greedy", "sampling"):
            name = f"{split}_{mode}_{count}x{args.new_tokens}_{dtype}.pt"
            sequences = continuations(target, prompts, args.new_tokens, mode == "greedy", 32, args.work / name)
            texts[split, mode] = dataset(target, draft, sequences, args.prompt_tokens)
    print(f"data: {len(texts['train', 'greedy']['sequence']):,} positions per mode ({time.time() - started:.0f} s)",
          flush=True)

    held = torch.zeros(args.sequences, dtype=torch.bool)
    held[torch.randperm(args.sequences, generator=torch.Generator().manual_seed(0))[:args.sequences // 8]] = True
    train = {mode: texts["train", mode] for mode in ("greedy", "sampling")}
    for data in train.values():
        for mode in ("greedy", "sampling"):
            data[f"branch_y_{mode}"] = branch_classes(data[f"adalength_y_{mode}"], ACCEPT_ALL_LENGTH)
    both = {k: torch.cat([train["greedy"][k], train["sampling"][k]]) for k in train["greedy"] if k != "positions"}
    sources = dict(  # kind -> column -> (data, inputs, labels); SpecDecPP's labels hold on any text: it reads both
        specdecpp={GREEDY: (both, "specdecpp_x", "specdecpp_y_greedy"),
                   SAMPLING: (both, "specdecpp_x", "specdecpp_y_sampling")},
        adalength={GREEDY: (train["greedy"], "adalength_in_greedy", "adalength_y_greedy"),
                   SAMPLING: (train["sampling"], "adalength_in_sampling", "adalength_y_sampling")},
        branch={GREEDY: (train["greedy"], "adalength_x", "branch_y_greedy"),
                SAMPLING: (train["sampling"], "adalength_x", "branch_y_sampling")})
    report, predictors = {}, {}
    for kind, loss in (("specdecpp", "bce"), ("adalength", "asymmetric_l1"), ("branch", "cross_entropy")):
        torch.manual_seed(0)
        width = sources[kind][GREEDY][0][sources[kind][GREEDY][1]].shape[1]
        model = ResidualMLP(width, out_features=6 if kind == "branch" else 2, hidden=args.hidden, depth=args.depth)
        fit, held_out = {}, {}
        for column, (data, x_name, y_name) in sources[kind].items():
            fit[column], held_out[column] = by_sequence(data, x_name, y_name, held)
        t = time.time()
        history = train_predictor(model, fit, loss, epochs=args.epochs, held_out=held_out)
        report[kind] = dict(train_seconds=round(time.time() - t, 1), **history)
        predictors[kind] = model
        print(kind, json.dumps(report[kind]), flush=True)

    cost_prompts = code_prompts(tokenizer, "validation", max(args.cost_prompts, args.batch), 96, seed=1)
    costs = round_costs(target, draft, cost_prompts[:args.cost_prompts], 96, args.repeats, args.fast_linear)
    decisions = decision_ms(predictors, target, draft)
    print("round cost", json.dumps(costs), "decisions", json.dumps(decisions), flush=True)
    batch_costs = round_costs(target, draft, cost_prompts[:args.batch], 96, args.repeats, args.fast_linear,
                              batch=args.batch)
    batch_decisions = decision_ms(predictors, target, draft, batch=args.batch)
    print(f"batch {args.batch}: round cost", json.dumps(batch_costs), "decisions", json.dumps(batch_decisions),
          flush=True)

    chosen, replayed, limits, chosen_batch, replayed_batch = {}, {}, {}, {}, {}
    for mode, column in (("greedy", GREEDY), ("sampling", SAMPLING)):
        data = texts["validation", mode]
        shape = (-1, data["positions"])
        accept = data[f"accepted_{mode}"].view(shape) > 0.5  # sampling: the draw AdaLength's history saw
        with torch.no_grad():
            accept_probability = torch.sigmoid(predictors["specdecpp"](data["specdecpp_x"])[:, column]).view(shape)
            length = predictors["adalength"](data[f"adalength_in_{mode}"])[:, column].view(shape)
        rates = replay(accept, {f"fixed k={k}": torch.full(accept.shape, k) for k in range(1, MAX_LENGTH + 1)},
                       costs["round_ms"])
        best_k = int(max(rates, key=lambda n: rates[n][0]).split("=")[1])
        length = torch.cat([torch.full_like(length[:, :1], best_k), length[:, :-1]], 1)  # root j reads entry j-1
        specdecpp_ms = [c + k * decisions["specdecpp_per_draft"] for k, c in enumerate(costs["round_ms"])]
        rates |= replay(accept, {f"specdecpp threshold={h}": specdecpp_lengths(accept_probability, h)
                                 for h in THRESHOLDS}, specdecpp_ms)
        adalength_ms = [c + decisions["adalength_per_round"] for c in costs["round_ms"]]
        rates |= replay(accept, {f"adalength offset={o}": (length + o).ceil().clamp(1, MAX_LENGTH).long()
                                 for o in OFFSETS}, adalength_ms)
        alone, many = costs["round_ms"], batch_costs["round_ms"]
        bound_lengths, bound_choices = bounds(accept, data[f"specdecpp_y_{mode}"].view(shape), alone,
                                              batch_round_ms(alone, many, args.batch))
        rates |= replay(accept, bound_lengths, alone)
        best, chosen[mode], replayed[mode] = best_of(rates)
        limits[mode] = {name: replayed[mode][name]["vs_best_fixed"] for name in bound_lengths}
        print(mode, {name: replayed[mode][name]["vs_best_fixed"] for name in best.values()}, limits[mode],
              flush=True)

        fixed, specdecpp, adalength = batch_choices(accept_probability, length)
        per_draft = decisions["specdecpp_per_draft"], batch_decisions["specdecpp_per_draft"]
        per_round = decisions["adalength_per_round"], batch_decisions["adalength_per_round"]
        rates = replay_batches(accept, fixed, alone, many, args.batch)
        rates |= replay_batches(accept, specdecpp, [c + k * per_draft[0] for k, c in enumerate(alone)],
                                [c + k * per_draft[1] for k, c in enumerate(many)], args.batch)
        rates |= replay_batches(accept, adalength, [c + per_round[0] for c in alone],
                                [c + per_round[1] for c in many], args.batch)
        rates |= replay_batches(accept, bound_choices, alone, many, args.batch)
        best, chosen_batch[mode], replayed_batch[mode] = best_of(rates)
        print(f"{mode}, batch {args.batch}:", {name: replayed_batch[mode][name]["vs_best_fixed"]
                                               for name in [*best.values(), *bound_choices]}, flush=True)

    best_k = int(chosen["greedy"]["fixed"])
    settings = dict(
        specdecpp=dict(kind="specdecpp", threshold=chosen["greedy"]["specdecpp"],
                       threshold_sampling=chosen["sampling"]["specdecpp"],
                       threshold_batch=chosen_batch["greedy"]["specdecpp"],
                       threshold_batch_sampling=chosen_batch["sampling"]["specdecpp"], max_draft=MAX_LENGTH),
        adalength=dict(kind="adalength", offset=chosen["greedy"]["adalength"],
                       offset_sampling=chosen["sampling"]["adalength"],
                       offset_batch=chosen_batch["greedy"]["adalength"],
                       offset_batch_sampling=chosen_batch["sampling"]["adalength"], max_draft=MAX_LENGTH,
                       first_round=best_k),
        branch=dict(kind="branch", accept_all_length=ACCEPT_ALL_LENGTH))
    for kind, model in predictors.items():
        model.save(args.out / f"{kind}.safetensors", **settings[kind])
    report.update(round_cost=costs, decision_ms=decisions, fast_linear=args.fast_linear, replayed_on_validation=replayed,
                  bounds_vs_best_fixed=limits, best_fixed_k=best_k,
                  best_fixed_k_sampling=int(chosen["sampling"]["fixed"]), batch=dict(
                      size=args.batch, round_cost=batch_costs, decision_ms=batch_decisions,
                      replayed_on_validation=replayed_batch, best_fixed_k=int(chosen_batch["greedy"]["fixed"]),
                      best_fixed_k_sampling=int(chosen_batch["sampling"]["fixed"])), settings=settings,
                  pair=dict(target=args.target.name, draft=args.draft.name), sequences_per_mode=args.sequences,
                  dtype=dtype, total_seconds=round(time.time() - started))
    (args.out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("settings", "bounds_vs_best_fixed", "total_seconds")}, indent=2))


if __name__ == "__main__":
    main()
