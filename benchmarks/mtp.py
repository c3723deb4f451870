"""MTP drafting on a small MTP-bearing target made here: the bundled target (a Llama, 8 layers,
320 wide) with one MTP layer added (transformers' ``MtpLayer`` over a Llama decoder layer, its
block started from the target's last layer), trained by benchmarks/train_mtp.py on the target's
own greedy continuations of stdlib code (its output, --layer, is read here).

The layer is written in the layout transformers' ``MtpModel.from_pretrained`` reads (the MTP
block as decoder layer L beside ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``; the
config's ``num_mtp_layers``), so the same weights draft in spec_ext (``"mtp"``) and in
``generate(use_mtp=True)``; and as a speculators ``mtp`` directory. Then, on held-out prompts,
greedy, interleaved and repeated: accepted per round, tokens/s and the speed-up against the
target alone (``target.generate``) and against ``generate(use_mtp=True)`` (batch 1 only: it
refuses more), at B=1 and B=8, on the same eight held-out prompts (B=1: each alone, one after
another; B=8: together), greedy and T=1. Writes benchmarks/results/mtp_cpu.{csv,txt}.

    python benchmarks/train_mtp.py      # first: the layer (benchmarks/.train_work/mtp/mtp_layer.pt)
    python benchmarks/mtp.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from stdlib_data import split_files  # noqa: E402

import spec_ext  # noqa: E402
from spec_ext.models.mtp import save_speculators_mtp  # noqa: E402
from spec_ext.policies import Fixed  # noqa: E402
from spec_ext.training.corpus import prompts_from_files  # noqa: E402
from train_mtp import new_mtp, with_mtp_config  # noqa: E402


def write_checkpoint(target, mtp, path: Path):
    """``target`` and its MTP layer as transformers lays out a checkpoint with MTP weights."""
    target.save_pretrained(path)
    L = target.config.num_hidden_layers
    state = load_file(str(path / "model.safetensors"))
    layer = mtp.layers[0]
    for name, tensor in layer.mtp_block.state_dict().items():
        state[f"model.layers.{L}.{name}"] = tensor.detach().clone().contiguous()
    for part, key in (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("post_norm", "shared_head.norm")):
        state[f"model.layers.{L}.{key}.weight"] = getattr(layer, part).weight.detach().clone().contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


def load_with_mtp(path: Path):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{model.config.num_hidden_layers}\..*"]
    return model


def timed(fn):
    started = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - started


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, default=ROOT / "models" / "stdlib-target")
    parser.add_argument("--layer", type=Path, default=ROOT / "benchmarks" / ".train_work" / "mtp" / "mtp_layer.pt",
                        help="the MTP layer benchmarks/train_mtp.py wrote (MtpModel.layers' state)")
    parser.add_argument("--trained", default="", help="how the layer was trained (written in the header)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "mtp_cpu")
    args = parser.parse_args()
    if not args.layer.exists():
        raise SystemExit(f"--layer: {args.layer} does not exist; run benchmarks/train_mtp.py first")
    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target = with_mtp_config(AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval())
    mtp = new_mtp(target, 0)
    mtp.layers.load_state_dict(torch.load(args.layer))
    mtp.eval()
    # held-out prompts: the validation split (files never trained on), 64 tokens before a line break
    prompts = prompts_from_files(tokenizer, split_files("validation"), 8, 64, seed=1)
    loads = [os.getloadavg()[0]]
    rows = []
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "target-mtp"
        write_checkpoint(target, mtp, path)
        model = load_with_mtp(path)
        save_speculators_mtp(spec_ext.models.mtp.load_mtp(model), Path(root) / "speculators-mtp", model)
        eos = tokenizer.eos_token_id
        new = args.new_tokens
        for temperature in [float(t) for t in args.temperatures.split(",")]:
            sample = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature,
                                                                         top_k=None, top_p=None)
            for B in (1, 8):
                groups = [[p] for p in prompts] if B == 1 else [prompts]  # B=1: the same prompts, one at a time

                def each(fn):
                    return lambda: [fn(group) for group in groups]

                def hf(group, **extra):
                    torch.manual_seed(0)
                    return model.generate(torch.tensor(group), max_new_tokens=new, eos_token_id=None,
                                          pad_token_id=eos, **sample, **extra)

                runs = {"target": each(hf)}
                if B == 1:  # transformers: assisted generation refuses batches above 1
                    runs["hf use_mtp"] = each(lambda g: hf(g, use_mtp=True))
                for k in (1, 2, 3):
                    runs[f"spec_ext Fixed({k})"] = each(lambda g, k=k: spec_ext.generate(
                        model, "mtp", g, max_new_tokens=new, eos_token_id=[], policy=Fixed(k),
                        temperature=temperature, seed=0))
                runs["spec_ext Auto"] = each(lambda g: spec_ext.generate(model, "mtp", g, max_new_tokens=new,
                                                                         eos_token_id=[], temperature=temperature,
                                                                         seed=0))
                times = {name: [] for name in runs}
                outputs, calls = {}, [0]
                with torch.no_grad():
                    for name, fn in runs.items():  # warm-up (and the outputs, the counts)
                        if name == "hf use_mtp":
                            hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
                        outputs[name] = fn()
                        if name == "hf use_mtp":
                            hook.remove()
                    for _ in range(args.repeats):  # interleaved
                        for name, fn in runs.items():
                            times[name].append(timed(fn)[1])
                loads.append(os.getloadavg()[0])
                reference = outputs["target"]
                for name in runs:
                    outs = outputs[name]
                    equal = "" if temperature else all(
                        torch.equal((o.sequences if hasattr(o, "sequences") else o)[:, :r.shape[1]], r)
                        for o, r in zip(outs, reference))
                    per_round = prompt0 = verifications = ""
                    if hasattr(outs[0], "stats"):  # accepted drafts per (row, verification), over all prompts
                        per_round = sum(o.stats.accepted for o in outs) / max(1, sum(o.stats.rounds for o in outs))
                        if B == 1:  # the first prompt's alone
                            prompt0 = outs[0].stats.mean_accepted
                        else:  # the batch runs until its slowest row is done
                            verifications = outs[0].stats.target_calls - 1
                    if name == "hf use_mtp":  # accepted = new tokens - target forwards (prefill's token, one per round)
                        forwards = calls[0] - len(groups)
                        per_round = (new * len(groups) - calls[0]) / max(1, forwards)
                    median = statistics.median(times[name])
                    base = statistics.median(times["target"])
                    rows.append(dict(temperature=f"{temperature:g}", B=B, method=name, median_s=median,
                                     spread_s=max(times[name]) - min(times[name]),
                                     tokens_per_s=len(prompts) * new / median, speedup_vs_target=base / median,
                                     speedup_vs_use_mtp=(statistics.median(times["hf use_mtp"]) / median)
                                     if B == 1 else "", accepted_per_round=per_round,
                                     accepted_per_round_prompt0=prompt0, verifications=verifications,
                                     equal_to_target=equal))
                    print(rows[-1], flush=True)
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD").read().strip()
    header = ["temperature", "B", "method", "median_s", "spread_s", "tokens_per_s", "speedup_vs_target",
              "speedup_vs_use_mtp", "accepted_per_round", "accepted_per_round_prompt0", "verifications",
              "equal_to_target"]

    def cell(v):
        return f"{v:.4f}" if isinstance(v, float) else str(v)

    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w") as f:
        f.write(",".join(header + ["commit"]) + "\n")
        for r in rows:
            f.write(",".join(cell(r[h]) for h in header) + f",{commit}\n")
    with open(args.out.with_suffix(".txt"), "w") as f:
        f.write(f"# benchmarks/mtp.py, commit {commit}: {args.threads} thread(s), {args.new_tokens} new tokens, "
                f"{args.repeats} interleaved repeats after a warm-up (median, spread = max - min); the same "
                f"{len(prompts)} held-out prompts at B=1 (one at a time) and B=8 (together); machine load (uptime, "
                f"2 cores shared with other jobs) {min(loads):.1f}-{max(loads):.1f}; MTP layer {args.layer.name}"
                f"{' (' + args.trained + ')' if args.trained else ''}; B=8 has no use_mtp: transformers' assisted "
                f"generation refuses batches above 1\n")
        for r in rows:
            vs = f"x{r['speedup_vs_use_mtp']:.2f} vs use_mtp" if r["B"] == 1 else "use_mtp refused"
            acc = f"{r['accepted_per_round']:.2f}" if r["accepted_per_round"] != "" else "-"
            if r["accepted_per_round_prompt0"] != "":
                acc += f" (prompt 0: {r['accepted_per_round_prompt0']:.2f})"
            if r["verifications"] != "":
                acc += f" ({r['verifications']} verifications)"
            f.write(f"T={r['temperature']} B={r['B']} {r['method']:<20} {r['median_s']:.3f}s "
                    f"(spread {r['spread_s']:.3f}) {r['tokens_per_s']:.0f} tok/s x{r['speedup_vs_target']:.2f} vs "
                    f"target, {vs}, accepted/round {acc}"
                    f"{', equal ' + str(r['equal_to_target']) if r['equal_to_target'] != '' else ''}\n")


if __name__ == "__main__":
    main()
