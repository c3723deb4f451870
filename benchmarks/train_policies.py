"""Train the learned policies (spec_ext.policies.learned) for a draft/target pair, or for a
target and its EAGLE-3 feature head (--head), with spec_ext.training, on prompts from the
Python standard library (benchmarks/stdlib_data.py).

Stages (generated text is cached under --work, so a rerun skips it):
  1. the target continues prompts of the training split and of the validation split,
     greedily and sampled at T=1;
  2. teacher-forced features and labels of both decoding modes from both models
     (spec_ext.training.features_and_labels; a head's from its unrolled chains);
  3. the SpecDecPP acceptance head (BCE; both modes' labels on all training text), the
     AdaLength length predictor (asymmetric L1) and SpecBranch's branch-point predictor
     (3 classes from the accepted length: none / some / at least ACCEPT_ALL_LENGTH;
     cross-entropy; draft models only: SpecBranch drafts with a draft model beside the
     target, which a head cannot, as its drafts read the verification's own hidden states).
     An eighth of the training sequences is held out; each predictor keeps its epoch with the
     lowest held-out loss;
  4. the cost of a round with k drafts: measured in the loop at batch 1 and at --batch for a
     few k, lines fitted; and the learned policies' own time per decision at both sizes;
  5. on the validation split (never the test prompts), per decoding mode, the replay of
     spec_ext.training.simulated_tokens_per_ms under that cost chooses the best fixed k, the
     SpecDecPP threshold and the AdaLength offset; two bounds (see bounds()) say what a length
     rule could gain at best: the oracle, which knows the run the target will accept, and a
     rule that knows each position's acceptance chance but not the draws. Then the same for
     batches of --batch rows that draft as one (simulated_batch_tokens_per_ms; a draft step
     costs more next to a verification there, so shorter drafts pay): the settings used at
     batch > 1;
  6. models/policies/{specdecpp,adalength,branch}.safetensors (settings in their metadata) and
     models/policies/validation.json (losses, costs, replayed rates, choices); with --head,
     specdecpp and adalength under HEAD/policies/ (or --out).

    python benchmarks/train_policies.py [--sequences 2048] [--fast-linear]
    python benchmarks/train_policies.py --head path/to/head     # SpecDecPP and AdaLength for a head
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, AutoTokenizer

from spec_ext.models.eagle import load_head
from spec_ext.policies import ResidualMLP
from spec_ext.policies.learned import GREEDY, SAMPLING
from spec_ext.training import (MAX_LENGTH, OFFSETS, THRESHOLDS, batch_choices, batch_round_ms, best_of, bounds,
                               branch_classes, by_sequence, continuations, dataset, decision_ms, replay,
                               replay_batches, round_costs, specdecpp_lengths, steps_ahead, train_predictor)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_data import code_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ACCEPT_ALL_LENGTH = 4  # the branch predictor's "accept all" class: at least this many drafts accepted


def load(path, dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype if dtype == "auto" else getattr(torch, dtype))
    model.eval()
    model.generation_config.eos_token_id = None
    return model


def predicted_acceptance(predictor: ResidualMLP, data: dict, column: int) -> Tensor:
    """[N,P,MAX_LENGTH]: SpecDecPP's predicted acceptance of each step of the round rooted at
    each validation root: a head's on its step grid; a draft model's from its per-position
    predictions (step s at root j: position j+s; 1 past the data, where no round reaches)."""
    with torch.no_grad():
        if "specdecpp_x_grid" in data:
            return torch.sigmoid(predictor(data["specdecpp_x_grid"])[..., column]).view(-1, data["positions"],
                                                                                      MAX_LENGTH)
        per_position = torch.sigmoid(predictor(data["specdecpp_x"])[:, column]).view(-1, data["positions"])
    return steps_ahead(per_position, MAX_LENGTH, past_end=1.0)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--head", type=Path, help="train for this EAGLE-3 head's drafts instead of --draft's")
    parser.add_argument("--out", type=Path, help="where the predictors go (default: models/policies, with --head "
                                                 "HEAD/policies)")
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
    args = parser.parse_args(argv)
    if args.batch < 2:
        parser.error(f"--batch: the batch size tuned for batch > 1 must be >= 2, got {args.batch}")
    if args.out is None:
        args.out = ROOT / "models" / "policies" if args.head is None else args.head / "policies"
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = load(args.target, args.dtype)
    draft = load(args.draft, args.dtype) if args.head is None else load_head(args.head, target.dtype)
    dtype = str(target.dtype).removeprefix("torch.")
    kinds = (("specdecpp", "bce"), ("adalength", "asymmetric_l1"))
    if args.head is None:
        kinds += (("branch", "cross_entropy"),)
    else:
        print("SpecBranch's branch predictor: skipped (draft models only: SpecBranch drafts beside the target, "
              "a head's drafts read the verification's own hidden states)", flush=True)
    texts = {}
    for split, count, seed in (("train", args.sequences, 7), ("validation", args.validation_sequences, 3)):
        prompts = code_prompts(tokenizer, split, count, args.prompt_tokens, seed=seed)
        for mode in ("greedy", "sampling"):
            name = f"{split}_{mode}_{count}x{args.new_tokens}_{dtype}.pt"
            sequences = continuations(target, prompts, args.new_tokens, mode == "greedy", 32, args.work / name)
            texts[split, mode] = dataset(target, draft, sequences, args.prompt_tokens, MAX_LENGTH,
                                         step_grid=args.head is not None and split == "validation")
    print(f"data: {len(texts['train', 'greedy']['sequence']):,} positions per mode ({time.time() - started:.0f} s)",
          flush=True)

    held = torch.zeros(args.sequences, dtype=torch.bool)
    held[torch.randperm(args.sequences, generator=torch.Generator().manual_seed(0))[:args.sequences // 8]] = True
    train = {mode: texts["train", mode] for mode in ("greedy", "sampling")}
    if args.head is None:
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
    for kind, loss in kinds:
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
        runs = data[f"runs_{mode}"].view(shape)  # sampling: from the draws AdaLength's history saw
        accept_probability = predicted_acceptance(predictors["specdecpp"], data, column)
        with torch.no_grad():
            length = predictors["adalength"](data[f"adalength_in_{mode}"])[:, column].view(shape)
        rates = replay(runs, {f"fixed k={k}": torch.full(runs.shape, k) for k in range(1, MAX_LENGTH + 1)},
                       costs["round_ms"])
        best_k = int(max(rates, key=lambda n: rates[n][0]).split("=")[1])
        length = torch.cat([torch.full_like(length[:, :1], best_k), length[:, :-1]], 1)  # root j reads entry j-1
        specdecpp_ms = [c + k * decisions["specdecpp_per_draft"] for k, c in enumerate(costs["round_ms"])]
        rates |= replay(runs, {f"specdecpp threshold={h}": specdecpp_lengths(accept_probability, h)
                               for h in THRESHOLDS}, specdecpp_ms)
        adalength_ms = [c + decisions["adalength_per_round"] for c in costs["round_ms"]]
        rates |= replay(runs, {f"adalength offset={o}": (length + o).ceil().clamp(1, MAX_LENGTH).long()
                               for o in OFFSETS}, adalength_ms)
        alone, many = costs["round_ms"], batch_costs["round_ms"]
        bound_lengths, bound_choices = bounds(runs, data[f"chances_{mode}"].view(*runs.shape, MAX_LENGTH), alone,
                                              batch_round_ms(alone, many, args.batch))
        rates |= replay(runs, bound_lengths, alone)
        best, chosen[mode], replayed[mode] = best_of(rates)
        limits[mode] = {name: replayed[mode][name]["vs_best_fixed"] for name in bound_lengths}
        print(mode, {name: replayed[mode][name]["vs_best_fixed"] for name in best.values()}, limits[mode],
              flush=True)

        fixed, specdecpp, adalength = batch_choices(accept_probability, length)
        per_draft = decisions["specdecpp_per_draft"], batch_decisions["specdecpp_per_draft"]
        per_round = decisions["adalength_per_round"], batch_decisions["adalength_per_round"]
        rates = replay_batches(runs, fixed, alone, many, args.batch)
        rates |= replay_batches(runs, specdecpp, [c + k * per_draft[0] for k, c in enumerate(alone)],
                                [c + k * per_draft[1] for k, c in enumerate(many)], args.batch)
        rates |= replay_batches(runs, adalength, [c + per_round[0] for c in alone],
                                [c + per_round[1] for c in many], args.batch)
        rates |= replay_batches(runs, bound_choices, alone, many, args.batch)
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
    settings = {kind: settings[kind] for kind in predictors}
    for kind, model in predictors.items():
        model.save(args.out / f"{kind}.safetensors", **settings[kind])
    report.update(round_cost=costs, decision_ms=decisions, fast_linear=args.fast_linear,
                  replayed_on_validation=replayed,
                  bounds_vs_best_fixed=limits, best_fixed_k=best_k,
                  best_fixed_k_sampling=int(chosen["sampling"]["fixed"]), batch=dict(
                      size=args.batch, round_cost=batch_costs, decision_ms=batch_decisions,
                      replayed_on_validation=replayed_batch, best_fixed_k=int(chosen_batch["greedy"]["fixed"]),
                      best_fixed_k_sampling=int(chosen_batch["sampling"]["fixed"])), settings=settings,
                  pair=dict(target=args.target.name, draft=(args.draft if args.head is None else args.head).name,
                            draft_kind="causal LM" if args.head is None else "feature head"),
                  sequences_per_mode=args.sequences,
                  dtype=dtype, total_seconds=round(time.time() - started))
    (args.out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("settings", "bounds_vs_best_fixed", "total_seconds")}, indent=2))


if __name__ == "__main__":
    main()
