"""Train the learned draft-length policies (spec_ext.learned) for a draft/target pair.

Stages (the generated data is cached under --work, so a rerun skips it):
  1. the target continues prompts of the training split, greedily and sampled at T=1;
  2. teacher-forced features and labels from both models (spec_ext.learned.features_and_labels);
  3. the SpecDecPP acceptance head (BCE on soft labels), the AdaLength length predictor
     (asymmetric L1) and SpecBranch's branch-point predictor (3 classes from the accepted
     length: none / some / at least ACCEPT_ALL_LENGTH; cross-entropy), each with a
     held-out tenth for its validation loss;
  4. on prompts of the validation split (never the test prompts), batch 1 greedy, side by
     side: the best fixed k, the SpecDecPP threshold and the AdaLength offset by tokens/s;
  5. models/policies/{specdecpp,adalength,branch}.safetensors (settings in their metadata) and
     models/policies/validation.json (the sweeps and the best fixed k).

    python benchmarks/train_policies.py [--sequences 384] [--new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import spec_ext  # noqa: E402
from spec_ext.learned import ResidualMLP, branch_classes, features_and_labels, train_predictor  # noqa: E402
from stdlib_data import code_prompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LENGTH = 12  # longest chain the labels (and the learned policies) consider
ACCEPT_ALL_LENGTH = 4  # the branch predictor's "accept all" class: at least this many drafts accepted


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


def dataset(target, draft, sequences, start, greedy, batch=32) -> dict:
    parts = [features_and_labels(target, draft, sequences[i:i + batch], start, greedy, MAX_LENGTH)
             for i in range(0, len(sequences), batch)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def split(x, y, seed=0):
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    held = len(y) // 10
    return (x[order[held:]], y[order[held:]]), (x[order[:held]], y[order[:held]])


def tokens_per_s(target, draft, prompts, policy, new_tokens) -> float:
    """Total tokens / total time over the prompts, batch 1 greedy."""
    produced = elapsed = 0.0
    for prompt in prompts:
        out = spec_ext.generate(target, draft, [prompt], max_new_tokens=new_tokens, eos_token_id=[], policy=policy)
        produced += out.stats.new_tokens
        elapsed += out.stats.wall_time
    return produced / elapsed


def sweep(target, draft, prompts, candidates: dict, new_tokens, repeats) -> dict:
    """{name: median tokens/s}; candidates interleaved per repeat so drift hits all alike."""
    rates = {name: [] for name in candidates}
    for _ in tqdm(range(repeats), desc="validation sweep"):
        for name, make in candidates.items():
            rates[name].append(tokens_per_s(target, draft, prompts, make(), new_tokens))
    return {name: statistics.median(r) for name, r in rates.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--draft", type=Path, default=ROOT / "models" / "stdlib-draft")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "policies")
    parser.add_argument("--work", type=Path, default=ROOT / "benchmarks" / ".train_work" / "policies")
    parser.add_argument("--sequences", type=int, default=384, help="continuations per decoding mode")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--validation-prompts", type=int, default=8)
    parser.add_argument("--validation-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="use the dtype you will decode in; auto: as stored (the bundled pair: bfloat16)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.time()

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target, draft = load(args.target, args.dtype), load(args.draft, args.dtype)
    dtype = str(target.dtype).removeprefix("torch.")
    prompts = code_prompts(tokenizer, "train", args.sequences, args.prompt_tokens, seed=7)
    data = {}
    for greedy in (True, False):
        name = "greedy" if greedy else "sampled"
        sequences = continuations(target, prompts, args.new_tokens, greedy, 32,
                                  args.work / f"{name}_{args.sequences}x{args.new_tokens}_{dtype}.pt")
        data[greedy] = dataset(target, draft, sequences, args.prompt_tokens, greedy)
    print(f"data: {len(data[True]['specdecpp_y']):,} positions per mode ({time.time() - started:.0f} s)", flush=True)

    report = {}
    predictors = {}
    for greedy in (True, False):
        data[greedy]["branch_x"] = data[greedy]["adalength_x"]
        data[greedy]["branch_y"] = branch_classes(data[greedy]["adalength_y"], ACCEPT_ALL_LENGTH)
    for kind, loss, width in (("specdecpp", "bce", draft.config.hidden_size),
                              ("adalength", "asymmetric_l1", 2 * target.config.hidden_size),
                              ("branch", "cross_entropy", 2 * target.config.hidden_size)):
        torch.manual_seed(0)
        model = ResidualMLP(width, out_features=6 if kind == "branch" else 2)
        train_sets, held_sets = {}, {}
        for column, greedy in ((0, True), (1, False)):
            train_sets[column], held_sets[column] = split(data[greedy][f"{kind}_x"], data[greedy][f"{kind}_y"])
        t = time.time()
        history = train_predictor(model, train_sets, loss, epochs=args.epochs)
        with torch.no_grad():
            held = {}
            for column, (x, y) in held_sets.items():
                if kind == "branch":
                    predicted = model(x)[:, 3 * column:3 * column + 3].argmax(-1)
                    held[column] = dict(accuracy=(predicted == y).float().mean().item(),
                                        class_shares=torch.bincount(y.long(), minlength=3).div(len(y)).tolist(),
                                        predicted_shares=torch.bincount(predicted, minlength=3).div(len(y)).tolist())
                    continue
                out = model(x)[:, column]
                if kind == "specdecpp":
                    held[column] = dict(bce=torch.nn.functional.binary_cross_entropy_with_logits(out, y).item(),
                                        base_rate=y.mean().item(),
                                        mae=(torch.sigmoid(out) - y).abs().mean().item())
                else:
                    held[column] = dict(mae=(out - y).abs().mean().item(), mean_label=y.mean().item(),
                                        mean_prediction=out.mean().item())
        report[kind] = dict(train_seconds=round(time.time() - t, 1), train_loss=history,
                            held_out_greedy=held[0], held_out_sampling=held[1])
        predictors[kind] = model
        print(kind, json.dumps(report[kind]), flush=True)

    validation = code_prompts(tokenizer, "validation", args.validation_prompts, 96, seed=1)
    from spec_ext.learned import AdaLength, SpecDecPP
    from spec_ext.policies import Fixed
    candidates = {f"fixed k={k}": (lambda k=k: Fixed(k)) for k in range(1, 9)}
    thresholds = (0.3, 0.5, 0.7, 0.8, 0.9)
    offsets = (-0.5, 0.0, 0.5, 1.0, 2.0)
    candidates |= {f"specdecpp threshold={h}": (lambda h=h: SpecDecPP(predictors["specdecpp"], threshold=h,
                                                                         max_draft=MAX_LENGTH)) for h in thresholds}
    candidates |= {f"adalength offset={o}": (lambda o=o: AdaLength(predictors["adalength"], offset=o,
                                                                      max_draft=MAX_LENGTH)) for o in offsets}
    rates = sweep(target, draft, validation, candidates, args.validation_tokens, args.repeats)
    best = {family: max((name for name in rates if name.startswith(family)), key=rates.get)
            for family in ("fixed", "specdecpp", "adalength")}
    settings = dict(
        specdecpp=dict(kind="specdecpp", threshold=float(best["specdecpp"].split("=")[1]), max_draft=MAX_LENGTH),
        adalength=dict(kind="adalength", offset=float(best["adalength"].split("=")[1]), max_draft=MAX_LENGTH,
                       first_round=int(best["fixed"].split("=")[1])),
        branch=dict(kind="branch", accept_all_length=ACCEPT_ALL_LENGTH))
    for kind, model in predictors.items():
        model.save(args.out / f"{kind}.safetensors", **settings[kind])
    report.update(validation_tokens_per_s={k: round(v, 1) for k, v in rates.items()}, best=best,
                  best_fixed_k=int(best["fixed"].split("=")[1]), settings=settings,
                  pair=dict(target=args.target.name, draft=args.draft.name),
                  sequences_per_mode=args.sequences, dtype=dtype, total_seconds=round(time.time() - started))
    (args.out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: report[k] for k in ("validation_tokens_per_s", "best", "total_seconds")}, indent=2))


if __name__ == "__main__":
    main()
